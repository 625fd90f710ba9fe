// Package fetch is the puller's chunk fetch scheduler. Demand reads (a
// restoring sandbox reading memory that is not local yet: its background
// loader's reads and its application's page faults) jump the queue, and a
// page fault that finds every worker busy gets one of its own; everything
// else is prefetched in the background, in the order given
// (ascending offsets, or a prefetch list). A bounded pool of workers keeps
// several fetches in flight over keep-alive connections; each chunk is
// tried on an ordered list of endpoints (mirrors first, then the primary),
// verified before it is stored or served, and retried with backoff until a
// deadline: gVisor kills a sandbox on a read error, so a read must wait
// rather than fail fast.
//
// A verified chunk goes to the reads waiting for it at once and is written
// into the node cache in the background (in place in the image dirs being
// assembled, see cache.Store.PutVerified), by a few writers behind a queue bounded in
// bytes: a fetch worker goes on to its next chunk instead of waiting for the
// disk, and a disk slower than the network slows fetching down instead of
// growing the queue. Until its write is over, a chunk stays in flight: a
// read of it gets the verified bytes from memory and does not fetch it
// again, and a prefetch of it is not done. A failed write (a full disk)
// fails no read; the chunk is fetched again when next needed.
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
	"runtime"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/opencontainers/go-digest"
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
	InFlight *Flights
	// Writers is how many verified chunks are written into the node cache
	// at once, in the background (default 4).
	Writers int
	// WriteBuffer bounds the bytes of verified chunks queued or being
	// written into the node cache (default 64 MiB; at least one chunk is
	// always let in). Fetching waits while it is full.
	WriteBuffer int64
	// Peers, if set, are the other pullers of the node's pool
	// (puller/peer): each chunk (or run of frames of one pack) is asked of
	// its owner among them before any endpoint. What a peer serves is
	// verified like an endpoint's answer; a peer that fails, is slow or
	// lies costs a bounded wait, and the chunk is fetched from the
	// endpoints.
	Peers Peers
	// BackgroundCPU bounds, while a page fault is being fetched, how
	// many frames of range requests (format v2: the background load's,
	// its loader's reads') that no sandbox waits on are verified and
	// decoded at once (default GOMAXPROCS-1, at least 1; a frame fetched
	// alone, as a retry is, does not wait). A fault's own frames
	// never wait for it: with every core hashing the background's frames,
	// Go's scheduler gives a fault's fetch its turn only after theirs,
	// and faults took 50-280 ms each on two cores (docs/benchmarks.md).
	BackgroundCPU int
	// RunsWhenTold makes the sandbox run when SandboxStarted says so, not
	// at its first page fault (SandboxFaulted then only makes the
	// background yield): a restore that starts runsc itself knows when
	// runsc restore returned, and the faults before that are runsc's own,
	// loading the kernel's state, which waits on the loader's reads.
	RunsWhenTold bool
	// ServesPeers marks the scheduler of the chunks a node serves its
	// peers (puller.ServeChunks): it does not follow another mount's fetch
	// of a chunk while that fetch waits on a peer (which may be waiting on
	// this very node, if two nodes disagree on who owns it), but fetches
	// the chunk from its own endpoints.
	ServesPeers bool
}

// Peers are the other node pullers a chunk may be taken from before the
// endpoints (puller/peer.Pool). They are not trusted: the scheduler
// verifies every chunk they serve.
type Peers interface {
	// Fetch asks the owner of chunks' unit of transfer (their blob: all
	// of chunks are frames of one blob, in ascending order) for their
	// bytes, decoded, and calls got with each chunk's in order as it
	// arrives. got verifies them and returns an error if they are wrong:
	// Fetch then stops, and avoids that peer for a while. Fetch returns
	// how many chunks, from the first, got took (served), how many it
	// asked for (asked: the first ones, as many as one request may ask
	// for; the others were not asked), and why it took fewer than it
	// asked for: ErrNoPeer if there was no peer to ask (the node owns the
	// unit itself, or no peer is live: the chunks are its to fetch
	// upstream; asked is then 0), else the peer's failure. fault says a
	// sandbox's page fault waits on the first chunk (the owner fetches it
	// first); urgent is closed once any read waits on the chunks (it may
	// be from the start): from then on the wait for the peer is the short
	// one.
	Fetch(ctx context.Context, chunks []format.Chunk, fault bool, urgent <-chan struct{}, got func(i int, data []byte) error) (served, asked int, err error)
}

// ErrNoPeer is Peers.Fetch's error when there was no peer to ask.
var ErrNoPeer = errors.New("no peer to ask: this node owns the unit, or no peer is live")

// urgency is closed when a read waits on chunks being asked of a peer.
type urgency struct {
	once sync.Once
	c    chan struct{}
}

func newUrgency() *urgency { return &urgency{c: make(chan struct{})} }

func (u *urgency) set() {
	if u != nil {
		u.once.Do(func() { close(u.c) })
	}
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
	// Profile is a chunk a working-set profile says the sandbox will wait
	// on soon (puller/profile), fetched in the profile's order: behind
	// reads while the sandbox is being restored (runsc restore waits on
	// the first reads of its loader), ahead of them once it runs (from
	// its first page fault on, Scheduler.SandboxFaulted, or with
	// Options.RunsWhenTold from Scheduler.SandboxStarted), one read in
	// flight excepted (next).
	Profile
	// Fault is a read the sandbox's application is blocked on (a page
	// fault: through FUSE a short read, see imagefs.FaultBelow, or one
	// the sweep classifier takes for a fault), served newest first.
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
// Fault), not a prefetch or a profile's.
func (e LogEntry) Demand() bool { return e.Priority.isDemand() }

// isDemand reports whether p is a read's priority (Read or Fault).
func (p Priority) isDemand() bool { return p == Read || p == Fault }

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

// chunkStore is the node cache as the scheduler uses it (a *cache.Store;
// tests wrap one to hold its writes).
type chunkStore interface {
	Has(d digest.Digest) bool
	Get(d digest.Digest, buf []byte, verify bool) ([]byte, error)
	PutVerified(d digest.Digest, data []byte) error
	PutVerifiedRun(ds []digest.Digest, datas [][]byte) []error
}

// Scheduler fetches chunks into a node cache.
type Scheduler struct {
	endpoints []Endpoint
	cache     chunkStore
	codec     *format.Codec
	opts      Options
	// w writes verified chunks into the cache.
	w *writer

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
	// byFrame finds the queued call of a pack's frame (format v2), for
	// the read-ahead of reads (coalesce).
	byFrame map[frame]*call
	closed  bool
	log     []LogEntry
	// link estimates the link from the fetches done, to bound the
	// background fetches while urgent ones run.
	link link
	// faultWorkers counts the workers started for page faults beyond
	// Options.Workers (faultWorker).
	faultWorkers int
	// running is set by SandboxFaulted (or SandboxStarted, with
	// Options.RunsWhenTold): the sandbox runs. Before it, reads go ahead
	// of profile chunks (the restore itself waits on them); after it,
	// profile chunks go ahead of reads but one (next).
	running bool
	// readSeen is set at the first read (priority Read) queued: the
	// sandbox's loader has started, and read something the node did not
	// hold (its first reads of a lead the node prefetched do not count).
	readSeen bool
	// backgroundCPU holds a token per background frame being verified
	// (Options.BackgroundCPU); yielding, if set (tests), is called when a
	// frame waits for one.
	backgroundCPU chan struct{}
	yielding      func()
	// faultEnded is when the last page fault's fetch ended, or a page
	// fault was last seen (SandboxFaulted): the background yields for
	// FaultQuiet after it, by the clock now (time.Now; tests set their
	// own).
	faultEnded time.Time
	now        func() time.Time

	wg sync.WaitGroup
}

// call is one chunk being fetched and stored; waiters block on done.
type call struct {
	chunk format.Chunk
	prio  Priority
	// want is the highest priority the call was asked for: a started
	// call is not promoted (prio), and is queued at want if run again.
	want    Priority
	started bool
	// batch, on the call a worker took, are the calls for the frames that
	// follow its own in the same pack, taken with it to be fetched in one
	// range request (format v2); flights are their node-wide fetches,
	// which this scheduler leads.
	batch   []*call
	flights []*flight
	// single: a range request with this call's frame failed; it is
	// fetched on its own (retries, backoff), never coalesced again.
	single bool
	// peerTries counts the times the call went back to its queue to be
	// asked of the peers again, after a peer failed a batch it was in
	// and no read waited on it (runBatch); at maxPeerTries it goes
	// upstream with the next batch that fails.
	peerTries int
	// demand: a read (Get) waits for the call, not only prefetches.
	demand bool
	// following is the node-wide fetch of another mount the call
	// follows; peerWait is set while the call is being asked of a peer: a
	// read that comes to wait on the call (or on the fetch it follows)
	// makes that wait urgent.
	following *flight
	peerWait  *urgency
	// done is closed when the call is over (finished set): the chunk is
	// in the node cache, flushed, or err says why not.
	done     chan struct{}
	finished bool
	// ready is closed when readers may go on: as soon as the chunk is
	// verified (data set), before it is written to the node cache, so
	// that a page fault does not wait for the disk; else
	// with done.
	ready     chan struct{}
	readyOnce sync.Once
	// data is the verified bytes while the chunk is being written, and
	// after a failed write if a read waits; nil once it is in the cache.
	data []byte
	err  error
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

// New starts a Scheduler with its workers and cache writers.
func New(endpoints []Endpoint, c *cache.Store, codec *format.Codec, opts Options) *Scheduler {
	return newWithStore(endpoints, c, codec, opts)
}

func newWithStore(endpoints []Endpoint, c chunkStore, codec *format.Codec, opts Options) *Scheduler {
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
	if opts.Writers <= 0 {
		opts.Writers = 4
	}
	if opts.WriteBuffer <= 0 {
		opts.WriteBuffer = 64 << 20
	}
	if opts.BackgroundCPU <= 0 {
		opts.BackgroundCPU = max(1, runtime.GOMAXPROCS(0)-1)
	}
	s := &Scheduler{endpoints: endpoints, cache: c, codec: codec, opts: opts, calls: map[key]*call{}, byFrame: map[frame]*call{},
		backgroundCPU: make(chan struct{}, opts.BackgroundCPU), now: time.Now}
	s.w = newWriter(c.PutVerifiedRun, opts.Writers, opts.WriteBuffer, opts.Metrics)
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
// waiting for a fetch deadline, and the chunks already fetched and queued
// for the node cache are written (at most Options.WriteBuffer bytes):
// nothing of this scheduler writes to the cache once Close returns. A fetch
// that another mount's scheduler runs and this one waits for goes on for
// that mount.
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
				s.forgetFrame(c)
			}
		}
		s.queues[i] = nil
	}
	s.cond.Broadcast()
	s.mu.Unlock()
	// Workers waiting for room in the write queue give up, and the
	// writes queued are done.
	s.w.close()
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
		// Verified bytes handed over before the cache write is over: a
		// read is served even if that write then fails (a full disk).
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
// behind any demand fetch. It returns a fetch for every chunk neither
// cached nor zero, in the order of chunks (a chunk already queued gets
// the queued call's); Wait reports completion.
func (s *Scheduler) Prefetch(chunks []format.Chunk) []*Pending {
	return s.queue(chunks, Prefetch)
}

// FetchProfile queues chunks at priority Profile, in the order given (a
// working-set profile's: what a sandbox restored from this snapshot
// waited on first): ahead of prefetches, behind faults, and behind reads
// until SandboxFaulted, ahead of them after. Chunks
// already cached or zero are skipped; queued ones are promoted. Wait
// reports completion.
func (s *Scheduler) FetchProfile(chunks []format.Chunk) []*Pending {
	return s.queue(chunks, Profile)
}

// queueBatch is how many chunks queue queues under one hold of s.mu.
const queueBatch = 1024

// queue queues chunks at prio and returns the fetches, in the order of
// chunks, of those neither zero nor cached. A load queues every chunk of
// a snapshot at once (35,000 of format v2's for 2 GiB), and one lock and
// wake-up per chunk took 0.5 s of CPU from a restoring sandbox; all of
// them under one lock would hold page faults up for 70-110 ms. So it
// queues queueBatch at a time.
func (s *Scheduler) queue(chunks []format.Chunk, prio Priority) []*Pending {
	todo := make([]format.Chunk, 0, len(chunks))
	for _, c := range chunks {
		if c.Encoding != format.EncodingZero && !s.cache.Has(c.Digest) {
			todo = append(todo, c)
		}
	}
	out := make([]*Pending, 0, len(todo))
	for len(todo) > 0 {
		batch := todo[:min(len(todo), queueBatch)]
		todo = todo[len(batch):]
		if !s.queueLocked(batch, prio, &out) {
			break
		}
	}
	return out
}

// queueLocked queues chunks at prio under one hold of s.mu, appending
// their fetches to out; it reports false once the scheduler is closed.
func (s *Scheduler) queueLocked(chunks []format.Chunk, prio Priority, out *[]*Pending) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range chunks {
		cl, err := s.enqueueLocked(c, prio, prio.isDemand())
		if err != nil {
			return false
		}
		*out = append(*out, &Pending{c: cl})
	}
	return true
}

// Want queues, at priority prio (Read or Fault), the fetches of the chunks
// a read is about to Get one after the other, all at once: queued side by
// side, the frames of a pack that follow each other are fetched in one
// range request (format v2) instead of one request per Get. Chunks cached,
// zero or already queued are skipped; Want does not wait.
func (s *Scheduler) Want(chunks []format.Chunk, prio Priority) {
	for _, c := range chunks {
		if c.Encoding == format.EncodingZero || !c.Packed() || s.cache.Has(c.Digest) {
			continue
		}
		if _, err := s.enqueue(c, max(prio, Read)); err != nil {
			return
		}
	}
}

// WantNear queues, at priority Fault, the fetches of a page fault's
// chunks (read, which it is about to Get one after the other) and of the
// chunks near them (near, in file order: see imagefs.NearWanter), all at
// once: the first chunk of read is taken first, in one range request with
// the frames that follow it in its pack (up to FaultCoalesce), and the
// frames before it next, in another. An
// application faults its pages one after the other, mostly near each
// other; v1's 1 MiB chunks brought the next faults' pages along, v2's
// 64 KiB ones, fetched one by one, did not (docs/benchmarks.md). Chunks
// cached, zero or not packed are skipped; the neighbours are no read's
// yet (a peer's wait for them stays the long one). WantNear does not
// wait.
func (s *Scheduler) WantNear(read, near []format.Chunk) {
	if len(read) == 0 {
		return
	}
	lo, hi := read[0].Offset, read[len(read)-1].End()
	// Faults are taken newest first, so the queue order is the reverse
	// of the fetch order: near's chunks before read, last first (the
	// first of them comes after read), then near's chunks after read and
	// read itself, last first (read[0] is taken first, then what follows
	// it, in file order).
	var todo []format.Chunk
	add := func(c format.Chunk) {
		if c.Encoding != format.EncodingZero && c.Packed() && !s.cache.Has(c.Digest) {
			todo = append(todo, c)
		}
	}
	for j := len(near) - 1; j >= 0; j-- {
		if near[j].Offset < lo {
			add(near[j])
		}
	}
	for j := len(near) - 1; j >= 0; j-- {
		if near[j].Offset >= hi {
			add(near[j])
		}
	}
	for j := len(read) - 1; j >= 0; j-- {
		add(read[j])
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range todo {
		if _, err := s.enqueueLocked(c, Fault, c.Offset >= lo && c.Offset < hi); err != nil {
			return
		}
	}
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
	return s.enqueueLocked(c, prio, prio.isDemand())
}

// enqueueLocked is enqueue with s.mu held; demand says a read waits on
// the chunk (false for a page fault's neighbours, WantNear).
func (s *Scheduler) enqueueLocked(c format.Chunk, prio Priority, demand bool) (*call, error) {
	if s.closed {
		return nil, ErrClosed
	}
	if prio == Read {
		s.readSeen = true
	}
	k := keyOf(c)
	if cl, ok := s.calls[k]; ok {
		cl.demand = cl.demand || demand
		if demand {
			cl.peerWait.set()
			if cl.following != nil {
				cl.following.demand()
			}
		}
		if s.ahead(prio, cl.want) {
			cl.want = prio // for a started call, if it is queued again
		}
		if s.ahead(prio, cl.prio) && !cl.started {
			// Promote a queued call; its entry in the lower queue is
			// skipped when met.
			cl.prio = prio
			s.queues[prio] = append(s.queues[prio], cl)
			s.cond.Signal()
			s.faultWorker(prio)
		}
		return cl, nil
	}
	cl := &call{chunk: c, prio: prio, want: prio, demand: demand, done: make(chan struct{}), ready: make(chan struct{})}
	s.calls[k] = cl
	if f := frameOf(c); c.Packed() && s.byFrame[f] == nil {
		s.byFrame[f] = cl
	}
	s.queues[prio] = append(s.queues[prio], cl)
	s.cond.Signal()
	s.faultWorker(prio)
	return cl, nil
}

// maxFaultWorkers bounds the workers started for page faults beyond
// Options.Workers.
const maxFaultWorkers = 4

// faultWorker starts a worker of its own for a page fault just queued
// (prio Fault) when every worker is busy: with the link slow, or with
// fetches waiting on a peer that stalls (up to its answer wait), a fault
// would otherwise wait for one of them to end. s.mu is held.
func (s *Scheduler) faultWorker(prio Priority) {
	if prio != Fault || s.faultWorkers >= maxFaultWorkers {
		return
	}
	busy := 0
	for _, n := range s.active {
		busy += n
	}
	if busy < s.opts.Workers {
		return
	}
	s.faultWorkers++
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.mu.Lock()
		var cl *call
		if !s.closed {
			if cl = s.take(Fault); cl != nil && cl.chunk.Packed() && !cl.single {
				s.coalesce(cl, Fault)
			}
		}
		if cl == nil {
			// A worker took it meanwhile, or the scheduler closed.
			s.faultWorkers--
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		s.runCall(cl, Fault)
		s.mu.Lock()
		s.faultWorkers--
		s.mu.Unlock()
	}()
}

// take pops the next call of priority p, if any, and counts it as
// started by a worker. s.mu is held.
func (s *Scheduler) take(p Priority) *call {
	cl := s.pop(p)
	if cl != nil {
		cl.started = true
		s.active[p]++
		s.record(cl)
	}
	return cl
}

// next takes the next call to run, and the priority it runs at: the
// newest fault, else the oldest read and profile chunk (reads first until
// the sandbox runs, profile chunks first after: order), else, only while
// no read waits or runs, the next prefetch. A restoring
// sandbox keeps many reads in flight (gVisor's background loader issues
// up to 128 at once, in ascending order); the page fault its application
// is blocked on arrives last, so faults go newest first. Prefetches wait
// while reads are served, which covers the whole file anyway.
//
// While faults, or once the sandbox runs profile chunks, are being
// fetched (urgent fetches), the background (reads and prefetches, and
// profile chunks before the sandbox runs) keeps at most link.backgroundLimit
// fetches in flight: about half the link's measured bandwidth-delay
// product, at least one, so that it neither stops nor queues bytes on the
// link ahead of what the sandbox waits for.
//
// Three rules keep the sandbox's loader going beside a profile, without
// its reads taking the link from the profile. Before the sandbox runs,
// while a read is in flight, profile chunks keep to that same limit, not
// every idle worker; and while profile chunks are left (queued or in
// flight), at most one read is in flight. After, a read is taken whenever
// none is in flight, ahead of profile chunks and whatever the limit.
// gVisor's loader keeps its reads in a fixed number of slots and issues a
// page fault's reads (runsc's own, while it restores, included) only as
// one of them completes: it needs its reads to complete, not to be many.
// While profile chunks are left, a read's range request also stops at
// FaultCoalesce (coalesce), so that one completes sooner and moves less.
// (256 MiB app on 100 Mbit/s + 25 ms, a 99 MiB profile: moved before its
// first answer 136 MiB, 116-118 MiB with the one-read rule before the
// sandbox runs and the 1 MiB cap; the answer 11.7 s, 10.0-10.2 s.)
func (s *Scheduler) next() (*call, Priority) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for {
		if s.closed {
			return nil, 0
		}
		urgent := s.active[Fault] > 0 || s.running && s.active[Profile] > 0
		limit := s.link.backgroundLimit(s.opts.Workers)
		order := s.order()
		oneRead := s.running && s.active[Read] == 0
		if oneRead {
			order = [...]Priority{Fault, Read, Profile, Prefetch}
		}
		for _, p := range order {
			if p == Prefetch && (s.active[Fault]+s.active[Profile]+s.active[Read] > 0) {
				break
			}
			if (p == Read && !oneRead || p == Prefetch || p == Profile && !s.running) && urgent && s.background() >= limit {
				break
			}
			if p == Profile && !s.running && s.active[Read] > 0 && s.active[Profile] >= limit {
				break
			}
			if p == Read && !s.running && s.active[Read] > 0 && s.profileLeft() {
				continue // one read at a time beside a profile
			}
			if p == Profile && !s.running && !s.readSeen && s.active[Profile] >= earlyProfile {
				break
			}
			if cl := s.take(p); cl != nil {
				if cl.chunk.Packed() && !cl.single {
					s.coalesce(cl, p)
				}
				return cl, p
			}
		}
		s.cond.Wait()
	}
}

// profileLeft reports whether profile chunks are queued or in flight. It
// drops the stale calls (started or promoted away, as pop skips them) at
// the head of the profile queue, so that they do not count. s.mu is held.
func (s *Scheduler) profileLeft() bool {
	if s.active[Profile] > 0 {
		return true
	}
	q := s.queues[Profile]
	for len(q) > 0 && (q[0].started || q[0].prio != Profile) {
		q = q[1:]
	}
	s.queues[Profile] = q
	return len(q) > 0
}

// earlyProfile bounds the profile chunks in flight before the sandbox's
// loader has read anything that must be fetched (readSeen): runsc is
// starting its sandbox on the same cores.
const earlyProfile = 2

// SandboxFaulted tells the scheduler that the sandbox took a page fault
// on memory not loaded yet (a Fault read of pages.img): it runs, and
// profile chunks go ahead of its loader's reads from now on. The
// puller's own urgent fetches (the small files, before the mount is
// ready) do not count. A fault found in place, never fetched, counts as
// a page fault's fetch that ended now: the background yields the CPU for
// FaultQuiet (Options.BackgroundCPU), for the sandbox copies the fault's
// bytes on the same cores.
func (s *Scheduler) SandboxFaulted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faultEnded = s.now()
	if !s.opts.RunsWhenTold {
		s.runsLocked()
	}
}

// SandboxStarted tells the scheduler that the sandbox runs (runsc
// restore returned): profile chunks go ahead of its loader's reads from
// now on. With Options.RunsWhenTold it is the only way to say so.
func (s *Scheduler) SandboxStarted() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.runsLocked()
}

// PeakRate is the highest rate, in stored bytes a second, the
// scheduler's fetches were measured to deliver (over windows of 250 ms,
// smoothed), or 0 before any was measured: an estimate of what the link
// can carry that a lull in the fetches does not lower (a first window
// that caught another mount's fetch can raise it past the link's rate).
func (s *Scheduler) PeakRate() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.link.peak
}

// RoundTrip is the shortest time one of the scheduler's own requests to
// its endpoints took, from the request to its bytes verified, or 0
// before one succeeded: an upper bound of the round trip to its
// endpoints, known after its first fetch. Fetches it followed (another
// mount's), failed requests and peers' answers are left out.
func (s *Scheduler) RoundTrip() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.link.shortest
}

// sawRequest records a request to an endpoint that succeeded after took
// (link.sawRequest).
func (s *Scheduler) sawRequest(took time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.link.sawRequest(took)
}

// Running reports whether the scheduler counts the sandbox as running
// (SandboxFaulted, SandboxStarted).
func (s *Scheduler) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.running
}

func (s *Scheduler) runsLocked() {
	if !s.running {
		s.running = true
		s.cond.Broadcast()
	}
}

// order is the order the queues are served in (see next).
func (s *Scheduler) order() [numPriorities]Priority {
	if s.running {
		return [...]Priority{Fault, Profile, Read, Prefetch}
	}
	return [...]Priority{Fault, Read, Profile, Prefetch}
}

// ahead reports whether queue a is served before queue b.
func (s *Scheduler) ahead(a, b Priority) bool {
	for _, p := range s.order() {
		switch p {
		case a:
			return a != b
		case b:
			return false
		}
	}
	return false
}

// background counts the fetches in flight that no sandbox waits on now.
func (s *Scheduler) background() int {
	n := s.active[Read] + s.active[Prefetch]
	if !s.running {
		n += s.active[Profile]
	}
	return n
}

// MaxCoalesce bounds the stored bytes of the frames one range request
// fetches (format v2): about one pack.
const MaxCoalesce = format.DefaultPackSize

// ReadAhead is the stored bytes the range request of a read (priority
// Read) is filled up to, past the frames queued right behind it, with the
// queued reads and prefetches of the frames that follow in the same pack,
// wherever they are in their queues: a pack, as a background fetch takes.
// gVisor's loader reads a file in order, 128 KiB at a time through FUSE;
// without it, each read (two or three 64 KiB chunks) would be a request of
// its own, and a registry's cost is per request (measured: 5,174 requests
// for a 2 GiB restore, 2,600 with 1 MiB of read-ahead, 870 with 4 MiB).
// It fetches nothing that was not queued.
const ReadAhead = MaxCoalesce

// FaultCoalesce bounds the stored bytes of a page fault's range request:
// its frame, then the queued frames that follow it in its pack (its
// neighbours, WantNear). The fault's bytes come first: they are served as
// soon as they are in, before the rest of the range arrives.
const FaultCoalesce = 1 << 20

// frame is where a format v2 chunk lies: its pack and its offset there.
type frame struct {
	pack digest.Digest
	off  int64
}

func frameOf(c format.Chunk) frame { return frame{c.Blob, c.PackOffset} }

// forgetFrame drops cl from byFrame. s.mu is held.
func (s *Scheduler) forgetFrame(cl *call) {
	if f := frameOf(cl.chunk); s.byFrame[f] == cl {
		delete(s.byFrame, f)
	}
}

// coalesce takes, with call cl just popped from queue p, the calls queued
// right behind it whose frames follow cl's in the same pack, up to
// MaxCoalesce bytes: one range request fetches them all. Queues hold reads
// and prefetches in ascending file order, and a pack holds consecutive
// chunks of a file, so neighbours in a pack are neighbours in the queue.
// A read then goes on with the queued reads and prefetches of the frames
// that follow (reads come in concurrently, so not always in file order),
// until the request holds ReadAhead bytes. A page fault (taken newest
// first, so the head of its queue says nothing of its neighbours) goes on
// the same way with the faults queued for the frames that follow it (its
// neighbours, WantNear), up to FaultCoalesce bytes, but not with the
// background's: a fault with no neighbourhood moves its own chunk only.
// While profile chunks are left, a read's request holds at most
// FaultCoalesce bytes (next says why). With a node-wide InFlight, a call
// joins the batch only if this scheduler leads its fetch; cl's own flight
// is joined by run.
func (s *Scheduler) coalesce(cl *call, p Priority) {
	end := cl.chunk.PackOffset + cl.chunk.BlobSize
	total := cl.chunk.BlobSize
	limit := int64(ReadAhead)
	if p == Fault || p == Read && s.profileLeft() {
		limit = FaultCoalesce
	}
	// take adds next, whose frame starts at end, to the batch, and
	// reports whether it did.
	take := func(next *call) bool {
		c := next.chunk
		if next.single || !c.Packed() || c.Blob != cl.chunk.Blob || c.PackOffset != end || total+c.BlobSize > limit {
			return false
		}
		var f *flight
		if s.opts.InFlight != nil {
			var lead bool
			if f, lead = s.opts.InFlight.join(keyOf(c), s.opts.Peers != nil); !lead {
				return false // another mount fetches it: its own worker follows that
			}
		}
		next.started = true
		s.record(next)
		cl.batch = append(cl.batch, next)
		cl.flights = append(cl.flights, f)
		end += c.BlobSize
		total += c.BlobSize
		return true
	}
	q := s.queues[p]
	for p != Fault && len(q) > 0 && total < limit {
		next := q[0]
		if next.started || next.prio != p {
			q = q[1:] // stale: promoted away or running
			continue
		}
		if !take(next) {
			break
		}
		q = q[1:]
	}
	s.queues[p] = q
	if p != Read && p != Fault {
		return
	}
	for total < limit {
		next := s.byFrame[frame{cl.chunk.Blob, end}]
		if next == nil || next.started || next.prio > p || p == Fault && next.prio != Fault || !take(next) {
			return
		}
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
	for {
		cl, prio := s.next()
		if cl == nil {
			return
		}
		s.runCall(cl, prio)
	}
}

// runCall runs call cl, taken at priority prio (counted in active), and
// accounts for it: the link's estimate, the priority's count.
func (s *Scheduler) runCall(cl *call, prio Priority) {
	start := time.Now()
	// The batch next gave this worker: run empties cl's, and once run
	// returns, cl may be queued again and run by another worker.
	batch := cl.batch
	n := cl.chunk.BlobSize
	for _, b := range batch {
		n += b.chunk.BlobSize
	}
	s.run(cl)
	end := time.Now()
	s.mu.Lock()
	s.link.done(n, end.Sub(start), end)
	// The priority it ran at: a call run again (requeue) may have been
	// promoted since.
	s.active[prio]--
	if prio == Fault || wantedByFault(cl, batch) {
		s.faultEnded = s.now()
	}
	s.cond.Broadcast() // lower priorities may run now
	s.mu.Unlock()
}

// wantedByFault says whether a page fault asked for cl or a call of its
// batch, perhaps after it started at a lower priority. s.mu is held.
func wantedByFault(cl *call, batch []*call) bool {
	if cl.want == Fault {
		return true
	}
	for _, b := range batch {
		if b.want == Fault {
			return true
		}
	}
	return false
}

// run fetches cl's chunk and returns once its write into the node cache is
// queued (the writer finishes the call) or the call is finished or handed
// on. If another mount's scheduler on the node is fetching the chunk
// stored the same way (Options.InFlight), the call follows that fetch
// instead (follow).
func (s *Scheduler) run(cl *call) {
	finish := func(data []byte, err error) { s.finish(cl, data, err) }
	batch, flights := cl.batch, cl.flights
	cl.batch, cl.flights = nil, nil
	if len(batch) > 0 {
		var f *flight
		if s.opts.InFlight != nil {
			var lead bool
			if f, lead = s.opts.InFlight.join(keyOf(cl.chunk), s.opts.Peers != nil); !lead {
				// Another mount took cl's chunk since: fetch the rest
				// of the batch without it, then follow that fetch.
				s.runBatch(batch, flights)
				s.followOrFetch(cl, f)
				return
			}
		}
		s.runBatch(append([]*call{cl}, batch...), append([]*flight{f}, flights...))
		return
	}
	if s.opts.InFlight == nil {
		s.fetchAndStore(cl, nil, finish)
		return
	}
	k := keyOf(cl.chunk)
	f, lead := s.opts.InFlight.join(k, s.opts.Peers != nil)
	if !lead {
		s.followOrFetch(cl, f)
		return
	}
	// The node-wide fetch lasts until the chunk is in the cache, so that
	// no mount fetches it again meanwhile; this worker goes on as soon as
	// the write is queued.
	s.fetchAndStore(cl, f, func(data []byte, err error) {
		finish(data, err)
		s.opts.InFlight.end(k, f, data, err)
	})
}

// followOrFetch follows another mount's fetch f of cl's chunk, unless
// this scheduler serves peers and f is waiting on a peer: then it fetches
// the chunk itself, outside the node-wide set (Options.ServesPeers).
func (s *Scheduler) followOrFetch(cl *call, f *flight) {
	if s.opts.ServesPeers && f.viaPeer.Load() {
		s.fetchAndStore(cl, nil, func(data []byte, err error) { s.finish(cl, data, err) })
		return
	}
	s.follow(cl, f)
}

// follow makes call cl follow another mount's fetch f of its chunk: cl's
// readers get the verified bytes as soon as that fetch has them, and cl
// ends when the chunk is in the node cache. The worker waits only for the
// bytes (about as long as fetching them itself); the write is waited for
// in the background. Only another mount's success is taken, and its
// verified bytes if its write failed; if that fetch failed (its endpoints,
// or its mount was closed), cl is queued again, to be fetched from this
// mount's endpoints.
func (s *Scheduler) follow(cl *call, f *flight) {
	finish := func(data []byte, err error) { s.finish(cl, data, err) }
	s.mu.Lock()
	cl.following = f
	if cl.demand {
		f.demand()
	}
	s.mu.Unlock()
	select {
	case <-f.verified:
	case <-s.ctx.Done():
		finish(nil, ErrClosed)
		return
	}
	if f.data != nil {
		s.publish(cl, f.data)
	}
	wait := func() {
		select {
		case <-f.done:
		case <-s.ctx.Done():
			finish(nil, ErrClosed)
			return
		}
		switch {
		case f.err == nil:
			finish(nil, nil) // in the cache
		case f.data != nil:
			// Fetched and verified (the same key) but not stored: store it.
			s.store(cl.chunk, f.data, finish)
		default:
			s.opts.Logger.Info("fetch chunk: another mount's fetch failed; fetching from this mount's endpoints", "chunk", cl.chunk.Digest, "err", f.err)
			if !s.requeue(cl) {
				finish(nil, ErrClosed)
			}
		}
	}
	select {
	case <-f.done:
		wait()
	default:
		s.wg.Add(1) // the worker calling follow holds the group open
		go func() {
			defer s.wg.Done()
			wait()
		}()
	}
}

// runBatch fetches the chunks of calls, whose frames follow each other in
// one pack, with one range request (fetchRange), and each chunk it could
// not get that way on its own (fetchAndStore: every endpoint, retries,
// the deadline). flights are the calls' node-wide fetches (nil entries
// without InFlight), which this scheduler leads.
func (s *Scheduler) runBatch(calls []*call, flights []*flight) {
	var todo []*call
	var tflights []*flight
	var ends []func([]byte, error)
	for i, cl := range calls {
		f := flights[i]
		end := func(data []byte, err error) {
			s.finish(cl, data, err)
			if f != nil {
				s.opts.InFlight.end(keyOf(cl.chunk), f, data, err)
			}
		}
		if s.cache.Has(cl.chunk.Digest) {
			end(nil, nil)
			continue
		}
		todo, tflights, ends = append(todo, cl), append(tflights, f), append(ends, end)
	}
	if len(todo) == 0 {
		return
	}
	// Peers first (Options.Peers), then the endpoints for the rest.
	done, asked, err := s.fromPeers(todo, tflights, func(i int, data []byte) {
		s.publish(todo[i], data)
		if f := tflights[i]; f != nil {
			f.verify(data)
		}
		s.store(todo[i].chunk, data, ends[i])
	})
	// [lo, hi) are fetched upstream now; the others from done go back to
	// be asked of the peers: those past the ones asked for (a request's
	// limits) as they are, those a failed peer did not serve counted in
	// their peerTries (upstreamShare).
	lo, hi := done, len(todo)
	switch {
	case done == len(todo) || errors.Is(err, ErrNoPeer):
	case err == nil && done == asked && done > 0:
		hi = done
	default:
		if asked <= done {
			asked = len(todo) // a Peers that did not say: it failed them all
		}
		a, b := s.upstreamShare(todo[done:asked])
		lo, hi = done+a, done+b
	}
	// Those go back first, before the fetch upstream: another mount
	// following one of their node-wide fetches then fetches for itself
	// at once, and a read coming to wait on one finds it queued.
	var again []*call
	for i := done; i < len(todo); i++ {
		if i >= lo && i < hi {
			continue
		}
		if f := tflights[i]; f != nil {
			s.opts.InFlight.end(keyOf(todo[i].chunk), f, nil, errAskPeersAgain)
		}
		again = append(again, todo[i])
	}
	for _, cl := range s.requeueFirst(again) {
		s.finish(cl, nil, ErrClosed)
	}
	got := lo + s.fetchRange(todo[lo:hi], tflights[lo:hi], ends[lo:hi])
	// The rest go back in their queues, each to be fetched on its own by
	// any worker (with retries and backoff), rather than one after the
	// other here. Their node-wide fetches end first: other mounts waiting
	// on them fetch for themselves.
	for i := got; i < hi; i++ {
		cl := todo[i]
		if f := tflights[i]; f != nil {
			s.opts.InFlight.end(keyOf(cl.chunk), f, nil, errRangeFailed)
		}
		if !s.requeueSingle(cl) {
			s.finish(cl, nil, ErrClosed)
		}
	}
}

// requeueFirst puts calls, in order, back at the head of their queues (the
// next to be taken at their priority), unless the scheduler is closed or
// a call is over; it returns the calls it did not requeue.
func (s *Scheduler) requeueFirst(calls []*call) []*call {
	s.mu.Lock()
	defer s.mu.Unlock()
	var left []*call
	var head [numPriorities][]*call
	for _, cl := range calls {
		if s.closed || cl.finished {
			left = append(left, cl)
			continue
		}
		s.unstart(cl)
		head[cl.prio] = append(head[cl.prio], cl)
	}
	for p, h := range head {
		if len(h) == 0 {
			continue
		}
		if Priority(p) == Fault {
			// Faults are taken newest first (pop), from the end.
			s.queues[p] = append(s.queues[p], h...)
			s.faultWorker(Fault)
		} else {
			s.queues[p] = append(h, s.queues[p]...)
		}
		s.cond.Broadcast()
	}
	return left
}

// unstart marks started call cl as not started, to be queued again, at
// the highest priority asked for it while it ran (a read coming to wait
// on a prefetch being fetched). s.mu is held.
func (s *Scheduler) unstart(cl *call) {
	cl.started = false
	if s.ahead(cl.want, cl.prio) {
		cl.prio = cl.want
	}
}

// maxPeerTries bounds how often a call goes back to be asked of the
// peers again (upstreamShare): a peer that fails every time costs a
// chunk no read waits on that many of its waits, then upstream.
const maxPeerTries = 2

// upstreamShare returns the calls, of calls (frames of one pack in order
// that a peer was asked for and failed to serve), to fetch upstream now,
// in one range request: calls[lo:hi], from the first to the last one a
// read waits on (the peer's wait was the short one for it, and is over)
// or that was asked of the peers maxPeerTries times already. The others,
// frames a prefetch queued or a read took along (ReadAhead), go back to
// be asked of the peers again, each counted in its peerTries: a slow
// owner, on a busy pool, then costs the registry the chunks its reads
// wait on, not whole packs.
func (s *Scheduler) upstreamShare(calls []*call) (lo, hi int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	lo = -1
	for i, cl := range calls {
		if goesUpstream(cl) {
			if lo < 0 {
				lo = i
			}
			hi = i + 1
		}
	}
	if lo < 0 {
		lo = 0
	}
	for i, cl := range calls {
		if i < lo || i >= hi {
			cl.peerTries++
		}
	}
	return lo, hi
}

// askPeersAgain reports whether call cl, which a peer failed to serve,
// goes back to be asked of the peers again (counted in its peerTries)
// rather than upstream: no read waits on it and it has tries left.
func (s *Scheduler) askPeersAgain(cl *call) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if goesUpstream(cl) {
		return false
	}
	cl.peerTries++
	return true
}

// goesUpstream reports whether call cl, which a peer failed to serve, is
// fetched upstream now rather than asked of the peers again: a read
// waits on it, or it was asked again maxPeerTries times. s.mu is held.
func goesUpstream(cl *call) bool { return cl.demand || cl.peerTries >= maxPeerTries }

// errAskPeersAgain ends the node-wide fetch of a chunk that goes back to
// be asked of the peers again (upstreamShare).
var errAskPeersAgain = errors.New("the peer failed; the chunk is asked of the peers again")

// fromPeers asks the peers (Options.Peers) for the chunks of calls,
// frames of one blob in ascending order, and verifies each they serve;
// took gets each verified chunk's index and bytes, in order. flights are
// the calls' node-wide fetches (nil entries without): while the peers
// are asked, they say so (flight.viaPeer), and a read that comes to wait
// on any of the calls, or on a fetch following one, makes the wait for
// the peer the short one. It returns how many chunks, from the first, it
// got, how many it asked for, and why not all (Peers.Fetch; ErrNoPeer
// without peers).
func (s *Scheduler) fromPeers(calls []*call, flights []*flight, took func(i int, data []byte)) (served, asked int, err error) {
	if s.opts.Peers == nil || len(calls) == 0 {
		return 0, 0, ErrNoPeer
	}
	chunks := make([]format.Chunk, len(calls))
	u := newUrgency()
	s.mu.Lock()
	fault := calls[0].prio == Fault
	for i, cl := range calls {
		chunks[i] = cl.chunk
		cl.peerWait = u
		if cl.demand {
			u.set()
		}
	}
	s.mu.Unlock()
	for _, f := range flights {
		if f != nil {
			f.asking(u)
		}
	}
	defer func() {
		for _, f := range flights {
			if f != nil {
				f.asking(nil)
			}
		}
		s.mu.Lock()
		for _, cl := range calls {
			cl.peerWait = nil
		}
		s.mu.Unlock()
	}()
	return s.opts.Peers.Fetch(s.ctx, chunks, fault, u.c, func(i int, data []byte) error {
		c := chunks[i]
		if err := s.codec.Verify(c, data); err != nil {
			s.opts.Metrics.verifyFailed(peerEndpoint)
			return err
		}
		s.fetched(c, Endpoint{Name: peerEndpoint})
		took(i, data)
		return nil
	})
}

// peerEndpoint names the peers in metrics and the fetch log.
const peerEndpoint = "peers"

// errRangeFailed ends a node-wide fetch whose range request failed.
var errRangeFailed = errors.New("range request failed; the chunk is fetched on its own")

// requeueSingle is requeue for a call to be fetched on its own.
func (s *Scheduler) requeueSingle(cl *call) bool {
	s.mu.Lock()
	cl.single = true
	s.mu.Unlock()
	return s.requeue(cl)
}

// fetchRange reads the frames of calls (in one pack, in ascending order)
// with one range request, from each endpoint in turn until all are in,
// decoding and verifying each frame as it arrives: its readers go on at
// once, and its write into the node cache is queued. It returns how many
// calls, from the first, it served; a frame that fails to arrive or to
// verify stops it there.
func (s *Scheduler) fetchRange(calls []*call, flights []*flight, ends []func([]byte, error)) int {
	if len(calls) == 0 {
		return 0
	}
	last := calls[len(calls)-1].chunk
	end := last.PackOffset + last.BlobSize
	desc := calls[0].chunk.BlobDescriptor()
	i := 0
	for _, ep := range s.endpoints {
		if i == len(calls) || s.ctx.Err() != nil {
			break
		}
		ctx, cancel := context.WithTimeout(s.ctx, 60*time.Second)
		start := calls[i].chunk.PackOffset
		asked := time.Now()
		rc, err := format.OpenRange(ctx, ep.Store, desc, start, end-start)
		if err != nil {
			cancel()
			if s.ctx.Err() == nil {
				s.opts.Logger.Warn("fetch frames", "pack", desc.Digest, "offset", start, "length", end-start, "endpoint", ep.Name, "err", err)
			}
			continue
		}
		// The range is read into one buffer, as much at a time as the
		// connection has, and each frame is taken as soon as it is in:
		// raw frames are the chunks' bytes, without a copy. (Read frame
		// by frame, 64 KiB at a time, the reads and the allocations were
		// 16 times v1's.)
		r := &rangeBuffer{r: rc, start: start, buf: make([]byte, end-start)}
		for ; i < len(calls); i++ {
			c := calls[i].chunk
			data, err := s.readFrame(r, calls[i])
			if err != nil {
				if errors.Is(err, format.ErrDigestMismatch) || errors.Is(err, format.ErrTooLarge) || errors.Is(err, format.ErrInvalid) {
					s.opts.Metrics.verifyFailed(ep.Name)
				}
				if s.ctx.Err() == nil {
					s.opts.Logger.Warn("fetch frame", "chunk", c.Digest, "pack", desc.Digest, "endpoint", ep.Name, "err", err)
				}
				break
			}
			s.fetched(c, ep)
			s.publish(calls[i], data)
			if flights[i] != nil {
				flights[i].verify(data)
			}
			s.store(c, data, ends[i])
		}
		if i == len(calls) { // every frame asked of ep verified
			s.sawRequest(time.Since(asked))
		}
		rc.Close()
		cancel()
	}
	return i
}

// rangeBuffer holds a range of a pack, from pack offset start, read from
// r as frames are asked for.
type rangeBuffer struct {
	r     io.Reader
	start int64
	buf   []byte
	have  int
}

// frame returns the bytes of [off, off+n) of the pack, reading until they
// are in. The slice is the buffer's (cap-limited): never modified after.
func (b *rangeBuffer) frame(off, n int64) ([]byte, error) {
	lo, hi := off-b.start, off-b.start+n
	if lo < 0 || hi > int64(len(b.buf)) {
		return nil, fmt.Errorf("frame [%d,+%d) outside the range read [%d,+%d)", off, n, b.start, len(b.buf))
	}
	if need := int(hi) - b.have; need > 0 {
		got, err := io.ReadAtLeast(b.r, b.buf[b.have:], need)
		b.have += got
		if err != nil {
			return nil, err
		}
	}
	return b.buf[lo:hi:hi], nil
}

// readFrame reads call cl's frame from r and returns its chunk's verified
// bytes (open).
func (s *Scheduler) readFrame(r *rangeBuffer, cl *call) ([]byte, error) {
	c := cl.chunk
	frame, err := r.frame(c.PackOffset, c.BlobSize)
	if err != nil {
		return nil, fmt.Errorf("chunk %s: read %d bytes of its frame: %w", c.Digest, c.BlobSize, err)
	}
	return s.open(cl, frame)
}

// open verifies (and decodes) the frame fetched for call cl. If cl yields
// to page faults, that takes a token of Options.BackgroundCPU: the frame
// was fetched without one, so the wait is for the CPU, not the network.
// Every upstream fetch goes through here, alone or coalesced.
func (s *Scheduler) open(cl *call, frame []byte) ([]byte, error) {
	if s.yields(cl) {
		if s.yielding != nil {
			s.yielding()
		}
		s.backgroundCPU <- struct{}{}
		defer func() { <-s.backgroundCPU }()
	}
	return s.codec.FromFrame(cl.chunk, frame, nil)
}

// FaultQuiet is how long after a page fault's fetch the background still
// yields the CPU (Options.BackgroundCPU): an application's faults come
// in bursts, 10-50 ms of its own work apart, and that work needs a core
// as much as the faults' fetches do (docs/benchmarks.md).
const FaultQuiet = 100 * time.Millisecond

// yields reports whether call cl's frame waits for a token of
// Options.BackgroundCPU before it is verified: page faults are being
// fetched (queued or running) or one ended less than FaultQuiet ago, and
// cl is not one of them nor, once the sandbox runs, a profile's chunk
// (the urgent fetches of next).
func (s *Scheduler) yields(cl *call) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cl.want == Fault || s.running && cl.want == Profile {
		return false
	}
	return s.active[Fault] > 0 || len(s.queues[Fault]) > 0 || s.now().Sub(s.faultEnded) < FaultQuiet
}

// requeue puts started call cl back in its queue, to be run again, unless
// the scheduler is closed or cl is over; it reports whether it did.
func (s *Scheduler) requeue(cl *call) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || cl.finished {
		return false
	}
	s.unstart(cl)
	s.queues[cl.prio] = append(s.queues[cl.prio], cl)
	s.cond.Signal()
	s.faultWorker(cl.prio)
	return true
}

// fetchAndStore fetches cl's chunk, unless the node cache has it, hands its
// verified bytes to cl's readers (and to the node-wide fetch f this
// scheduler leads for it, if not nil) and queues its write into the
// cache. done gets the outcome: from the writer once the write is over,
// or from this goroutine if nothing was queued. It returns once the write
// is queued or done was called.
func (s *Scheduler) fetchAndStore(cl *call, f *flight, done func(data []byte, err error)) {
	c := cl.chunk
	if s.cache.Has(c.Digest) {
		done(nil, nil)
		return
	}
	var data []byte
	n, _, perr := s.fromPeers([]*call{cl}, []*flight{f}, func(_ int, d []byte) { data = d })
	if n == 0 && perr != nil && !errors.Is(perr, ErrNoPeer) && s.askPeersAgain(cl) {
		// A peer failed a chunk no read waits on: asked of the peers
		// again (upstreamShare's rule), not fetched upstream.
		if f != nil {
			s.opts.InFlight.end(keyOf(c), f, nil, errAskPeersAgain)
		}
		if !s.requeue(cl) {
			s.finish(cl, nil, ErrClosed) // its node-wide fetch has ended
		}
		return
	}
	if n == 0 {
		var err error
		if data, err = s.fetch(cl); err != nil {
			done(nil, err)
			return
		}
	}
	s.publish(cl, data)
	if f != nil {
		f.verify(data)
	}
	s.store(c, data, done)
}

// store queues verified chunk c's write into the node cache, waiting for
// room; done gets data and the outcome. A write that fails is logged and
// counted: the chunk is fetched again when next needed.
func (s *Scheduler) store(c format.Chunk, data []byte, done func(data []byte, err error)) {
	err := s.w.submit(c.Digest, data, func(err error) {
		if err != nil {
			s.opts.Metrics.writeFailed()
			s.opts.Logger.Warn("store chunk in the node cache", "chunk", c.Digest, "err", err)
		}
		done(data, err)
	})
	if err != nil {
		done(data, fmt.Errorf("chunk %s: %w", c.Digest, err))
	}
}

// publish lets cl's readers go on with its verified bytes, before they are
// written into the node cache. The bytes are shared, never modified. A
// page fault's reader goes on now: the background's FaultQuiet counts
// from here (and again from the end of the fetch, runCall).
func (s *Scheduler) publish(cl *call, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !cl.finished && cl.data == nil {
		cl.data = data
		cl.markReady()
		if cl.want == Fault {
			s.faultEnded = s.now()
		}
	}
}

// finish ends cl, once: the chunk is in the node cache (err nil), or err
// says why not. Its bytes are dropped unless a read waits and the write
// failed: the read is served from memory.
func (s *Scheduler) finish(cl *call, data []byte, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if cl.finished {
		return
	}
	cl.finished = true
	cl.err = err
	switch {
	case err == nil || !cl.demand:
		cl.data = nil
	case cl.data == nil:
		cl.data = data
	}
	if k := keyOf(cl.chunk); s.calls[k] == cl {
		delete(s.calls, k)
	}
	s.forgetFrame(cl)
	close(cl.done)
	cl.markReady()
}

// fetch gets and verifies call cl's chunk, trying every endpoint in order
// (FirstOf), again and again with backoff, until the deadline. If every
// endpoint served bad data in one round, it gives up at once: that will
// not get better.
func (s *Scheduler) fetch(cl *call) ([]byte, error) {
	c := cl.chunk
	ctx, cancel := context.WithTimeout(s.ctx, s.opts.Deadline)
	defer cancel()
	backoff := s.opts.Backoff
	for attempt := 1; ; attempt++ {
		corrupt := 0
		data, errs := FirstOf(ctx, s.endpoints, func(ctx context.Context, ep Endpoint) ([]byte, error) {
			data, err := s.fetchFrom(ctx, ep, cl)
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

// fetchFrom fetches call cl's frame from ep into a new buffer and returns
// its chunk's verified bytes (open): they go to readers and the cache
// writer.
func (s *Scheduler) fetchFrom(ctx context.Context, ep Endpoint, cl *call) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	asked := time.Now()
	frame, err := format.FetchFrame(ctx, ep.Store, cl.chunk, nil)
	if err != nil {
		return nil, err
	}
	data, err := s.open(cl, frame)
	if err == nil {
		s.sawRequest(time.Since(asked))
	}
	return data, err
}
