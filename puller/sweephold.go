package puller

import (
	"context"
	"sync"
	"time"

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
// reads to a rate well below the app's, for the first RecordHoldFor after
// its first one: the app's faults, not held, then reach the recorder
// for every window the app touches in that time, except those the held
// sweep still gets to first (the first RecordHoldFor x rate bytes of
// pages.img at most). What is held is what the classifier takes for the
// sweep's reads, which include a fault within profile.SweepGap ahead of
// the sweep (profile.Classifier): such a fault waits at the held rate,
// and is not recorded either. The hold costs the recording restore its full-load
// time (about RecordHoldFor longer), and may delay its app's first answer
// a little: gVisor's loader issues a fault's reads once one of its reads
// in flight, held sweep reads among them, completes.

// DefaultRecordSweepRate is the sweep's rate in bytes a second while a
// recording holds it: a 32 MiB window every two seconds. (Not a share of
// the link's measured rate: the scheduler measures what its fetches
// deliver, which the hold itself lowers.) On a link slower than this the
// hold does not bind.
const DefaultRecordSweepRate = 16 << 20

// RecordHoldFor is how long a recording holds the sweep after its first
// read.
const RecordHoldFor = 10 * time.Second

// holdBurst is the most bytes one read waits for: larger reads wait as
// for this many (the gofer's reads are 1 MiB, FUSE's at most 1 MiB). A
// read's wait ends at the hold's end (RecordHoldFor) whatever the rate.
const holdBurst = 4 << 20

// sweepHold holds a recording mount's sweep reads to its limiter's rate,
// from the first of them for RecordHoldFor. A nil sweepHold holds nothing.
type sweepHold struct {
	lim *rate.Limiter

	mu    sync.Mutex
	until time.Time // set at the first sweep read
}

// newSweepHold returns a hold at bytesPerSec, or nil if bytesPerSec <= 0.
func newSweepHold(bytesPerSec float64) *sweepHold {
	if bytesPerSec <= 0 {
		return nil
	}
	return &sweepHold{lim: rate.NewLimiter(rate.Limit(bytesPerSec), holdBurst)}
}

// rate is the hold's rate in bytes a second, 0 for no hold.
func (h *sweepHold) rate() float64 {
	if h == nil {
		return 0
	}
	return float64(h.lim.Limit())
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
	if h.until.IsZero() {
		h.until = now.Add(RecordHoldFor)
	}
	until := h.until
	h.mu.Unlock()
	if !now.Before(until) {
		return
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
