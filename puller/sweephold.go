package puller

import (
	"context"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/puller/profile"
	"golang.org/x/time/rate"
)

// A recording sees the app's working set as the reads of pages.img the
// sandbox waits on: page faults on memory not loaded yet. gVisor's loader
// sweeps pages.img in order beside the app, and a window the sweep has
// loaded before the app touches it never faults, so it is missing from
// the profile. A replay, which fetches the profile first, slows the sweep
// down and then waits on exactly those windows. On a 1 Gbit/s link a
// 256 MiB app's recording caught 35 MiB of its 99 MiB of windows.
//
// A recording mount (Options.RecordSweepRate) therefore holds the sweep's
// reads to a rate well below the app's: the fixed rate, or the highest
// rate the load's fetches were measured at divided by holdDivisor if that
// is lower, but never below minHoldRate. The hold lasts RecordHoldFor from
// the first read of pages.img (the sweep's or a fault's: the recorder's
// clock starts there too), and while the app faults: until RecordHoldFor
// after its last page fault; never past the recording's end. The app's
// faults, not held, then reach the recorder for every window the app
// touches, except those the held sweep still gets to first (the first
// bytes of pages.img it reads while held). What is held is what the
// classifier takes for the sweep's reads, which include a fault within
// profile.SweepGap ahead of the sweep (profile.Classifier): such a fault
// waits at the held rate, and is not recorded either. The hold costs the
// recording restore its full-load time (about as long as the hold
// lasts), and may delay its app's first answer a little: gVisor's loader
// issues a fault's reads once one of its reads in flight, held sweep reads
// among them, completes.
//
// The share is of the peak rate, not of the rate measured now: a
// fetch delivers what the hold lets it, so a share of the present rate
// would hold the sweep ever lower. On a link slower than the fixed rate
// the fixed rate alone would not bind (a 256 MiB app's recording on
// 100 Mbit/s caught 67 of its 99 MiB of windows), and the app, whose
// faults each wait seconds for a 32 MiB window there, faults for longer
// than RecordHoldFor.

// DefaultRecordSweepRate is the sweep's highest rate in bytes a second
// while a recording holds it: a 32 MiB window every two seconds.
const DefaultRecordSweepRate = 16 << 20

// RecordHoldFor is how long a recording holds the sweep after the first
// read of pages.img, and after each page fault: as long as a recording
// goes on after one.
const RecordHoldFor = profile.RecordQuiet

// holdDivisor divides the link's peak rate into the most the held sweep
// gets: on 1 Gbit/s about the fixed rate, on 100 Mbit/s 1.5 MiB/s.
const holdDivisor = 8

// minHoldRate is the lowest rate a hold holds the sweep to: gVisor's
// loader issues a fault's reads once one of its reads completes, so a
// held 1 MiB read keeps a fault waiting up to a second at this rate.
const minHoldRate = 1 << 20

// holdBurst is the most bytes one read waits for: larger reads wait as
// for this many (the gofer's reads are 1 MiB, FUSE's at most 1 MiB). A
// read's wait ends at the hold's end whatever the rate.
const holdBurst = 4 << 20

// sweepHold holds a recording mount's sweep reads to its limiter's rate,
// from the first read of pages.img for RecordHoldFor, longer while the
// sandbox faults, never past the recording's end as it stood when the
// hold started or a fault extended it (a recording that stops at its
// limits leaves the hold's end as it was). A nil sweepHold holds nothing.
type sweepHold struct {
	lim   *rate.Limiter
	fixed float64
	// peak is the load's highest measured rate (fetch.Scheduler.PeakRate),
	// 0 before any; recording is when the mount's recording ends
	// (profile.Recorder.Until), which bounds the hold.
	peak      func() float64
	recording func() time.Time

	mu    sync.Mutex
	start time.Time // the first read of pages.img
	until time.Time
}

// newSweepHold returns a hold at most at bytesPerSec, peak's rate over
// holdDivisor if that is lower (peak may be nil), lasting no longer than
// the recording whose end recording gives (profile.Recorder.Until; a zero
// end, before it started, or a nil recording bounds nothing); or nil if
// bytesPerSec <= 0.
func newSweepHold(bytesPerSec float64, peak func() float64, recording func() time.Time) *sweepHold {
	if bytesPerSec <= 0 {
		return nil
	}
	if peak == nil {
		peak = func() float64 { return 0 }
	}
	if recording == nil {
		recording = func() time.Time { return time.Time{} }
	}
	return &sweepHold{lim: rate.NewLimiter(rate.Limit(bytesPerSec), holdBurst), fixed: bytesPerSec, peak: peak, recording: recording}
}

// rate is the hold's highest rate in bytes a second, 0 for no hold.
func (h *sweepHold) rate() float64 {
	if h == nil {
		return 0
	}
	return h.fixed
}

// currentRate is the rate the sweep is held to now: the fixed rate, or
// the peak rate over holdDivisor if lower, but not below minHoldRate (nor
// above the fixed rate).
func (h *sweepHold) currentRate() float64 {
	r := h.fixed
	if p := h.peak(); p > 0 {
		r = min(r, max(p/holdDivisor, minHoldRate))
	}
	return r
}

// extendLocked starts the hold at now if it has not started, for
// RecordHoldFor, and after a page fault makes it last until RecordHoldFor
// after now (as a recording goes on profile.RecordQuiet after one); never
// past the recording's end as it stands. It returns the hold's end. h.mu
// is held.
func (h *sweepHold) extendLocked(now time.Time, fault bool) time.Time {
	starting := h.start.IsZero()
	if starting {
		h.start = now
	}
	if starting || fault {
		end := now.Add(RecordHoldFor)
		if last := h.recording(); !last.IsZero() && end.After(last) {
			end = last
		}
		if end.After(h.until) {
			h.until = end
		}
	}
	return h.until
}

// begin starts the hold at now, if it has not started: at the sandbox's
// first read of pages.img, before the background that waits for that
// read looks at the hold (load.waitHold).
func (h *sweepHold) begin(now time.Time) { h.extend(now, false) }

// end is when the hold ends as it stands (a fault can extend it), zero
// before it started.
func (h *sweepHold) end() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.until
}

// faulted makes the hold last RecordHoldFor after a page fault at now
// (never past the recording's end as it stands), starting it if this is
// the first read of pages.img.
func (h *sweepHold) faulted(now time.Time) { h.extend(now, true) }

// extend is extendLocked for a hold that may be nil (none).
func (h *sweepHold) extend(now time.Time, fault bool) {
	if h == nil {
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.extendLocked(now, fault)
}

// wait holds a sweep read of n bytes for its turn at the rate, while the
// hold lasts: a turn that would come after the hold's end is waited for
// only until then. It never fails the read: a ctx that ends only ends the
// wait.
func (h *sweepHold) wait(ctx context.Context, n int64) {
	if h == nil || n <= 0 {
		return
	}
	now := time.Now()
	h.mu.Lock()
	until := h.until
	if h.start.IsZero() {
		until = h.extendLocked(now, false)
	}
	h.mu.Unlock()
	if !now.Before(until) {
		return
	}
	if r := rate.Limit(h.currentRate()); r != h.lim.Limit() {
		h.lim.SetLimitAt(now, r)
	}
	r := h.lim.ReserveN(now, int(min(n, holdBurst)))
	d := min(r.DelayFrom(now), until.Sub(now))
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		r.CancelAt(time.Now())
	}
}
