package fetch

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"
)

// heldStore is a node cache whose writes wait: every PutVerified reports
// its chunk on entered, then waits until release is closed before writing
// it into the real cache underneath.
type heldStore struct {
	*cache.Store
	entered chan digest.Digest
	release chan struct{}
	once    sync.Once
}

func newHeldStore(c *cache.Store) *heldStore {
	return &heldStore{Store: c, entered: make(chan digest.Digest, 100), release: make(chan struct{})}
}

func (h *heldStore) PutVerified(d digest.Digest, data []byte) error {
	h.entered <- d
	<-h.release
	return h.Store.PutVerified(d, data)
}

func (h *heldStore) PutVerifiedRun(ds []digest.Digest, datas [][]byte) []error {
	errs := make([]error, len(ds))
	for i, d := range ds {
		errs[i] = h.PutVerified(d, datas[i])
	}
	return errs
}

func (h *heldStore) open() { h.once.Do(func() { close(h.release) }) }

// fetchCounter serves blobs and counts the fetches of each.
type fetchCounter struct {
	blobs
	mu sync.Mutex
	n  map[digest.Digest]int
}

func (f *fetchCounter) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	f.mu.Lock()
	if f.n == nil {
		f.n = map[digest.Digest]int{}
	}
	f.n[desc.Digest]++
	f.mu.Unlock()
	return f.blobs.Fetch(ctx, desc)
}

func (f *fetchCounter) count(d digest.Digest) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.n[d]
}

func (f *fetchCounter) total() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	t := 0
	for _, n := range f.n {
		t += n
	}
	return t
}

// rawChunks returns n random raw chunks of size bytes and their blobs.
func rawChunks(seed uint64, n, size int) ([]format.Chunk, blobs) {
	b := blobs{}
	var cs []format.Chunk
	for i := range n {
		data := randBytes(seed+uint64(i), size)
		d := digest.FromBytes(data)
		b[d] = data
		cs = append(cs, format.Chunk{Offset: int64(i * size), Size: int64(size), Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: int64(size)})
	}
	return cs, b
}

// startScheduler starts a scheduler over store with opts (a 10-minute
// deadline, quiet) and closes it at the end of the test, bounded: a Close
// that hangs fails the test instead of hanging it.
func startScheduler(t *testing.T, eps []Endpoint, store chunkStore, codec *format.Codec, opts Options) *Scheduler {
	t.Helper()
	opts.Deadline = 10 * time.Minute
	opts.KeepLog = true
	opts.Backoff = 10 * time.Millisecond
	opts.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	s := newWithStore(eps, store, codec, opts)
	t.Cleanup(func() {
		closed := make(chan struct{})
		go func() { s.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(hangLimit):
			t.Errorf("Close: still waiting after %s", hangLimit)
		}
	})
	return s
}

func isDone(p *Pending) bool {
	select {
	case <-p.c.done:
		return true
	default:
		return false
	}
}

// TestFetchingGoesOnWhileCacheWriteWaits holds every node cache write (a
// disk that takes its time to flush) with one fetch worker and one
// writer. A read of chunk A gets its bytes; with A's write held, a read of
// chunk B still gets its bytes: the worker is not stuck behind A's write
// (it was, before writes went to the background). A is not in the cache
// until its write is over, yet a second read of A gets its bytes from
// memory and fetches nothing, and a prefetch of A waits for the write.
// Once the writes go through, every chunk is in the cache, fetched once.
func TestFetchingGoesOnWhileCacheWriteWaits(t *testing.T) {
	c, codec := setup(t)
	held := newHeldStore(c)
	defer held.open()
	cs, b := rawChunks(10, 3, 64<<10)
	src := &fetchCounter{blobs: b}
	s := startScheduler(t, []Endpoint{{Name: "primary", Store: src}}, held, codec, Options{Workers: 1, Writers: 1})
	ctx := context.Background()
	a, bc, cc := cs[0], cs[1], cs[2]

	if res := wait(t, get(s, ctx, a), "read of A"); res.err != nil || !bytes.Equal(res.data, b[a.Digest]) {
		t.Fatalf("read of A: %d bytes, %v", len(res.data), res.err)
	}
	if d := wait(t, held.entered, "A's cache write"); d != a.Digest {
		t.Fatalf("first cache write is %s, want A %s", d, a.Digest)
	}
	if res := wait(t, get(s, ctx, bc), "read of B while A's cache write waits"); res.err != nil || !bytes.Equal(res.data, b[bc.Digest]) {
		t.Fatalf("read of B: %d bytes, %v", len(res.data), res.err)
	}
	if c.Has(a.Digest) {
		t.Fatal("A is in the cache before its write is over")
	}
	if res := wait(t, get(s, ctx, a), "second read of A"); res.err != nil || !bytes.Equal(res.data, b[a.Digest]) {
		t.Fatalf("second read of A: %d bytes, %v", len(res.data), res.err)
	}
	pa := s.Prefetch([]format.Chunk{a})
	if len(pa) != 1 || isDone(pa[0]) {
		t.Fatalf("prefetch of A while its write waits: %d pending, done %v; want 1, not done", len(pa), len(pa) == 1 && isDone(pa[0]))
	}
	pc := s.Prefetch([]format.Chunk{cc})
	held.open()
	for _, p := range append(pa, pc...) {
		ctx, cancel := context.WithTimeout(ctx, hangLimit)
		if err := p.Wait(ctx); err != nil {
			t.Fatalf("prefetch of %s: %v", p.Chunk().Digest, err)
		}
		cancel()
	}
	for _, ch := range cs {
		if !c.Has(ch.Digest) {
			t.Errorf("chunk %s not in the cache once written", ch.Digest)
		}
		if n := src.count(ch.Digest); n != 1 {
			t.Errorf("chunk %s fetched %d times, want 1", ch.Digest, n)
		}
	}
}

// TestAnotherMountTakesTheBytesNotAFetch: mount A has fetched a chunk and
// its cache write is held; mount B reads the same chunk (stored the same
// way). B gets the verified bytes at once, while A's write is still held
// (a page fault does not wait for another mount's disk), and the chunk is
// fetched once: the node-wide fetch lasts until the chunk is in the cache,
// so B joins it instead of fetching again because the chunk is neither in
// flight nor in the cache. B's call ends when A's write does.
func TestAnotherMountTakesTheBytesNotAFetch(t *testing.T) {
	c, codec := setup(t)
	held := newHeldStore(c)
	defer held.open()
	cs, b := rawChunks(20, 1, 64<<10)
	src := &fetchCounter{blobs: b}
	var inFlight Flights
	eps := []Endpoint{{Name: "primary", Store: src}}
	ma := startScheduler(t, eps, held, codec, Options{InFlight: &inFlight})
	mb := startScheduler(t, eps, held, codec, Options{InFlight: &inFlight})
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()

	if res := wait(t, get(ma, ctx, cs[0]), "mount A's read"); res.err != nil || !bytes.Equal(res.data, b[cs[0].Digest]) {
		t.Fatalf("mount A's read: %d bytes, %v", len(res.data), res.err)
	}
	wait(t, held.entered, "mount A's cache write")
	if res := wait(t, get(mb, ctx, cs[0]), "mount B's read while A's cache write is held"); res.err != nil || !bytes.Equal(res.data, b[cs[0].Digest]) {
		t.Fatalf("mount B's read: %d bytes, %v", len(res.data), res.err)
	}
	if n := src.total(); n != 1 {
		t.Fatalf("the chunk was fetched %d times, want once", n)
	}
	pb := mb.Prefetch(cs[:1])
	if len(pb) != 1 {
		t.Fatalf("mount B's prefetch of a chunk not in the cache: %d pending, want 1", len(pb))
	}
	if isDone(pb[0]) {
		t.Fatal("mount B's call ended before mount A's cache write")
	}
	held.open()
	if err := pb[0].Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if !c.Has(cs[0].Digest) {
		t.Error("chunk not in the cache once A's write is over")
	}
	if n := src.total(); n != 1 {
		t.Fatalf("the chunk was fetched %d times, want once", n)
	}
}

// TestCacheWriteQueueIsBounded holds every node cache write, with 4 fetch
// workers, one writer and room for two chunks in the write queue, and
// prefetches ten chunks: fetching stops once the queue is full and every
// worker waits for room (2 chunks queued, 4 more fetched and waiting, none
// beyond), so a slow disk slows fetching instead of growing memory. Once
// the writes go through, all ten are stored.
func TestCacheWriteQueueIsBounded(t *testing.T) {
	c, codec := setup(t)
	held := newHeldStore(c)
	defer held.open()
	const size = 64 << 10
	cs, b := rawChunks(30, 10, size)
	src := &fetchCounter{blobs: b}
	s := startScheduler(t, []Endpoint{{Name: "primary", Store: src}}, held, codec, Options{Workers: 4, Writers: 1, WriteBuffer: 2 * size})
	pending := s.Prefetch(cs)

	deadline := time.Now().Add(hangLimit)
	for {
		if _, waiting := s.w.state(); waiting == 4 {
			break
		}
		if time.Now().After(deadline) {
			q, waiting := s.w.state()
			t.Fatalf("after %s: %d workers waiting for room in the write queue (%d bytes queued, %d fetches), want all 4", hangLimit, waiting, q, src.total())
		}
		time.Sleep(time.Millisecond)
	}
	if q, _ := s.w.state(); q != 2*size {
		t.Errorf("%d bytes in the write queue, want %d", q, 2*size)
	}
	if n := src.total(); n != 6 {
		t.Errorf("%d chunks fetched with the write queue full, want 6 (2 queued, 4 waiting)", n)
	}
	held.open()
	for _, p := range pending {
		ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
		if err := p.Wait(ctx); err != nil {
			t.Fatalf("prefetch of %s: %v", p.Chunk().Digest, err)
		}
		cancel()
		if !c.Has(p.Chunk().Digest) {
			t.Errorf("chunk %s not in the cache", p.Chunk().Digest)
		}
	}
}

// TestCloseWritesQueuedChunks closes a scheduler while one chunk's cache
// write is held and another's is queued behind it: Close returns once
// both are written (the verified chunks are not lost), and a prefetch
// after Close queues nothing.
func TestCloseWritesQueuedChunks(t *testing.T) {
	c, codec := setup(t)
	held := newHeldStore(c)
	defer held.open()
	cs, b := rawChunks(40, 3, 64<<10)
	s := startScheduler(t, []Endpoint{{Name: "primary", Store: b}}, held, codec, Options{Workers: 2, Writers: 1})
	ctx := context.Background()
	ra, rb := get(s, ctx, cs[0]), get(s, ctx, cs[1])
	for _, r := range []<-chan result{ra, rb} {
		if res := wait(t, r, "read"); res.err != nil {
			t.Fatal(res.err)
		}
	}
	wait(t, held.entered, "the first cache write")
	// A read goes on as soon as its chunk is verified, before its write
	// is queued: wait until the second is in the writer too (queued
	// behind the held one, or taken with it in one run).
	queued := func() bool {
		b, _ := s.w.state()
		return b == cs[0].Size+cs[1].Size
	}
	for deadline := time.Now().Add(hangLimit); !queued(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the second chunk's write was never queued")
		}
	}
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	deadline := time.Now().Add(hangLimit)
	for !s.w.isClosed() {
		if time.Now().After(deadline) {
			t.Fatal("Close never closed the writer")
		}
		time.Sleep(time.Millisecond)
	}
	held.open()
	wait(t, closed, "Close")
	for _, ch := range cs[:2] {
		if !c.Has(ch.Digest) {
			t.Errorf("chunk %s, fetched before Close, not in the cache after it", ch.Digest)
		}
	}
	if p := s.Prefetch(cs[2:]); len(p) != 0 {
		t.Errorf("prefetch after Close: %d pending", len(p))
	}
	if c.Has(cs[2].Digest) {
		t.Error("a chunk was stored after Close")
	}
}

// TestFullDiskFailsNoRead puts the node cache on a tmpfs too small for one
// chunk (a real full disk, ENOSPC): a read of a chunk still gets its
// verified bytes, from memory, while its write fails; a prefetch gets the
// write's error (the load is not complete), the failures are counted and
// nothing is in the cache. Once there is room, a read fetches the chunk
// again and it is stored.
func TestFullDiskFailsNoRead(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.SkipOrFatal(t, "mounting a tmpfs needs root")
	}
	mnt := filepath.Join(t.TempDir(), "fs")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=32k,mode=0700"); err != nil {
		testenv.SkipOrFatal(t, "mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	c, codec := setupIn(t, mnt)
	cs, b := rawChunks(50, 2, 64<<10)
	src := &fetchCounter{blobs: b}
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	s := startScheduler(t, []Endpoint{{Name: "primary", Store: src}}, c, codec, Options{Writers: 1, Metrics: m})
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	a, bc := cs[0], cs[1]

	if res := wait(t, get(s, ctx, a), "read with the disk full"); res.err != nil || !bytes.Equal(res.data, b[a.Digest]) {
		t.Fatalf("read with the disk full: %d bytes, %v", len(res.data), res.err)
	}
	p := s.Prefetch([]format.Chunk{bc})
	if len(p) != 1 {
		t.Fatalf("%d pending prefetches, want 1", len(p))
	}
	if err := p[0].Wait(ctx); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("prefetch with the disk full: %v; want ENOSPC", err)
	}
	t.Log(p[0].Wait(ctx))
	if c.Has(a.Digest) || c.Has(bc.Digest) {
		t.Fatal("a chunk is in the cache although its write failed")
	}
	// One writer: A's write failed before B's.
	if n := counter(t, reg, "cryo_puller_cache_write_failures_total"); n != 2 {
		t.Errorf("%v write failures counted, want 2", n)
	}

	if err := unix.Mount("tmpfs", mnt, "tmpfs", unix.MS_REMOUNT, "size=1m"); err != nil {
		t.Fatal(err)
	}
	if res := wait(t, get(s, ctx, a), "read once there is room"); res.err != nil || !bytes.Equal(res.data, b[a.Digest]) {
		t.Fatalf("read once there is room: %d bytes, %v", len(res.data), res.err)
	}
	for _, p := range s.Prefetch([]format.Chunk{a}) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if !c.Has(a.Digest) {
		t.Fatal("chunk not stored once there is room")
	}
	if n := src.count(a.Digest); n != 2 {
		t.Errorf("chunk fetched %d times, want 2 (once more after its write failed)", n)
	}
}

// counter returns the value of the counter named name in reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name && len(mf.GetMetric()) == 1 {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("no counter %s", name)
	return 0
}

// TestLargeChunkIsNotStarved fills a writer (room for 4 KiB, writes held)
// with 3 KiB of small chunks, then submits a 3 KiB chunk, which must wait,
// and after it a 1 KiB chunk, which would fit: the small one waits its
// turn behind the large one instead of taking the room the large one waits
// for (a stream of small chunks would otherwise starve it forever). Once
// the writes go through, the large chunk is written before the small one.
func TestLargeChunkIsNotStarved(t *testing.T) {
	release := make(chan struct{})
	var mu sync.Mutex
	var order []digest.Digest
	put := func(ds []digest.Digest, _ [][]byte) []error {
		<-release
		mu.Lock()
		order = append(order, ds...)
		mu.Unlock()
		return make([]error, len(ds))
	}
	w := newWriter(put, 1, 4<<10, nil)
	defer w.close()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	noop := func(error) {}
	for i := range 3 {
		if err := w.submit(digest.FromBytes([]byte{byte(i)}), make([]byte, 1<<10), noop); err != nil {
			t.Fatal(err)
		}
	}
	large, small := digest.FromString("large"), digest.FromString("small")
	submitted := make(chan error, 2)
	go func() { submitted <- w.submit(large, make([]byte, 3<<10), noop) }()
	waitFor(t, func() bool { _, n := w.state(); return n == 1 }, "the large chunk waiting for room")
	go func() { submitted <- w.submit(small, make([]byte, 1<<10), noop) }()
	waitFor(t, func() bool { b, n := w.state(); return n == 2 || b != 3<<10 }, "the small chunk waiting or let in")
	if b, n := w.state(); b != 3<<10 || n != 2 {
		t.Fatalf("%d bytes queued, %d submits waiting; want 3 KiB and both waiting (the small chunk took the large one's room)", b, n)
	}
	close(release)
	for range 2 {
		if err := <-submitted; err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 5 }, "all five writes")
	if order[3] != large || order[4] != small {
		t.Errorf("writes 4 and 5 are %s, %s; want the large chunk, then the small one", order[3], order[4])
	}
}

// waitFor polls cond until it holds, failing the test after hangLimit.
func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: still waiting after %s", what, hangLimit)
		}
		time.Sleep(time.Millisecond)
	}
}
