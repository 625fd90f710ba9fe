// Package fetch is the puller's chunk fetch scheduler. Demand reads (a
// restoring sandbox reading memory that is not local yet: its background
// loader's reads and its application's page faults) jump the queue;
// everything else is prefetched in the background, in the order given
// (ascending offsets, or a prefetch list). A bounded pool of workers keeps
// several fetches in flight over keep-alive connections; each chunk is
// tried on an ordered list of endpoints (mirrors first, then the primary),
// verified before it is stored or served, and retried with backoff until a
// deadline: gVisor kills a sandbox on a read error, so a read must wait
// rather than fail fast.
//
// Mounts are isolated from each other: a fetch in flight is shared only
// between requests for the same chunk stored the same way (chunk digest,
// blob digest, encoding, sizes: a key), and only its success is shared. A
// mount whose chunk table lies about a chunk (names it in a junk blob, or
// with a wrong size), whose endpoints serve junk, or that is unmounted
// cannot make another mount's read of that chunk fail or wait on it.
package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
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
	// chunk that two mounts need at the same moment one fetch, if both ask
	// for it stored the same way (see the package doc). Optional.
	InFlight *singleflight.Group
}

// Priority orders fetches.
type Priority int

// The priorities, lowest first.
const (
	// Prefetch is the background load, in the order given.
	Prefetch Priority = iota
	// Read is a read waiting for the chunk, served in arrival order: a
	// restoring sandbox's background loader reads pages.img this way, in
	// large pieces, many at once.
	Read
	// Fault is a read the sandbox's application is blocked on (a page
	// fault: a short read, see imagefs.FaultBelow), served newest first.
	Fault
	numPriorities
)

// LogEntry is one fetch, as recorded with Options.KeepLog.
type LogEntry struct {
	Digest   digest.Digest
	Offset   int64
	Priority Priority
	Endpoint string
}

// Demand reports whether the fetch was on demand, for a read (Read or
// Fault), not a prefetch.
func (e LogEntry) Demand() bool { return e.Priority > Prefetch }

// key identifies a fetch: a chunk and exactly how a table says it is
// stored. Two table entries for one chunk digest that disagree on the rest
// are different fetches: at most one of them is true.
type key struct {
	digest, blob   digest.Digest
	encoding       format.Encoding
	size, blobSize int64
}

func keyOf(c format.Chunk) key {
	return key{digest: c.Digest, blob: c.Blob, encoding: c.Encoding, size: c.Size, blobSize: c.BlobSize}
}

// String is the key in the node-wide InFlight group.
func (k key) String() string {
	return fmt.Sprintf("%s %s %s %d %d", k.digest, k.blob, k.encoding, k.size, k.blobSize)
}

// Scheduler fetches chunks into a node cache.
type Scheduler struct {
	endpoints []Endpoint
	cache     *cache.Store
	codec     *format.Codec
	opts      Options

	// ctx is canceled by Close: it stops fetches and their retries.
	ctx    context.Context
	cancel context.CancelFunc

	mu   sync.Mutex
	cond *sync.Cond
	// queues holds the calls waiting at each priority; active counts the
	// calls in flight at each.
	queues [numPriorities][]*call
	active [numPriorities]int
	calls  map[key]*call
	closed bool
	log    []LogEntry

	wg sync.WaitGroup
}

// call is one chunk being fetched; waiters block on done.
type call struct {
	chunk   format.Chunk
	prio    Priority
	started bool
	// done is closed when the call is over: the chunk is in the node
	// cache, or err says why not.
	done chan struct{}
	// ready is closed when readers may go on: as soon as a read's chunk
	// is verified (data set), before it is written to the node cache and
	// fsynced, so that a page fault does not wait for the disk; else
	// with done.
	ready     chan struct{}
	readyOnce sync.Once
	data      []byte // verified bytes, kept only for demand waiters
	err       error
}

// readyData returns the verified bytes handed to readers, if any.
func (cl *call) readyData(mu *sync.Mutex) []byte {
	mu.Lock()
	defer mu.Unlock()
	return cl.data
}

// markReady lets the call's readers go on.
func (cl *call) markReady() { cl.readyOnce.Do(func() { close(cl.ready) }) }

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
	s := &Scheduler{endpoints: endpoints, cache: c, codec: codec, opts: opts, calls: map[key]*call{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.cond = sync.NewCond(&s.mu)
	for range opts.Workers {
		s.wg.Add(1)
		go s.worker()
	}
	return s
}

// Close stops the workers and cancels the fetches in flight, retries
// included: queued and running fetches fail with ErrClosed, and so do the
// reads waiting for them. It returns once the workers have stopped, without
// waiting for a fetch deadline. A fetch that another mount's scheduler runs
// and this one waits for goes on for that mount.
func (s *Scheduler) Close() {
	s.mu.Lock()
	s.closed = true
	s.cancel()
	for i, q := range s.queues {
		for _, c := range q {
			if k := keyOf(c.chunk); !c.started && s.calls[k] == c {
				c.err = ErrClosed
				close(c.done)
				c.markReady()
				delete(s.calls, k)
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

// Get returns chunk c's verified bytes, exactly c.Size of them, from the
// cache or fetched now at priority prio (Read or Fault), ahead of every
// prefetch. Zero chunks need no fetch. The bytes are in buf when they come
// from the cache; bytes just fetched are shared with other readers of the
// chunk and must not be modified.
func (s *Scheduler) Get(ctx context.Context, c format.Chunk, buf []byte, prio Priority) ([]byte, error) {
	if c.Encoding == format.EncodingZero {
		return s.codec.Decode(c, nil, buf)
	}
	if data, err := s.cache.Get(c.Digest, buf, false); err == nil {
		s.opts.Metrics.cacheHit()
		return checkSize(c, data)
	}
	s.opts.Metrics.cacheMiss()
	start := time.Now()
	// A chunk fetched into the cache by a prefetch or by another mount
	// could be evicted (or dropped as damaged) before it is read back:
	// then it is fetched again, a few times, rather than failing the read.
	for attempt := 1; ; attempt++ {
		cl, err := s.enqueue(c, max(prio, Read))
		if err != nil {
			return nil, err
		}
		select {
		case <-cl.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		// Verified bytes handed over before the cache write: a read is
		// served even if that write then fails (a full disk).
		if data := cl.readyData(&s.mu); data != nil {
			s.opts.Metrics.demandLatency(time.Since(start))
			return data, nil
		}
		if cl.err != nil {
			return nil, cl.err
		}
		// Fetched by a prefetch that finished first, or by another mount:
		// it is in the cache.
		data, err := s.cache.Get(c.Digest, buf, false)
		if err == nil {
			s.opts.Metrics.demandLatency(time.Since(start))
			return checkSize(c, data)
		}
		if !errors.Is(err, cache.ErrNotFound) || attempt == 3 {
			return nil, fmt.Errorf("chunk %s: read back from the node cache: %w", c.Digest, err)
		}
	}
}

// checkSize refuses cached bytes of a chunk whose table entry gives it
// another size: bytes that hash to the digest have one length, so the
// entry lies, and its reader gets an error rather than a short or long
// chunk.
func checkSize(c format.Chunk, data []byte) ([]byte, error) {
	if int64(len(data)) != c.Size {
		return nil, fmt.Errorf("chunk %s: table says %d bytes, the chunk has %d: %w", c.Digest, c.Size, len(data), format.ErrDigestMismatch)
	}
	return data, nil
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
	k := keyOf(c)
	if cl, ok := s.calls[k]; ok {
		if prio > cl.prio && !cl.started {
			// Promote a queued call; its entry in the lower queue is
			// skipped when met.
			cl.prio = prio
			s.queues[prio] = append(s.queues[prio], cl)
			s.cond.Signal()
		}
		return cl, nil
	}
	cl := &call{chunk: c, prio: prio, done: make(chan struct{}), ready: make(chan struct{})}
	s.calls[k] = cl
	s.queues[prio] = append(s.queues[prio], cl)
	s.cond.Signal()
	return cl, nil
}

// next takes the next call to run: the newest fault, else the oldest read,
// else, only while no read waits or runs, the next prefetch. A restoring
// sandbox keeps many reads in flight (gVisor's background loader issues up
// to 128 at once, in ascending order); the page fault its application is
// blocked on arrives last, so faults go newest first. Faults do not hold
// the loader's reads back: that would serialize the loader behind every
// page fault. Prefetches wait while reads are served,
// which covers the whole file anyway.
func (s *Scheduler) next() *call {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.closed {
			return nil
		}
		for p := numPriorities - 1; p >= 0; p-- {
			if p == Prefetch && (s.active[Fault]+s.active[Read] > 0) {
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
		if p == Fault {
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
		// Readers waiting for the chunk get its verified bytes before
		// they are written to the node cache.
		publish := func(data []byte) {
			s.mu.Lock()
			if cl.prio > Prefetch && cl.data == nil {
				cl.data = append([]byte(nil), data...)
				cl.markReady()
			}
			s.mu.Unlock()
		}
		data, err := s.fetchOnce(cl.chunk, buf, publish)
		s.mu.Lock()
		if err == nil && data != nil && cl.prio > Prefetch && cl.data == nil {
			cl.data = append([]byte(nil), data...)
		}
		cl.err = err
		delete(s.calls, keyOf(cl.chunk))
		close(cl.done)
		cl.markReady()
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
// returns no bytes) or is fetching it stored the same way (then it waits
// for that fetch). Only another mount's success is taken: if that fetch
// fails (its endpoints, or its mount was closed), this one fetches from
// its own endpoints.
func (s *Scheduler) fetchOnce(c format.Chunk, buf []byte, verified func([]byte)) ([]byte, error) {
	if s.opts.InFlight == nil {
		return s.fetchAndStore(c, buf, verified)
	}
	ran := false
	ch := s.opts.InFlight.DoChan(keyOf(c).String(), func() (any, error) {
		ran = true
		return s.fetchAndStore(c, buf, verified)
	})
	select {
	case res := <-ch:
		if ran {
			data, _ := res.Val.([]byte)
			return data, res.Err
		}
		if res.Err == nil {
			return nil, nil // in the cache
		}
		s.opts.Logger.Info("fetch chunk: another mount's fetch failed; fetching from this mount's endpoints", "chunk", c.Digest, "err", res.Err)
		return s.fetchAndStore(c, buf, verified)
	case <-s.ctx.Done():
		// Closed while waiting. If the fetch is this scheduler's own, it
		// stops too (its context is canceled) and whoever waits for it
		// fetches for themselves.
		return nil, ErrClosed
	}
}

// fetchAndStore fetches a chunk and stores it in the cache, unless the
// cache has it already (then it returns no bytes). verified gets the
// chunk's bytes once they are verified, before the cache write (which
// fsyncs).
func (s *Scheduler) fetchAndStore(c format.Chunk, buf []byte, verified func([]byte)) ([]byte, error) {
	if s.cache.Has(c.Digest) {
		return nil, nil
	}
	data, err := s.fetch(c, buf)
	if err == nil {
		verified(data)
		err = s.cache.PutVerified(c.Digest, data)
	}
	return data, err
}

// fetch gets and verifies one chunk, trying every endpoint in order
// (FirstOf), again and again with backoff, until the deadline. If every
// endpoint served bad data in one round, it gives up at once: that will
// not get better.
func (s *Scheduler) fetch(c format.Chunk, buf []byte) ([]byte, error) {
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.Deadline)
	defer cancel()
	backoff := s.opts.Backoff
	for attempt := 1; ; attempt++ {
		corrupt := 0
		data, errs := FirstOf(ctx, s.endpoints, func(ctx context.Context, ep Endpoint) ([]byte, error) {
			data, err := s.fetchFrom(ctx, ep, c, buf)
			if err == nil {
				s.fetched(c, ep)
				return data, nil
			}
			if errors.Is(err, format.ErrDigestMismatch) || errors.Is(err, format.ErrTooLarge) || errors.Is(err, format.ErrInvalid) {
				corrupt++
				s.opts.Metrics.verifyFailed(ep.Name)
			}
			if s.ctx.Err() == nil {
				s.opts.Logger.Warn("fetch chunk", "chunk", c.Digest, "endpoint", ep.Name, "attempt", attempt, "err", err)
			}
			return nil, err
		})
		if errs == nil {
			return data, nil
		}
		if s.ctx.Err() != nil {
			return nil, fmt.Errorf("chunk %s: %w", c.Digest, ErrClosed)
		}
		if corrupt == len(s.endpoints) {
			return nil, fmt.Errorf("chunk %s (blob %s) failed verification from every endpoint: %w", c.Digest, c.Blob, errs)
		}
		wait := backoff/2 + rand.N(backoff)
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			if s.ctx.Err() != nil {
				return nil, fmt.Errorf("chunk %s: %w", c.Digest, ErrClosed)
			}
			return nil, fmt.Errorf("chunk %s (blob %s) not fetched within %s after %d rounds: %w", c.Digest, c.Blob, s.opts.Deadline, attempt, errs)
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// fetched counts chunk c as fetched from ep and records ep in the log.
func (s *Scheduler) fetched(c format.Chunk, ep Endpoint) {
	s.opts.Metrics.fetched(ep.Name, c.BlobSize)
	if !s.opts.KeepLog {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := len(s.log) - 1; i >= 0; i-- {
		if s.log[i].Digest == c.Digest {
			s.log[i].Endpoint = ep.Name
			return
		}
	}
}

// fetchFrom fetches chunk c's blob from ep and decodes and verifies it. The
// blob's size is checked against the largest chunk before anything is
// allocated: a table's sizes are the word of whoever pushed it.
func (s *Scheduler) fetchFrom(ctx context.Context, ep Endpoint, c format.Chunk, buf []byte) ([]byte, error) {
	if c.Size <= 0 || c.BlobSize <= 0 {
		return nil, fmt.Errorf("chunk %s: size %d, blob %s of %d bytes: %w", c.Digest, c.Size, c.Blob, c.BlobSize, format.ErrInvalid)
	}
	if c.Size > format.MaxChunkSize || c.BlobSize > format.MaxChunkSize {
		return nil, fmt.Errorf("chunk %s: size %d, blob %s of %d bytes: %w (limit %d)", c.Digest, c.Size, c.Blob, c.BlobSize, format.ErrTooLarge, format.MaxChunkSize)
	}
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
