package puller

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/cache"
)

// TestMaterializedDirSurvivesCrash loads a snapshot with its node cache on
// a filesystem that then loses power (testenv.CrashableFS) right after the
// load reported the snapshot materialized: after the crash, a new puller
// finds the materialized dir complete (flushed before it was renamed into
// place, the rename flushed too) and serves the right bytes from it.
func TestMaterializedDirSurvivesCrash(t *testing.T) {
	needFUSE(t)
	mnt, crash := testenv.CrashableFS(t, 128<<20)
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 8<<20, 71)
	cacheDir := filepath.Join(mnt, "cache")
	p1 := newPuller(t, Options{CacheDir: cacheDir})
	m := mount(t, p1, s)
	waitLoaded(t, m)
	if err := m.Unmount(); err != nil {
		t.Fatal(err)
	}
	p1.Close() // the process ends with the power
	crash()
	p := newPuller(t, Options{CacheDir: cacheDir})
	img, ok := p.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("the materialized dir did not survive the crash")
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img", format.PagesFile} {
		sameFile(t, filepath.Join(img, name), filepath.Join(src, name))
	}
	m2 := mount(t, p, s)
	if mode := m2.Progress().Mode; mode != "materialized" {
		t.Errorf("mode %s after the crash, want materialized", mode)
	}
	sameFile(t, filepath.Join(m2.Dir(), format.PagesFile), filepath.Join(src, format.PagesFile))
	if _, err := os.Stat(filepath.Join(img, cache.ImageMarker)); err != nil {
		t.Errorf("no completion marker: %v", err)
	}
}
