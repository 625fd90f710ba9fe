package format

import (
	"context"
	"fmt"
	"io"
	"sync"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
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
// What a plan holds is bounded: runs are fetched ahead of the one read
// only while the runs fetched and not yet dropped hold at most
// maxHeldBytes, and a frame read again later (a chunk two files hold,
// stored once) is counted only while its run is the one being planned; a
// later read of it finds its count spent and fetches it alone, so no run
// waits for a reader files away.

// Bounds of a run: a pack of the default size whole (a writer fills a
// pack past DefaultPackSize by up to a chunk; a frame larger than that is
// a run of its own), and the gap between two frames of the plan that a
// run reads and drops. How many runs may be fetched ahead of the one
// being read, and how many bytes the runs fetched and not yet dropped may
// hold before no more are fetched ahead (the run a reader waits for is
// always fetched).
const (
	maxRunBytes  = 2 * DefaultPackSize
	maxRunGap    = 64 << 10
	maxRunsAhead = 8
	maxHeldBytes = 6 * maxRunBytes
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
	// reads counts, per frame, the reads the plan serves that are yet to
	// come; held is the bytes of the runs fetched (or being fetched) and
	// not yet dropped.
	reads map[frameKey]int
	held  int64
}

// run is a range of a pack that holds frames of the plan.
type run struct {
	index  int
	desc   ocispec.Descriptor // the pack's
	off, n int64
	// Under runPlan.mu: users counts the reads of the run's frames the
	// plan serves that are yet to end; started says its fetch began,
	// fetched that it ended, dropped that its bytes are gone.
	users                     int
	started, fetched, dropped bool

	done chan struct{} // closed once fetched
	data []byte        // once fetched, if err is nil, until dropped
	err  error
}

// planRuns makes the runs of the packed chunks of files, read in order
// from rf, with up to ahead runs (at most maxRunsAhead) fetched ahead of
// the one being read, under a context derived from ctx. The caller must
// close the plan.
func planRuns(ctx context.Context, rf RangeFetcher, files [][]Chunk, ahead int) *runPlan {
	ctx, cancel := context.WithCancel(ctx)
	p := &runPlan{ctx: ctx, cancel: cancel, rf: rf, ahead: min(max(ahead, 1), maxRunsAhead),
		byFrame: map[frameKey]*run{}, reads: map[frameKey]int{}}
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
					p.reads[key]++
				}
				continue // else read alone, when it comes
			}
			end := c.PackOffset + c.BlobSize
			if cur == nil || cur.desc.Digest != c.Blob || cur.desc.Size != c.PackSize || c.PackOffset < cur.off+cur.n || c.PackOffset > cur.off+cur.n+maxRunGap || end-cur.off > maxRunBytes {
				cur = &run{index: len(p.runs), desc: c.BlobDescriptor(), off: c.PackOffset, done: make(chan struct{})}
				p.runs = append(p.runs, cur)
			}
			cur.n = end - cur.off
			cur.users++
			p.reads[key]++
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
	key := frameKey{c.Blob, c.PackOffset, c.BlobSize}
	p.mu.Lock()
	r := p.byFrame[key]
	if r == nil || p.reads[key] <= 0 {
		p.mu.Unlock()
		return nil, false
	}
	p.reads[key]--
	p.start(r)
	p.mu.Unlock()
	select {
	case <-r.done:
	case <-ctx.Done():
		p.mu.Lock()
		p.used(r)
		p.mu.Unlock()
		return nil, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var frame []byte
	if lo, hi := c.PackOffset-r.off, c.PackOffset-r.off+c.BlobSize; r.data != nil && lo >= 0 && hi <= int64(len(r.data)) {
		frame = r.data[lo:hi:hi]
	}
	p.used(r)
	return frame, frame != nil
}

// skip takes back one read of chunk c the plan counted, which its reader
// found elsewhere (on disk, when an unpack resumes): a run none of whose
// frames is read is never fetched, and one fetched is dropped once its
// last counted read is made or skipped.
func (p *runPlan) skip(c Chunk) {
	key := frameKey{c.Blob, c.PackOffset, c.BlobSize}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r := p.byFrame[key]; r != nil && p.reads[key] > 0 {
		p.reads[key]--
		p.used(r)
	}
}

// start fetches run r, if no reader did, and the runs after it, up to
// p.ahead of them, while they fit in maxHeldBytes. Under p.mu.
func (p *runPlan) start(r *run) {
	for i := r.index; i < len(p.runs) && i <= r.index+p.ahead; i++ {
		q := p.runs[i]
		if q.started || q.users <= 0 {
			continue
		}
		if q != r && p.held+q.n > maxHeldBytes {
			break
		}
		q.started = true
		p.held += q.n
		p.wg.Add(1)
		go p.fetch(q)
	}
}

// used ends a read of one of run r's frames; the last one drops the
// run's bytes. Under p.mu.
func (p *runPlan) used(r *run) {
	r.users--
	if r.users <= 0 && r.fetched {
		p.drop(r)
	}
}

// drop lets run r's bytes go. Under p.mu.
func (p *runPlan) drop(r *run) {
	if !r.dropped {
		r.dropped = true
		r.data = nil
		p.held -= r.n
	}
}

// fetch reads run r's range, keeps its bytes if a read is still to
// come, and closes r.done.
func (p *runPlan) fetch(r *run) {
	defer p.wg.Done()
	data, err := p.read(r)
	p.mu.Lock()
	r.fetched, r.data, r.err = true, data, err
	if err != nil || r.users <= 0 {
		p.drop(r) // failed, or every read of it ended first (their ctx)
	}
	p.mu.Unlock()
	close(r.done)
}

func (p *runPlan) read(r *run) ([]byte, error) {
	rc, err := p.rf.FetchRange(p.ctx, r.desc, r.off, r.n)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data := make([]byte, r.n)
	if _, err := io.ReadFull(rc, data); err != nil {
		return nil, fmt.Errorf("read %d bytes at %d of pack %s: %w", r.n, r.off, r.desc.Digest, err)
	}
	return data, nil
}
