package format

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"runtime"
	"sync"

	"github.com/cryo-oci/cryo/internal/ordered"
	"github.com/opencontainers/go-digest"
	"oras.land/oras-go/v2/content"
)

// Reader fetches, decodes and verifies the files of snapshots from a content
// store. It is safe for concurrent use.
type Reader struct {
	src         content.Fetcher
	codec       *Codec
	concurrency int
	bufs        sync.Pool
}

// NewReader returns a Reader that fetches from src with up to concurrency
// chunks in flight (default GOMAXPROCS). Close it when done.
func NewReader(src content.Fetcher, concurrency int) (*Reader, error) {
	if concurrency <= 0 {
		concurrency = runtime.GOMAXPROCS(0)
	}
	codec, err := NewCodec(runtime.GOMAXPROCS(0))
	if err != nil {
		return nil, err
	}
	r := &Reader{src: src, codec: codec, concurrency: concurrency}
	r.bufs.New = func() any { return new([]byte) }
	return r, nil
}

// Close releases the Reader's decoders.
func (r *Reader) Close() { r.codec.Close() }

// FetchChunk fetches chunk c's blob and returns its verified bytes, appended
// to dst[:0]. Zero chunks need no fetch.
func (r *Reader) FetchChunk(ctx context.Context, c Chunk, dst []byte) ([]byte, error) {
	if c.Encoding == EncodingZero {
		return r.codec.Decode(c, nil, dst)
	}
	if c.Encoding == EncodingRaw {
		// The blob is the chunk: read it straight into dst, verify in place.
		blob, err := fetchExact(ctx, r.src, c, dst)
		if err != nil {
			return nil, err
		}
		return blob, r.codec.Verify(c, blob)
	}
	bp := r.bufs.Get().(*[]byte)
	defer r.bufs.Put(bp)
	blob, err := fetchExact(ctx, r.src, c, *bp)
	*bp = blob
	if err != nil {
		return nil, err
	}
	return r.codec.Decode(c, blob, dst)
}

// fetchExact reads chunk c's blob into buf. Its size is checked here; its
// content is checked by Decode against the chunk's digest, so a raw chunk is
// hashed once.
func fetchExact(ctx context.Context, src content.Fetcher, c Chunk, buf []byte) ([]byte, error) {
	if c.BlobSize <= 0 || c.BlobSize > MaxChunkSize {
		return buf, fmt.Errorf("chunk %s: blob of %d bytes: %w", c.Digest, c.BlobSize, ErrInvalid)
	}
	desc := c.BlobDescriptor()
	rc, err := src.Fetch(ctx, desc)
	if err != nil {
		return buf, fmt.Errorf("fetch chunk %s (blob %s): %w", c.Digest, c.Blob, err)
	}
	defer rc.Close()
	if int64(cap(buf)) < c.BlobSize {
		buf = make([]byte, c.BlobSize)
	}
	buf = buf[:c.BlobSize]
	if _, err := io.ReadFull(rc, buf); err != nil {
		return buf, fmt.Errorf("fetch chunk %s (blob %s): read %d bytes: %w", c.Digest, c.Blob, c.BlobSize, err)
	}
	return buf, nil
}

// ChunkFunc receives a file's chunks with their verified bytes. local says
// the bytes came from the local copy given to ReadFile rather than from the
// store. data is only valid during the call. ReadFile calls it from several
// goroutines at once, in no particular order (a writer uses WriteAt).
type ChunkFunc func(c Chunk, data []byte, local bool) error

// ReadFile fetches and verifies the chunks of file f in parallel and hands
// each to fn, while the whole file's sha256 is computed in file order and
// checked at the end. If local is not nil, a chunk whose bytes it already holds
// (verified against the chunk's digest) is taken from it instead of being
// fetched: that is how an interrupted unpack resumes. fn sees only verified
// chunks, but it sees them before the file digest is checked: a caller that
// writes them must discard its output if ReadFile fails.
func (r *Reader) ReadFile(ctx context.Context, f *File, local io.ReaderAt, fn ChunkFunc) error {
	h := sha256.New()
	type result struct {
		c     Chunk
		buf   *[]byte
		local bool
	}
	produce := func(ctx context.Context, emit func(Chunk) error) error {
		for i := range f.Parts {
			pt, err := LoadPart(ctx, r.src, f, i)
			if err != nil {
				return err
			}
			for _, c := range pt.Table.Chunks {
				if err := emit(c); err != nil {
					return err
				}
			}
		}
		return nil
	}
	fetch := func(ctx context.Context, c Chunk) (result, error) {
		bp := r.bufs.Get().(*[]byte)
		if local != nil {
			if data, ok := r.localChunk(local, c, *bp); ok {
				*bp = data
				return result{c, bp, true}, nil
			}
		}
		data, err := r.FetchChunk(ctx, c, *bp)
		if err != nil {
			r.bufs.Put(bp)
			return result{}, fmt.Errorf("%s at offset %d: %w", f.Path, c.Offset, err)
		}
		*bp = data
		return result{c, bp, false}, nil
	}
	// fn runs in the workers, so writes proceed in parallel; only the
	// file hash, which needs file order, runs in the sink.
	work := func(ctx context.Context, c Chunk) (result, error) {
		res, err := fetch(ctx, c)
		if err != nil {
			return res, err
		}
		if err := fn(res.c, *res.buf, res.local); err != nil {
			r.bufs.Put(res.buf)
			return result{}, err
		}
		return res, nil
	}
	sink := func(res result) error {
		h.Write(*res.buf)
		r.bufs.Put(res.buf)
		return nil
	}
	if err := ordered.Map(ctx, r.concurrency, 2*r.concurrency+2, produce, work, sink); err != nil {
		return err
	}
	if got := digest.NewDigestFromBytes(digest.SHA256, h.Sum(nil)); got != f.Digest {
		return fmt.Errorf("%s: file hashes to %s, snapshot says %s: %w", f.Path, got, f.Digest, ErrDigestMismatch)
	}
	return nil
}

// localChunk reads chunk c's range from local into buf and reports whether
// it holds exactly the chunk's bytes. Bytes past the end of local read as
// zeros (a file is extended to its size only at the end of an unpack).
func (r *Reader) localChunk(local io.ReaderAt, c Chunk, buf []byte) ([]byte, bool) {
	if int64(cap(buf)) < c.Size {
		buf = make([]byte, c.Size)
	}
	buf = buf[:c.Size]
	n, err := local.ReadAt(buf, c.Offset)
	if err != nil && err != io.EOF {
		return buf, false
	}
	clear(buf[n:])
	return buf, r.codec.Verify(c, buf) == nil
}
