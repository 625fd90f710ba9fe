package puller

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/opencontainers/go-digest"
)

// asNobody runs cat on path as user nobody (a real other uid, no groups)
// and returns its output (cut short) and error.
func asNobody(t *testing.T, path string) (string, error) {
	t.Helper()
	out, err := testenv.AsNobody(t, "cat", path)
	if len(out) > 200 {
		out = out[:200]
	}
	return out, err
}

// refused fails the test unless user nobody is refused reading path
// (EACCES), while root reads it.
func refused(t *testing.T, what, path string) {
	t.Helper()
	if _, err := os.ReadFile(path); err != nil {
		t.Fatalf("%s: root cannot read %s: %v", what, path, err)
	}
	out, err := asNobody(t, path)
	if err == nil {
		t.Errorf("%s: user nobody read %s", what, path)
	} else if !strings.Contains(out, "Permission denied") {
		t.Errorf("%s: nobody reading %s: %v %q; want Permission denied", what, path, err, out)
	}
}

// worldTraversable makes dir and its parents up to the system temp dir
// 0755, as /run/cryo and /var/lib/cryo are on a node.
func worldTraversable(t *testing.T, dir string) {
	t.Helper()
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// TestOtherUserCannotReadSnapshot has user nobody (a real other uid, via
// setpriv) try to read snapshot memory on a node whose dirs are
// world-traversable: pages.img through the live FUSE mount, the image dir
// being assembled and the materialized dir in the node cache, a chunk file
// of the cache, and
// pages.img through a mount bind-mounted from the materialized dir. Every
// read is refused; root reads them all. The modes say so too.
func TestOtherUserCannotReadSnapshot(t *testing.T) {
	needFUSE(t)
	base := t.TempDir()
	worldTraversable(t, base)
	// The harness itself: nobody reads a world-readable file here.
	public := filepath.Join(base, "public")
	os.WriteFile(public, []byte("hello"), 0o644)
	if out, err := asNobody(t, public); err != nil || out != "hello" {
		t.Fatalf("nobody cannot read a public file: %v %q", err, out)
	}

	r := startReg(t)
	_, s := push(t, r, "app", synth.Random, 4<<20, 31)
	cacheDir := filepath.Join(base, "cache")
	os.Mkdir(cacheDir, 0o755)
	p := newPuller(t, Options{CacheDir: cacheDir})
	// pages.img's background load retries until its blobs are served: the
	// snapshot is still being assembled below.
	unserved := map[string]bool{}
	for _, c := range snapshotChunksOf(t, s, format.PagesFile) {
		unserved[c.Blob.String()] = true
	}
	r.set(func(r *reg) { r.unserved = unserved })
	m, err := p.Mount(context.Background(), s, filepath.Join(base, "mnt"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	waitPrepared(t, m)
	// The image dir the chunks are written into as they come.
	worldTraversable(t, filepath.Join(cacheDir, "images"))
	assembling, _ := filepath.Glob(filepath.Join(cacheDir, "images", "*.tmp-*", format.PagesFile))
	if len(assembling) != 1 {
		t.Fatalf("%d snapshots being assembled in the node cache, want 1", len(assembling))
	}
	refused(t, "image dir being assembled", assembling[0])
	checkMode(t, filepath.Dir(assembling[0]), 0o700)
	checkMode(t, assembling[0], 0o600)
	r.set(func(r *reg) { r.unserved = nil })
	pages := filepath.Join(m.Dir(), format.PagesFile)
	refused(t, "FUSE mount", pages)
	refused(t, "FUSE mount, small file", filepath.Join(m.Dir(), "checkpoint.img"))
	checkMode(t, m.Dir(), 0o500)
	checkMode(t, pages, 0o400)

	waitLoaded(t, m)
	img, ok := p.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("not materialized")
	}
	// Even with every parent world-traversable, the dir and its files are
	// the puller's.
	worldTraversable(t, filepath.Join(cacheDir, "images"))
	refused(t, "materialized dir", filepath.Join(img, format.PagesFile))
	checkMode(t, img, 0o700)
	checkMode(t, filepath.Join(img, format.PagesFile), 0o600)
	// A chunk file (of a chunk no snapshot being assembled holds).
	data := []byte("a chunk of no snapshot")
	d := digest.FromBytes(data)
	if err := p.Cache().Put(d, data); err != nil {
		t.Fatal(err)
	}
	chunk := p.Cache().Path(d)
	worldTraversable(t, filepath.Dir(chunk))
	refused(t, "cache chunk", chunk)
	checkMode(t, chunk, 0o400)

	m2, err := p.Mount(context.Background(), s, filepath.Join(base, "mnt2"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Unmount() })
	if m2.Progress().Mode != "materialized" {
		t.Fatalf("second mount in mode %s, want materialized", m2.Progress().Mode)
	}
	refused(t, "bind mount of the materialized dir", filepath.Join(m2.Dir(), format.PagesFile))
}

// checkMode fails unless path has permission bits perm and is owned by
// this process's uid.
func checkMode(t *testing.T, path string, perm os.FileMode) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != perm {
		t.Errorf("%s: mode %v, want %v", path, fi.Mode().Perm(), perm)
	}
	if st := fi.Sys().(*syscall.Stat_t); int(st.Uid) != os.Getuid() {
		t.Errorf("%s: owner uid %d, want %d", path, st.Uid, os.Getuid())
	}
}
