// Package synth makes synthetic checkpoint image dirs for the demo, tests and
// benchmarks: pages.img of random, text-like or half-zero memory, and a
// mutated copy of it with page-aligned insertions, deletions and rewrites,
// as two checkpoints of one app would differ.
package synth

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"

	"github.com/cryo-oci/cryo/format/statefile"
)

// PageSize is the memory page size.
const PageSize = 4096

// Kind names the content of a synthetic pages.img.
type Kind string

// The kinds of synthetic memory.
const (
	// Random pages do not compress.
	Random Kind = "random"
	// Text pages hold words and numbers and compress about 2x.
	Text Kind = "text"
	// HalfZero has every other run of pages all zero, the rest random.
	HalfZero Kind = "halfzero"
)

// Kinds lists every kind.
var Kinds = []Kind{Random, Text, HalfZero}

// Pages returns a deterministic generator of page content of the given kind.
type Pages struct {
	kind  Kind
	rng   *rand.Rand
	vocab [][]byte
}

// NewPages returns a page generator seeded with seed.
func NewPages(kind Kind, seed uint64) (*Pages, error) {
	p := &Pages{kind: kind, rng: rand.New(rand.NewPCG(seed, 0x63727930))}
	switch kind {
	case Random, HalfZero:
	case Text:
		// A vocabulary of 4096 random "words": with a bigram-free mix of
		// words and numbers zstd reaches about 2x.
		for range 4096 {
			w := make([]byte, 3+p.rng.IntN(8))
			for i := range w {
				w[i] = byte('a' + p.rng.IntN(26))
			}
			p.vocab = append(p.vocab, w)
		}
	default:
		return nil, fmt.Errorf("unknown kind %q", kind)
	}
	return p, nil
}

// Fill fills buf (a whole number of pages, starting at page index first of
// the image) with content.
func (p *Pages) Fill(buf []byte, first int64) {
	switch p.kind {
	case Random:
		p.random(buf)
	case HalfZero:
		// Runs of 64 pages alternate between zero and random.
		for off := 0; off < len(buf); off += PageSize {
			page := buf[off:min(off+PageSize, len(buf))]
			if (first+int64(off/PageSize))/64%2 == 0 {
				clear(page)
			} else {
				p.random(page)
			}
		}
	case Text:
		i := 0
		for i < len(buf) {
			var w []byte
			if p.rng.IntN(4) == 0 {
				w = fmt.Appendf(nil, "%d", p.rng.IntN(1<<20))
			} else {
				w = p.vocab[p.rng.IntN(len(p.vocab))]
			}
			i += copy(buf[i:], w)
			if i < len(buf) {
				buf[i] = " \n"[p.rng.IntN(2)]
				i++
			}
		}
	}
}

func (p *Pages) random(buf []byte) {
	i := 0
	for ; i+8 <= len(buf); i += 8 {
		binary.LittleEndian.PutUint64(buf[i:], p.rng.Uint64())
	}
	for ; i < len(buf); i++ {
		buf[i] = byte(p.rng.Uint32())
	}
}

// WritePages writes size bytes (rounded up to whole pages) of the given kind
// to w.
func WritePages(w io.Writer, kind Kind, size int64, seed uint64) error {
	p, err := NewPages(kind, seed)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < size; off += int64(len(buf)) {
		b := buf[:min(int64(len(buf)), (size-off+PageSize-1)/PageSize*PageSize)]
		p.Fill(b, off/PageSize)
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// ImageDir writes a synthetic checkpoint image dir: checkpoint.img with a
// gVisor state file header, a small pages_meta.img and a pages.img of size
// bytes of the given kind.
func ImageDir(dir string, kind Kind, size int64, seed uint64) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "checkpoint.img"), StateFile(map[string]string{
		"runsc_version": "synthetic", "_timestamp": "2026-11-30 00:00:00 +0000 UTC", "container_count": "1",
	}, 64<<10, seed), 0o644); err != nil {
		return err
	}
	meta := make([]byte, 2048)
	binary.LittleEndian.PutUint64(meta, uint64(size))
	if err := os.WriteFile(filepath.Join(dir, "pages_meta.img"), meta, 0o644); err != nil {
		return err
	}
	return WriteFile(filepath.Join(dir, "pages.img"), func(w io.Writer) error { return WritePages(w, kind, size, seed) })
}

// StateFile returns a gVisor state file: header with metadata md, then
// bodySize bytes of text-like state.
func StateFile(md map[string]string, bodySize int, seed uint64) []byte {
	out := statefile.Header(md)
	body := make([]byte, bodySize)
	p, _ := NewPages(Text, seed)
	p.Fill(body, 0)
	return append(out, body...)
}

// WriteFile creates the file name and fills it through a buffered writer
// with fill.
func WriteFile(name string, fill func(io.Writer) error) error {
	f, err := os.Create(name)
	if err != nil {
		return err
	}
	bw := bufio.NewWriterSize(f, 1<<20)
	if err := fill(bw); err != nil {
		f.Close()
		return err
	}
	if err := bw.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// Edit is one change Mutate makes, at a page index of the original.
type Edit struct {
	// Page is where the edit applies, in pages of the original.
	Page int64
	// Insert pages of new content are inserted before Page (if > 0).
	Insert int64
	// Delete pages are removed from Page on (if > 0).
	Delete int64
	// Rewrite pages from Page on get new content (if > 0).
	Rewrite int64
}

// MutationPlan returns the edits of the dedup benchmark for an image of
// pages pages: indels insertions or deletions of 1-16 pages (4-64 KiB) and
// rewrites of rewriteFrac of the pages in runs of 16-256 pages, sorted and
// not overlapping.
func MutationPlan(pages int64, indels int, rewriteFrac float64, seed uint64) []Edit {
	rng := rand.New(rand.NewPCG(seed, 0x6d7574))
	var edits []Edit
	for range indels {
		n := 1 + rng.Int64N(16)
		e := Edit{Page: rng.Int64N(pages)}
		if rng.IntN(2) == 0 {
			e.Insert = n
		} else {
			e.Delete = n
		}
		edits = append(edits, e)
	}
	target := int64(float64(pages) * rewriteFrac)
	for done := int64(0); done < target; {
		n := min(16+rng.Int64N(241), target-done)
		edits = append(edits, Edit{Page: rng.Int64N(pages), Rewrite: n})
		done += n
	}
	sort.Slice(edits, func(i, j int) bool { return edits[i].Page < edits[j].Page })
	// Drop edits that overlap the one before.
	var out []Edit
	var end int64
	for _, e := range edits {
		if e.Page < end {
			continue
		}
		out = append(out, e)
		end = e.Page + max(e.Delete, e.Rewrite, 1)
	}
	return out
}

// Mutate copies the pages of src to dst, applying edits with fresh content.
// It returns how many bytes of dst are unchanged copies of src bytes.
func Mutate(dst io.Writer, src io.Reader, pages int64, edits []Edit, kind Kind, seed uint64) (unchanged int64, err error) {
	fresh, err := NewPages(kind, seed^0x5eed)
	if err != nil {
		return 0, err
	}
	page := make([]byte, PageSize)
	copyPages := func(n int64) error {
		for range n {
			if _, err := io.ReadFull(src, page); err != nil {
				return err
			}
			if _, err := dst.Write(page); err != nil {
				return err
			}
			unchanged += PageSize
		}
		return nil
	}
	newPages := func(n, at int64) error {
		for i := range n {
			fresh.Fill(page, at+i)
			if _, err := dst.Write(page); err != nil {
				return err
			}
		}
		return nil
	}
	skip := func(n int64) error { _, err := io.CopyN(io.Discard, src, n*PageSize); return err }
	var pos int64
	for _, e := range edits {
		if err := copyPages(e.Page - pos); err != nil {
			return 0, err
		}
		pos = e.Page
		if err := newPages(e.Insert, pos); err != nil {
			return 0, err
		}
		if e.Delete > 0 {
			n := min(e.Delete, pages-pos)
			if err := skip(n); err != nil {
				return 0, err
			}
			pos += n
		}
		if e.Rewrite > 0 {
			n := min(e.Rewrite, pages-pos)
			if err := skip(n); err != nil {
				return 0, err
			}
			if err := newPages(n, pos); err != nil {
				return 0, err
			}
			pos += n
		}
	}
	if err := copyPages(pages - pos); err != nil {
		return 0, err
	}
	return unchanged, nil
}
