package puller

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
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
// A part's table is fetched from the load's endpoints (format.FetchPart and
// Decode:
// digests checked against the index, the table against its manifest and
// the index). A fetch that fails is tried again, with backoff, until the
// deadline of the read (or background load) waiting for it, so that a
// sandbox's read is never failed fast; a failure that outlives it is not
// kept, and the next read of the part tries afresh. A table that is
// invalid (its bytes are what the index names, so it is invalid on every
// endpoint) fails the reads of its part at once, for good.
type tables struct {
	ctx      context.Context
	src      content.Fetcher
	snap     *format.Snapshot
	deadline time.Duration

	// mu guards every part's state and the counts; cond is signalled
	// when a part is hurried, a fetch ends or a loader's context ends.
	mu    sync.Mutex
	cond  *sync.Cond
	parts [][]*partTable
	// urgent counts the fetches a read waits for (at most
	// urgentTableLoads at once), background the others: the background
	// starts none while urgent > 0, and at most backgroundTableLoads at
	// once.
	urgent, background int
	// decoding holds a token while a background fetch decodes its table
	// (backgroundTableDecodes).
	decoding chan struct{}
}

// partTable is one part's table and its loading.
type partTable struct {
	// loading is set while a loader runs; done is closed when it ends.
	loading bool
	done    chan struct{}
	// hurried says a read waits for the part: its fetches go ahead of the
	// background's (at most urgentTableLoads at once).
	hurried bool
	// chunks is set, once, when the table is in: read without mu, so
	// that reads of a loaded part take no lock. err: a permanent error.
	// lastErr: the last loader's error, if it gave up (not kept).
	chunks  atomic.Pointer[[]format.Chunk]
	err     error
	lastErr error
}

// backgroundTableLoads is how many parts' tables a background fetches at
// once.
const backgroundTableLoads = 4

// backgroundTableDecodes is how many of them decode at once: one, so that
// decoding (35,000 chunks for 2 GiB in format v2, about 150 ms of CPU)
// takes at most one core from a sandbox whose runsc restore runs
// meanwhile; four at once took both cores of two (docs/benchmarks.md).
// A table a read waits for decodes at once.
const backgroundTableDecodes = 1

// urgentTableLoads bounds the tables that reads waiting for them load at
// once: page faults all over a large snapshot must not fetch (and hold) a
// table of up to format.MaxTableSize for every part at the same time. The
// standalone gofer runs in the sandbox's cgroup.
const urgentTableLoads = 8

// tableFetchTimeout bounds one attempt at a part's table (its manifest
// and table, at most format.MaxManifestSize and format.MaxTableSize).
const tableFetchTimeout = 60 * time.Second

// newTables returns the tables of snap, loaded from src under ctx (its end
// stops every load), each waiter retrying fetch failures for up to
// deadline.
func newTables(ctx context.Context, src content.Fetcher, snap *format.Snapshot, deadline time.Duration) *tables {
	if deadline <= 0 {
		deadline = 5 * time.Minute
	}
	t := &tables{ctx: ctx, src: src, snap: snap, deadline: deadline, parts: make([][]*partTable, len(snap.Files)),
		decoding: make(chan struct{}, backgroundTableDecodes)}
	t.cond = sync.NewCond(&t.mu)
	for i, f := range snap.Files {
		t.parts[i] = make([]*partTable, len(f.Parts))
		for j := range f.Parts {
			t.parts[i][j] = &partTable{}
		}
	}
	return t
}

// loaded returns the chunks of part pi of file fi if its table is in.
func (t *tables) loaded(fi, pi int) ([]format.Chunk, bool) {
	if c := t.parts[fi][pi].chunks.Load(); c != nil {
		return *c, true
	}
	return nil, false
}

// start starts loading part pi of file fi unless it is loaded, failed for
// good or loading; hurry marks it as waited for by a read. It returns the
// running loader's done channel, or nil if the part is loaded or failed
// for good. t.mu is held.
func (t *tables) start(fi, pi int, hurry bool) <-chan struct{} {
	p := t.parts[fi][pi]
	if hurry && !p.hurried {
		p.hurried = true
		t.cond.Broadcast()
	}
	if p.chunks.Load() != nil || p.err != nil {
		return nil
	}
	if !p.loading {
		p.loading, p.done = true, make(chan struct{})
		go t.load(fi, pi, p, time.Now().Add(t.deadline))
	}
	return p.done
}

// part returns the chunks of part pi of file fi, loading its table ahead
// of the background's if it is not loaded yet, for up to the deadline.
func (t *tables) part(ctx context.Context, fi, pi int) ([]format.Chunk, error) {
	return t.wait(ctx, fi, pi, true)
}

// wait waits for part pi of file fi, as a read (hurry) or the background.
// A loader that gave up (its deadline passed) is started again, until the
// waiter's own deadline.
func (t *tables) wait(ctx context.Context, fi, pi int, hurry bool) ([]format.Chunk, error) {
	if c, ok := t.loaded(fi, pi); ok {
		return c, nil
	}
	until := time.Now().Add(t.deadline)
	p := t.parts[fi][pi]
	for {
		t.mu.Lock()
		done := t.start(fi, pi, hurry)
		if done == nil {
			err := p.err
			t.mu.Unlock()
			if c, ok := t.loaded(fi, pi); ok {
				return c, nil
			}
			return nil, err
		}
		t.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return nil, fmt.Errorf("chunk table of %q part %d: %w", t.snap.Files[fi].Path, pi, ctx.Err())
		}
		t.mu.Lock()
		gaveUp := p.chunks.Load() == nil && p.err == nil
		lastErr := p.lastErr
		t.mu.Unlock()
		if gaveUp && (!time.Now().Before(until) || ctx.Err() != nil || t.ctx.Err() != nil) {
			return nil, fmt.Errorf("chunk table of %q part %d: %w", t.snap.Files[fi].Path, pi, lastErr)
		}
	}
}

// load loads one part's table until deadline: each fetch waits for its
// turn (if a read waits for the part, once fewer than urgentTableLoads
// such fetches run; else once no read waits for a table and fewer than
// backgroundTableLoads run), and a failed one is tried again with backoff.
func (t *tables) load(fi, pi int, p *partTable, deadline time.Time) {
	ctx, cancel := context.WithDeadline(t.ctx, deadline)
	defer cancel()
	// A loader waiting for its turn gives up when ctx ends.
	defer context.AfterFunc(ctx, func() {
		t.mu.Lock()
		t.cond.Broadcast()
		t.mu.Unlock()
	})()
	f := &t.snap.Files[fi]
	wait := 100 * time.Millisecond
	var err, failed error // failed: the last fetch's own error
	for {
		t.mu.Lock()
		for ctx.Err() == nil && (p.hurried && t.urgent >= urgentTableLoads || !p.hurried && (t.urgent > 0 || t.background >= backgroundTableLoads)) {
			t.cond.Wait()
		}
		urgent := p.hurried
		if urgent {
			t.urgent++
		} else {
			t.background++
		}
		t.mu.Unlock()
		var pt *format.PartTable
		if ctx.Err() == nil {
			// One attempt holds a slot for at most tableFetchTimeout: a
			// download that stalls is tried again, and leaves its slot to
			// others meanwhile.
			actx, acancel := context.WithTimeout(ctx, tableFetchTimeout)
			pt, err = t.loadPart(actx, f, pi, urgent)
			acancel()
		} else {
			err = ctx.Err()
		}
		t.mu.Lock()
		if urgent {
			t.urgent--
		} else {
			t.background--
		}
		t.cond.Broadcast()
		switch {
		case err == nil:
			p.chunks.Store(&pt.Table.Chunks)
		case errors.Is(err, format.ErrInvalid) || errors.Is(err, format.ErrTooLarge):
			p.err = err
		case ctx.Err() != nil:
			p.lastErr = err
			if failed != nil {
				p.lastErr = fmt.Errorf("%w (still failing after %s)", failed, t.deadline)
			}
		default:
			failed = err
			t.mu.Unlock()
			select {
			case <-time.After(wait):
			case <-ctx.Done():
			}
			wait = min(2*wait, 2*time.Second)
			continue
		}
		p.loading = false
		close(p.done)
		t.mu.Unlock()
		return
	}
}

// loadPart fetches and decodes part pi of f's table (format.LoadPart),
// the decoding of a background load (not urgent) with a token of
// t.decoding.
func (t *tables) loadPart(ctx context.Context, f *format.File, pi int, urgent bool) (*format.PartTable, error) {
	fp, err := format.FetchPart(ctx, t.src, f, pi)
	if err != nil {
		return nil, err
	}
	if !urgent {
		select {
		case t.decoding <- struct{}{}:
			defer func() { <-t.decoding }()
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return fp.Decode()
}

// hurry starts loading the tables of file fi's parts, ahead of the
// background's.
func (t *tables) hurry(fi int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for pi := range t.parts[fi] {
		t.start(fi, pi, true)
	}
}

// startAll starts loading every part's table (the background's turn).
func (t *tables) startAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for fi := range t.parts {
		for pi := range t.parts[fi] {
			t.start(fi, pi, false)
		}
	}
}

// file returns every chunk of file fi in offset order, once each of its
// parts is loaded (those not loaded yet first, as a read's).
func (t *tables) file(ctx context.Context, fi int) ([]format.Chunk, error) {
	t.hurry(fi)
	var out []format.Chunk
	for pi := range t.parts[fi] {
		c, err := t.part(ctx, fi, pi)
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
	t.startAll()
	out := make([][]format.Chunk, len(t.parts))
	for fi := range t.parts {
		for pi := range t.parts[fi] {
			c, err := t.wait(ctx, fi, pi, false)
			if err != nil {
				return nil, err
			}
			out[fi] = append(out[fi], c...)
		}
	}
	return out, nil
}

// loadedSpan returns the chunks that hold [off, off+n) of file fi, as far
// as their parts' tables are loaded, without waiting for any: the
// neighbourhood of a page fault (imagefs.File.Near), which must not hold
// up the fault.
func (t *tables) loadedSpan(fi int, off, n int64) []format.Chunk {
	f := &t.snap.Files[fi]
	first, last := f.PartAt(max(off, 0)), f.PartAt(min(off+n, f.Size)-1)
	if first < 0 || last < 0 {
		return nil
	}
	var out []format.Chunk
	for pi := first; pi <= last; pi++ {
		if c, ok := t.loaded(fi, pi); ok {
			out = append(out, clip(c, off, n)...)
		}
	}
	return out
}

// hurrySpan starts loading the tables of the parts of file fi that hold
// [off, off+n), ahead of the background's.
func (t *tables) hurrySpan(fi int, off, n int64) {
	f := &t.snap.Files[fi]
	first, last := f.PartAt(off), f.PartAt(off+n-1)
	if first < 0 || last < 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for pi := first; pi <= last; pi++ {
		t.start(fi, pi, true)
	}
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
	if _, ok := t.loaded(fi, first); !ok || first != last {
		t.hurrySpan(fi, off, n)
	}
	var out []format.Chunk
	for pi := first; pi <= last; pi++ {
		c, err := t.part(ctx, fi, pi)
		if err != nil {
			return nil, err
		}
		if first == last {
			return clip(c, off, n), nil
		}
		out = append(out, clip(c, off, n)...)
	}
	return out, nil
}

// clip returns the chunks of c (in offset order) that hold bytes of
// [off, off+n).
func clip(c []format.Chunk, off, n int64) []format.Chunk {
	lo := sort.Search(len(c), func(i int) bool { return c[i].End() > off })
	hi := sort.Search(len(c), func(i int) bool { return c[i].Offset >= off+n })
	return c[lo:hi]
}
