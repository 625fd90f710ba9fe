package fetch

import (
	"bytes"
	"context"
	"io"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestPriorityOrder: with the one worker busy, a fault starts at once on a
// worker of its own; the queued work runs a read first (no read is in
// flight: the sandbox's loader issues a fault's reads only as one of its
// reads completes), then a profile's chunks, in its order, then
// prefetches.
func TestPriorityOrder(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(1, 7, 4096)
	g := newGate(b)
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: g}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	s.SandboxFaulted()
	first := s.Prefetch(cs[:1])
	wait(t, g.entered, "the first fetch")
	pre := s.Prefetch(cs[1:2])
	read := make(chan result, 1)
	go func() { data, err := s.Get(ctx, cs[2], nil, Read); read <- result{data, err} }()
	prof := s.FetchProfile(cs[3:5])
	fault := get(s, ctx, cs[5])
	// Let the read reach the queue and the fault start.
	deadline := time.Now().Add(hangLimit)
	for {
		s.mu.Lock()
		queued, faulting := len(s.queues[Read]), s.active[Fault]
		s.mu.Unlock()
		if queued == 1 && faulting == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("read never queued, or the fault never started")
		}
		time.Sleep(time.Millisecond)
	}
	g.open()
	for _, p := range append(append(first, pre...), prof...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if r := wait(t, read, "read"); r.err != nil {
		t.Fatal(r.err)
	}
	if r := wait(t, fault, "fault"); r.err != nil {
		t.Fatal(r.err)
	}
	var got []int64
	var prios []Priority
	for _, e := range s.Log()[1:] {
		got = append(got, e.Offset/4096)
		prios = append(prios, e.Priority)
	}
	want := []int64{5, 2, 3, 4, 1}
	if len(got) != len(want) {
		t.Fatalf("fetched chunks %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("fetched chunks %v (priorities %v), want %v: fault, read, profile in order, prefetch", got, prios, want)
		}
	}
}

// TestOneReadBesideTheProfile: once the sandbox runs, a profile's chunks
// go ahead of its loader's reads, but never all of them: a worker that
// frees up while no read is in flight takes a read, the next one
// (a read now in flight) the profile's first chunk. (gVisor's loader
// keeps its reads in a fixed number of slots and issues a page fault's
// reads only as one completes: reads that all wait behind a profile hold
// the sandbox's next fault back.)
func TestOneReadBesideTheProfile(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(3, 6, 4096)
	h := holdBlobs(b, cs)
	s := startScheduler(t, []Endpoint{{Name: "held", Store: h}}, c, codec, Options{Workers: 2})
	ctx := context.Background()
	s.SandboxFaulted()
	busy := s.Prefetch(cs[:2])
	eventually(t, "both workers to take a prefetch", activeIs(s, Prefetch, 2))
	reads := make(chan result, 2)
	for _, ch := range cs[2:4] {
		go func() { data, err := s.Get(ctx, ch, nil, Read); reads <- result{data, err} }()
	}
	eventually(t, "the reads to queue", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.queues[Read]) == 2
	})
	prof := s.FetchProfile(cs[4:6])
	close(h.released[cs[0].Digest])
	eventually(t, "the freed worker to take a read", activeIs(s, Read, 1))
	close(h.released[cs[1].Digest])
	eventually(t, "the other worker to take a profile chunk", activeIs(s, Profile, 1))
	log := s.Log()[2:4]
	if log[0].Priority != Read || log[1].Offset != cs[4].Offset || log[1].Priority != Profile {
		t.Errorf("the two fetches after the prefetches: %+v, want a read, then the profile's first chunk", log)
	}
	for _, ch := range cs[2:] {
		close(h.released[ch.Digest])
	}
	for _, p := range append(busy, prof...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if r := wait(t, reads, "read"); r.err != nil {
			t.Fatal(r.err)
		}
	}
}

// heldBlobs holds each blob's fetch until its channel in released is
// closed.
type heldBlobs struct {
	blobs
	released map[digest.Digest]chan struct{}
}

// holdBlobs holds the fetch of each of cs's blobs in b.
func holdBlobs(b blobs, cs []format.Chunk) *heldBlobs {
	h := &heldBlobs{blobs: b, released: map[digest.Digest]chan struct{}{}}
	for _, ch := range cs {
		h.released[ch.Digest] = make(chan struct{})
	}
	return h
}

func (h *heldBlobs) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	select {
	case <-h.released[desc.Digest]:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return h.blobs.Fetch(ctx, desc)
}

// TestProfileBesideReadsBeforeTheSandboxRuns: until the sandbox runs,
// runsc restore waits on its loader's reads (and on page faults whose
// reads the loader issues only as those complete): while a read is in
// flight, a profile's chunks keep to the link's background limit (one,
// with nothing measured yet), not every idle worker.
func TestProfileBesideReadsBeforeTheSandboxRuns(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(4, 5, 4096)
	g := newGate(b)
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: g}}, c, codec, Options{Workers: 4})
	ctx := context.Background()
	reads := make(chan result, 2)
	for _, ch := range cs[:2] {
		go func() { data, err := s.Get(ctx, ch, nil, Read); reads <- result{data, err} }()
	}
	eventually(t, "both reads to start", activeIs(s, Read, 2))
	prof := s.FetchProfile(cs[2:5])
	eventually(t, "a worker to take a profile chunk", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.active[Profile] > 0
	})
	// Give the two idle workers every chance to take more of the profile
	// than allowed.
	time.Sleep(200 * time.Millisecond)
	s.mu.Lock()
	active := s.active[Profile]
	s.mu.Unlock()
	if active != 1 {
		t.Errorf("%d profile chunks in flight beside the reads before the sandbox runs, want 1", active)
	}
	g.open()
	for _, p := range prof {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 {
		if r := wait(t, reads, "read"); r.err != nil {
			t.Fatal(r.err)
		}
	}
}

// TestReadsBesideAProfile: while a profile's chunk is being
// fetched, reads keep one in flight before the sandbox runs (no fault
// yet: gVisor needs its loader's reads to complete, not to be many) and,
// once it faults, at most the link's background limit (one, with nothing
// measured yet); once it is in, they all go. Without a profile, before
// the sandbox runs, every worker takes a read.
func TestReadsBesideAProfile(t *testing.T) {
	for _, c := range []struct {
		name             string
		running, profile bool
		want             int
	}{
		{"before the sandbox runs", false, true, 1},
		{"once it runs", true, true, 1},
		{"before it runs, no profile", false, false, 4},
	} {
		cache, codec := setup(t)
		cs, b := rawChunks(2, 6, 4096)
		g := newGate(b)
		s := startScheduler(t, []Endpoint{{Name: "gated", Store: g}}, cache, codec, Options{Workers: 4})
		ctx := context.Background()
		var fault <-chan result
		if c.running {
			fault = get(s, ctx, cs[5])
			s.SandboxFaulted()
		}
		var prof []*Pending
		if c.profile {
			prof = s.FetchProfile(cs[:1])
			wait(t, g.entered, "the first fetch")
		}
		reads := make(chan result, 4)
		for _, ch := range cs[1:5] {
			go func() { data, err := s.Get(ctx, ch, nil, Read); reads <- result{data, err} }()
		}
		// Give the idle workers every chance to take more reads than
		// allowed.
		time.Sleep(200 * time.Millisecond)
		s.mu.Lock()
		active := s.active[Read]
		s.mu.Unlock()
		if active != c.want {
			t.Errorf("%s: %d reads in flight, want %d", c.name, active, c.want)
		}
		g.open()
		for _, p := range prof {
			if err := p.Wait(ctx); err != nil {
				t.Fatal(err)
			}
		}
		for range cs[1:5] {
			if r := wait(t, reads, "read"); r.err != nil {
				t.Fatal(r.err)
			}
		}
		if fault != nil {
			if r := wait(t, fault, "fault"); r.err != nil {
				t.Fatal(r.err)
			}
		}
	}
}

// TestLinkBackgroundLimit: the limit is half the measured bandwidth-delay
// product in fetches, at least one, at most the workers.
func TestLinkBackgroundLimit(t *testing.T) {
	var l link
	if n := l.backgroundLimit(12); n != 1 {
		t.Errorf("unmeasured: %d, want 1", n)
	}
	// 1 MiB fetches taking 50 ms each, 40 of them per 250 ms window:
	// 160 MiB/s over a 50 ms round trip is 8 MiB in flight, 4 fetches
	// for half of it.
	now := time.Unix(0, 0)
	for range 400 {
		now = now.Add(250 * time.Millisecond / 40)
		l.done(1<<20, 50*time.Millisecond, now)
	}
	if n := l.backgroundLimit(12); n != 4 {
		t.Errorf("160 MiB/s, 50 ms: limit %d (rate %.0f MiB/s, min %v), want 4", n, l.rate/(1<<20), l.minTook)
	}
	if n := l.backgroundLimit(2); n != 2 {
		t.Errorf("capped at the workers: %d, want 2", n)
	}
	// Runs that never crossed the link (a chunk another mount had just
	// fetched) do not make it look like one without a round trip.
	for range 100 {
		now = now.Add(time.Millisecond)
		l.done(1<<20, 20*time.Microsecond, now)
	}
	if n := l.backgroundLimit(12); n != 4 {
		t.Errorf("after runs that did not fetch: limit %d, want 4 still", n)
	}
}

// TestLinkPeak: the peak is the highest smoothed rate measured, and a
// spell of slower fetches (a held sweep's) does not lower it.
func TestLinkPeak(t *testing.T) {
	var l link
	if l.peak != 0 {
		t.Fatalf("unmeasured: peak %.0f, want 0", l.peak)
	}
	now := time.Unix(0, 0)
	// 40 fetches of 1 MiB per 250 ms window: 160 MiB/s.
	for range 400 {
		now = now.Add(250 * time.Millisecond / 40)
		l.done(1<<20, 50*time.Millisecond, now)
	}
	fast := l.rate
	if fast < 150<<20 || l.peak != fast {
		t.Fatalf("at 160 MiB/s: rate %.0f, peak %.0f MiB/s", fast/(1<<20), l.peak/(1<<20))
	}
	// Then 1 MiB per 250 ms: 4 MiB/s.
	for range 100 {
		now = now.Add(250 * time.Millisecond)
		l.done(1<<20, 50*time.Millisecond, now)
	}
	if l.rate > 8<<20 || l.peak != fast {
		t.Errorf("after a slow spell: rate %.0f MiB/s (want about 4), peak %.0f MiB/s (want %.0f)", l.rate/(1<<20), l.peak/(1<<20), fast/(1<<20))
	}
}

// stuckExcept blocks every fetch but those of free, until its test ends,
// and counts the fetches blocked.
type stuckExcept struct {
	blobs
	free    digest.Digest
	stuck   chan struct{}
	release chan struct{}
}

func (s *stuckExcept) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	if desc.Digest != s.free {
		s.stuck <- struct{}{}
		select {
		case <-s.release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return s.blobs.Fetch(ctx, desc)
}

// TestFaultWithEveryWorkerStuck: while every worker waits on a fetch that
// does not end (a stalled link or peer), a page fault is still fetched,
// on a worker of its own, rather than waiting for one of them.
func TestFaultWithEveryWorkerStuck(t *testing.T) {
	c, codec := setup(t)
	chunks, b := rawChunks(40, 5, 4096)
	fault := chunks[4]
	st := &stuckExcept{blobs: b, free: fault.Digest, stuck: make(chan struct{}, 8), release: make(chan struct{})}
	defer close(st.release)
	s := startScheduler(t, []Endpoint{{Name: "stuck", Store: st}}, c, codec, Options{Workers: 2})
	s.Prefetch(chunks[:4])
	<-st.stuck
	<-st.stuck // both workers are stuck
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	data, err := s.Get(ctx, fault, nil, Fault)
	if err != nil {
		t.Fatalf("a page fault waited for a worker stuck on another fetch: %v", err)
	}
	if !bytes.Equal(data, b[fault.Digest]) {
		t.Fatal("wrong bytes")
	}
}

// TestRunsWhenTold: with Options.RunsWhenTold a page fault makes the
// background yield but does not make the sandbox run (runsc restore's own
// faults, loading the kernel, come before it returns): reads stay ahead of
// a profile's chunks until SandboxStarted.
func TestRunsWhenTold(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(5, 2, 4096)
	s := startScheduler(t, []Endpoint{{Name: "blobs", Store: b}}, c, codec, Options{Workers: 1, RunsWhenTold: true})
	s.SandboxFaulted()
	s.mu.Lock()
	running, faulted := s.running, !s.faultEnded.IsZero()
	order := s.order()
	s.mu.Unlock()
	if running || !faulted || order[1] != Read {
		t.Errorf("after a fault: running %v, fault noted %v, order %v; want not running, noted, reads second", running, faulted, order)
	}
	s.SandboxStarted()
	s.mu.Lock()
	running, order = s.running, s.order()
	s.mu.Unlock()
	if !running || order[1] != Profile {
		t.Errorf("after SandboxStarted: running %v, order %v; want running, profile second", running, order)
	}
	for _, p := range s.FetchProfile(cs) {
		if err := p.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOneReadRuleLetsTheProfileGo: with the sandbox running, no read in
// flight and none queued, a worker freed while a prefetch is in flight
// takes the profile's next chunk: the read the rule puts first is not
// there, and the background's limit (the prefetch) does not hold back a
// profile chunk, which is not background once the sandbox runs.
func TestOneReadRuleLetsTheProfileGo(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(6, 4, 4096)
	h := holdBlobs(b, cs)
	s := startScheduler(t, []Endpoint{{Name: "held", Store: h}}, c, codec, Options{Workers: 3})
	ctx := context.Background()
	s.SandboxFaulted()
	pre := s.Prefetch(cs[:1])
	eventually(t, "a worker to take the prefetch", activeIs(s, Prefetch, 1))
	prof := s.FetchProfile(cs[1:])
	eventually(t, "two workers to take profile chunks", activeIs(s, Profile, 2))
	close(h.released[cs[2].Digest])
	eventually(t, "the freed worker to take the profile's last chunk", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.active[Profile] == 2 && len(s.log) == 4
	})
	for _, ch := range []int{0, 1, 3} {
		close(h.released[cs[ch].Digest])
	}
	for _, p := range append(pre, prof...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestProfileEarlyBound: before the sandbox's loader reads anything fetched (runsc
// still starting its sandbox on the same cores), at most earlyProfile
// profile chunks are in flight, not every idle worker.
func TestProfileEarlyBound(t *testing.T) {
	c, codec := setup(t)
	cs, b := rawChunks(7, 5, 4096)
	g := newGate(b)
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: g}}, c, codec, Options{Workers: 4})
	ctx := context.Background()
	prof := s.FetchProfile(cs)
	eventually(t, "profile chunks in flight", activeIs(s, Profile, earlyProfile))
	// Give the idle workers every chance to take more than allowed.
	time.Sleep(200 * time.Millisecond)
	s.mu.Lock()
	active := s.active[Profile]
	s.mu.Unlock()
	if active != earlyProfile {
		t.Errorf("%d profile chunks in flight before any read, want %d", active, earlyProfile)
	}
	g.open()
	for _, p := range prof {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// activeIs reports, for eventually, whether s has n fetches of priority p
// in flight.
func activeIs(s *Scheduler, p Priority, n int) func() bool {
	return func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.active[p] == n
	}
}

// TestLinkRoundTrip: the round trip is the shortest request recorded.
func TestLinkRoundTrip(t *testing.T) {
	var l link
	if l.shortest != 0 {
		t.Fatalf("unmeasured: %v, want 0", l.shortest)
	}
	l.sawRequest(80 * time.Millisecond)
	l.sawRequest(27 * time.Millisecond)
	l.sawRequest(40 * time.Millisecond)
	if l.shortest != 27*time.Millisecond {
		t.Errorf("round trip %v, want 27ms (the shortest request)", l.shortest)
	}
}
