package format

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"sync"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// Reader is the ChunkSource over a content store (an OCI layout, a
// registry): it fetches a chunk's blob, decodes it and verifies it. It is
// safe for concurrent use.
type Reader struct {
	src   content.Fetcher
	codec *Codec
	bufs  sync.Pool
	// runs, if set (plan), fetches the frames it names in runs.
	runs *runPlan
}

var _ ChunkSource = (*Reader)(nil)

// NewReader returns a Reader that fetches from src. Close it when done.
func NewReader(src content.Fetcher) (*Reader, error) {
	codec, err := NewCodec(runtime.GOMAXPROCS(0))
	if err != nil {
		return nil, err
	}
	r := &Reader{src: src, codec: codec}
	r.bufs.New = func() any { return new([]byte) }
	return r, nil
}

// plan makes the Reader fetch the packed chunks of files, which it will be
// asked for in this order, in runs of several frames per range request
// (planRuns, with up to ahead runs in flight ahead of the one read), if
// its source serves ranges. Close ends the plan's fetches.
func (r *Reader) plan(ctx context.Context, files [][]Chunk, ahead int) {
	if rf, ok := r.src.(RangeFetcher); ok && r.runs == nil {
		r.runs = planRuns(ctx, rf, files, ahead)
	}
}

// Close cancels and waits for the fetches of its plan, if any, and
// releases the Reader's decoders.
func (r *Reader) Close() {
	if r.runs != nil {
		r.runs.close()
	}
	r.codec.Close()
}

// skipChunk tells the Reader's plan that chunk c, found on disk, will not
// be read (an unpack resuming).
func (r *Reader) skipChunk(c Chunk) {
	if r.runs != nil && c.Packed() {
		r.runs.skip(c)
	}
}

// Chunk fetches chunk c's blob and returns its verified bytes, appended to
// buf[:0] (FetchChunk), or, for a frame of its plan (planRuns), decodes
// and verifies it from its run's bytes. Zero chunks need no fetch.
func (r *Reader) Chunk(ctx context.Context, c Chunk, buf []byte) ([]byte, error) {
	if r.runs != nil && c.Packed() {
		if frame, ok := r.runs.frame(ctx, c); ok {
			// A raw frame is verified where it lies, in the run's bytes,
			// which are never written again: shared, not copied.
			data, err := r.codec.FromFrame(c, frame, buf)
			if err == nil {
				return data, nil
			}
			// Bytes damaged in one range request of many frames: this
			// frame is fetched alone, once more, and verified again.
		}
	}
	bp := r.bufs.Get().(*[]byte)
	defer r.bufs.Put(bp)
	return FetchChunk(ctx, r.src, r.codec, c, buf, bp)
}

// FetchChunk fetches chunk c's blob from src, decodes it with codec and
// returns the chunk's verified bytes, appended to buf[:0]: the one way cryo
// turns a stored chunk into its bytes, for the Reader and for the puller's
// fetch scheduler. A zero chunk needs no fetch. The sizes in c are checked
// before anything is allocated (a table's sizes are the word of whoever
// pushed it), and exactly BlobSize bytes are read. A raw chunk is read
// straight into buf and verified in place; a zstd blob is read into
// *scratch (grown as needed and kept for the caller's next call), or a new
// buffer if scratch is nil. It is FetchFrame then Codec.FromFrame.
func FetchChunk(ctx context.Context, src content.Fetcher, codec *Codec, c Chunk, buf []byte, scratch *[]byte) ([]byte, error) {
	if c.Encoding == EncodingRaw {
		// The blob is the chunk: hashed once, by FromFrame.
		frame, err := FetchFrame(ctx, src, c, buf)
		if err != nil {
			return nil, err
		}
		return codec.FromFrame(c, frame, buf)
	}
	var sb []byte
	if scratch != nil {
		sb = *scratch
	}
	frame, err := FetchFrame(ctx, src, c, sb)
	if scratch != nil && frame != nil {
		*scratch = frame
	}
	if err != nil {
		return nil, err
	}
	return codec.FromFrame(c, frame, buf)
}

// FetchFrame fetches chunk c's stored frame from src, unverified: exactly
// BlobSize bytes, read into buf if it is large enough, else into a new
// buffer. The sizes in c are checked before anything is allocated. A zero
// chunk has no frame (nil). Codec.FromFrame turns the frame into the
// chunk's verified bytes; the two are apart so that a caller can fetch
// frames while others hold the CPU (the puller verifies background frames
// only with a token while page faults are being served).
func FetchFrame(ctx context.Context, src content.Fetcher, c Chunk, buf []byte) ([]byte, error) {
	if c.Encoding == EncodingZero {
		return nil, nil
	}
	if c.Size <= 0 || c.BlobSize <= 0 {
		return nil, fmt.Errorf("chunk %s: size %d, blob %s of %d bytes: %w", c.Digest, c.Size, c.Blob, c.BlobSize, ErrInvalid)
	}
	if c.Size > MaxChunkSize || c.BlobSize > MaxChunkSize {
		return nil, fmt.Errorf("chunk %s: size %d, blob %s of %d bytes: %w (limit %d)", c.Digest, c.Size, c.Blob, c.BlobSize, ErrTooLarge, MaxChunkSize)
	}
	return fetchExact(ctx, src, c, buf)
}

// RangeFetcher fetches n bytes at off of a blob: a registry by HTTP Range,
// a local store by seeking. FetchChunk reads a packed chunk's frame
// through it when the source has it, else through Fetch, skipping to the
// frame.
type RangeFetcher interface {
	// FetchRange returns a reader of exactly the n bytes at off of the
	// blob desc (or fewer, if the blob is shorter: a lying table).
	FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error)
}

// OpenRange opens n bytes at off of blob desc in src: with FetchRange if
// src is a RangeFetcher, else by seeking or skipping in the whole blob.
func OpenRange(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	if rf, ok := src.(RangeFetcher); ok {
		return rf.FetchRange(ctx, desc, off, n)
	}
	rc, err := src.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	if off > 0 {
		if sk, ok := rc.(io.Seeker); ok {
			_, err = sk.Seek(off, io.SeekStart)
		} else {
			_, err = io.CopyN(io.Discard, rc, off)
		}
		if err != nil {
			rc.Close()
			return nil, fmt.Errorf("skip to %d in %s: %w", off, desc.Digest, err)
		}
	}
	return struct {
		io.Reader
		io.Closer
	}{io.LimitReader(rc, n), rc}, nil
}

// fetchExact reads chunk c's stored bytes, c.BlobSize of them (its blob,
// or its frame of a pack), into buf (grown as needed).
func fetchExact(ctx context.Context, src content.Fetcher, c Chunk, buf []byte) ([]byte, error) {
	var rc io.ReadCloser
	var err error
	if c.Packed() {
		rc, err = OpenRange(ctx, src, c.BlobDescriptor(), c.PackOffset, c.BlobSize)
	} else {
		rc, err = src.Fetch(ctx, c.BlobDescriptor())
	}
	if err != nil {
		return nil, fmt.Errorf("fetch chunk %s (blob %s): %w", c.Digest, c.Blob, err)
	}
	defer rc.Close()
	if int64(cap(buf)) < c.BlobSize {
		buf = make([]byte, c.BlobSize)
	}
	buf = buf[:c.BlobSize]
	if _, err := io.ReadFull(rc, buf); err != nil {
		return nil, fmt.Errorf("fetch chunk %s (blob %s): read %d bytes: %w", c.Digest, c.Blob, c.BlobSize, err)
	}
	return buf, nil
}
