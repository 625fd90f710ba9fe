package format

// Media types and artifact types of a cryo snapshot. See SPEC.md.
const (
	// ArtifactTypeSnapshot is the artifactType of a snapshot's image index.
	ArtifactTypeSnapshot = "application/vnd.cryo.snapshot.v1"
	// ArtifactTypeFile is the artifactType of a file part's manifest.
	ArtifactTypeFile = "application/vnd.cryo.file.v1"
	// MediaTypeChunkTable is the media type of a file part's chunk table, the
	// config of its manifest.
	MediaTypeChunkTable = "application/vnd.cryo.chunktable.v1+json"
	// MediaTypeChunkRaw is the media type of a chunk blob stored as is.
	MediaTypeChunkRaw = "application/vnd.cryo.chunk.v1"
	// MediaTypeChunkZstd is the media type of a chunk blob stored as one
	// zstd frame.
	MediaTypeChunkZstd = "application/vnd.cryo.chunk.v1+zstd"
)

// Annotation keys. Values are strings, as OCI requires.
const (
	// AnnotationCreated is the snapshot's creation time (RFC 3339, UTC).
	AnnotationCreated = "org.opencontainers.image.created"
	// AnnotationRunscVersion is runsc_version from checkpoint.img's header.
	AnnotationRunscVersion = "vnd.cryo.runsc.version"
	// AnnotationRunscTimestamp is _timestamp from checkpoint.img's header.
	AnnotationRunscTimestamp = "vnd.cryo.runsc.timestamp"
	// AnnotationContainerCount is container_count from checkpoint.img's header.
	AnnotationContainerCount = "vnd.cryo.runsc.container-count"

	// AnnotationFilePath is the slash-separated path of a file in the image
	// dir, on each file part descriptor of the index.
	AnnotationFilePath = "vnd.cryo.file.path"
	// AnnotationFileSize is the file's size in bytes (decimal).
	AnnotationFileSize = "vnd.cryo.file.size"
	// AnnotationFileMode is the file's permission bits (octal, e.g. "0644").
	AnnotationFileMode = "vnd.cryo.file.mode"
	// AnnotationFileDigest is the sha256 digest of the whole file.
	AnnotationFileDigest = "vnd.cryo.file.digest"
	// AnnotationPartOffset is the offset in the file where a part starts.
	AnnotationPartOffset = "vnd.cryo.part.offset"
	// AnnotationPartLength is the number of file bytes a part covers.
	AnnotationPartLength = "vnd.cryo.part.length"
)
