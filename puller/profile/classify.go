package profile

import (
	"slices"
	"sort"

	"github.com/cryo-oci/cryo/puller/fetch"
)

// Classifier tells the reads of pages.img a sandbox waits on (gVisor's
// priority reads: the mapping windows around page faults, up to 32 MiB
// each, anywhere in the file) from its background sweep. The sweep reads
// the file in ascending order, each read starting at the lowest offset
// not read yet: it skips what priority reads asked for, and pages freed
// before they were loaded, which nobody asks for. So a read is the
// sweep's if it starts at the frontier (where the sweep's last read
// ended, moved past what was asked for since), or past at most SweepGap
// bytes nobody asked for (a fault that close to the sweep is taken for
// it: its bytes come next anyway). Such a read moves the frontier only
// if it skipped at most MaxHole bytes and the next read taken for the
// sweep continues it: then it was the sweep past freed pages, not a fault
// just ahead of it. A read that starts in a hole the frontier moved
// past is the sweep's too: the sentry's sweep passes only pages that are
// loading, loaded or freed (it sweeps the pages nobody has started to
// load, in file order), so such a read is one of the sweep's that arrived
// after the reads that followed it (FUSE hands the sentry's parallel
// reads over in any order), or, rarely, a fault in a gap of at most
// MaxHole that the frontier took for freed pages. Any other read is a
// fault. Freed ranges of more than SweepGap at once leave
// the rest of the sweep classified as faults: served first, newest first,
// with the app's real faults among them. Reads should be classified in
// the order the sentry submits them; reads that arrive a little out of
// order (up to MaxHole past a late one) are told apart as well. It is not
// safe for concurrent use.
type Classifier struct {
	// frontier is where the sweep's next read starts: the end of its last
	// read, moved past what was asked for since.
	frontier int64
	// lastRead is the end of the last read taken for the sweep.
	lastRead int64
	// asked are the ranges asked for, sorted, disjoint, not adjacent.
	asked []span
	// holes are the last MaxHoles ranges the frontier moved past unasked,
	// oldest first: freed pages, or sweep reads still to arrive.
	holes []span
}

// MaxHoles is how many of the holes the frontier moved past a Classifier
// remembers, to take a late read of one for the sweep's.
const MaxHoles = 256

// SweepGap is how many bytes nobody asked for the sweep may skip (pages
// freed before they were loaded) and still be taken for the sweep.
const SweepGap = 16 << 20

// MaxHole is the largest run of unasked bytes the frontier moves past
// when the sweep goes on beyond it: a fault window of several reads just
// ahead of the sweep also goes on contiguously, past a larger gap.
const MaxHole = 1 << 20

type span struct{ start, end int64 }

// Classify returns the priority of a read of n bytes at off.
func (c *Classifier) Classify(off, n int64) fetch.Priority {
	prio := fetch.Fault
	gap := int64(-1)
	if off >= c.frontier {
		gap = c.unasked(c.frontier, off)
	} else if c.fillHole(off, off+n) {
		c.add(off, off+n)
		return fetch.Read
	}
	c.add(off, off+n)
	switch {
	case gap == 0:
		prio, c.frontier = fetch.Read, off+n
		c.lastRead = off + n
	case gap > 0 && gap <= SweepGap:
		// The sweep past freed pages, or a fault just ahead of it: taken
		// for the sweep. The frontier moves only if this read continues
		// the last one taken for the sweep (the sweep goes on past a
		// hole), so that the sweep's own next read is not taken for a
		// fault if this one was a fault.
		prio = fetch.Read
		if off == c.lastRead && gap <= MaxHole {
			c.addHoles(c.frontier, off)
			c.frontier = off + n
		}
		c.lastRead = off + n
	}
	// Past what priority reads have asked for: the sweep skips it.
	if i := c.find(c.frontier); i < len(c.asked) && c.asked[i].start <= c.frontier {
		c.frontier = max(c.frontier, c.asked[i].end)
	}
	return prio
}

// gaps calls f with each range of [from, to) nobody asked for, in order,
// until f returns false.
func (c *Classifier) gaps(from, to int64, f func(g span) bool) {
	for i := c.find(from); from < to; i++ {
		end := to
		if i < len(c.asked) && c.asked[i].start < to {
			end = c.asked[i].start
		}
		if end > from && !f(span{from, end}) {
			return
		}
		if i == len(c.asked) || c.asked[i].start >= to {
			return
		}
		from = c.asked[i].end
	}
}

// unasked returns how many bytes of [from, to) nobody asked for, counting
// at most SweepGap+1.
func (c *Classifier) unasked(from, to int64) int64 {
	var n int64
	c.gaps(from, to, func(g span) bool {
		n += g.end - g.start
		return n <= SweepGap
	})
	return n
}

// addHoles remembers the unasked ranges of [from, to), which the
// frontier is moving past.
func (c *Classifier) addHoles(from, to int64) {
	c.gaps(from, to, func(g span) bool {
		c.holes = append(c.holes, g)
		return true
	})
	c.trimHoles()
}

// trimHoles keeps the last MaxHoles holes.
func (c *Classifier) trimHoles() {
	if over := len(c.holes) - MaxHoles; over > 0 {
		c.holes = slices.Delete(c.holes, 0, over)
	}
}

// fillHole reports whether [start, end) starts in a hole the frontier
// moved past, and takes what it covers out of it.
func (c *Classifier) fillHole(start, end int64) bool {
	for i := len(c.holes) - 1; i >= 0; i-- {
		h := c.holes[i]
		if start < h.start || start >= h.end {
			continue
		}
		var rest []span
		if h.start < start {
			rest = append(rest, span{h.start, start})
		}
		if end < h.end {
			rest = append(rest, span{end, h.end})
		}
		c.holes = slices.Replace(c.holes, i, i+1, rest...)
		c.trimHoles()
		return true
	}
	return false
}

// find returns the index of the first span ending after off.
func (c *Classifier) find(off int64) int {
	return sort.Search(len(c.asked), func(i int) bool { return c.asked[i].end > off })
}

// add records [start, end) as asked for, merging it with the spans it
// overlaps or touches.
func (c *Classifier) add(start, end int64) {
	i := sort.Search(len(c.asked), func(i int) bool { return c.asked[i].end >= start })
	j := i
	for j < len(c.asked) && c.asked[j].start <= end {
		start, end = min(start, c.asked[j].start), max(end, c.asked[j].end)
		j++
	}
	c.asked = slices.Replace(c.asked, i, j, span{start, end})
}
