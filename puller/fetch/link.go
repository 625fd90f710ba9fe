package fetch

import (
	"math"
	"time"
)

// link estimates the link to a scheduler's endpoints from the fetches it
// ran: the rate they delivered bytes at and the shortest time one took
// in the last window (an upper bound of the round trip), hence its
// bandwidth-delay product. Runs shorter than minSample (a chunk another
// mount had just fetched, a cache hit) say nothing of the link and are
// left out. The scheduler's lock guards it.
type link struct {
	// minTook is the shortest fetch of the last window, rate the bytes
	// per second delivered (smoothed over windows of windowLen),
	// meanBlob the mean bytes of a fetch.
	minTook  time.Duration
	rate     float64
	meanBlob float64
	// peak is the highest rate measured: what the link can carry, at
	// least, whatever its fetches deliver now.
	peak float64
	// shortest is the shortest of the scheduler's own requests to its
	// endpoints that succeeded, from request to verified bytes
	// (sawRequest): an upper bound of the round trip, known from a
	// load's first fetch (the small files fetched before a mount is
	// ready), long before rate is.
	shortest time.Duration
	// The window: bytes done and the shortest fetch since windowStart.
	windowStart time.Time
	windowBytes int64
	windowMin   time.Duration
}

// minSample is the shortest run taken for a fetch over the link.
const minSample = 500 * time.Microsecond

// windowLen is how long the link's rate is measured over before it is
// folded into the smoothed rate.
const windowLen = 250 * time.Millisecond

// done records a fetch of n stored bytes that took took, ending at now.
func (l *link) done(n int64, took time.Duration, now time.Time) {
	if n <= 0 || took < minSample {
		return
	}
	if l.minTook == 0 {
		l.minTook = took
	}
	if l.windowMin == 0 || took < l.windowMin {
		l.windowMin = took
	}
	if l.meanBlob == 0 {
		l.meanBlob = float64(n)
	} else {
		l.meanBlob += (float64(n) - l.meanBlob) / 16
	}
	if l.windowStart.IsZero() || now.Sub(l.windowStart) > 4*windowLen {
		// First, or after an idle spell, which says nothing of the rate.
		l.windowStart, l.windowBytes = now.Add(-took), 0
	}
	l.windowBytes += n
	if d := now.Sub(l.windowStart); d >= windowLen {
		r := float64(l.windowBytes) / d.Seconds()
		if l.rate == 0 {
			l.rate = r
		} else {
			l.rate += (r - l.rate) / 4
		}
		l.peak = max(l.peak, l.rate)
		l.minTook = l.windowMin
		l.windowStart, l.windowBytes, l.windowMin = now, 0, 0
	}
}

// sawRequest records a request to an endpoint that took took, from its
// start to its bytes verified. Only requests the scheduler made itself
// and that succeeded count: a fetch another mount made, which this one
// followed, or a failure says nothing of the round trip.
func (l *link) sawRequest(took time.Duration) {
	if took > 0 && (l.shortest == 0 || took < l.shortest) {
		l.shortest = took
	}
}

// backgroundLimit is how many background fetches may be in flight while
// urgent ones run: half the bandwidth-delay product in fetches, at least
// one (the background never stops), at most workers. Before anything is
// measured, one.
func (l *link) backgroundLimit(workers int) int {
	if l.rate == 0 || l.meanBlob == 0 {
		return 1
	}
	n := int(math.Round(l.rate * l.minTook.Seconds() / l.meanBlob / 2))
	return max(1, min(n, workers))
}
