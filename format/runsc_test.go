package format

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/gvisortest"
)

// TestRealCheckpointRoundTrip packs a real runsc checkpoint of a Python app,
// unpacks it, compares every byte, and restores the app from the unpacked
// dir: its counter goes on and its memory hash is unchanged. It needs root
// and the pinned runsc (make runsc); under CI=true it fails instead of
// skipping when they are missing.
func TestRealCheckpointRoundTrip(t *testing.T) {
	runsc := gvisortest.Runsc(t)
	ctx := context.Background()
	app := gvisortest.StartApp(t, runsc, gvisortest.AppOptions{MemoryMiB: 64})
	app.NextCount(t)
	img := app.Checkpoint(t)

	store, err := layout.New(filepath.Join(t.TempDir(), "layout"))
	if err != nil {
		t.Fatal(err)
	}
	desc, st, err := Pack(ctx, img, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("packed %d files, %d logical bytes, %d stored, chunks %v", st.Files, st.LogicalBytes, st.StoredBytes, st.Chunks)
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := snap.RunscVersion(), gvisortest.RunscVersion(t, runsc); got != want {
		t.Errorf("snapshot records runsc %q, runsc says %q", got, want)
	}
	if snap.Created() == "" || snap.Annotations[AnnotationContainerCount] != "1" {
		t.Errorf("annotations from checkpoint.img missing: %v", snap.Annotations)
	}
	for _, name := range []string{CheckpointFile, PagesMetaFile, PagesFile} {
		if snap.File(name) == nil {
			t.Errorf("snapshot lacks %s", name)
		}
	}

	out := filepath.Join(t.TempDir(), "img")
	if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{}); err != nil {
		t.Fatal(err)
	}
	compareDirs(t, img, out)

	last := app.LastCount()
	app.Restore(t, out)
	if next := app.NextCount(t); next != last+1 {
		t.Errorf("restored app counts %d, want %d (it should go on, not restart)", next, last+1)
	}
	if h := app.Hash(t); h != app.StartHash() {
		t.Errorf("memory hash after restore %s, before checkpoint %s", h, app.StartHash())
	}
}
