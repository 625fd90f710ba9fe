package chunkindex

import (
	"fmt"
	"slices"
	"testing"

	"github.com/opencontainers/go-digest"
)

// TestFullNeighborListKeepsTheNewest records more neighbors of a pack
// than a list holds: the newest must stay (a chain of snapshots pushes new
// packs beside an old one at every pause, and a composition of the next
// needs the latest), the oldest go, and one already listed changes nothing.
func TestFullNeighborListKeepsTheNewest(t *testing.T) {
	var packs []digest.Digest
	for i := range maxNeighbors + 3 {
		packs = append(packs, digest.FromString(fmt.Sprint(i)))
	}
	var list []digest.Digest
	for _, p := range packs {
		var changed bool
		if list, changed = withNeighbor(list, p); !changed {
			t.Fatalf("adding new neighbor %s changed nothing", p)
		}
	}
	if want := packs[len(packs)-maxNeighbors:]; !slices.Equal(list, want) {
		t.Errorf("full list holds %v, want the newest %v", list, want)
	}
	if _, changed := withNeighbor(list, packs[len(packs)-1]); changed {
		t.Error("adding a listed neighbor changed the list")
	}
}
