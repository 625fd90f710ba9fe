package transfer

import (
	"slices"
	"testing"
)

// TestNaturalCompare checks the order in which tags are taken as
// candidate bases: numbers by value, so that the last tags of a run of
// pauses are the newest ones, not "pause-9" after "pause-10".
func TestNaturalCompare(t *testing.T) {
	tags := []string{"pause-10", "latest", "pause-010", "pause-9", "v1.10.0", "pause-010a", "v1.9.2", "pause-100", "pause-10-notes", "v1.10"}
	slices.SortFunc(tags, naturalCompare)
	want := []string{"latest", "pause-9", "pause-010", "pause-10", "pause-10-notes", "pause-010a", "pause-100", "v1.9.2", "v1.10", "v1.10.0"}
	if !slices.Equal(tags, want) {
		t.Fatalf("natural order %q, want %q", tags, want)
	}
	for _, s := range want {
		if naturalCompare(s, s) != 0 {
			t.Errorf("naturalCompare(%q, %q) != 0", s, s)
		}
	}
}
