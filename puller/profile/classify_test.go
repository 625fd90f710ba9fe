package profile

import (
	"math/rand/v2"
	"testing"

	"github.com/cryo-oci/cryo/puller/fetch"
)

func TestClassifier(t *testing.T) {
	var c Classifier
	mib := int64(1 << 20)
	for i, tc := range []struct {
		off  int64
		want fetch.Priority
	}{
		{44 * mib, fetch.Fault},  // a fault window before the sweep starts
		{45 * mib, fetch.Fault},  // and the rest of it
		{0, fetch.Read},          // the sweep starts
		{1 * mib, fetch.Read},    // and goes on
		{500 * mib, fetch.Fault}, // a fault far ahead
		{2 * mib, fetch.Read},    // the sweep again: the fault did not move it
		{3 * mib, fetch.Read},
		{10 * mib, fetch.Read},  // a fault just ahead of the sweep: taken for it
		{4 * mib, fetch.Read},   // and the sweep goes on where it was
		{30 * mib, fetch.Fault}, // ahead by more than SweepGap of bytes not asked for
		{5 * mib, fetch.Read},
		{6 * mib, fetch.Read},
		{7 * mib, fetch.Read},
		{8 * mib, fetch.Read},
		{9 * mib, fetch.Read},
		{11 * mib, fetch.Read}, // the sweep skips 10 MiB, which was asked for
		{13 * mib, fetch.Read}, // and 12 MiB, freed: nobody asks for it
		{14 * mib, fetch.Read},
		{2 * mib, fetch.Fault}, // behind the sweep
	} {
		if got := c.Classify(tc.off, mib); got != tc.want {
			t.Errorf("read %d at %d MiB: %v, want %v", i, tc.off/mib, got, tc.want)
		}
	}
	// The sweep reaches the fault windows at 30 and 44-46 MiB and skips
	// them.
	for off := 15 * mib; off < 44*mib; off += mib {
		if off == 30*mib {
			continue
		}
		if got := c.Classify(off, mib); got != fetch.Read {
			t.Fatalf("sweep read at %d MiB: %v", off/mib, got)
		}
	}
	if got := c.Classify(46*mib, mib); got != fetch.Read {
		t.Errorf("sweep read after the fault window: %v, want read", got)
	}
}

// TestClassifierSweepPastHole: once the sweep has skipped freed pages (a
// hole not on a read boundary), it goes on being taken for the sweep, and
// a fault behind it is a fault again: before, the frontier stayed at the
// hole, and every read up to SweepGap past it, the app's faults behind the
// sweep among them, was taken for the sweep.
func TestClassifierSweepPastHole(t *testing.T) {
	var c Classifier
	mib := int64(1 << 20)
	hole := int64(56 << 10)
	for off := int64(0); off < 4*mib; off += mib {
		if got := c.Classify(off, mib); got != fetch.Read {
			t.Fatalf("sweep read at %d: %v", off, got)
		}
	}
	for off := 4*mib + hole; off < 40*mib; off += mib {
		if got := c.Classify(off, mib); got != fetch.Read {
			t.Fatalf("sweep read past the hole at %d: %v", off, got)
		}
	}
	// A fault far behind the sweep, well within SweepGap of the hole.
	if got := c.Classify(10*mib-hole, mib); got != fetch.Fault {
		t.Errorf("fault behind the sweep: %v, want fault", got)
	}
	if got := c.Classify(40*mib+hole, mib); got != fetch.Read {
		t.Errorf("the sweep after the fault: %v, want read", got)
	}
}

// TestClassifierWindowAheadOfSweep: a fault window of several contiguous
// reads just ahead of the sweep does not move the frontier over the gap
// before it: the sweep's reads of that gap stay the sweep's, not faults.
func TestClassifierWindowAheadOfSweep(t *testing.T) {
	var c Classifier
	mib := int64(1 << 20)
	for off := int64(0); off < 3*mib; off += mib {
		c.Classify(off, mib)
	}
	for off := 10 * mib; off < 13*mib; off += mib {
		c.Classify(off, mib) // within SweepGap: taken for the sweep
	}
	for off := 3 * mib; off < 10*mib; off += mib {
		if got := c.Classify(off, mib); got != fetch.Read {
			t.Fatalf("sweep read at %d MiB after a window ahead of it: %v, want read", off/mib, got)
		}
	}
	if got := c.Classify(13*mib, mib); got != fetch.Read {
		t.Errorf("sweep read past the window: %v, want read", got)
	}
}

// TestClassifierSweepOutOfOrder: through FUSE the sentry's parallel sweep
// reads arrive a few reads out of order. A read that comes after the two
// that follow it is still the sweep's: before, the frontier moved past it
// (the sweep going on past a hole) and it was taken for a fault, about one
// sweep read in twelve in a real restore. The app's faults far ahead stay
// faults.
func TestClassifierSweepOutOfOrder(t *testing.T) {
	const piece = 256 << 10
	mib := int64(1 << 20)
	rng := rand.New(rand.NewPCG(1, 2))
	var c Classifier
	var sweep []int64
	for off := int64(0); off < 256*mib; off += piece {
		sweep = append(sweep, off)
	}
	// Each read swaps with one up to 6 places after it (a read swapped on
	// again can end up further).
	for i := range sweep {
		j := min(len(sweep)-1, i+rng.IntN(7))
		sweep[i], sweep[j] = sweep[j], sweep[i]
	}
	faults := map[int64]bool{}
	for i, off := range sweep {
		if i%100 == 50 {
			// A fault window far ahead of the sweep, two reads long.
			f := 600*mib + int64(i)*mib
			for _, o := range []int64{f, f + piece} {
				faults[o] = true
				if got := c.Classify(o, piece); got != fetch.Fault {
					t.Errorf("fault at %d: %v, want fault", o, got)
				}
			}
		}
		if got := c.Classify(off, piece); got != fetch.Read {
			t.Errorf("sweep read %d at %d KiB: %v, want read", i, off>>10, got)
		}
	}
}
