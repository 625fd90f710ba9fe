package format

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/opencontainers/go-digest"
)

// An unpack of a v2 snapshot reads its chunks in file order, and a first
// snapshot's consecutive chunks are consecutive frames of one pack: a
// range request per frame (64 KiB) would make a 1 GiB pull about 17,000
// requests, each a round trip and a registry's per-request cost. A
// runPlan groups the frames an unpack will read, in the order it reads
// them, into runs: frames of one pack that follow each other in the plan
// and lie back to back in the pack (a gap of at most maxRunGap bytes is
// read and dropped), up to maxRunBytes a run, each fetched with one range
// request. Nothing is fetched that the plan does not name: a pack of an
// earlier snapshot that the unpacked one reuses in part is read only
// where it does. The puller's fetch scheduler coalesces the same way for
// what it has queued (fetch.MaxCoalesce); an unpack knows its whole plan
// at the start, so this is the simpler form of it.
//
// A run's bytes are fetched once, when a reader first asks for one of its
// frames, together with the next runs of the plan (up to ahead of them),
// each in a goroutine of its own, so that several requests are in flight
// while the unpack's workers read one run. Each frame is still verified
// (Codec.FromFrame) when it is read. A run's bytes are dropped once every
// read the plan counted for it has been made; one that fails to fetch
// gives its frames back to the caller, who fetches them one by one
// (Reader.Chunk), so a failed range costs a retry, not the unpack.
//
// What a run holds is bounded by what the plan counts: a frame read again
// later (a chunk two files hold, stored once) is counted only while its
// run is the one being planned; a later read of it finds the run gone and
// fetches it alone, so no run waits for a reader files away.

// Bounds of a run: a pack of the default size whole (a writer fills a
// pack past DefaultPackSize by up to a chunk), and the gap between two
// frames of the plan that a run reads and drops. And how many runs may be
// fetched ahead of the one being read: with maxRunBytes, what a plan
// holds in memory at once is about (maxRunsAhead+1) x 8 MiB.
const (
	maxRunBytes  = 2 * DefaultPackSize
	maxRunGap    = 64 << 10
	maxRunsAhead = 8
)

// frameKey names a frame by where it lies: two table entries that name
// one offset with different lengths (a lying table) are two frames.
type frameKey struct {
	pack digest.Digest
	off  int64
	n    int64
}

type runPlan struct {
	// ctx is the plan's own, derived from the unpack's and cancelled by
	// close: runs are fetched under it, not under the context of the read
	// that starts them (a file's, which ends with the file while runs of
	// the next are fetched ahead).
	ctx    context.Context
	cancel context.CancelFunc
	rf     RangeFetcher
	ahead  int
	wg     sync.WaitGroup

	mu      sync.Mutex
	runs    []*run
	byFrame map[frameKey]*run
}

// run is a range of a pack that holds frames of the plan.
type run struct {
	index  int
	c      Chunk // a frame of the run, for its pack's descriptor
	off, n int64
	// Under runPlan.mu: users counts the plan's reads of frames in the
	// run not yet made; started says its fetch began.
	users   int
	started bool

	done chan struct{}
	data []byte // once done, if err is nil; nil again once users is 0
	err  error
}

// planRuns makes the runs of the packed chunks of files, read in order
// from rf, with up to ahead runs (at most maxRunsAhead) fetched ahead of
// the one being read, under a context derived from ctx. The caller must
// close the plan.
func planRuns(ctx context.Context, rf RangeFetcher, files [][]Chunk, ahead int) *runPlan {
	ctx, cancel := context.WithCancel(ctx)
	p := &runPlan{ctx: ctx, cancel: cancel, rf: rf, ahead: min(max(ahead, 1), maxRunsAhead), byFrame: map[frameKey]*run{}}
	var cur *run
	for _, chunks := range files {
		for _, c := range chunks {
			if !c.Packed() || c.Encoding == EncodingZero || c.PackOffset < 0 || c.BlobSize <= 0 || c.BlobSize > MaxChunkSize || c.Size <= 0 || c.Size > MaxChunkSize {
				continue // zero, v1, or sizes FetchFrame refuses
			}
			key := frameKey{c.Blob, c.PackOffset, c.BlobSize}
			if r := p.byFrame[key]; r != nil {
				if r == cur {
					r.users++ // read again while its run is read
				}
				continue // else read alone, when it comes
			}
			end := c.PackOffset + c.BlobSize
			if cur == nil || cur.c.Blob != c.Blob || c.PackOffset < cur.off+cur.n || c.PackOffset > cur.off+cur.n+maxRunGap || end-cur.off > maxRunBytes {
				cur = &run{index: len(p.runs), c: c, off: c.PackOffset, done: make(chan struct{})}
				p.runs = append(p.runs, cur)
			}
			cur.n = end - cur.off
			cur.users++
			p.byFrame[key] = cur
		}
	}
	return p
}

// requests returns how many range requests the plan makes.
func (p *runPlan) requests() int { return len(p.runs) }

// close cancels the fetches still in flight and waits for them.
func (p *runPlan) close() {
	p.cancel()
	p.wg.Wait()
}

// frame returns chunk c's stored bytes, from its run (whose fetch, and
// that of the runs ahead of it, starts now if no reader started it
// before), and whether the plan has them: a chunk it does not name, read
// more often than it counted, whose run failed, or whose read's ctx ends
// first, is the caller's to fetch alone. The bytes are shared with the
// run's other frames and must not be modified.
func (p *runPlan) frame(ctx context.Context, c Chunk) ([]byte, bool) {
	p.mu.Lock()
	r := p.byFrame[frameKey{c.Blob, c.PackOffset, c.BlobSize}]
	if r == nil || r.users == 0 {
		p.mu.Unlock()
		return nil, false
	}
	for i := r.index; i < len(p.runs) && i <= r.index+p.ahead; i++ {
		if q := p.runs[i]; !q.started && q.users > 0 {
			q.started = true
			p.wg.Add(1)
			go p.fetch(q)
		}
	}
	p.mu.Unlock()
	select {
	case <-r.done:
	case <-ctx.Done():
		// The fetch may still write r.data: it is left to the plan's
		// close.
		p.mu.Lock()
		r.users--
		p.mu.Unlock()
		return nil, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r.users--
	var frame []byte
	if lo := c.PackOffset - r.off; r.err == nil && lo >= 0 && lo+c.BlobSize <= int64(len(r.data)) {
		frame = r.data[lo : lo+c.BlobSize]
	}
	if r.users <= 0 {
		r.data = nil // the last read the plan counted: the bytes go with it
	}
	return frame, frame != nil
}

// fetch reads run r's range; it closes r.done when the bytes (or an
// error) are in.
func (p *runPlan) fetch(r *run) {
	defer p.wg.Done()
	defer close(r.done)
	rc, err := p.rf.FetchRange(p.ctx, r.c.BlobDescriptor(), r.off, r.n)
	if err != nil {
		r.err = err
		return
	}
	defer rc.Close()
	data := make([]byte, r.n)
	if _, err := io.ReadFull(rc, data); err != nil {
		r.err = fmt.Errorf("read %d bytes at %d of pack %s: %w", r.n, r.off, r.c.Blob, err)
		return
	}
	r.data = data
}
