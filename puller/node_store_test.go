package puller

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
)

// TestMaterializedDirsCountAgainstCap loads two snapshots whose
// materialized dirs do not fit the cache cap together. While both are
// mounted both stay (a live mount's are never evicted); once unmounted the
// cap holds, evicting the least recently used; and a dir a live mount is
// bind-mounted from survives the pressure of another snapshot loading.
func TestMaterializedDirsCountAgainstCap(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	srcA, a := push(t, r, "a", synth.Random, 8<<20, 41)
	srcB, b := push(t, r, "b", synth.Random, 8<<20, 42)
	const capBytes = 12 << 20
	p := newPuller(t, Options{CacheCap: capBytes})
	ma := mount(t, p, a)
	waitLoaded(t, ma)
	mb := mount(t, p, b)
	waitLoaded(t, mb)
	for _, s := range []Source{a, b} {
		if _, ok := p.Materialized(s.Index.Digest); !ok {
			t.Fatalf("snapshot %s of a live mount not materialized (evicted?)", s.Index.Digest)
		}
	}
	sameFile(t, filepath.Join(ma.Dir(), format.PagesFile), filepath.Join(srcA, format.PagesFile))
	ma.Unmount()
	mb.Unmount()
	st := p.Cache().Stats()
	if st.Bytes > capBytes {
		t.Errorf("no live mount, cache holds %d bytes over its cap of %d: %+v", st.Bytes, capBytes, st)
	}
	if _, ok := p.Materialized(a.Index.Digest); ok {
		t.Error("the least recently used materialized dir (a) was kept over the cap")
	}
	if _, err := os.Stat(p.MaterializedDir(a.Index.Digest)); !os.IsNotExist(err) {
		t.Errorf("evicted dir still on disk: %v", err)
	}
	imgB, ok := p.Materialized(b.Index.Digest)
	if !ok {
		t.Fatal("the most recent materialized dir (b) was evicted too")
	}

	// b, bind-mounted from its dir, stays while a loads and materializes.
	mb2 := mount(t, p, b)
	if mb2.Progress().Mode != "materialized" {
		t.Fatalf("remount of b in mode %s", mb2.Progress().Mode)
	}
	ma2 := mount(t, p, a)
	waitLoaded(t, ma2)
	if _, err := os.Stat(imgB); err != nil {
		t.Fatalf("dir of a live bind mount evicted: %v", err)
	}
	sameFile(t, filepath.Join(mb2.Dir(), format.PagesFile), filepath.Join(srcB, format.PagesFile))
}

// TestSmallFilesMemoryCapped mounts a memory bomb: a snapshot with 8 zero
// files of 64 MiB each, every one a "small" file (at most SmallFileLimit),
// 512 MiB in all, twice the default SmallFilesCap (thousands of them would
// exhaust any node; a few show the cap). The mount holds at most the cap
// in memory and serves the rest lazily, with the right bytes.
func TestSmallFilesMemoryCapped(t *testing.T) {
	needFUSE(t)
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 1<<20, 61); err != nil {
		t.Fatal(err)
	}
	const n, size = 8, 64 << 20
	os.Mkdir(filepath.Join(dir, "zero"), 0o755)
	for i := range n {
		f, err := os.Create(filepath.Join(dir, "zero", fmt.Sprintf("%03d.img", i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Truncate(size) // sparse: costs no disk
		f.Close()
	}
	r := startReg(t)
	s := pushDir(t, r, "bomb", dir)
	p := newPuller(t, Options{})
	m := mount(t, p, s)
	var held int64
	for _, f := range m.files {
		held += int64(len(f.Data))
	}
	if limit := p.opts.SmallFilesCap; held > limit {
		t.Errorf("the mount holds %d MiB of small files in memory, over its cap of %d MiB", held>>20, limit>>20)
	}
	got, err := os.ReadFile(filepath.Join(m.Dir(), "zero", fmt.Sprintf("%03d.img", n-1)))
	if err != nil || len(got) != size || !bytes.Equal(got, make([]byte, size)) {
		t.Fatalf("zero file served lazily: %d bytes, %v", len(got), err)
	}
	sameFile(t, filepath.Join(m.Dir(), "checkpoint.img"), filepath.Join(dir, "checkpoint.img"))
}

// TestConcurrentUnmountUnpinsOnce unmounts one of two mounts of a snapshot
// from 8 goroutines at once (as two concurrent DELETEs of a mount in the
// daemon would): the pins are dropped once, so the other mount's chunks stay
// pinned, and it still reads.
func TestConcurrentUnmountUnpinsOnce(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	// Slow enough that neither mount finishes loading (and materializes)
	// before both exist: both are FUSE mounts pinning every chunk.
	r.set(func(r *reg) { r.delay = 20 * time.Millisecond })
	src, s := push(t, r, "app", synth.Random, 8<<20, 51)
	p := newPuller(t, Options{Workers: 2})
	m1, m2 := mount(t, p, s), mount(t, p, s)
	if m1.Progress().Mode != "fuse" || m2.Progress().Mode != "fuse" {
		t.Fatalf("modes %s, %s; want two FUSE mounts", m1.Progress().Mode, m2.Progress().Mode)
	}
	waitPrepared(t, m1)
	waitPrepared(t, m2)
	pinned := p.Cache().Stats().Pinned
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m1.Unmount()
		}()
	}
	wg.Wait()
	if got := p.Cache().Stats().Pinned; got != pinned {
		t.Errorf("after one of two mounts was unmounted 8 times at once, %d keys pinned, want %d (the other mount's)", got, pinned)
	}
	r.set(func(r *reg) { r.delay = 0 })
	sameFile(t, filepath.Join(m2.Dir(), format.PagesFile), filepath.Join(src, format.PagesFile))
	waitLoaded(t, m2)
}
