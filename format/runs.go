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
// read and dropped), up to maxRunBytes a run (a default pack whole), each fetched with one range
// request. Nothing is fetched that the plan does not name: a pack of an
// earlier snapshot that the unpacked one reuses in part is read only
// where it does. The puller's fetch scheduler coalesces the same way for
// what it has queued (fetch.MaxCoalesce); an unpack knows its whole plan
// at the start, so this is the simpler form of it.
//
// A run's bytes are fetched once, by the first reader of one of its
// frames, and the next runAhead runs of the plan are fetched behind it,
// so that several requests are in flight while the unpack's workers read
// one run. Each frame is still verified (Codec.Decode) when it is read.
// A run is dropped once every frame it holds has been read; one that
// fails to fetch is dropped at once, and its frames are fetched one by
// one instead (Reader.Chunk), so a failed range costs a retry, not the
// unpack.

// Bounds of a run: a pack of the default size whole (a writer fills a
// pack past DefaultPackSize by up to a chunk), and the gap between two
// frames of the plan that a run reads and drops.
const (
	maxRunBytes = 2 * DefaultPackSize
	maxRunGap   = 64 << 10
)

type frameKey struct {
	pack digest.Digest
	off  int64
}

type runPlan struct {
	// ctx is the unpack's: runs are fetched under it, not under the
	// context of the read that starts them (a file's, which ends with
	// the file while runs of the next are fetched ahead).
	ctx   context.Context
	ahead int

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
	data []byte // once done, if err is nil
	err  error
}

// planRuns makes the runs of the packed chunks of files, read in order,
// with up to ahead runs fetched ahead of the one being read, under ctx.
func planRuns(ctx context.Context, files [][]Chunk, ahead int) *runPlan {
	p := &runPlan{ctx: ctx, ahead: ahead, byFrame: map[frameKey]*run{}}
	var cur *run
	for _, chunks := range files {
		for _, c := range chunks {
			if !c.Packed() || c.Encoding == EncodingZero || c.BlobSize <= 0 || c.BlobSize > MaxChunkSize || c.Size <= 0 || c.Size > MaxChunkSize {
				continue // zero, v1, or sizes FetchFrame refuses
			}
			key := frameKey{c.Blob, c.PackOffset}
			if r := p.byFrame[key]; r != nil {
				r.users++ // a frame read again (a chunk the files hold twice)
				continue
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

// frame returns chunk c's stored bytes, from its run (fetched now if no
// reader did before), and whether the plan has it: a chunk it does not
// name, read more often than it names it, or whose run failed, is the
// caller's to fetch alone.
func (p *runPlan) frame(ctx context.Context, rf RangeFetcher, c Chunk) ([]byte, bool) {
	p.mu.Lock()
	r := p.byFrame[frameKey{c.Blob, c.PackOffset}]
	if r == nil || r.users == 0 {
		p.mu.Unlock()
		return nil, false
	}
	var start []*run
	for i := r.index; i < len(p.runs) && i <= r.index+p.ahead; i++ {
		if q := p.runs[i]; !q.started && q.users > 0 {
			q.started = true
			start = append(start, q)
		}
	}
	p.mu.Unlock()
	for _, q := range start {
		if q == r {
			continue
		}
		go q.fetch(p.ctx, rf)
	}
	if len(start) > 0 && start[0] == r {
		r.fetch(p.ctx, rf)
	}
	select {
	case <-r.done:
	case <-ctx.Done():
		return nil, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	r.users--
	if r.err != nil {
		return nil, false
	}
	lo := c.PackOffset - r.off
	frame := r.data[lo : lo+c.BlobSize]
	if r.users <= 0 {
		r.data = nil // the last frame read: the run's bytes go with it
	}
	return frame, true
}

// fetch reads the run's range; it closes done when the bytes (or an
// error) are in.
func (r *run) fetch(ctx context.Context, rf RangeFetcher) {
	defer close(r.done)
	rc, err := rf.FetchRange(ctx, r.c.BlobDescriptor(), r.off, r.n)
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
