package puller

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"oras.land/oras-go/v2/content"
)

// tables are a snapshot's chunk tables, loaded part by part: a read
// waits only for the table of the part it falls in (fetched at once, ahead
// of the others), while a load's background fills in the rest a few at a
// time. So a mount is ready, and serves its first reads, in a time that
// does not grow with the snapshot's size (SPEC.md 13.4).
//
// A part's table is fetched from the load's endpoints (format.LoadPart:
// digests checked against the index, the table against its manifest and
// the index). A failure to fetch is retried until the deadline, so that a
// sandbox's read is never failed fast; a table that is invalid (its bytes
// are what the index names, so it is invalid on every endpoint) fails the
// reads of its part at once.
type tables struct {
	ctx      context.Context
	src      content.Fetcher
	snap     *format.Snapshot
	deadline time.Duration
	// sem bounds the background's loads in flight; a load a read waits
	// for takes no slot.
	sem   chan struct{}
	parts [][]*partTable
	// urgent counts the loads a read waits for that are fetching; the
	// background starts no fetch while there are any (cond, under mu).
	mu     sync.Mutex
	cond   *sync.Cond
	urgent int
}

// partTable is one part's table, loaded once.
type partTable struct {
	start  sync.Once
	urgent chan struct{}
	hurry  sync.Once
	done   chan struct{}
	// chunks and err are set before done is closed.
	chunks []format.Chunk
	err    error
}

// backgroundTableLoads is how many parts' tables a background loads at once.
const backgroundTableLoads = 4

// newTables returns the tables of snap, loaded from src under ctx (its end
// stops every load) with fetch failures retried for up to deadline.
func newTables(ctx context.Context, src content.Fetcher, snap *format.Snapshot, deadline time.Duration) *tables {
	if deadline <= 0 {
		deadline = 5 * time.Minute
	}
	t := &tables{ctx: ctx, src: src, snap: snap, deadline: deadline, sem: make(chan struct{}, backgroundTableLoads), parts: make([][]*partTable, len(snap.Files))}
	t.cond = sync.NewCond(&t.mu)
	for i, f := range snap.Files {
		t.parts[i] = make([]*partTable, len(f.Parts))
		for j := range f.Parts {
			t.parts[i][j] = &partTable{urgent: make(chan struct{}), done: make(chan struct{})}
		}
	}
	return t
}

// part returns the chunks of part pi of file fi, loading its table ahead
// of the background's if it is not loaded yet.
func (t *tables) part(ctx context.Context, fi, pi int) ([]format.Chunk, error) {
	p := t.parts[fi][pi]
	select {
	case <-p.done:
		return p.chunks, p.err
	default:
	}
	t.hurryPart(fi, pi)
	return t.wait(ctx, fi, pi)
}

// wait waits for part pi of file fi, started already.
func (t *tables) wait(ctx context.Context, fi, pi int) ([]format.Chunk, error) {
	p := t.parts[fi][pi]
	select {
	case <-p.done:
		return p.chunks, p.err
	case <-ctx.Done():
		return nil, fmt.Errorf("chunk table of %q part %d: %w", t.snap.Files[fi].Path, pi, ctx.Err())
	}
}

// hurryPart starts loading part pi of file fi, if it is not loading yet,
// ahead of the background's loads.
func (t *tables) hurryPart(fi, pi int) {
	p := t.parts[fi][pi]
	p.hurry.Do(func() {
		close(p.urgent)
		t.mu.Lock()
		t.cond.Broadcast()
		t.mu.Unlock()
	})
	t.startPart(fi, pi)
}

// startPart starts loading part pi of file fi, once.
func (t *tables) startPart(fi, pi int) {
	p := t.parts[fi][pi]
	p.start.Do(func() { go t.loadPart(fi, pi, p) })
}

// loadPart loads one part's table: in a slot of sem and once no read
// waits for a table unless a read wants this one, retrying fetch failures
// with backoff until the deadline.
func (t *tables) loadPart(fi, pi int, p *partTable) {
	defer close(p.done)
	select {
	case t.sem <- struct{}{}:
		defer func() { <-t.sem }()
	case <-p.urgent:
	case <-t.ctx.Done():
		p.err = t.ctx.Err()
		return
	}
	t.mu.Lock()
	for t.urgent > 0 && !closedChan(p.urgent) && t.ctx.Err() == nil {
		t.cond.Wait()
	}
	urgent := closedChan(p.urgent)
	if urgent {
		t.urgent++
	}
	t.mu.Unlock()
	if urgent {
		defer func() {
			t.mu.Lock()
			t.urgent--
			t.cond.Broadcast()
			t.mu.Unlock()
		}()
	}
	ctx, cancel := context.WithTimeout(t.ctx, t.deadline)
	defer cancel()
	f := &t.snap.Files[fi]
	wait := 100 * time.Millisecond
	for {
		pt, err := format.LoadPart(ctx, t.src, f, pi)
		if err == nil {
			p.chunks = pt.Table.Chunks
			return
		}
		if errors.Is(err, format.ErrInvalid) || errors.Is(err, format.ErrTooLarge) || ctx.Err() != nil {
			p.err = err
			return
		}
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			p.err = fmt.Errorf("%w (still failing after %s)", err, t.deadline)
			return
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// hurry starts loading the tables of file fi's parts, ahead of the
// background's.
func (t *tables) hurry(fi int) {
	for pi := range t.parts[fi] {
		t.hurryPart(fi, pi)
	}
}

// closedChan reports whether c is closed.
func closedChan(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// file returns every chunk of file fi in offset order, once each of its
// parts is loaded (those not loaded yet first, as a read's).
func (t *tables) file(ctx context.Context, fi int) ([]format.Chunk, error) {
	t.hurry(fi)
	var out []format.Chunk
	for pi := range t.parts[fi] {
		c, err := t.wait(ctx, fi, pi)
		if err != nil {
			return nil, err
		}
		if len(t.parts[fi]) == 1 {
			return c, nil
		}
		out = append(out, c...)
	}
	return out, nil
}

// all returns every file's chunks (indexed like the snapshot's files),
// once every part's table is loaded: those no read asked for yet a few
// at a time.
func (t *tables) all(ctx context.Context) ([][]format.Chunk, error) {
	for fi := range t.parts {
		for pi := range t.parts[fi] {
			t.startPart(fi, pi)
		}
	}
	out := make([][]format.Chunk, len(t.parts))
	for fi := range t.parts {
		for pi := range t.parts[fi] {
			c, err := t.wait(ctx, fi, pi)
			if err != nil {
				return nil, err
			}
			out[fi] = append(out[fi], c...)
		}
	}
	return out, nil
}

// span returns the chunks of file fi that hold [off, off+n), in offset
// order: a read's, whose parts' tables it loads first if they are not
// loaded yet. n > 0 and the range must lie within the file.
func (t *tables) span(ctx context.Context, fi int, off, n int64) ([]format.Chunk, error) {
	f := &t.snap.Files[fi]
	first, last := f.PartAt(off), f.PartAt(off+n-1)
	if first < 0 || last < 0 {
		return nil, fmt.Errorf("%s: no part holds [%d,+%d) of its %d bytes", f.Path, off, n, f.Size)
	}
	var out []format.Chunk
	for pi := first; pi <= last; pi++ {
		c, err := t.part(ctx, fi, pi)
		if err != nil {
			return nil, err
		}
		lo := sort.Search(len(c), func(i int) bool { return c[i].End() > off })
		hi := sort.Search(len(c), func(i int) bool { return c[i].Offset >= off+n })
		if first == last {
			return c[lo:hi], nil
		}
		out = append(out, c[lo:hi]...)
	}
	return out, nil
}
