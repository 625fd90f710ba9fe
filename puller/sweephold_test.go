package puller

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/fetch"
)

// TestRecordingHoldsTheSweep: a mount that records for a profile
// (Options.RecordSweepRate) holds the loader's sweep of pages.img, through
// ReadAt and answered in place alike, and never a page fault or another
// file's read; once RecordHoldFor has passed, or for a mount that does not
// record, nothing is held. FilesOptions.RecordSweepRate holds one mount's
// sweep, and its Progress says so; a materialized mount holds nothing. A
// hold at 1 byte a second is measured by the budget its reads take (its
// limiter's tokens, give or take what a second refills), not by time.
func TestRecordingHoldsTheSweep(t *testing.T) {
	r := startReg(t)
	_, s := pushV2(t, r, "app", synth.Random, 8<<20, 7)
	ctx := context.Background()
	// mount mounts s on a new node; mountRate is the mount's own hold
	// (FilesOptions.RecordSweepRate).
	mount := func(opts Options, mountRate float64) *Mount {
		p := newPuller(t, opts)
		f := FilesOptions{MaterializeAfter: make(chan struct{}), AwaitSandbox: time.Millisecond, RecordSweepRate: mountRate}
		m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Unmount() })
		return m
	}
	short, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	taken := func(m *Mount, read func()) float64 {
		before := m.hold.lim.Tokens()
		read()
		return before - m.hold.lim.Tokens()
	}
	readAt := func(m *Mount, path string, prio fetch.Priority) func() {
		return func() {
			if err := m.ReadAt(short, path, make([]byte, 4096), 0, prio); err != nil {
				t.Fatal(err)
			}
		}
	}

	m := mount(Options{RecordSweepRate: 1}, 0)
	near := func(got, want float64) bool { return got > want-64 && got < want+64 }
	if got := taken(m, readAt(m, format.PagesFile, fetch.Read)); !near(got, 4096) {
		t.Errorf("a sweep read of 4096 bytes took %.0f of the hold's budget", got)
	}
	// A page fault is not held, and makes the hold last RecordHoldFor
	// from it (through ReadAt here, through FUSE below).
	extended := func(fault func()) bool {
		m.hold.mu.Lock()
		m.hold.until = time.Now().Add(time.Second)
		m.hold.mu.Unlock()
		t0 := time.Now()
		fault()
		m.hold.mu.Lock()
		defer m.hold.mu.Unlock()
		return !m.hold.until.Before(t0.Add(RecordHoldFor))
	}
	var got float64
	if !extended(func() { got = taken(m, readAt(m, format.PagesFile, fetch.Fault)) }) {
		t.Error("a page fault through ReadAt did not extend the hold")
	}
	if !near(got, 0) {
		t.Errorf("a page fault took %.0f of the hold's budget, want none", got)
	}
	if got := taken(m, readAt(m, "checkpoint.img", fetch.Read)); !near(got, 0) {
		t.Errorf("a read of checkpoint.img took %.0f of the hold's budget, want none", got)
	}
	// Through FUSE, the reads the classifier takes for the sweep's are
	// held, a page fault's (shorter than imagefs.FaultBelow) not.
	if got := taken(m, func() { m.observeFUSE(format.PagesFile, 0, 1<<20) }); !near(got, 1<<20) {
		t.Errorf("a FUSE sweep read of 1 MiB took %.0f of the hold's budget", got)
	}
	if !extended(func() { got = taken(m, func() { m.observeFUSE(format.PagesFile, 6<<20, 4096) }) }) {
		t.Error("a FUSE page fault did not extend the hold")
	}
	if !near(got, 0) {
		t.Errorf("a FUSE page fault took %.0f of the hold's budget, want none", got)
	}
	// Once the sandbox has faulted, the stored bytes are answered in
	// place: the sweep's reads held as well, a fault's not. (A fault in
	// place holds nothing: it waits until its chunks are written there.)
	settle(t, m.l.p.cache, snapshotChunksOf(t, s, format.PagesFile))
	for deadline := time.Now().Add(time.Minute); ; {
		if _, ok := m.Place(short, format.PagesFile, 2<<20, 1<<20, fetch.Fault); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("pages.img never in place")
		}
		time.Sleep(10 * time.Millisecond)
	}
	place := func(prio fetch.Priority) func() {
		return func() {
			if _, ok := m.Place(short, format.PagesFile, 2<<20, 1<<20, prio); !ok {
				t.Fatal("a stored range not answered in place")
			}
		}
	}
	if got := taken(m, place(fetch.Read)); !near(got, 1<<20) {
		t.Errorf("a sweep read of 1 MiB answered in place took %.0f of the hold's budget", got)
	}
	if got := taken(m, place(fetch.Fault)); !near(got, 0) {
		t.Errorf("a page fault answered in place took %.0f of the hold's budget, want none", got)
	}
	// A turn past the hold's end is waited for only until then: with the
	// budget spent, a read whose turn is weeks away (at 1 byte a second)
	// waits for what is left of the hold.
	m.hold.mu.Lock()
	m.hold.until = time.Now().Add(50 * time.Millisecond)
	m.hold.mu.Unlock()
	waited := make(chan struct{})
	go func() {
		m.hold.wait(ctx, holdBurst)
		m.hold.wait(ctx, holdBurst)
		close(waited)
	}()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		t.Fatal("a held read waits past the hold's end")
	}
	m.hold.mu.Lock()
	m.hold.until = time.Now().Add(-time.Second)
	m.hold.mu.Unlock()
	if got := taken(m, readAt(m, format.PagesFile, fetch.Read)); !near(got, 0) {
		t.Errorf("a sweep read after RecordHoldFor took %.0f of the hold's budget, want none", got)
	}

	if plain := mount(Options{}, 0); plain.hold != nil || plain.Progress().RecordSweepRate != 0 {
		t.Error("a mount that does not record holds its sweep")
	}
	// One mount of a puller that holds none (the daemon's, asked for).
	if one := mount(Options{}, 5); one.hold == nil || one.Progress().RecordSweepRate != 5 {
		t.Errorf("a mount asked to hold its sweep at 5 B/s: hold %v, progress says %v", one.hold != nil, one.Progress().RecordSweepRate)
	}
	// A snapshot the node has materialized is read from there: there is
	// no sweep to hold, and its Progress says none is.
	p := newPuller(t, Options{})
	first, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitLoaded(t, first)
	first.Unmount()
	again, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{RecordSweepRate: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Unmount()
	if pr := again.Progress(); pr.Mode != "materialized" || again.hold != nil || pr.RecordSweepRate != 0 {
		t.Errorf("a materialized mount asked to hold its sweep: mode %q, hold %v, progress says %v; want materialized, none, 0", pr.Mode, again.hold != nil, pr.RecordSweepRate)
	}
}

// TestSweepHoldShareOfThePeak: the held sweep's rate is the fixed rate,
// or the load's peak rate over holdDivisor if lower (so that the hold
// binds on a link slower than the fixed rate), never below minHoldRate;
// each wait sets its limiter to it, as the peak changes.
func TestSweepHoldShareOfThePeak(t *testing.T) {
	const fixed = 16 << 20
	var peak float64
	h := newSweepHold(fixed, func() float64 { return peak }, nil)
	for _, c := range []struct {
		name       string
		peak, want float64
	}{
		{"unmeasured", 0, fixed},
		{"1 Gbit/s", 1e9 / 8, 1e9 / 8 / holdDivisor},
		{"10 Gbit/s", 10e9 / 8, fixed},
		{"100 Mbit/s", 100e6 / 8, 100e6 / 8 / holdDivisor},
		{"10 Mbit/s", 10e6 / 8, minHoldRate},
		{"1 Gbit/s again", 1e9 / 8, 1e9 / 8 / holdDivisor},
	} {
		peak = c.peak
		h.wait(context.Background(), 1)
		if got := float64(h.lim.Limit()); got != c.want {
			t.Errorf("%s (peak %.0f B/s): held to %.0f B/s, want %.0f", c.name, peak, got, c.want)
		}
		if h.rate() != fixed {
			t.Errorf("%s: the hold says %.0f B/s, want its fixed rate %d", c.name, h.rate(), fixed)
		}
	}
	// Below minHoldRate the fixed rate still wins.
	low := newSweepHold(1000, func() float64 { return 1e9 }, nil)
	low.wait(context.Background(), 1)
	if got := low.lim.Limit(); got != 1000 {
		t.Errorf("a fixed rate of 1000 B/s on a fast link: held to %.0f B/s", got)
	}
}

// TestSweepHoldLastsWhileTheAppFaults: the hold starts at the first read
// of pages.img (begin, a sweep read's wait or a fault) for RecordHoldFor;
// a page fault extends it to RecordHoldFor after it; and it never lasts
// past the recording's end as the recorder has it (a recording that
// ended, or stopped, extends it no more).
func TestSweepHoldLastsWhileTheAppFaults(t *testing.T) {
	var recEnd time.Time
	h := newSweepHold(1<<20, nil, func() time.Time { return recEnd })
	h.wait(context.Background(), 1)
	start := h.start
	if start.IsZero() || !h.until.Equal(start.Add(RecordHoldFor)) {
		t.Fatalf("after the first read: start %v, until %v, want until start+%v", start, h.until, RecordHoldFor)
	}
	recEnd = start.Add(30 * time.Second)
	for _, c := range []struct {
		name                string
		fault, recEnd, want time.Duration
	}{
		{"a fault at 5 s", 5 * time.Second, 30 * time.Second, 5*time.Second + RecordHoldFor},
		{"an earlier fault", time.Second, 30 * time.Second, 5*time.Second + RecordHoldFor},
		{"a fault at 25 s, which extended the recording to 35 s", 25 * time.Second, 35 * time.Second, 35 * time.Second},
		{"a fault at 36 s, after the recording ended", 36 * time.Second, 35 * time.Second, 35 * time.Second},
		{"a fault once the recording stopped (its end its start)", 30 * time.Second, 0, 35 * time.Second},
	} {
		recEnd = start.Add(c.recEnd)
		h.faulted(start.Add(c.fault))
		if !h.until.Equal(start.Add(c.want)) {
			t.Errorf("%s: hold until +%v, want +%v", c.name, h.until.Sub(start), c.want)
		}
	}

	// A recording of 3 s bounds a hold's first RecordHoldFor.
	t0 := time.Now()
	short := newSweepHold(1<<20, nil, func() time.Time { return t0.Add(3 * time.Second) })
	short.begin(t0)
	if !short.start.Equal(t0) || !short.end().Equal(t0.Add(3*time.Second)) {
		t.Errorf("begin with a 3 s recording: start %v, until +%v; want %v, +3s", short.start, short.end().Sub(t0), t0)
	}
	short.begin(t0.Add(time.Second)) // started already: nothing changes
	if !short.end().Equal(t0.Add(3 * time.Second)) {
		t.Errorf("a second begin moved the hold's end to +%v", short.end().Sub(t0))
	}
	first := newSweepHold(1<<20, nil, nil)
	first.faulted(t0)
	if !first.start.Equal(t0) || !first.until.Equal(t0.Add(RecordHoldFor)) {
		t.Errorf("a first fault: start %v, until +%v; want %v, +%v", first.start, first.until.Sub(t0), t0, RecordHoldFor)
	}
	var none *sweepHold
	none.faulted(time.Now()) // a mount that holds nothing
	none.begin(time.Now())
}

// TestBackgroundWaitsForTheHold: the sandbox's first read of pages.img
// starts the hold, bounded by the recording (Recorder.Until), before it
// lets the background go; while the hold lasts, the puller's own
// background load past pages.img's lead waits (it would take the link
// from the app's faults); once the hold ends, it loads.
func TestBackgroundWaitsForTheHold(t *testing.T) {
	r := startReg(t)
	_, s := pushV2(t, r, "app", synth.Random, sandboxLead+8<<20, 9)
	ctx := context.Background()
	// Recording for 3 s bounds the hold to 3 s from its start.
	p := newPuller(t, Options{RecordSweepRate: 64 << 20, RecordFor: 3 * time.Second})
	// The background waits for the sandbox's first read (a minute at
	// most), which starts the hold before it looks.
	m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{MaterializeAfter: make(chan struct{}), AwaitSandbox: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Unmount()
	// The sandbox's first read of pages.img, as accounted before it is
	// served: the hold has started, bounded by the 3 s recording, by the
	// time the background is let go.
	pages, _ := m.fileIndex(format.PagesFile)
	t0 := time.Now()
	m.account(pages, 0, 4096, fetch.Read)
	select {
	case <-m.l.sandboxRead:
	default:
		t.Fatal("the first read of pages.img did not let the background go")
	}
	if end := m.hold.end(); end.Before(t0) || end.After(time.Now().Add(3*time.Second)) {
		t.Fatalf("after the first read the hold ends at %v, want within 3 s of %v (the recording's bound)", end, t0)
	}
	short, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	if err := m.ReadAt(short, format.PagesFile, make([]byte, 4096), 0, fetch.Read); err != nil {
		t.Fatal(err)
	}
	var past []format.Chunk
	for _, c := range snapshotChunksOf(t, s, format.PagesFile) {
		if c.Offset >= sandboxLead && c.Encoding != format.EncodingZero {
			past = append(past, c)
		}
	}
	if len(past) == 0 {
		t.Fatal("no chunk past the lead")
	}
	loaded := func() (n int) {
		for _, c := range past {
			if p.cache.Has(c.Digest) {
				n++
			}
		}
		return n
	}
	// Time for the 8 MiB past the lead to load on loopback, were they not
	// held; checked only if the hold still lasts.
	time.Sleep(time.Second)
	if n := loaded(); time.Now().Before(m.hold.end()) && n > 0 {
		t.Errorf("%d of %d chunks past the lead loaded while the hold lasts", n, len(past))
	}
	for deadline := time.Now().Add(time.Minute); loaded() < len(past); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after the hold: %d of %d chunks past the lead loaded", loaded(), len(past))
		}
	}
}
