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
	"strings"
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
	// FSManifestFile and FSMultiTarFile are, beside a pages file and its
	// metadata, the files of a filesystem checkpoint (runsc
	// fscheckpoint): its manifest, and tar archives of the overlay upper
	// layers whose file contents lie in the pages file.
	FSManifestFile = "fscheckpoint.pb"
	FSMultiTarFile = "multitar.img"
)

// ImageFiles returns the files of one of gVisor's two kinds of image (its
// pkg/sentry/state/checkpointfiles), in the order runsc opens them: a
// checkpoint's (runsc checkpoint and restore), or with filesystem a
// filesystem checkpoint's (runsc fscheckpoint, and runsc create
// --fs-restore-image-path), whose pages files hold the sandbox's overlay
// upper layers, not its memory.
func ImageFiles(filesystem bool) []string {
	if filesystem {
		return []string{FSManifestFile, FSMultiTarFile, PagesMetaFile, PagesFile}
	}
	return []string{CheckpointFile, PagesMetaFile, PagesFile}
}

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
	// without an upload, such as by a cross-repository mount) for it. In
	// format v2 it names a frame of a pack dst has.
	Resolver ChunkResolver
	// Format is the format version written (default V1).
	Format Version
	// PackSize is the size format v2 fills packs to (default
	// DefaultPackSize, at most MaxPackSize).
	PackSize int
	// Composer, if set, is asked (format v2) for every pack the
	// destination lacks before it is uploaded, and may make it, or a pack
	// of some of its chunks, from frames the destination holds elsewhere.
	Composer PackComposer
	// PlainTables stores format v2 chunk tables as their JSON
	// (MediaTypeChunkTableV2) instead of a zstd frame of it: about four
	// times the table bytes, but the tables' digests then depend on no
	// compressor's output (zstd-encoded chunks still do), so that another
	// implementation can write a snapshot whose chunks do not compress
	// byte for byte (SPEC.md 11, 15.3).
	PlainTables bool
}

// PackComposer makes, in the destination, packs of frames the destination
// already holds elsewhere (format v2): a cryo registry composes them from
// chunks of other repositories, with no upload (SPEC.md 12.2.1).
type PackComposer interface {
	// ComposePack gets the chunks of a pack about to be uploaded, in pack
	// order (Digest, Size and Encoding set), and the size of that pack. It
	// returns, by chunk digest, the entries of the chunks it now has
	// frames of in a pack the destination holds (Encoding, Blob,
	// BlobSize, PackOffset and PackSize set), or none. An error ends the
	// push; a composer that cannot help returns no entries.
	ComposePack(ctx context.Context, chunks []Chunk, packSize int64) (map[digest.Digest]Chunk, error)
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
	// BlobsUploaded and BlobsSkipped count distinct chunk blobs (format
	// v2: packs) pushed and found already present.
	BlobsUploaded int `json:"blobsUploaded"`
	BlobsSkipped  int `json:"blobsSkipped"`
	// ReusedBytes is the stored size of the distinct chunks (format v2)
	// the snapshot references in packs that were stored before it.
	ReusedBytes int64 `json:"reusedBytes"`
	// ComposedBytes is the size of the frames (format v2) the destination
	// put in packs it composed from chunks it held elsewhere, instead of
	// an upload (PackOptions.Composer); PacksComposed counts those packs.
	ComposedBytes int64 `json:"composedBytes,omitempty"`
	PacksComposed int   `json:"packsComposed,omitempty"`
}

// Pack chunks and encodes the image dir dir, stores every blob, manifest and
// the snapshot index in dst, and returns the index's descriptor. Blobs dst
// already has are not pushed again. Pack reads each file once and keeps at
// most a few chunks per worker in memory.
func Pack(ctx context.Context, dir string, dst content.Storage, opts PackOptions) (ocispec.Descriptor, *PackStats, error) {
	files, err := listFiles(dir)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	md, err := readMetadata(dir, files)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	pk, err := NewPacker(dst, opts)
	if err != nil {
		return ocispec.Descriptor{}, nil, err
	}
	defer pk.Close()
	for _, f := range files {
		if err := pk.addFromDir(ctx, dir, f); err != nil {
			return ocispec.Descriptor{}, nil, err
		}
	}
	pk.metadata = md
	return pk.Finish(ctx)
}

// Packer packs an image dir given as streams, one per file, straight into
// a store: what a checkpoint gofer does while the sentry writes the files,
// with no copy of them on disk. Files may be added concurrently; Finish
// pushes the snapshot index once every file is in. A Packer that is never
// finished leaves blobs and manifests in the store but no index: no
// snapshot.
type Packer struct {
	p *packer

	mu       sync.Mutex
	files    map[string][]ocispec.Descriptor
	failed   map[string]error
	metadata map[string]string
	finished bool
}

// NewPacker returns a Packer into dst. Call Close when done with it.
func NewPacker(dst content.Storage, opts PackOptions) (*Packer, error) {
	p, err := newPacker(dst, opts)
	if err != nil {
		return nil, err
	}
	return &Packer{p: p, files: map[string][]ocispec.Descriptor{}, failed: map[string]error{}}, nil
}

// Close releases the Packer's encoders.
func (pk *Packer) Close() { pk.p.codec.Close() }

// MaxHeader bounds the bytes of checkpoint.img a Packer keeps to read its
// header (the snapshot's annotations) from.
const MaxHeader = 4 << 20

// AddFile packs the file at path (slash-separated, relative) with mode
// from r, read to its end, and returns its size. A checkpoint.img's header
// gives the snapshot's annotations, as Pack reads them.
func (pk *Packer) AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	if err := ValidatePath(path); err != nil {
		return 0, fmt.Errorf("%s: %v: %w", path, err, ErrUnsupported)
	}
	pk.mu.Lock()
	if pk.finished {
		pk.mu.Unlock()
		return 0, fmt.Errorf("%s added after the snapshot was finished: %w", path, ErrInvalid)
	}
	_, dup := pk.files[path]
	if !dup {
		if len(pk.files) >= MaxFiles {
			pk.mu.Unlock()
			return 0, fmt.Errorf("more than %d files: %w", MaxFiles, ErrTooLarge)
		}
		pk.files[path] = nil
	}
	pk.mu.Unlock()
	if dup {
		return 0, fmt.Errorf("%s added twice: %w", path, ErrInvalid)
	}
	var head *headBuffer
	if path == CheckpointFile {
		head = &headBuffer{max: MaxHeader}
		r = io.TeeReader(r, head)
	}
	descs, size, err := pk.p.packStream(ctx, fileEntry{path: path, mode: mode.Perm()}, r)
	var md map[string]string
	if err == nil && head != nil {
		md, err = statefile.ReadMetadata(bytes.NewReader(head.b))
		if errors.Is(err, statefile.ErrNotStateFile) {
			md, err = nil, nil // not a gVisor checkpoint: packed as any file
		} else if err != nil {
			err = fmt.Errorf("%s: %w", CheckpointFile, err)
		}
	}
	if err != nil {
		pk.mu.Lock()
		pk.failed[path] = err
		pk.mu.Unlock()
		return 0, err
	}
	pk.mu.Lock()
	defer pk.mu.Unlock()
	pk.files[path] = descs
	if head != nil {
		pk.metadata = md
	}
	return size, nil
}

// addFromDir packs file f of the image dir dir.
func (pk *Packer) addFromDir(ctx context.Context, dir string, f fileEntry) error {
	fh, err := os.OpenFile(filepath.Join(dir, filepath.FromSlash(f.path)), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", f.path, err)
	}
	defer fh.Close()
	st, err := fh.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", f.path, err)
	}
	if !st.Mode().IsRegular() {
		return fmt.Errorf("%s is no longer a regular file: %w", f.path, ErrUnsupported)
	}
	descs, size, err := pk.p.packStream(ctx, f, fh)
	if err != nil {
		return err
	}
	if size != st.Size() {
		return fmt.Errorf("pack %s: read %d bytes but the file has %d: it changed while packing", f.path, size, st.Size())
	}
	pk.mu.Lock()
	pk.files[f.path] = descs
	pk.mu.Unlock()
	return nil
}

// Finish pushes the snapshot index over every file added (in path order)
// and returns its descriptor. It fails if a file is still being added.
func (pk *Packer) Finish(ctx context.Context) (ocispec.Descriptor, *PackStats, error) {
	pk.mu.Lock()
	defer pk.mu.Unlock()
	if pk.finished {
		return ocispec.Descriptor{}, nil, errors.New("packer finished twice")
	}
	if len(pk.files) == 0 {
		return ocispec.Descriptor{}, nil, fmt.Errorf("no files: %w", ErrInvalid)
	}
	paths := make([]string, 0, len(pk.files))
	for path, descs := range pk.files {
		if err := pk.failed[path]; err != nil {
			return ocispec.Descriptor{}, nil, fmt.Errorf("%s failed: %w: %w", path, ErrInvalid, err)
		}
		if descs == nil {
			return ocispec.Descriptor{}, nil, fmt.Errorf("%s is still being packed: %w", path, ErrInvalid)
		}
		paths = append(paths, path)
	}
	sort.Strings(paths)
	idx := ocispec.Index{
		Versioned:    specsVersioned,
		MediaType:    ocispec.MediaTypeImageIndex,
		ArtifactType: pk.p.opts.Format.snapshotArtifactType(),
		Manifests:    []ocispec.Descriptor{},
		Annotations:  snapshotAnnotations(pk.metadata, pk.p.opts.Created),
	}
	for _, path := range paths {
		idx.Manifests = append(idx.Manifests, pk.files[path]...)
	}
	desc, err := pk.p.pushJSON(ctx, ocispec.MediaTypeImageIndex, pk.p.opts.Format.snapshotArtifactType(), idx)
	if err != nil {
		return ocispec.Descriptor{}, nil, fmt.Errorf("push snapshot index: %w", err)
	}
	pk.finished = true
	pk.p.mu.Lock()
	defer pk.p.mu.Unlock()
	st := pk.p.stats
	st.Files = len(paths)
	return desc, &st, nil
}

// headBuffer keeps the first max bytes written to it.
type headBuffer struct {
	b   []byte
	max int
}

func (h *headBuffer) Write(p []byte) (int, error) {
	if room := h.max - len(h.b); room > 0 {
		h.b = append(h.b, p[:min(len(p), room)]...)
	}
	return len(p), nil
}

// specsVersioned is the schemaVersion every OCI manifest and index carries.
var specsVersioned = specs.Versioned{SchemaVersion: 2}

type packer struct {
	dst   content.Storage
	opts  PackOptions
	codec *Codec
	bufs  sync.Pool
	// packs recycles format v2's open packs (PackSize each) once
	// uploaded: a snapshot fills one every 4 MiB of new frames, and fresh
	// memory is what some machines charge most for (docs/benchmarks.md,
	// "Loaded at 2 GiB").
	packs sync.Pool
	mu    sync.Mutex
	blobs map[digest.Digest]bool // blob digest -> uploaded by us
	stats PackStats
	// Format v2: chunkSeen holds the chunks counted in StoredBytes;
	// newChunk the chunks it compressed (not reused).
	chunkSeen map[digest.Digest]bool
	newChunk  map[digest.Digest]bool
}

func newPacker(dst content.Storage, opts PackOptions) (*packer, error) {
	switch opts.Format {
	case 0:
		opts.Format = V1
	case V1, V2:
	default:
		return nil, fmt.Errorf("format version %d: want 1 or 2", opts.Format)
	}
	if opts.Chunking == (chunker.Params{}) {
		opts.Chunking = chunker.DefaultPageCDC(DefaultAvgChunkSize)
		if opts.Format == V2 {
			opts.Chunking = chunker.DefaultPageCDC(DefaultAvgChunkSizeV2)
		}
	}
	if opts.PackSize <= 0 {
		opts.PackSize = DefaultPackSize
	}
	if opts.PackSize > MaxPackSize || (opts.Format == V2 && opts.Chunking.Max > MaxPackSize) {
		return nil, fmt.Errorf("pack size %d or chunk size %d over the %d bytes a pack may hold", opts.PackSize, opts.Chunking.Max, MaxPackSize)
	}
	if err := opts.Chunking.Validate(); err != nil {
		return nil, err
	}
	if opts.Concurrency <= 0 {
		// More workers than cores: each worker also waits on the
		// destination (creating a blob file, an HTTP round trip).
		opts.Concurrency = 4 * runtime.GOMAXPROCS(0)
	}
	newCodec := NewCodec
	if opts.Format == V2 {
		newCodec = NewCodecV2
	}
	codec, err := newCodec(runtime.GOMAXPROCS(0))
	if err != nil {
		return nil, err
	}
	max := opts.Chunking.Max
	p := &packer{dst: dst, opts: opts, codec: codec, blobs: map[digest.Digest]bool{},
		stats:     PackStats{Chunks: map[Encoding]int{}},
		chunkSeen: map[digest.Digest]bool{}, newChunk: map[digest.Digest]bool{}}
	p.bufs.New = func() any { b := make([]byte, 0, max); return &b }
	p.packs.New = func() any { b := make([]byte, 0, p.opts.PackSize); return &b }
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

// readMetadata reads checkpoint.img's header in dir, if files has one
// and it is a gVisor state file.
func readMetadata(dir string, files []fileEntry) (map[string]string, error) {
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
			return nil, nil // not a gVisor checkpoint: pack it as any file
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", CheckpointFile, err)
		}
		return md, nil
	}
	return nil, nil
}

// snapshotAnnotations returns the index annotations from checkpoint.img's
// header metadata md (nil if none).
func snapshotAnnotations(md map[string]string, created time.Time) map[string]string {
	a := map[string]string{}
	for key, ann := range map[string]string{
		statefile.KeyRunscVersion:   AnnotationRunscVersion,
		statefile.KeyTimestamp:      AnnotationRunscTimestamp,
		statefile.KeyContainerCount: AnnotationContainerCount,
	} {
		if v, ok := md[key]; ok {
			a[ann] = v
		}
	}
	if created.IsZero() && md != nil {
		created, _ = ParseRunscTimestamp(md[statefile.KeyTimestamp])
	}
	if !created.IsZero() {
		a[AnnotationCreated] = created.UTC().Format(time.RFC3339Nano)
	}
	if len(a) == 0 {
		return nil
	}
	return a
}

// ParseRunscTimestamp parses the _timestamp of a checkpoint.img header
// (SPEC.md section 3): Go's time.Time.String form, which runsc writes
// ("2006-01-02 15:04:05.999999999 -0700 ZONE", any zone name, a monotonic
// clock suffix " m=±..." ignored), or RFC 3339 with or without a fraction.
func ParseRunscTimestamp(s string) (time.Time, error) {
	if i := strings.Index(s, " m="); i >= 0 {
		s = s[:i]
	}
	// Go's form ends in a zone name that can be anything ("UTC", "CET",
	// "+0545"): the offset before it decides the time.
	if i := strings.LastIndexByte(s, ' '); i > 0 {
		if t, err := time.Parse("2006-01-02 15:04:05.999999999 -0700", s[:i]); err == nil {
			return t, nil
		}
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("checkpoint.img _timestamp %q: neither Go's time format nor RFC 3339", s)
	}
	return t, nil
}

type packJob struct {
	buf    *[]byte
	offset int64
}

type packResult struct {
	buf   *[]byte
	chunk Chunk
}

// packStream chunks, encodes and stores one file read from r, and returns
// the descriptors of its part manifests, annotated for the index, and its
// size.
func (p *packer) packStream(ctx context.Context, f fileEntry, r io.Reader) ([]ocispec.Descriptor, int64, error) {
	if p.opts.Format == V2 {
		return p.packStreamV2(ctx, f, r)
	}
	ck, err := chunker.New(r, p.opts.Chunking)
	if err != nil {
		return nil, 0, err
	}
	fileHash := sha256.New()
	var chunks []Chunk
	var size int64
	produce := p.chunkJobs(ck, f.path)
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
		return nil, 0, fmt.Errorf("pack %s: %w", f.path, err)
	}
	p.mu.Lock()
	p.stats.LogicalBytes += size
	for _, c := range chunks {
		p.stats.Chunks[c.Encoding]++
	}
	p.mu.Unlock()
	descs, err := p.pushParts(ctx, f, size, digest.NewDigestFromBytes(digest.SHA256, fileHash.Sum(nil)), chunks)
	return descs, size, err
}

// chunkJobs returns the producer of packStream's pipelines: the chunks ck
// cuts from the file at path, each copied into a pooled buffer.
func (p *packer) chunkJobs(ck *chunker.Chunker, path string) func(context.Context, func(packJob) error) error {
	return func(ctx context.Context, emit func(packJob) error) error {
		for {
			data, off, err := ck.Next()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return fmt.Errorf("read %s: %w", path, err)
			}
			buf := p.bufs.Get().(*[]byte)
			*buf = append((*buf)[:0], data...)
			if err := emit(packJob{buf: buf, offset: off}); err != nil {
				return err
			}
		}
	}
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
	return p.push(ctx, desc, data)
}

// push pushes data as desc, which dst lacked when asked, and reports
// whether it pushed (not if dst got it meanwhile).
func (p *packer) push(ctx context.Context, desc ocispec.Descriptor, data []byte) (bool, error) {
	var err error
	if bw, ok := p.dst.(BlobWriter); ok && (isChunk(desc.MediaType) || desc.MediaType == MediaTypePack) {
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
// pushes each part's chunk table and manifest in the packer's format, and
// returns the annotated manifest descriptors in order. A v1 manifest's
// layers are the part's chunk blobs, a v2 manifest's its packs, in order of
// first use.
func (p *packer) pushParts(ctx context.Context, f fileEntry, size int64, fileDigest digest.Digest, chunks []Chunk) ([]ocispec.Descriptor, error) {
	v := p.opts.Format
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
			Offset: offset, Length: length, Chunker: p.opts.Chunking, Chunks: pc, Version: v}
		if t.Chunks == nil {
			t.Chunks = []Chunk{}
		}
		layers := partLayers(pc)
		if v == V2 {
			t.Packs = layers
		}
		if err := t.Validate(); err != nil {
			return nil, fmt.Errorf("internal error: %w", err)
		}
		data, err := t.Marshal()
		if err != nil {
			return nil, fmt.Errorf("internal error: %w", err)
		}
		tableType := v.tableMediaType()
		if v == V2 && p.opts.PlainTables {
			tableType = MediaTypeChunkTableV2
		} else if v == V2 {
			data = p.codec.CompressTable(data)
		}
		tdesc, err := p.pushBytes(ctx, tableType, "", data)
		if err != nil {
			return nil, fmt.Errorf("push chunk table of %s: %w", f.path, err)
		}
		m := ocispec.Manifest{
			Versioned:    specsVersioned,
			MediaType:    ocispec.MediaTypeImageManifest,
			ArtifactType: v.fileArtifactType(),
			Config:       tdesc,
			Layers:       layers,
		}
		if len(m.Layers) == 0 {
			// OCI 1.1: a manifest with no layers uses the empty descriptor.
			if _, err := p.pushIfMissing(ctx, ocispec.DescriptorEmptyJSON, ocispec.DescriptorEmptyJSON.Data); err != nil {
				return nil, err
			}
			m.Layers = []ocispec.Descriptor{emptyLayer()}
		}
		mdesc, err := p.pushJSON(ctx, ocispec.MediaTypeImageManifest, v.fileArtifactType(), m)
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
	return p.pushBytes(ctx, mediaType, artifactType, data)
}

// pushBytes pushes the JSON document data unless present and returns its
// descriptor.
func (p *packer) pushBytes(ctx context.Context, mediaType, artifactType string, data []byte) (ocispec.Descriptor, error) {
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
