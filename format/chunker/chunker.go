// Package chunker cuts the bytes of one file into chunks, either at fixed
// sizes or at page-aligned, content-defined cut points.
//
// Page-aligned content-defined chunking (the "page-cdc" algorithm) is written
// here by hand because no Go library cuts only at page boundaries: byte-level
// CDC libraries (restic/chunker, FastCDC ports) would cut gVisor's pages.img
// in the middle of pages. The algorithm is deliberately simple so that a
// second implementation can reproduce it exactly (see SPEC.md):
//
//   - cut points lie only at multiples of PageSize from the start of the file;
//   - a chunk is at least Min bytes long (unless the file ends first) and at
//     most Max bytes long;
//   - for each candidate end point e with Min <= e-start <= Max, in order, e
//     is the cut point if the page that ends at e (bytes [e-PageSize, e))
//     hashes (XXH64, seed 0) below Threshold(), or if exactly one of that
//     page and the next one (bytes [e, e+PageSize), if the file has them) is
//     all zero bytes: runs of zero pages become chunks of their own, which
//     are stored as nothing;
//   - if no candidate qualifies, the chunk is cut at Max, or at the end of the
//     file if that comes first.
//
// Because a cut depends only on the content of one page, two memory images that
// hold the same pages shifted by whole pages find the same cut points after the
// first cut past the shift, so their chunks dedupe.
package chunker

import (
	"errors"
	"fmt"
	"io"
	"math"

	"github.com/cespare/xxhash/v2"
)

// PageSize is the unit of page-aligned chunking: the page size of gVisor's
// memory file on amd64 and arm64.
const PageSize = 4096

// Algorithm names, as recorded in chunk tables.
const (
	// PageCDC cuts at page boundaries chosen by the content of the page.
	PageCDC = "page-cdc"
	// Fixed cuts every Avg bytes.
	Fixed = "fixed"
)

// MaxChunkSize bounds Max for every algorithm. Readers rely on it to bound the
// memory one chunk can take.
const MaxChunkSize = 16 << 20

// Params selects a chunking algorithm and its sizes.
type Params struct {
	// Algorithm is PageCDC or Fixed.
	Algorithm string `json:"algorithm"`
	// Min is the smallest chunk, except the last chunk of a file.
	Min int `json:"min"`
	// Avg is the target mean chunk size (the exact size for Fixed).
	Avg int `json:"avg"`
	// Max is the largest chunk.
	Max int `json:"max"`
}

// DefaultPageCDC returns the page-aligned CDC parameters for a mean chunk
// size of avg bytes: min avg/4, max avg*4.
func DefaultPageCDC(avg int) Params {
	return Params{Algorithm: PageCDC, Min: avg / 4, Avg: avg, Max: avg * 4}
}

// FixedSize returns parameters that cut every size bytes.
func FixedSize(size int) Params {
	return Params{Algorithm: Fixed, Min: size, Avg: size, Max: size}
}

// Validate reports whether p can be used to chunk, and why not.
func (p Params) Validate() error {
	switch p.Algorithm {
	case Fixed:
		if p.Avg <= 0 || p.Avg > MaxChunkSize || p.Min != p.Avg || p.Max != p.Avg {
			return fmt.Errorf("fixed chunking needs 0 < min = avg = max <= %d, got %d/%d/%d", MaxChunkSize, p.Min, p.Avg, p.Max)
		}
	case PageCDC:
		if p.Min <= 0 || p.Min%PageSize != 0 || p.Avg%PageSize != 0 || p.Max%PageSize != 0 {
			return fmt.Errorf("page-cdc sizes must be positive multiples of %d, got %d/%d/%d", PageSize, p.Min, p.Avg, p.Max)
		}
		if !(p.Min < p.Avg && p.Avg < p.Max) || p.Max > MaxChunkSize {
			return fmt.Errorf("page-cdc needs min < avg < max <= %d, got %d/%d/%d", MaxChunkSize, p.Min, p.Avg, p.Max)
		}
	default:
		return fmt.Errorf("unknown chunking algorithm %q", p.Algorithm)
	}
	return nil
}

// Threshold is the page-cdc cut threshold: a candidate page whose XXH64 is
// below it ends the chunk. It is floor((2^64-1) / ((Avg-Min)/PageSize)), so
// that each candidate page cuts with probability PageSize/(Avg-Min) and the
// mean chunk size is close to Avg.
func (p Params) Threshold() uint64 {
	return math.MaxUint64 / uint64((p.Avg-p.Min)/PageSize)
}

// Cut returns the length of the chunk that starts at b[0]. b holds the rest
// of the file if eof is true; otherwise it must hold at least Lookahead()
// bytes. Cut returns 0 only for an empty b.
func (p Params) Cut(b []byte, eof bool) int {
	if len(b) == 0 {
		return 0
	}
	if p.Algorithm == Fixed {
		return min(p.Avg, len(b))
	}
	if !eof && len(b) < p.Lookahead() {
		panic("chunker: Cut needs Lookahead() bytes before the end of the file")
	}
	threshold := p.Threshold()
	end := min(p.Max, len(b))
	if p.Min > end {
		return end
	}
	zero := IsZero(b[p.Min-PageSize : p.Min])
	for e := p.Min; e <= end; e += PageSize {
		page := b[e-PageSize : e]
		if xxhash.Sum64(page) < threshold {
			return e
		}
		if e+PageSize <= len(b) {
			nextZero := IsZero(b[e : e+PageSize])
			if nextZero != zero {
				return e
			}
			zero = nextZero
		}
	}
	return end
}

// Lookahead is how many bytes Cut needs to see unless the file ends sooner.
func (p Params) Lookahead() int {
	if p.Algorithm == Fixed {
		return p.Max
	}
	return p.Max + PageSize
}

// IsZero reports whether b holds only zero bytes (a zero page, or a zero
// chunk: any length).
func IsZero(b []byte) bool {
	for len(b) >= len(zeroPage) {
		if string(b[:len(zeroPage)]) != string(zeroPage[:]) {
			return false
		}
		b = b[len(zeroPage):]
	}
	return string(b) == string(zeroPage[:len(b)])
}

// zeroPage is compared against, never written.
var zeroPage [PageSize]byte

// Chunker splits a stream into chunks with Params.
type Chunker struct {
	r      io.Reader
	p      Params
	buf    []byte
	start  int // start of unconsumed bytes in buf
	end    int // end of valid bytes in buf
	eof    bool
	offset int64
}

// New returns a Chunker that reads r. p must be valid.
func New(r io.Reader, p Params) (*Chunker, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	return &Chunker{r: r, p: p, buf: make([]byte, 2*p.Lookahead())}, nil
}

// Next returns the next chunk and its offset in the stream. The bytes are
// valid until the next call. At the end of the stream it returns io.EOF.
func (c *Chunker) Next() (chunk []byte, offset int64, err error) {
	if err := c.fill(); err != nil {
		return nil, 0, err
	}
	n := c.p.Cut(c.buf[c.start:c.end], c.eof)
	if n == 0 {
		return nil, 0, io.EOF
	}
	chunk = c.buf[c.start : c.start+n]
	offset = c.offset
	c.start += n
	c.offset += int64(n)
	return chunk, offset, nil
}

// fill makes sure at least Lookahead bytes are buffered, or the rest of the
// stream.
func (c *Chunker) fill() error {
	if c.eof || c.end-c.start >= c.p.Lookahead() {
		return nil
	}
	if c.start > 0 {
		c.end = copy(c.buf, c.buf[c.start:c.end])
		c.start = 0
	}
	for c.end < len(c.buf) {
		n, err := c.r.Read(c.buf[c.end:])
		c.end += n
		if errors.Is(err, io.EOF) {
			c.eof = true
			return nil
		}
		if err != nil {
			return fmt.Errorf("read at offset %d: %w", c.offset+int64(c.end), err)
		}
	}
	return nil
}
