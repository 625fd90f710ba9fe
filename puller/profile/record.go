package profile

import (
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
)

// DefaultRecordFor is how long a Recorder records after the sandbox's
// first read of pages.img: long enough for an app to answer its first
// requests after a restore, short enough that what an app does later,
// on its own schedule, stays out of the profile.
const DefaultRecordFor = 30 * time.Second

// RecordQuiet is how long a recording goes on after the app's last page
// fault on pages.img, past its bound: an app that still faults is still
// getting to its first answers (on a slow link a 2 GiB app's took 41 s).
const RecordQuiet = 10 * time.Second

// MaxRecording is the longest a recording bounded by recFor lasts, page
// faults or not: four times recFor (2 minutes by default).
func MaxRecording(recFor time.Duration) time.Duration { return 4 * recFor }

// Recorder records a restore's working set: the reads a sandbox waited
// on, in first-access order, from when it started (the mount's start)
// until recFor after the first read of pages.img (times counted from it),
// or RecordQuiet after the last page fault recorded if that is later, at
// most MaxRecording(recFor) after that first read; at most MaxRanges
// ranges and MaxSize encoded.
// Reads of bytes already recorded add nothing. It is safe for concurrent
// use.
type Recorder struct {
	recFor time.Duration

	mu sync.Mutex
	// first is the sandbox's first read of pages.img, which times count
	// from (nodes differ in how long a mount takes to get there); until
	// is when recording stops.
	first, until time.Time
	stopped      bool
	cov          coverage
	p            Profile
	// size is about the encoded bytes of p's ranges (encodedSize).
	size int
	// sweep tells, for a presenter that cannot (FUSE), pages.img's
	// page-fault reads from the background sweep.
	sweep Classifier
	// now is the clock (time.Now; tests set their own).
	now func() time.Time
}

// NewRecorder starts recording the working set of snapshot subject, with
// times counted from the sandbox's first read of pages.img (reads before
// it at 0); recFor <= 0 means DefaultRecordFor.
func NewRecorder(subject digest.Digest, recFor time.Duration) *Recorder {
	if recFor <= 0 {
		recFor = DefaultRecordFor
	}
	return &Recorder{recFor: recFor, p: Profile{MediaType: MediaType, Subject: subject}, now: time.Now}
}

// Waited records a read of n bytes at off of the file path that a sandbox
// waits on: a page fault's read of pages.img, or any read of another file.
func (r *Recorder) Waited(path string, off, n int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.record(path, off, n, r.now())
}

// Read records a read of n bytes at off of path whose kind the presenter
// does not know, in the order the sandbox submitted it (FUSE): a read of
// pages.img is recorded only if it is not the background sweep's
// (Classifier). It reports whether the sandbox waits on the read: any
// read but the sweep's, which the presenter then serves first.
func (r *Recorder) Read(path string, off, n int64) (waited bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if path == format.PagesFile && r.sweep.Classify(off, n) != fetch.Fault {
		r.startClock(r.now())
		return false
	}
	r.record(path, off, n, r.now())
	return true
}

// Swept notes a read of pages.img that is the background sweep's: it
// starts the recording's clock, as a fault does.
func (r *Recorder) Swept() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.startClock(r.now())
}

func (r *Recorder) startClock(now time.Time) {
	if r.until.IsZero() {
		r.first, r.until = now, now.Add(r.recFor)
	}
}

func (r *Recorder) record(path string, off, n int64, now time.Time) {
	if path == format.PagesFile {
		r.startClock(now)
	}
	if r.stopped || n <= 0 || !r.until.IsZero() && now.After(r.until) {
		return
	}
	if path == format.PagesFile {
		// A page fault: the app is still getting there.
		end := now.Add(RecordQuiet)
		if last := r.first.Add(MaxRecording(r.recFor)); end.After(last) {
			end = last
		}
		if end.After(r.until) {
			r.until = end
		}
	}
	var at int64
	if !r.first.IsZero() {
		at = now.Sub(r.first).Milliseconds()
	}
	for _, piece := range r.cov.add(path, off, off+n) {
		rg := Range{Path: path}
		if r.size += encodedSize(rg); len(r.p.Ranges) == MaxRanges || r.size > encodedBudget {
			r.stopped = true
			return
		}
		r.p.append(Range{Path: path, Offset: piece.start, Length: piece.end - piece.start, AtMillis: max(at, 0)})
	}
}

// Until is when the recording ends as it stands (a page fault can
// extend it): zero before the sandbox's first read of pages.img, and its
// first read once the recording stopped.
func (r *Recorder) Until() time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped && !r.first.IsZero() {
		return r.first
	}
	return r.until
}

// Stop ends the recording: nothing is recorded after it.
func (r *Recorder) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
}

// Profile returns what was recorded so far.
func (r *Recorder) Profile() *Profile {
	r.mu.Lock()
	defer r.mu.Unlock()
	p := r.p
	p.Ranges = slices.Clone(r.p.Ranges)
	return &p
}

// coverage is the bytes of each file recorded so far.
type coverage struct {
	byPath map[string][]span
}

// add marks [start, end) of path covered and returns the pieces of it
// that were not, in ascending order.
func (c *coverage) add(path string, start, end int64) []span {
	if c.byPath == nil {
		c.byPath = map[string][]span{}
	}
	spans := c.byPath[path]
	var fresh []span
	pos := start
	i := sort.Search(len(spans), func(i int) bool { return spans[i].end > start })
	for j := i; j < len(spans) && spans[j].start < end; j++ {
		if spans[j].start > pos {
			fresh = append(fresh, span{pos, spans[j].start})
		}
		pos = max(pos, spans[j].end)
	}
	if pos < end {
		fresh = append(fresh, span{pos, end})
	}
	if len(fresh) == 0 {
		return nil
	}
	// Merge [start, end) with the spans it overlaps or touches.
	i = sort.Search(len(spans), func(i int) bool { return spans[i].end >= start })
	j := i
	for j < len(spans) && spans[j].start <= end {
		start, end = min(start, spans[j].start), max(end, spans[j].end)
		j++
	}
	c.byPath[path] = slices.Replace(spans, i, j, span{start, end})
	return fresh
}
