package puller

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/cache"
)

// chunksOf returns the stored (non-zero) chunks of the mounted file path.
func chunksOf(t testing.TB, m *Mount, path string) []format.Chunk {
	waitPrepared(t, m)
	var out []format.Chunk
	for i, f := range m.files {
		if f.Path != path {
			continue
		}
		for _, c := range m.l.chunks[i] {
			if c.Encoding != format.EncodingZero {
				out = append(out, c)
			}
		}
	}
	return out
}

// damageFile rewrites file p (a read-only cache file) with f(its bytes).
func damageFile(t *testing.T, p string, f func([]byte) []byte) {
	t.Helper()
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, f(data), 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, 0o400)
}

// TestDamagedCacheChunksRefetched is bit rot in the node cache found by a
// restart: snapshot a was loaded (its chunks written in place into its
// materialized dir), then two chunks of a's pages.img and one of its
// checkpoint.img got a byte flipped on disk. A new puller (a new process:
// a fresh cache.Open) mounts snapshot b, which shares every chunk with a,
// through FUSE: the chunks it takes from a's dir are verified on their
// first use, the damage is found, a's dir is dropped (a later mount of a
// must not bind-mount it) and its chunks fetched again; no read fails and
// every byte served is right. b then materializes intact.
func TestDamagedCacheChunksRefetched(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 8<<20, 21); err != nil {
		t.Fatal(err)
	}
	a := pushDir(t, r, "a", dir)
	cacheDir := t.TempDir()
	p1 := newPuller(t, Options{CacheDir: cacheDir})
	m1 := mount(t, p1, a)
	waitLoaded(t, m1)
	if err := m1.Unmount(); err != nil {
		t.Fatal(err)
	}
	p1.Close()
	imgA, ok := p1.Materialized(a.Index.Digest)
	if !ok {
		t.Fatal("a not materialized")
	}
	pages, state := chunksOf(t, m1, format.PagesFile), chunksOf(t, m1, "checkpoint.img")
	if len(pages) < 4 || len(state) == 0 {
		t.Fatalf("%d chunks in pages.img, %d in checkpoint.img: too few to damage", len(pages), len(state))
	}
	flip := func(name string, c format.Chunk, at int64) {
		damageFile(t, filepath.Join(imgA, name), func(b []byte) []byte { b[c.Offset+at] ^= 0x40; return b })
	}
	flip(format.PagesFile, pages[1], 0)
	flip(format.PagesFile, pages[len(pages)/2], pages[len(pages)/2].Size/2)
	flip("checkpoint.img", state[0], state[0].Size-1)

	if err := os.WriteFile(filepath.Join(dir, "extra.img"), []byte("b has one more file"), 0o644); err != nil {
		t.Fatal(err)
	}
	b := pushDir(t, r, "b", dir)
	before := r.blobGets.Load()
	p2 := newPuller(t, Options{CacheDir: cacheDir})
	m2 := mount(t, p2, b)
	if mode := m2.Progress().Mode; mode != "fuse" {
		t.Fatalf("mode %s, want fuse", mode)
	}
	for _, name := range []string{"checkpoint.img", format.PagesFile} {
		got, err := os.ReadFile(filepath.Join(m2.Dir(), name))
		if err != nil {
			t.Fatalf("read %s from the damaged cache: %v", name, err)
		}
		want, _ := os.ReadFile(filepath.Join(dir, name))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s served from the damaged cache differs from the snapshot", name)
		}
	}
	if n := r.blobGets.Load() - before; n < 3 {
		t.Errorf("%d blobs fetched, want at least the 3 damaged chunks", n)
	}
	if _, ok := p2.Materialized(a.Index.Digest); ok {
		t.Error("a's damaged materialized dir is still offered")
	}
	if _, err := os.Stat(imgA); !os.IsNotExist(err) {
		t.Errorf("a's damaged materialized dir is still on disk: %v", err)
	}
	waitLoaded(t, m2)
	if err := m2.Err(); err != nil {
		t.Fatal(err)
	}
	img, ok := p2.Materialized(b.Index.Digest)
	if !ok {
		t.Fatal("b not materialized after the load")
	}
	for _, name := range []string{"checkpoint.img", format.PagesFile} {
		sameFile(t, filepath.Join(img, name), filepath.Join(dir, name))
	}
}

// sameFile fails unless files a and b hold the same bytes.
func sameFile(t *testing.T, a, b string) {
	t.Helper()
	x, err1 := os.ReadFile(a)
	y, err2 := os.ReadFile(b)
	if err1 != nil || err2 != nil || !bytes.Equal(x, y) {
		t.Fatalf("%s and %s differ (%v, %v)", a, b, err1, err2)
	}
}

// TestInterruptedMaterializeIgnoredAndCleaned leaves what a puller killed
// while materializing leaves: a temporary dir, and a dir renamed into place
// whose files never reached the disk (no completion marker). A new puller
// removes both, mounts through FUSE (not from the torn dir) and serves the
// right bytes.
func TestInterruptedMaterializeIgnoredAndCleaned(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 8<<20, 22)
	cacheDir := t.TempDir()
	p := newPuller(t, Options{CacheDir: cacheDir})
	final := p.MaterializedDir(s.Index.Digest)
	tmp := final + ".tmp-1234"
	for _, d := range []string{final, tmp} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"checkpoint.img", "pages_meta.img", format.PagesFile} {
			// A torn write: the right size, zeros.
			info, _ := os.Stat(filepath.Join(src, name))
			os.WriteFile(filepath.Join(d, name), make([]byte, info.Size()), 0o600)
		}
	}
	p2 := newPuller(t, Options{CacheDir: cacheDir})
	for _, d := range []string{final, tmp} {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("leftover %s kept: %v", d, err)
		}
	}
	m := mount(t, p2, s)
	if mode := m.Progress().Mode; mode != "fuse" {
		t.Errorf("mode %s: a torn materialized dir was used", mode)
	}
	sameFile(t, filepath.Join(m.Dir(), format.PagesFile), filepath.Join(src, format.PagesFile))
	waitLoaded(t, m)
	if _, err := os.Stat(filepath.Join(final, cache.ImageMarker)); err != nil {
		t.Errorf("materialized without its marker: %v", err)
	}
}
