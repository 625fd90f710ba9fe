package format

import "fmt"

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

// Media types and artifact types of format v2 (SPEC.md section 15): small
// chunks stored as frames in pack blobs, read by byte range.
const (
	// ArtifactTypeSnapshotV2 is the artifactType of a v2 snapshot's index.
	ArtifactTypeSnapshotV2 = "application/vnd.cryo.snapshot.v2"
	// ArtifactTypeFileV2 is the artifactType of a v2 file part's manifest.
	ArtifactTypeFileV2 = "application/vnd.cryo.file.v2"
	// MediaTypeChunkTableV2 is the media type of a v2 chunk table, as
	// JSON; MediaTypeChunkTableV2Zstd of one stored as a zstd frame of that
	// JSON, which cryo writes (SPEC.md 15.3).
	MediaTypeChunkTableV2     = "application/vnd.cryo.chunktable.v2+json"
	MediaTypeChunkTableV2Zstd = "application/vnd.cryo.chunktable.v2+json+zstd"
	// MediaTypePack is the media type of a pack: consecutive chunk
	// frames, each decodable on its own.
	MediaTypePack = "application/vnd.cryo.pack.v2"
)

// Version is a version of the snapshot format.
type Version int

// The format versions.
const (
	// V1 stores every chunk as a blob of its own (1 MiB chunks).
	V1 Version = 1
	// V2 stores small chunks as frames of pack blobs (SPEC.md section 15).
	V2 Version = 2
)

// String is "v1" or "v2".
func (v Version) String() string { return fmt.Sprintf("v%d", int(v)) }

// ParseVersion parses "v1" or "v2" (or "1", "2").
func ParseVersion(s string) (Version, error) {
	switch s {
	case "v1", "1":
		return V1, nil
	case "v2", "2":
		return V2, nil
	}
	return 0, fmt.Errorf("format %q: want v1 or v2", s)
}

// snapshotArtifactType, fileArtifactType and tableMediaType are the types
// of version v.
func (v Version) snapshotArtifactType() string {
	if v == V2 {
		return ArtifactTypeSnapshotV2
	}
	return ArtifactTypeSnapshot
}

func (v Version) fileArtifactType() string {
	if v == V2 {
		return ArtifactTypeFileV2
	}
	return ArtifactTypeFile
}

func (v Version) tableMediaType() string {
	if v == V2 {
		return MediaTypeChunkTableV2Zstd
	}
	return MediaTypeChunkTable
}

// IsTableMediaType reports whether t is the media type of a chunk table of
// version v (a v2 table compressed or not).
func IsTableMediaType(v Version, t string) bool {
	if v == V2 {
		return t == MediaTypeChunkTableV2 || t == MediaTypeChunkTableV2Zstd
	}
	return t == MediaTypeChunkTable
}

// IsSnapshotArtifactType reports whether t is the artifactType of a
// snapshot index of some version this package reads.
func IsSnapshotArtifactType(t string) bool {
	return t == ArtifactTypeSnapshot || t == ArtifactTypeSnapshotV2
}

// IsFileArtifactType reports whether t is the artifactType of a file part
// manifest of some version this package reads.
func IsFileArtifactType(t string) bool { return t == ArtifactTypeFile || t == ArtifactTypeFileV2 }

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
