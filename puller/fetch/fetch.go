// Package fetch is the puller's chunk fetch scheduler. Demand reads (a
// sandbox faulting on memory that is not local yet) jump the queue;
// everything else is prefetched in the background, in the order given
// (ascending offsets, or a prefetch list). A bounded pool of workers keeps
// several fetches in flight over keep-alive connections; each chunk is
// tried on an ordered list of endpoints (mirrors first, then the primary),
// verified before it is stored or served, and retried with backoff until a
// deadline: gVisor kills a sandbox on a read error, so a read must wait
// rather than fail fast.
package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/singleflight"
	"oras.land/oras-go/v2/content"
)

// Endpoint is one place a chunk's blob can be fetched from.
type Endpoint struct {
	// Name identifies the endpoint in logs, errors and metrics.
	Name string
	// Store fetches blobs, e.g. an oras-go remote.Repository.
	Store content.Fetcher
}

// Options tune a Scheduler.
type Options struct {
	// Workers is how many chunks are fetched at once (default 12: the thaw
	// measurements found 12 readers beat 128).
	Workers int
	// Deadline bounds how long one chunk is retried before its read fails
	// (default 5 minutes).
	Deadline time.Duration
	// Backoff is the first retry delay, doubled up to 5 s (default 100 ms).
	Backoff time.Duration
	// Logger receives retries and failures. Default: slog.Default().
	Logger *slog.Logger
	// Metrics, if set, receives counters and latencies.
	Metrics *Metrics
	// KeepLog records every fetch in order, for tests (Log).
	KeepLog bool
	// InFlight, shared by the schedulers of every mount on a node, makes a
	// chunk that two mounts need at the same moment one fetch. Optional.
	InFlight *singleflight.Group
}

// Priority orders fetches.
type Priority int

// The priorities, lowest first.
const (
	// Prefetch is the background load, in the order given.
	Prefetch Priority = iota
	// Demand is a read waiting for the chunk, served in arrival order: a
	// restoring sandbox's background loader reads pages.img this way.
	Demand
	// Urgent is a read the sandbox's application is blocked on, served
	// newest first.
	Urgent
	numPriorities
)

// LogEntry is one fetch, as recorded with Options.KeepLog.
type LogEntry struct {
	Digest   digest.Digest
	Offset   int64
	Priority Priority
	Endpoint string
}

// Demand reports whether the fetch was for a read (Demand or Urgent).
func (e LogEntry) Demand() bool { return e.Priority > Prefetch }

// Scheduler fetches chunks into a node cache.
type Scheduler struct {
	endpoints []Endpoint
	cache     *cache.Store
	codec     *format.Codec
	opts      Options

	mu   sync.Mutex
	cond *sync.Cond
	// queues holds the calls waiting at each priority; active counts the
	// calls in flight at each.
	queues [numPriorities][]*call
	active [numPriorities]int
	calls  map[digest.Digest]*call
	closed bool
	log    []LogEntry

	wg sync.WaitGroup
}

// call is one chunk being fetched; waiters block on done.
type call struct {
	chunk   format.Chunk
	prio    Priority
	started bool
	done    chan struct{}
	data    []byte // verified bytes, kept only for demand waiters
	err     error
}

// ErrClosed is returned for fetches after Close.
var ErrClosed = errors.New("fetch scheduler closed")

// New starts a Scheduler with its workers.
func New(endpoints []Endpoint, c *cache.Store, codec *format.Codec, opts Options) *Scheduler {
	if opts.Workers <= 0 {
		opts.Workers = 12
	}
	if opts.Deadline <= 0 {
		opts.Deadline = 5 * time.Minute
	}
	if opts.Backoff <= 0 {
		opts.Backoff = 100 * time.Millisecond
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	s := &Scheduler{endpoints: endpoints, cache: c, codec: codec, opts: opts, calls: map[digest.Digest]*call{}}
	s.cond = sync.NewCond(&s.mu)
	for range opts.Workers {
		s.wg.Add(1)
		go s.worker()
	}
	return s
}

// Close stops the workers; queued fetches fail with ErrClosed.
func (s *Scheduler) Close() {
	s.mu.Lock()
	s.closed = true
	for i, q := range s.queues {
		for _, c := range q {
			if !c.started && s.calls[c.chunk.Digest] == c {
				c.err = ErrClosed
				close(c.done)
				delete(s.calls, c.chunk.Digest)
			}
		}
		s.queues[i] = nil
	}
	s.cond.Broadcast()
	s.mu.Unlock()
	s.wg.Wait()
}

// Log returns the fetches made so far, in the order they started.
func (s *Scheduler) Log() []LogEntry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]LogEntry(nil), s.log...)
}

// Get returns chunk c's verified bytes, from the cache or fetched now at
// priority prio (Demand or Urgent), ahead of every prefetch. Zero chunks
// need no fetch. The bytes are in buf when they come from the cache;
// bytes just fetched are shared with other readers of the chunk and must
// not be modified.
func (s *Scheduler) Get(ctx context.Context, c format.Chunk, buf []byte, prio Priority) ([]byte, error) {
	if c.Encoding == format.EncodingZero {
		return s.codec.Decode(c, nil, buf)
	}
	if data, err := s.cache.Get(c.Digest, buf, false); err == nil {
		s.opts.Metrics.cacheHit()
		return data, nil
	}
	s.opts.Metrics.cacheMiss()
	start := time.Now()
	cl, err := s.enqueue(c, max(prio, Demand))
	if err != nil {
		return nil, err
	}
	select {
	case <-cl.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	s.opts.Metrics.demandLatency(time.Since(start))
	if cl.err != nil {
		return nil, cl.err
	}
	if cl.data != nil {
		return cl.data, nil
	}
	// Fetched by a prefetch that finished first: it is in the cache.
	return s.cache.Get(c.Digest, buf, false)
}

// Prefetch queues chunks for background fetching, in the order given,
// behind any demand fetch. Chunks already cached, queued or zero are
// skipped. Wait reports completion.
func (s *Scheduler) Prefetch(chunks []format.Chunk) []*Pending {
	var out []*Pending
	for _, c := range chunks {
		if c.Encoding == format.EncodingZero || s.cache.Has(c.Digest) {
			continue
		}
		cl, err := s.enqueue(c, Prefetch)
		if err != nil {
			break
		}
		out = append(out, &Pending{c: cl})
	}
	return out
}

// Pending is a queued prefetch.
type Pending struct{ c *call }

// Wait blocks until the chunk is fetched (or failed) and returns its error.
func (p *Pending) Wait(ctx context.Context) error {
	select {
	case <-p.c.done:
		return p.c.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Chunk is the chunk the prefetch is for.
func (p *Pending) Chunk() format.Chunk { return p.c.chunk }

func (s *Scheduler) enqueue(c format.Chunk, prio Priority) (*call, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, ErrClosed
	}
	if cl, ok := s.calls[c.Digest]; ok {
		if prio > cl.prio && !cl.started {
			// Promote a queued call; its entry in the lower queue is
			// skipped when met.
			cl.prio = prio
			s.queues[prio] = append(s.queues[prio], cl)
			s.cond.Signal()
		}
		return cl, nil
	}
	cl := &call{chunk: c, prio: prio, done: make(chan struct{})}
	s.calls[c.Digest] = cl
	s.queues[prio] = append(s.queues[prio], cl)
	s.cond.Signal()
	return cl, nil
}

// next takes the next call to run: the newest urgent call, else the oldest
// demand call, else, only while no read waits or runs, the next prefetch.
// A restoring sandbox keeps many reads in flight (gVisor's background
// loader issues up to 128 at once, in ascending order); the read its
// application is blocked on arrives last, so urgent calls go newest first.
// Urgent calls do not hold demand calls back: that would serialize the
// loader behind every page fault. Prefetches wait while reads are served,
// which covers the whole file anyway.
func (s *Scheduler) next() *call {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.closed {
			return nil
		}
		for p := numPriorities - 1; p >= 0; p-- {
			if p == Prefetch && (s.active[Urgent]+s.active[Demand] > 0) {
				break
			}
			if cl := s.pop(p); cl != nil {
				cl.started = true
				s.active[p]++
				s.record(cl)
				return cl
			}
		}
		s.cond.Wait()
	}
}

// pop takes the next runnable call of priority p, skipping entries that
// were promoted away or already started.
func (s *Scheduler) pop(p Priority) *call {
	q := s.queues[p]
	for len(q) > 0 {
		var cl *call
		if p == Urgent {
			cl, q = q[len(q)-1], q[:len(q)-1]
		} else {
			cl, q = q[0], q[1:]
		}
		if !cl.started && cl.prio == p {
			s.queues[p] = q
			return cl
		}
	}
	s.queues[p] = q
	return nil
}

func (s *Scheduler) record(cl *call) {
	if s.opts.KeepLog {
		s.log = append(s.log, LogEntry{Digest: cl.chunk.Digest, Offset: cl.chunk.Offset, Priority: cl.prio})
	}
}

func (s *Scheduler) worker() {
	defer s.wg.Done()
	var buf []byte
	for {
		cl := s.next()
		if cl == nil {
			return
		}
		data, err := s.fetchOnce(cl.chunk, buf)
		s.mu.Lock()
		if err == nil && data != nil && cl.prio > Prefetch {
			cl.data = append([]byte(nil), data...)
		}
		cl.err = err
		delete(s.calls, cl.chunk.Digest)
		close(cl.done)
		s.active[cl.prio]--
		s.cond.Broadcast() // lower priorities may run now
		s.mu.Unlock()
		if data != nil {
			buf = data
		}
	}
}

// fetchOnce fetches a chunk into the cache unless another mount's
// scheduler on the node has (then waiters read it from the cache, and it
// returns no bytes) or is fetching it (then it waits for that fetch).
func (s *Scheduler) fetchOnce(c format.Chunk, buf []byte) ([]byte, error) {
	fetch := func() ([]byte, error) {
		if s.cache.Has(c.Digest) {
			return nil, nil
		}
		data, err := s.fetch(c, buf)
		if err == nil {
			err = s.cache.PutVerified(c.Digest, data)
		}
		return data, err
	}
	if s.opts.InFlight == nil {
		return fetch()
	}
	v, err, shared := s.opts.InFlight.Do(c.Digest.String(), func() (any, error) { return fetch() })
	if shared {
		// The bytes are another worker's buffer: read them from the cache.
		return nil, err
	}
	data, _ := v.([]byte)
	return data, err
}

// fetch gets and verifies one chunk, trying every endpoint in order, again
// and again with backoff, until the deadline. If every endpoint served bad
// data in one round, it gives up at once: that will not get better.
func (s *Scheduler) fetch(c format.Chunk, buf []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.opts.Deadline)
	defer cancel()
	backoff := s.opts.Backoff
	var errs []string
	for attempt := 1; ; attempt++ {
		corrupt := 0
		errs = errs[:0]
		for _, ep := range s.endpoints {
			data, err := s.fetchFrom(ctx, ep, c, buf)
			if err == nil {
				s.opts.Metrics.fetched(ep.Name, c.BlobSize)
				if s.opts.KeepLog {
					s.mu.Lock()
					for i := len(s.log) - 1; i >= 0; i-- {
						if s.log[i].Digest == c.Digest {
							s.log[i].Endpoint = ep.Name
							break
						}
					}
					s.mu.Unlock()
				}
				return data, nil
			}
			if errors.Is(err, format.ErrDigestMismatch) || errors.Is(err, format.ErrTooLarge) {
				corrupt++
				s.opts.Metrics.verifyFailed(ep.Name)
			}
			errs = append(errs, fmt.Sprintf("%s: %v", ep.Name, err))
			s.opts.Logger.Warn("fetch chunk", "chunk", c.Digest, "endpoint", ep.Name, "attempt", attempt, "err", err)
		}
		if corrupt == len(s.endpoints) {
			return nil, fmt.Errorf("chunk %s (blob %s) failed verification from every endpoint: %s", c.Digest, c.Blob, strings.Join(errs, "; "))
		}
		wait := backoff/2 + rand.N(backoff)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return nil, fmt.Errorf("chunk %s (blob %s) not fetched within %s after %d rounds: %s", c.Digest, c.Blob, s.opts.Deadline, attempt, strings.Join(errs, "; "))
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

func (s *Scheduler) fetchFrom(ctx context.Context, ep Endpoint, c format.Chunk, buf []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	desc := c.BlobDescriptor()
	rc, err := ep.Store.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	blob := make([]byte, c.BlobSize)
	if _, err := io.ReadFull(rc, blob); err != nil {
		return nil, fmt.Errorf("read blob %s: %w", c.Blob, err)
	}
	return s.codec.Decode(c, blob, buf)
}
