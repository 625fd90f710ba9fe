package format

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"sync"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/internal/ordered"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2/content"
)

// ChunkSource supplies the verified bytes of chunks: the one way cryo reads
// a chunk, whether from an OCI layout or a registry (Reader) or, on a node,
// through the puller's fetch scheduler and node cache. UnpackFrom writes a
// snapshot's files from any ChunkSource.
type ChunkSource interface {
	// Chunk returns chunk c's bytes, exactly c.Size of them, verified
	// against c (a zero chunk's are zeros and need no fetch). They are in
	// buf, grown as needed, or in a slice shared with other readers of
	// the chunk, which the caller must not modify.
	Chunk(ctx context.Context, c Chunk, buf []byte) ([]byte, error)
}

// LoadChunks loads the chunk table of every part of every file of snap from
// src (LoadPart, a few at once) and returns each file's chunks in offset
// order, indexed like snap.Files.
func LoadChunks(ctx context.Context, src content.Fetcher, snap *Snapshot) ([][]Chunk, error) {
	tables := make([][]*PartTable, len(snap.Files))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i := range snap.Files {
		f := &snap.Files[i]
		tables[i] = make([]*PartTable, len(f.Parts))
		for part := range f.Parts {
			g.Go(func() error {
				pt, err := LoadPart(gctx, src, f, part)
				tables[i][part] = pt
				return err
			})
		}
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	chunks := make([][]Chunk, len(snap.Files))
	for i, parts := range tables {
		for _, pt := range parts {
			chunks[i] = append(chunks[i], pt.Table.Chunks...)
		}
	}
	return chunks, nil
}

// chunkFunc receives a file's chunks with their verified bytes; local says
// they came from the local copy given to readFile rather than from the
// source. data is only valid during the call, and must not be modified.
// readFile calls it from several goroutines at once, in no particular order
// (a writer uses WriteAt).
type chunkFunc func(c Chunk, data []byte, local bool) error

// fileReader reads files chunk by chunk from a ChunkSource, several chunks
// at once, and checks each whole file's sha256.
type fileReader struct {
	src         ChunkSource
	concurrency int
	bufs        sync.Pool
}

func newFileReader(src ChunkSource, concurrency int) *fileReader {
	fr := &fileReader{src: src, concurrency: max(concurrency, 1)}
	fr.bufs.New = func() any { return new([]byte) }
	return fr
}

// readFile reads file f, whose chunks are chunks, from the source in
// parallel and hands each chunk to fn, while the file's sha256 is computed
// in file order and checked at the end. A zero chunk is read from nowhere.
// If local is not nil, a chunk whose bytes it already holds (verified
// against the chunk) is taken from it instead: that is how an interrupted
// unpack resumes. fn sees only verified chunks, but sees them before the
// file digest is checked: a caller that writes them must discard its
// output if readFile fails.
func (fr *fileReader) readFile(ctx context.Context, f *File, chunks []Chunk, local *localFile, fn chunkFunc) error {
	h := sha256.New()
	produce := func(ctx context.Context, emit func(Chunk) error) error {
		for _, c := range chunks {
			if err := emit(c); err != nil {
				return err
			}
		}
		return nil
	}
	// fn runs in the workers, so writes proceed in parallel; only the file
	// hash, which needs file order, runs in the sink.
	work := func(ctx context.Context, c Chunk) (gotChunk, error) {
		if c.Size <= 0 || c.Size > MaxChunkSize {
			return gotChunk{}, fmt.Errorf("%s: chunk at offset %d has size %d: %w", f.Path, c.Offset, c.Size, ErrInvalid)
		}
		bp := fr.bufs.Get().(*[]byte)
		if int64(cap(*bp)) < c.Size {
			*bp = make([]byte, c.Size)
		}
		res, err := fr.chunk(ctx, c, (*bp)[:c.Size], local)
		if err != nil {
			fr.bufs.Put(bp)
			return gotChunk{}, fmt.Errorf("%s at offset %d: %w", f.Path, c.Offset, err)
		}
		res.buf = bp
		if err := fn(c, res.data, res.local); err != nil {
			fr.bufs.Put(bp)
			return gotChunk{}, err
		}
		return res, nil
	}
	sink := func(res gotChunk) error {
		h.Write(res.data)
		fr.bufs.Put(res.buf)
		return nil
	}
	if err := ordered.Map(ctx, fr.concurrency, 2*fr.concurrency+2, produce, work, sink); err != nil {
		return err
	}
	if got := digest.NewDigestFromBytes(digest.SHA256, h.Sum(nil)); got != f.Digest {
		return fmt.Errorf("%s: file hashes to %s, snapshot says %s: %w", f.Path, got, f.Digest, ErrDigestMismatch)
	}
	return nil
}

// gotChunk is a chunk's verified bytes, in buf (from the pool) or shared
// with the source's other readers; local says they came from the local copy.
type gotChunk struct {
	data  []byte
	buf   *[]byte
	local bool
}

// chunkSkipper is a ChunkSource told of the chunks a reader found on
// disk and will not ask it for (a Reader, whose plan then drops them).
type chunkSkipper interface {
	skipChunk(c Chunk)
}

// localFile is the copy of a file an unpack resumes from: r holds it, and
// inPlace, if set, names the chunks in it that need no verification (their
// writer verified them; the whole file's sha256 still covers them).
type localFile struct {
	r       io.ReaderAt
	inPlace func(Chunk) bool
}

// chunk returns chunk c's verified bytes: from local if it holds them, else
// zeros or the source's. buf has room for c.Size bytes.
func (fr *fileReader) chunk(ctx context.Context, c Chunk, buf []byte, local *localFile) (gotChunk, error) {
	if local != nil && local.inPlace != nil && c.Encoding != EncodingZero && local.inPlace(c) {
		n, err := local.r.ReadAt(buf, c.Offset)
		if n == len(buf) {
			return gotChunk{data: buf, local: true}, nil
		}
		if err == nil || err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return gotChunk{}, fmt.Errorf("read back chunk %s at %d: %w", c.Digest, c.Offset, err)
	}
	if local != nil && localChunk(local.r, c, buf) {
		if sk, ok := fr.src.(chunkSkipper); ok {
			sk.skipChunk(c)
		}
		return gotChunk{data: buf, local: true}, nil
	}
	if c.Encoding == EncodingZero {
		clear(buf)
		return gotChunk{data: buf}, nil
	}
	data, err := fr.src.Chunk(ctx, c, buf)
	if err != nil {
		return gotChunk{}, err
	}
	// Every source verifies; one that hands back the wrong length anyway
	// must not shift the file.
	if int64(len(data)) != c.Size {
		return gotChunk{}, fmt.Errorf("chunk %s: source returned %d bytes, want %d: %w", c.Digest, len(data), c.Size, ErrDigestMismatch)
	}
	return gotChunk{data: data}, nil
}

// localChunk reads chunk c's range from local into buf (len(buf) == c.Size)
// and reports whether it holds exactly the chunk's bytes. Bytes past the
// end of local read as zeros (a file is extended to its size only at the
// end of an unpack).
func localChunk(local io.ReaderAt, c Chunk, buf []byte) bool {
	n, err := local.ReadAt(buf, c.Offset)
	if err != nil && err != io.EOF {
		return false
	}
	clear(buf[n:])
	if c.Encoding == EncodingZero {
		return chunker.IsZero(buf)
	}
	return digest.FromBytes(buf) == c.Digest
}
