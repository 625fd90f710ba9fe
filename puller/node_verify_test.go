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
func chunksOf(m *Mount, path string) []format.Chunk {
	var out []format.Chunk
	for _, f := range m.files {
		if f.Path != path {
			continue
		}
		for _, c := range f.Chunks {
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

// TestDamagedCacheChunksRefetched is a torn node cache after a crash: the
// materialized dirs are gone, one chunk file of pages.img is truncated,
// another has a byte flipped at the same size, and so has a chunk of
// checkpoint.img. A new puller (a new process: a fresh cache.Open) mounting
// the snapshot through FUSE from that cache serves the right bytes: each
// damaged chunk is found on its first use, dropped and fetched again, and
// no read fails. The snapshot then materializes intact.
func TestDamagedCacheChunksRefetched(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 8<<20, 21)
	cacheDir := t.TempDir()
	m1 := mount(t, newPuller(t, Options{CacheDir: cacheDir}), s)
	waitLoaded(t, m1)
	if err := m1.Unmount(); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(cacheDir, "images")); err != nil {
		t.Fatal(err)
	}
	pages, state := chunksOf(m1, format.PagesFile), chunksOf(m1, "checkpoint.img")
	if len(pages) < 4 || len(state) == 0 {
		t.Fatalf("%d chunks in pages.img, %d in checkpoint.img: too few to damage", len(pages), len(state))
	}
	c0, _ := cache.Open(cacheDir, 0) // only for the paths
	truncated, flipped := pages[1], pages[len(pages)/2]
	damageFile(t, c0.Path(truncated.Digest), func(b []byte) []byte { return b[:len(b)/3] })
	damageFile(t, c0.Path(flipped.Digest), func(b []byte) []byte { b[len(b)/2] ^= 0x40; return b })
	damageFile(t, c0.Path(state[0].Digest), func(b []byte) []byte { b[len(b)-1] ^= 1; return b })

	before := r.blobGets.Load()
	p2 := newPuller(t, Options{CacheDir: cacheDir})
	m2 := mount(t, p2, s)
	if mode := m2.Progress().Mode; mode != "fuse" {
		t.Fatalf("mode %s, want fuse (the materialized dir was removed)", mode)
	}
	for _, name := range []string{"checkpoint.img", format.PagesFile} {
		got, err := os.ReadFile(filepath.Join(m2.Dir(), name))
		if err != nil {
			t.Fatalf("read %s from the torn cache: %v", name, err)
		}
		want, _ := os.ReadFile(filepath.Join(src, name))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s served from the torn cache differs from the snapshot", name)
		}
	}
	if n := r.blobGets.Load() - before; n < 3 {
		t.Errorf("%d blobs fetched again, want the 3 damaged chunks", n)
	}
	waitLoaded(t, m2)
	img, ok := p2.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("not materialized after the load")
	}
	sameFile(t, filepath.Join(img, format.PagesFile), filepath.Join(src, format.PagesFile))
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
