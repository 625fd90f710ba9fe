package format

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/format/statefile"
	"github.com/cryo-oci/cryo/internal/ordered"
	"github.com/opencontainers/go-digest"
	specs "github.com/opencontainers/image-spec/specs-go"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/errdef"
)

// Well-known files of a gVisor checkpoint image dir.
const (
	// CheckpointFile holds the sentry state; its header has the metadata.
	CheckpointFile = "checkpoint.img"
	// PagesMetaFile holds the memory file metadata.
	PagesMetaFile = "pages_meta.img"
	// PagesFile holds the raw memory pages.
	PagesFile = "pages.img"
)

// DefaultAvgChunkSize is the default mean chunk size. SPEC.md explains the
// choice with the dedup benchmark's figures.
const DefaultAvgChunkSize = 1 << 20

// PackOptions tune Pack. The zero value packs with the defaults.
type PackOptions struct {
	// Chunking cuts every file. Zero value: page-aligned CDC with a 1 MiB
	// mean (DefaultPageCDC(DefaultAvgChunkSize)).
	Chunking chunker.Params
	// Created is recorded as the snapshot's creation time. Zero value: the
	// _timestamp of checkpoint.img's header, if there is one; else none, so
	// that packing the same dir twice gives the same index.
	Created time.Time
	// Concurrency is how many chunks are encoded and stored at once
	// (default 4 x GOMAXPROCS).
	Concurrency int
	// OnChunk, if set, is called from worker goroutines after each chunk is
	// stored, with its table entry and whether its blob was uploaded.
	OnChunk func(c Chunk, uploaded bool)
	// Resolver, if set, is asked for every non-zero chunk before it is
	// compressed, and may name a blob that dst already has (or can get
	// without an upload, such as by a cross-repository mount) for it.
	Resolver ChunkResolver
}

// ChunkResolver finds, by a chunk's uncompressed digest, a blob that carries
// it and that the destination has or can get without an upload: a registry's
// chunk index knows blobs whose compressed bytes differ from what this
// packer's zstd would write.
type ChunkResolver interface {
	// ResolveChunk gets c (Size and Digest set) and returns the entry to
	// use instead, with Encoding, Blob and BlobSize set, and true; or false
	// if it knows no such blob. After it returns true, the blob must be
	// present in the destination.
	ResolveChunk(ctx context.Context, c Chunk) (Chunk, bool, error)
}

// PackStats counts what Pack did.
type PackStats struct {
	// Files is the number of files packed.
	Files int `json:"files"`
	// LogicalBytes is the total size of the files.
	LogicalBytes int64 `json:"logicalBytes"`
	// Chunks counts chunks by encoding.
	Chunks map[Encoding]int `json:"chunks"`
	// StoredBytes is the size of the distinct chunk blobs the snapshot uses.
	StoredBytes int64 `json:"storedBytes"`
	// UploadedBytes is the size of the chunk blobs pushed to the store
	// because it did not have them yet.
	UploadedBytes int64 `json:"uploadedBytes"`
	// BlobsUploaded and BlobsSkipped count distinct chunk blobs pushed and
	// found already present.
	BlobsUploaded int `json:"blobsUploaded"`
	BlobsSkipped  int `json:"blobsSkipped"`
}

// Pack chunks and encodes the image dir dir, stores every blob, manifest and
// the snapshot index in dst, and returns the index's descriptor. Blobs dst
// already has are not pushed again. Pack reads each file once and keeps at
// most a few chunks per worker in memory.
func Pack(ctx context.Context, dir string, dst content.Storage, opts PackOptions) (ocispec.Descriptor, *PackStats, error) {
	p, err := newPacker(dst, opts)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	defer p.codec.Close()
	files, err := listFiles(dir)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	annotations, err := snapshotAnnotations(dir, files, opts.Created)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	idx := ocispec.Index{
		Versioned:    specsVersioned,
		MediaType:    ocispec.MediaTypeImageIndex,
		ArtifactType: ArtifactTypeSnapshot,
		Manifests:    []ocispec.Descriptor{},
		Annotations:  annotations,
	}
	for _, f := range files {
		descs, err := p.packFile(ctx, dir, f)
		if err != nil {
			return ocispec.Descriptor{}, nil, err
		}
		idx.Manifests = append(idx.Manifests, descs...)
	}
	desc, err := p.pushJSON(ctx, ocispec.MediaTypeImageIndex, ArtifactTypeSnapshot, idx)
	if err != nil {
		return ocispec.Descriptor{}, nil, fmt.Errorf("push snapshot index: %w", err)
	}
	p.stats.Files = len(files)
	return desc, &p.stats, nil
}

// specsVersioned is the schemaVersion every OCI manifest and index carries.
var specsVersioned = specs.Versioned{SchemaVersion: 2}

type packer struct {
	dst   content.Storage
	opts  PackOptions
	codec *Codec
	bufs  sync.Pool
	mu    sync.Mutex
	blobs map[digest.Digest]bool // blob digest -> uploaded by us
	stats PackStats
}

func newPacker(dst content.Storage, opts PackOptions) (*packer, error) {
	if opts.Chunking == (chunker.Params{}) {
		opts.Chunking = chunker.DefaultPageCDC(DefaultAvgChunkSize)
	}
	if err := opts.Chunking.Validate(); err != nil {
		return nil, err
	}
	if opts.Concurrency <= 0 {
		// More workers than cores: each worker also waits on the
		// destination (creating a blob file, an HTTP round trip).
		opts.Concurrency = 4 * runtime.GOMAXPROCS(0)
	}
	codec, err := NewCodec(runtime.GOMAXPROCS(0))
	if err != nil {
		return nil, err
	}
	max := opts.Chunking.Max
	p := &packer{dst: dst, opts: opts, codec: codec, blobs: map[digest.Digest]bool{},
		stats: PackStats{Chunks: map[Encoding]int{}}}
	p.bufs.New = func() any { b := make([]byte, 0, max); return &b }
	return p, nil
}

// fileEntry is a regular file found in the image dir.
type fileEntry struct {
	path string // slash-separated, relative
	mode fs.FileMode
}

// listFiles walks dir and returns its regular files sorted by path. Symlinks
// and special files are refused: cryo never follows a link out of the dir.
func listFiles(dir string) ([]fileEntry, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("image dir: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("image dir %s: %w", dir, syscall.ENOTDIR)
	}
	var files []fileEntry
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("walk image dir: %w", err)
		}
		if p == dir {
			return nil
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		switch {
		case d.Type().IsDir():
			return nil
		case d.Type().IsRegular():
		case d.Type()&fs.ModeSymlink != 0:
			return fmt.Errorf("%s is a symlink: cryo packs only regular files and directories: %w", rel, ErrUnsupported)
		default:
			return fmt.Errorf("%s is a %v: cryo packs only regular files and directories: %w", rel, d.Type(), ErrUnsupported)
		}
		if err := ValidatePath(rel); err != nil {
			return fmt.Errorf("%s: %v: %w", rel, err, ErrUnsupported)
		}
		info, err := d.Info()
		if err != nil {
			return fmt.Errorf("stat %s: %w", rel, err)
		}
		files = append(files, fileEntry{path: rel, mode: info.Mode().Perm()})
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("image dir %s holds no files: %w", dir, ErrInvalid)
	}
	if len(files) > MaxFiles {
		return nil, fmt.Errorf("image dir %s holds %d files: %w (limit %d)", dir, len(files), ErrTooLarge, MaxFiles)
	}
	sort.Slice(files, func(i, j int) bool { return files[i].path < files[j].path })
	return files, nil
}

// snapshotAnnotations reads checkpoint.img's header, if there is one, and
// returns the index annotations.
func snapshotAnnotations(dir string, files []fileEntry, created time.Time) (map[string]string, error) {
	a := map[string]string{}
	for _, f := range files {
		if f.path != CheckpointFile {
			continue
		}
		fh, err := os.Open(filepath.Join(dir, CheckpointFile))
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", CheckpointFile, err)
		}
		md, err := statefile.ReadMetadata(fh)
		fh.Close()
		if errors.Is(err, statefile.ErrNotStateFile) {
			break // not a gVisor checkpoint: pack it as any file
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", CheckpointFile, err)
		}
		for key, ann := range map[string]string{
			statefile.KeyRunscVersion:   AnnotationRunscVersion,
			statefile.KeyTimestamp:      AnnotationRunscTimestamp,
			statefile.KeyContainerCount: AnnotationContainerCount,
		} {
			if v, ok := md[key]; ok {
				a[ann] = v
			}
		}
		if created.IsZero() {
			created, _ = ParseRunscTimestamp(md[statefile.KeyTimestamp])
		}
	}
	if !created.IsZero() {
		a[AnnotationCreated] = created.UTC().Format(time.RFC3339Nano)
	}
	if len(a) == 0 {
		return nil, nil
	}
	return a, nil
}

// ParseRunscTimestamp parses the _timestamp runsc writes into checkpoint.img
// (Go's time.Time.String of a UTC time).
func ParseRunscTimestamp(s string) (time.Time, error) {
	return time.Parse("2006-01-02 15:04:05.999999999 -0700 MST", s)
}

type packJob struct {
	buf    *[]byte
	offset int64
}

type packResult struct {
	buf   *[]byte
	chunk Chunk
}

// packFile chunks, encodes and stores one file and returns the descriptors
// of its part manifests, annotated for the index.
func (p *packer) packFile(ctx context.Context, dir string, f fileEntry) ([]ocispec.Descriptor, error) {
	fh, err := os.OpenFile(filepath.Join(dir, filepath.FromSlash(f.path)), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", f.path, err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return nil, fmt.Errorf("stat %s: %w", f.path, err)
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is no longer a regular file: %w", f.path, ErrUnsupported)
	}
	ck, err := chunker.New(fh, p.opts.Chunking)
	if err != nil {
		return nil, err
	}
	fileHash := sha256.New()
	var chunks []Chunk
	var size int64
	produce := func(ctx context.Context, emit func(packJob) error) error {
		for {
			data, off, err := ck.Next()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", f.path, err)
			}
			buf := p.bufs.Get().(*[]byte)
			*buf = append((*buf)[:0], data...)
			if err := emit(packJob{buf: buf, offset: off}); err != nil {
				return err
			}
		}
	}
	work := func(ctx context.Context, j packJob) (packResult, error) {
		c, err := p.storeChunk(ctx, *j.buf)
		c.Offset = j.offset
		return packResult{buf: j.buf, chunk: c}, err
	}
	sink := func(r packResult) error {
		fileHash.Write(*r.buf)
		size += int64(len(*r.buf))
		p.bufs.Put(r.buf)
		chunks = append(chunks, r.chunk)
		return nil
	}
	if err := ordered.Map(ctx, p.opts.Concurrency, 2*p.opts.Concurrency+2, produce, work, sink); err != nil {
		return nil, fmt.Errorf("pack %s: %w", f.path, err)
	}
	if size != st.Size() {
		return nil, fmt.Errorf("pack %s: read %d bytes but the file has %d: it changed while packing", f.path, size, st.Size())
	}
	p.mu.Lock()
	p.stats.LogicalBytes += size
	for _, c := range chunks {
		p.stats.Chunks[c.Encoding]++
	}
	p.mu.Unlock()
	return p.pushParts(ctx, f, size, digest.NewDigestFromBytes(digest.SHA256, fileHash.Sum(nil)), chunks)
}

// storeChunk encodes data and pushes its blob unless dst has it.
func (p *packer) storeChunk(ctx context.Context, data []byte) (Chunk, error) {
	c := p.codec.Identify(data)
	if c.Encoding == EncodingZero {
		p.done(c, false)
		return c, nil
	}
	if p.opts.Resolver != nil {
		rc, ok, err := p.opts.Resolver.ResolveChunk(ctx, c)
		if err != nil {
			return c, fmt.Errorf("resolve chunk %s: %w", c.Digest, err)
		}
		if ok {
			rc.Offset, rc.Size, rc.Digest = c.Offset, c.Size, c.Digest
			if err := rc.validateEncoding(); err != nil {
				return c, fmt.Errorf("resolver's blob for chunk %s: %w", c.Digest, err)
			}
			if p.firstUse(rc) {
				p.count(false, rc.BlobSize)
			}
			p.done(rc, false)
			return rc, nil
		}
	}
	zbuf := p.bufs.Get().(*[]byte)
	defer p.bufs.Put(zbuf)
	c, blob := p.codec.Compress(c, data, *zbuf)
	uploaded := false
	if p.firstUse(c) {
		var err error
		if uploaded, err = p.pushIfMissing(ctx, c.BlobDescriptor(), blob); err != nil {
			return c, fmt.Errorf("store chunk %s (blob %s): %w", c.Digest, c.Blob, err)
		}
		p.count(uploaded, c.BlobSize)
	}
	p.done(c, uploaded)
	return c, nil
}

// firstUse reports whether c's blob is seen for the first time in this pack.
func (p *packer) firstUse(c Chunk) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.blobs[c.Blob] {
		return false
	}
	p.blobs[c.Blob] = true
	p.stats.StoredBytes += c.BlobSize
	return true
}

func (p *packer) count(uploaded bool, size int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if uploaded {
		p.stats.UploadedBytes += size
		p.stats.BlobsUploaded++
	} else {
		p.stats.BlobsSkipped++
	}
}

func (p *packer) done(c Chunk, uploaded bool) {
	if p.opts.OnChunk != nil {
		p.opts.OnChunk(c, uploaded)
	}
}

// BlobWriter is implemented by stores that take a blob whose digest the
// caller computed from the very bytes it passes, sparing the store a second
// hash of every chunk. Pack uses it when dst has it.
type BlobWriter interface {
	WriteBlob(ctx context.Context, desc ocispec.Descriptor, data []byte) error
}

// pushIfMissing pushes data as desc unless dst already has it, and reports
// whether it pushed.
func (p *packer) pushIfMissing(ctx context.Context, desc ocispec.Descriptor, data []byte) (bool, error) {
	ok, err := p.dst.Exists(ctx, desc)
	if err != nil {
		return false, fmt.Errorf("check %s: %w", desc.Digest, err)
	}
	if ok {
		return false, nil
	}
	if bw, ok := p.dst.(BlobWriter); ok && isChunk(desc.MediaType) {
		err = bw.WriteBlob(ctx, desc, data)
	} else {
		err = p.dst.Push(ctx, desc, bytes.NewReader(data))
	}
	if errors.Is(err, errdef.ErrAlreadyExists) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("push %s: %w", desc.Digest, err)
	}
	return true, nil
}

// pushParts splits a file's chunks into parts of at most MaxChunksPerPart,
// pushes each part's chunk table and manifest, and returns the annotated
// manifest descriptors in order.
func (p *packer) pushParts(ctx context.Context, f fileEntry, size int64, fileDigest digest.Digest, chunks []Chunk) ([]ocispec.Descriptor, error) {
	nparts := max(1, (len(chunks)+MaxChunksPerPart-1)/MaxChunksPerPart)
	if nparts > MaxParts {
		return nil, fmt.Errorf("%s needs %d parts: %w (limit %d)", f.path, nparts, ErrTooLarge, MaxParts)
	}
	var descs []ocispec.Descriptor
	var offset int64
	for part := range nparts {
		pc := chunks[min(part*MaxChunksPerPart, len(chunks)):min((part+1)*MaxChunksPerPart, len(chunks))]
		var length int64
		for _, c := range pc {
			length += c.Size
		}
		t := Table{Path: f.path, Size: size, Mode: uint32(f.mode), Digest: fileDigest, Part: part, Parts: nparts,
			Offset: offset, Length: length, Chunker: p.opts.Chunking, Chunks: pc}
		if t.Chunks == nil {
			t.Chunks = []Chunk{}
		}
		if err := t.Validate(); err != nil {
			return nil, fmt.Errorf("internal error: %w", err)
		}
		tdesc, err := p.pushJSON(ctx, MediaTypeChunkTable, "", t)
		if err != nil {
			return nil, fmt.Errorf("push chunk table of %s: %w", f.path, err)
		}
		m := ocispec.Manifest{
			Versioned:    specsVersioned,
			MediaType:    ocispec.MediaTypeImageManifest,
			ArtifactType: ArtifactTypeFile,
			Config:       tdesc,
			Layers:       partLayers(pc),
		}
		if len(m.Layers) == 0 {
			// OCI 1.1: a manifest with no layers uses the empty descriptor.
			if _, err := p.pushIfMissing(ctx, ocispec.DescriptorEmptyJSON, ocispec.DescriptorEmptyJSON.Data); err != nil {
				return nil, err
			}
			m.Layers = []ocispec.Descriptor{emptyLayer()}
		}
		mdesc, err := p.pushJSON(ctx, ocispec.MediaTypeImageManifest, ArtifactTypeFile, m)
		if err != nil {
			return nil, fmt.Errorf("push manifest of %s: %w", f.path, err)
		}
		mdesc.Annotations = map[string]string{
			AnnotationFilePath:   f.path,
			AnnotationFileSize:   strconv.FormatInt(size, 10),
			AnnotationFileMode:   fmt.Sprintf("%04o", uint32(f.mode)),
			AnnotationFileDigest: fileDigest.String(),
			AnnotationPartOffset: strconv.FormatInt(offset, 10),
			AnnotationPartLength: strconv.FormatInt(length, 10),
		}
		descs = append(descs, mdesc)
		offset += length
	}
	return descs, nil
}

func isChunk(mediaType string) bool {
	return mediaType == MediaTypeChunkRaw || mediaType == MediaTypeChunkZstd
}

// emptyLayer is the OCI empty descriptor without its inline data, as it is
// written in a manifest.
func emptyLayer() ocispec.Descriptor {
	return ocispec.Descriptor{MediaType: ocispec.DescriptorEmptyJSON.MediaType, Digest: ocispec.DescriptorEmptyJSON.Digest, Size: ocispec.DescriptorEmptyJSON.Size}
}

// partLayers returns the distinct blobs of chunks in order of first use.
func partLayers(chunks []Chunk) []ocispec.Descriptor {
	seen := map[digest.Digest]bool{}
	layers := []ocispec.Descriptor{}
	for _, c := range chunks {
		if c.Encoding == EncodingZero || seen[c.Blob] {
			continue
		}
		seen[c.Blob] = true
		layers = append(layers, c.BlobDescriptor())
	}
	return layers
}

// pushJSON marshals v, pushes it unless present and returns its descriptor.
func (p *packer) pushJSON(ctx context.Context, mediaType, artifactType string, v any) (ocispec.Descriptor, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if len(data) > MaxManifestSize {
		return ocispec.Descriptor{}, fmt.Errorf("%s of %d bytes: %w (limit %d)", mediaType, len(data), ErrTooLarge, MaxManifestSize)
	}
	desc := content.NewDescriptorFromBytes(mediaType, data)
	desc.ArtifactType = artifactType
	if _, err := p.pushIfMissing(ctx, desc, data); err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}
