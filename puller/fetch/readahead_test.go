package fetch

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// rangeLog is a gated pack store that records the byte ranges asked of it.
type rangeLog struct {
	*gate
	mu     sync.Mutex
	ranges [][2]int64 // offset, length
}

func (r *rangeLog) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	r.mu.Lock()
	r.ranges = append(r.ranges, [2]int64{off, n})
	r.mu.Unlock()
	rc, err := r.gate.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	data, _ := io.ReadAll(rc)
	return io.NopCloser(bytes.NewReader(data[off : off+n])), nil
}

// eventually polls cond until it holds, failing the test after hangLimit.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(hangLimit); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not after %s", what, hangLimit)
		}
	}
}

// packedChunks returns n raw chunks of size bytes, the frames of one
// pack, in order, and the pack.
func packedChunks(seed uint64, n, size int) ([]format.Chunk, blobs) {
	var pack []byte
	var cs []format.Chunk
	for i := range n {
		data := randBytes(seed+uint64(i), size)
		cs = append(cs, format.Chunk{Offset: int64(i * size), Size: int64(size), Encoding: format.EncodingRaw, Digest: digest.FromBytes(data),
			PackOffset: int64(len(pack)), BlobSize: int64(size)})
		pack = append(pack, data...)
	}
	d := digest.FromBytes(pack)
	for i := range cs {
		cs[i].Blob, cs[i].PackSize = d, int64(len(pack))
	}
	return cs, blobs{d: pack}
}

// TestReadReadsAhead: a read (priority Read) of one frame of a pack whose
// following frames are queued as prefetches fetches them with it, in one
// range request of ReadAhead bytes: gVisor's loader reads 128 KiB at a
// time, and one request per read would cost the registry many times the
// requests.
func TestReadReadsAhead(t *testing.T) {
	readRange, ranges := readAheadOf(t, false, false)
	if readRange[1] != ReadAhead {
		t.Errorf("the read's range request: %d bytes at %d, want %d (ranges asked: %v)", readRange[1], readRange[0], ReadAhead, ranges)
	}
	if len(ranges) != 4 {
		t.Errorf("%d range requests, want 4 (the first frame, the read and its read-ahead, the prefetches before and after it): %v", len(ranges), ranges)
	}
}

// TestReadReadsAheadLessWhileAProfileLoads: while profile chunks are
// left, a read's range request stops at FaultCoalesce: on a link the
// profile fills, the loader's reads take bytes from it, and gVisor needs
// them to complete (it issues a fault's reads only as one does), not to be
// long.
func TestReadReadsAheadLessWhileAProfileLoads(t *testing.T) {
	readRange, ranges := readAheadOf(t, true, false)
	if readRange[1] != FaultCoalesce {
		t.Errorf("the read's range request with a profile chunk queued: %d bytes at %d, want %d (ranges asked: %v)", readRange[1], readRange[0], FaultCoalesce, ranges)
	}
}

// readAheadOf reads the 11th of 160 frames of a pack, the frames after the
// first queued as prefetches, with one worker held on the pack's first
// frame or, withProfile, on the first of two profile chunks (the second
// queued, and with promoted a page fault's before the read). It returns
// the read's range request and every range asked.
func readAheadOf(t *testing.T, withProfile, promoted bool) (readRange [2]int64, ranges [][2]int64) {
	t.Helper()
	c, codec := setup(t)
	const size = 32 << 10
	cs, b := packedChunks(1, 160, size) // 5 MiB: more than ReadAhead past the read
	pcs, pb := rawChunks(500, 2, 4096)
	store := &rangeLog{gate: newGate(merged(b, pb))}
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: store}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	var first []*Pending
	if withProfile {
		first = s.FetchProfile(pcs)
	} else {
		first = s.Prefetch(cs[:1])
	}
	wait(t, store.entered, "the first fetch")
	var fault <-chan result
	if promoted {
		fault = get(s, ctx, pcs[1])
		eventually(t, "the profile chunk promoted to a fault", func() bool {
			s.mu.Lock()
			defer s.mu.Unlock()
			cl := s.calls[keyOf(pcs[1])]
			return cl != nil && cl.prio == Fault
		})
	}
	rest := s.Prefetch(cs[1:])
	read := make(chan result, 1)
	go func() { data, err := s.Get(ctx, cs[10], nil, Read); read <- result{data, err} }()
	eventually(t, "the read queued", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.queues[Read]) == 1
	})
	store.open()
	if fault != nil {
		if r := wait(t, fault, "fault"); r.err != nil {
			t.Fatal(r.err)
		}
	}
	if r := wait(t, read, "read"); r.err != nil || !bytes.Equal(r.data, b[cs[0].Blob][cs[10].PackOffset:cs[10].PackOffset+size]) {
		t.Fatalf("read: %v", r.err)
	}
	for _, p := range append(first, rest...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	for _, r := range store.ranges {
		if r[0] == cs[10].PackOffset {
			readRange = r
		}
	}
	return readRange, slices.Clone(store.ranges)
}

// TestProfileLeftIgnoresStaleCalls: a profile chunk a page fault took
// over leaves a stale entry in the profile queue; once every profile
// chunk is in, a read reads ahead in full again (ReadAhead), whatever
// the queue still holds.
func TestProfileLeftIgnoresStaleCalls(t *testing.T) {
	readRange, ranges := readAheadOf(t, true, true)
	if readRange[1] != ReadAhead {
		t.Errorf("the read's range request after the profile was in: %d bytes, want %d (ranges asked: %v)", readRange[1], ReadAhead, ranges)
	}
}

// TestFaultBringsItsNeighbours: a page fault told its neighbourhood
// (WantNear) is fetched first, in one range request with the frames that
// follow it in the pack, and the frames before it come next, in another:
// two requests for the 1 MiB around the fault instead of one per chunk,
// and nothing outside it.
func TestFaultBringsItsNeighbours(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	cs, b := packedChunks(2, 40, size) // 1.25 MiB: the neighbourhood is the first 1 MiB
	store := &rangeLog{gate: newGate(b)}
	store.open()
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: store}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	near := cs[:32]
	s.WantNear(cs[10:11], near)
	data, err := s.Get(ctx, cs[10], nil, Fault)
	if err != nil || !bytes.Equal(data, b[cs[0].Blob][cs[10].PackOffset:cs[10].PackOffset+size]) {
		t.Fatalf("fault: %v", err)
	}
	eventually(t, "the neighbours in the node cache", func() bool {
		all := true
		for _, x := range near {
			all = all && c.Has(x.Digest)
		}
		return all
	})
	store.mu.Lock()
	defer store.mu.Unlock()
	want := [][2]int64{{cs[10].PackOffset, 22 * size}, {0, 10 * size}}
	if len(store.ranges) != len(want) || store.ranges[0] != want[0] || store.ranges[1] != want[1] {
		t.Errorf("range requests %v, want %v (the fault and the frames after it, then the frames before it)", store.ranges, want)
	}
	for _, x := range cs[32:] {
		if c.Has(x.Digest) {
			t.Errorf("chunk at %d, outside the neighbourhood, was fetched", x.Offset)
		}
	}
}

// packGate serves ranges of blobs, those of one pack only once opened.
type packGate struct {
	blobs
	pack    digest.Digest
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func (g *packGate) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	if desc.Digest == g.pack {
		g.once.Do(func() { close(g.entered) })
		select {
		case <-g.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	data, ok := g.blobs[desc.Digest]
	if !ok || off+n > int64(len(data)) {
		return nil, fmt.Errorf("no range [%d,+%d) of %s", off, n, desc.Digest)
	}
	return io.NopCloser(bytes.NewReader(data[off : off+n])), nil
}

// TestBackgroundYieldsToFaults: while a page fault is being fetched, a
// background frame (a read of the loader) is verified only with a token
// of Options.BackgroundCPU, and the fault's own frame never waits for
// one: with the only token held, the read waits and the fault is served;
// the read is served once the token is back.
func TestBackgroundYieldsToFaults(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	faulted, fb := packedChunks(3, 2, size)
	read, rb := packedChunks(4, 2, size)
	all := blobs{}
	for d, p := range fb {
		all[d] = p
	}
	for d, p := range rb {
		all[d] = p
	}
	store := &packGate{blobs: all, pack: faulted[0].Blob, entered: make(chan struct{}), release: make(chan struct{})}
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: store}}, c, codec, Options{Workers: 2, BackgroundCPU: 1})
	yielded := make(chan struct{}, 4)
	s.yielding = func() { yielded <- struct{}{} }
	s.backgroundCPU <- struct{}{} // the only token, held
	ctx := context.Background()
	faultDone := make(chan result, 1)
	go func() {
		s.WantNear(faulted, nil)
		d, err := s.Get(ctx, faulted[0], nil, Fault)
		faultDone <- result{d, err}
	}()
	wait(t, store.entered, "the fault's fetch") // a fault is being fetched
	// A read of two frames: one range request, as the loader's reads are.
	readDone := make(chan result, 1)
	go func() { s.Want(read, Read); d, err := s.Get(ctx, read[0], nil, Read); readDone <- result{d, err} }()
	wait(t, yielded, "the read's frame waiting for the token")
	select {
	case r := <-readDone:
		t.Fatalf("the read was served (err %v) without the token", r.err)
	default:
	}
	close(store.release)
	if r := wait(t, faultDone, "the fault, with the token held"); r.err != nil || !bytes.Equal(r.data, fb[faulted[0].Blob][:size]) {
		t.Fatalf("fault: %v", r.err)
	}
	<-s.backgroundCPU
	if r := wait(t, readDone, "the read"); r.err != nil || !bytes.Equal(r.data, rb[read[0].Blob][:size]) {
		t.Fatalf("read: %v", r.err)
	}
}

// TestFaultReadInOneRequest: a page fault's read of several chunks
// (WantNear with no neighbourhood, or a neighbourhood the read runs past)
// is fetched in file order, in one range request per FaultCoalesce bytes,
// not one request per chunk nor last chunk first.
func TestFaultReadInOneRequest(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	cs, b := packedChunks(5, 48, size) // 1.5 MiB
	store := &rangeLog{gate: newGate(b)}
	store.open()
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: store}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	read := cs[4:44] // 1.25 MiB: past the 1 MiB neighbourhood cs[:32]
	s.WantNear(read, cs[:32])
	for _, x := range read {
		data, err := s.Get(ctx, x, nil, Fault)
		if err != nil || !bytes.Equal(data, b[x.Blob][x.PackOffset:x.PackOffset+size]) {
			t.Fatalf("chunk at %d: %v", x.Offset, err)
		}
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	perRequest := int64(FaultCoalesce / size)
	if len(store.ranges) < 2 || store.ranges[0] != [2]int64{cs[4].PackOffset, perRequest * size} ||
		store.ranges[1] != [2]int64{cs[4+perRequest].PackOffset, (44 - 4 - perRequest) * size} {
		t.Errorf("range requests %v: want the read's first %d chunks from %d, then the rest of it", store.ranges, perRequest, cs[4].PackOffset)
	}
}

// TestLoneFaultMovesItsChunk: a page fault without a neighbourhood takes
// along none of the frames queued behind it in its pack for the
// background load: a random 4 KiB read moves its own chunk.
func TestLoneFaultMovesItsChunk(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	cs, b := packedChunks(6, 20, size)
	store := &rangeLog{gate: newGate(b)}
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: store}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	first := s.Prefetch(cs[:1])
	wait(t, store.entered, "the first fetch")
	rest := s.Prefetch(cs[1:])
	fault := make(chan result, 1)
	go func() { s.WantNear(cs[10:11], nil); d, err := s.Get(ctx, cs[10], nil, Fault); fault <- result{d, err} }()
	eventually(t, "the fault taken", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.active[Fault] > 0
	})
	store.open()
	if r := wait(t, fault, "fault"); r.err != nil {
		t.Fatal(r.err)
	}
	for _, p := range append(first, rest...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	for _, r := range store.ranges {
		if r[0] == cs[10].PackOffset && r[1] != size {
			t.Errorf("the fault's range request: %d bytes, want its own frame's %d (ranges asked: %v)", r[1], size, store.ranges)
		}
	}
}

// TestBackgroundYieldsAfterAFault: the background goes on yielding the
// CPU for FaultQuiet after a page fault's fetch ended (the application
// works between its faults), and not after that; whether the later read
// is fetched alone (one chunk of a pack: no range coalesced) or with
// others of its pack.
func TestBackgroundYieldsAfterAFault(t *testing.T) {
	for _, later := range []int{1, 2} {
		t.Run(fmt.Sprintf("%d chunks read", later), func(t *testing.T) { backgroundYieldsAfterAFault(t, later) })
	}
}

func backgroundYieldsAfterAFault(t *testing.T, later int) {
	c, codec := setup(t)
	const size = 32 << 10
	// Seeds 10 apart: packedChunks' chunk i of seed n is chunk 0 of seed
	// n+i, and a chunk the node has is not fetched (nor yields).
	faulted, fb := packedChunks(10, 1, size)
	read, rb := packedChunks(20, later, size)
	late, lb := packedChunks(30, later, size)
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: &packGate{blobs: merged(fb, rb, lb)}}}, c, codec, Options{Workers: 2, BackgroundCPU: 1})
	clock, yields := fakeClock(s)
	ctx := context.Background()
	if _, err := s.Get(ctx, faulted[0], nil, Fault); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, s)
	clock.Store(int64(FaultQuiet / 2))
	s.Want(read, Read)
	if _, err := s.Get(ctx, read[0], nil, Read); err != nil {
		t.Fatal(err)
	}
	if yields.Load() == 0 {
		t.Errorf("a read %v after a fault did not yield", FaultQuiet/2)
	}
	waitIdle(t, s) // the read's other chunks have yielded too, or not
	clock.Store(int64(2 * FaultQuiet))
	before := yields.Load()
	s.Want(late, Read)
	if _, err := s.Get(ctx, late[0], nil, Read); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, s)
	if n := yields.Load() - before; n != 0 {
		t.Errorf("a read %v after a fault yielded %d times", 2*FaultQuiet, n)
	}
}

// TestBackgroundYieldsAfterAFaultInPlace: a page fault whose bytes were
// in place, never fetched (SandboxFaulted alone), makes the background
// yield the CPU for FaultQuiet, as a fetched one does: the sandbox copies
// them on the same cores.
func TestBackgroundYieldsAfterAFaultInPlace(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	read, rb := packedChunks(40, 1, size)
	late, lb := packedChunks(50, 1, size)
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: &packGate{blobs: merged(rb, lb)}}}, c, codec, Options{Workers: 2, BackgroundCPU: 1})
	clock, yields := fakeClock(s)
	ctx := context.Background()
	s.SandboxFaulted()
	clock.Store(int64(FaultQuiet / 2))
	if _, err := s.Get(ctx, read[0], nil, Read); err != nil {
		t.Fatal(err)
	}
	if yields.Load() == 0 {
		t.Errorf("a read %v after a fault found in place did not yield", FaultQuiet/2)
	}
	waitIdle(t, s)
	clock.Store(int64(2 * FaultQuiet))
	before := yields.Load()
	if _, err := s.Get(ctx, late[0], nil, Read); err != nil {
		t.Fatal(err)
	}
	if n := yields.Load() - before; n != 0 {
		t.Errorf("a read %v after a fault found in place yielded %d times", 2*FaultQuiet, n)
	}
}

// TestBackgroundYieldsAfterAFaultThatJoinedARead: a page fault on a chunk
// the background had already started fetching, alone or coalesced into
// the range of another (a member of its batch), waits on that fetch; once
// the fault has its bytes, the background yields for FaultQuiet as after
// any fault, before the fetch's write into the node cache is done.
func TestBackgroundYieldsAfterAFaultThatJoinedARead(t *testing.T) {
	for _, tc := range []struct {
		name          string
		chunks, fault int
	}{{"the fetch's chunk", 1, 0}, {"a chunk of its batch", 3, 2}} {
		t.Run(tc.name, func(t *testing.T) { backgroundYieldsAfterJoinedFault(t, tc.chunks, tc.fault) })
	}
}

func backgroundYieldsAfterJoinedFault(t *testing.T, chunks, fault int) {
	c, codec := setup(t)
	const size = 32 << 10
	joined, jb := packedChunks(10, chunks, size)
	late, lb := packedChunks(20, 1, size) // not one of joined's (seeds 10 apart)
	gate := &packGate{blobs: merged(jb, lb), pack: joined[0].Blob, entered: make(chan struct{}), release: make(chan struct{})}
	s := startScheduler(t, []Endpoint{{Name: "ranges", Store: gate}}, c, codec, Options{Workers: 2, BackgroundCPU: 1})
	clock, yields := fakeClock(s)
	ctx := context.Background()
	s.Want(joined, Read)
	<-gate.entered // the background's fetch has started
	got := make(chan error, 1)
	go func() { _, err := s.Get(ctx, joined[fault], nil, Fault); got <- err }()
	eventually(t, "the fault to join the started fetch", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		cl := s.calls[keyOf(joined[fault])]
		return cl != nil && cl.want == Fault && cl.started
	})
	close(gate.release)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	// The fault's reader goes on as soon as its bytes are verified; the
	// application's work starts then, not when the write is queued.
	if !s.yields(&call{want: Read}) {
		t.Errorf("right after the fault was served, the background does not yield")
	}
	clock.Store(int64(FaultQuiet / 2))
	s.Want(late, Read)
	if _, err := s.Get(ctx, late[0], nil, Read); err != nil {
		t.Fatal(err)
	}
	if yields.Load() == 0 {
		t.Errorf("a read %v after a fault that joined a started fetch did not yield", FaultQuiet/2)
	}
}

// fakeClock gives s a clock that stands still at its start until the test
// moves it (nanoseconds past the start), and counts the background's
// yields to page faults.
func fakeClock(s *Scheduler) (clock, yields *atomic.Int64) {
	clock, yields = new(atomic.Int64), new(atomic.Int64)
	t0 := time.Now()
	s.now = func() time.Time { return t0.Add(time.Duration(clock.Load())) }
	s.yielding = func() { yields.Add(1) }
	return clock, yields
}

// waitIdle waits until s has no call queued or running.
func waitIdle(t *testing.T, s *Scheduler) {
	t.Helper()
	eventually(t, "the scheduler to be idle", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		for p := range numPriorities {
			if s.active[p] > 0 || len(s.queues[p]) > 0 {
				return false
			}
		}
		return true
	})
}

// merged returns one set of the blobs of all of ms.
func merged(ms ...blobs) blobs {
	all := blobs{}
	for _, m := range ms {
		for d, p := range m {
			all[d] = p
		}
	}
	return all
}
