package cache

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

func chunk(b byte, n int) ([]byte, digest.Digest) {
	data := bytes.Repeat([]byte{b}, n)
	return data, digest.FromBytes(data)
}

func TestPutGetAndVerify(t *testing.T) {
	s, err := Open(t.TempDir(), 0)
	if err != nil {
		t.Fatal(err)
	}
	data, d := chunk(1, 1000)
	if err := s.Put(digest.FromString("other"), data); err == nil {
		t.Fatal("Put accepted data that does not match its digest")
	}
	if err := s.Put(d, data); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get(d, nil, true)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get: %v", err)
	}
	part := make([]byte, 10)
	if n, err := s.ReadAt(d, part, 990); err != nil || n != 10 {
		t.Fatalf("ReadAt: %d %v", n, err)
	}
	// A chunk damaged on disk is detected when verified, and dropped.
	p := s.Path(d)
	os.Chmod(p, 0o600)
	os.WriteFile(p, bytes.Repeat([]byte{2}, 1000), 0o600)
	if _, err := s.Get(d, nil, true); !errors.Is(err, ErrNotFound) || s.Has(d) {
		t.Fatalf("damaged chunk: %v, still cached %v", err, s.Has(d))
	}
}

func TestReopenIndexesAndDropsLeftovers(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	data, d := chunk(3, 500)
	s.Put(d, data)
	// A leftover of a write interrupted by a crash (rename fallback path).
	leftover := filepath.Join(filepath.Dir(s.Path(d)), ".tmp-123")
	os.WriteFile(leftover, []byte("partial"), 0o600)
	s2, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !s2.Has(d) || s2.Stats().Bytes != 500 {
		t.Fatalf("reopened cache: %+v", s2.Stats())
	}
	if _, err := os.Stat(leftover); !errors.Is(err, os.ErrNotExist) {
		t.Fatal("leftover temp file kept")
	}
}

func TestEvictionSparesPinned(t *testing.T) {
	s, _ := Open(t.TempDir(), 3000)
	now := time.Unix(1000, 0)
	s.clock = func() time.Time { now = now.Add(time.Second); return now }
	var ds []digest.Digest
	for i := range 5 {
		data, d := chunk(byte(10+i), 1000)
		ds = append(ds, d)
		if i == 0 {
			s.Pin([]digest.Digest{d})
		}
		if err := s.Put(d, data); err != nil {
			t.Fatal(err)
		}
	}
	if !s.Has(ds[0]) {
		t.Fatal("pinned chunk evicted")
	}
	if st := s.Stats(); st.Bytes > 3000 || st.Evictions == 0 {
		t.Fatalf("cap not enforced: %+v", st)
	}
	if s.Has(ds[1]) || !s.Has(ds[4]) {
		t.Fatal("eviction is not least recently used first")
	}
	s.Unpin([]digest.Digest{ds[0]})
	if st := s.Stats(); st.Pinned != 0 {
		t.Fatalf("pins left: %+v", st)
	}
}

// TestFirstUseVerification reopens a cache (a new process) whose chunk files
// were damaged on disk, one truncated and one with a byte flipped at the
// same size: the first use of each reports it not found and drops it, so the
// caller fetches it again; no damaged byte is returned, and an intact chunk
// reads as before.
func TestFirstUseVerification(t *testing.T) {
	root := t.TempDir()
	s, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	short, ds := chunk(4, 4096)
	flipped, df := chunk(5, 4096)
	intact, di := chunk(6, 4096)
	for _, c := range []struct {
		d    digest.Digest
		data []byte
	}{{ds, short}, {df, flipped}, {di, intact}} {
		if err := s.Put(c.d, c.data); err != nil {
			t.Fatal(err)
		}
	}
	damage(t, s.Path(ds), func(b []byte) []byte { return b[:len(b)/2] })
	damage(t, s.Path(df), func(b []byte) []byte { b[100] ^= 1; return b })

	s2, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got, err := s2.Get(ds, nil, false); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of a truncated chunk: %d bytes, %v; want ErrNotFound", len(got), err)
	}
	p := make([]byte, 10)
	if n, err := s2.ReadAt(df, p, 95); !errors.Is(err, ErrNotFound) {
		t.Errorf("ReadAt of a flipped chunk: %d bytes %x, %v; want ErrNotFound", n, p[:n], err)
	}
	for _, d := range []digest.Digest{ds, df} {
		if s2.Has(d) {
			t.Errorf("damaged chunk %s still indexed", d)
		}
		if _, err := os.Stat(s2.Path(d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("damaged chunk file %s kept: %v", d, err)
		}
	}
	if n, err := s2.ReadAt(di, p, 95); err != nil || n != 10 || !bytes.Equal(p, intact[95:105]) {
		t.Fatalf("ReadAt of an intact chunk: %d %v", n, err)
	}
	if got, err := s2.Get(di, nil, false); err != nil || !bytes.Equal(got, intact) {
		t.Fatalf("Get of an intact chunk: %v", err)
	}
	// A damaged chunk fetched again is stored again.
	if err := s2.Put(df, flipped); err != nil || !s2.Has(df) {
		t.Fatalf("Put after drop: %v", err)
	}
	if got, err := s2.Get(df, nil, false); err != nil || !bytes.Equal(got, flipped) {
		t.Fatalf("Get after refetch: %v", err)
	}
	if st := s2.Stats(); st.Chunks != 2 || st.Bytes != 2*4096 {
		t.Errorf("stats after drops and refetch: %+v", st)
	}
}

// damage rewrites the chunk file at p with f(its bytes), same inode mode.
func damage(t *testing.T, p string, f func([]byte) []byte) {
	t.Helper()
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, 0o600)
	if err := os.WriteFile(p, f(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestReadAtPastChunkEnd(t *testing.T) {
	s, _ := Open(t.TempDir(), 0)
	data, d := chunk(7, 1000)
	s.Put(d, data)
	if _, err := s.ReadAt(d, make([]byte, 10), 995); err == nil || errors.Is(err, ErrNotFound) {
		t.Fatalf("ReadAt past the chunk's end: %v; want an error other than not found", err)
	}
}

// writeImage writes and commits an image dir for d holding one file of n
// random-ish bytes.
func writeImage(t *testing.T, s *Store, d digest.Digest, n int) string {
	t.Helper()
	tmp, err := s.NewImageDir(d)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := chunk(byte(n), n)
	if err := os.WriteFile(filepath.Join(tmp, "pages.img"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.CommitImage(d, tmp); err != nil {
		t.Fatal(err)
	}
	return s.ImagePath(d)
}

// TestImageDirsCrashLeftovers commits an image dir, then leaves what a
// crash leaves (a temporary dir, a dir renamed into place whose marker
// never reached the disk): a reopened cache keeps the complete one and
// removes the rest.
func TestImageDirsCrashLeftovers(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	good := digest.FromString("good")
	dir := writeImage(t, s, good, 8192)
	for _, p := range []string{filepath.Join(root, "images"), dir} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %v, %v; want 0700", p, fi.Mode().Perm(), err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ImageMarker)); err != nil {
		t.Fatalf("no completion marker: %v", err)
	}
	torn := s.ImagePath(digest.FromString("torn"))
	tmp := s.ImagePath(digest.FromString("tmp")) + ".tmp-42"
	for _, p := range []string{torn, tmp} {
		os.MkdirAll(p, 0o700)
		os.WriteFile(filepath.Join(p, "pages.img"), []byte("partial"), 0o600)
	}
	s2, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s2.Image(good); !ok {
		t.Error("complete image dir lost on reopen")
	}
	if _, ok := s2.Image(digest.FromString("torn")); ok {
		t.Error("image dir without its marker is used")
	}
	for _, p := range []string{torn, tmp} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("leftover %s kept: %v", p, err)
		}
	}
	if st := s2.Stats(); st.Images != 1 || st.Bytes < 8192 {
		t.Errorf("reopened stats %+v; want one image of 8 KiB counted", st)
	}
}

// TestImageDirsCountAgainstCap commits two image dirs that do not fit the
// cap together: a pinned one stays, an unpinned one goes, least recently
// used first.
func TestImageDirsCountAgainstCap(t *testing.T) {
	s, _ := Open(t.TempDir(), 100<<10)
	now := time.Unix(1000, 0)
	s.clock = func() time.Time { now = now.Add(time.Second); return now }
	a, b, c := digest.FromString("a"), digest.FromString("b"), digest.FromString("c")
	s.PinImage(a)
	writeImage(t, s, a, 60<<10)
	writeImage(t, s, b, 60<<10)
	if _, ok := s.Image(a); !ok {
		t.Fatal("pinned image dir evicted")
	}
	if _, ok := s.Image(b); ok {
		t.Fatal("over the cap, the unpinned image dir was kept")
	}
	if _, err := os.Stat(s.ImagePath(b)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("evicted image dir still on disk: %v", err)
	}
	s.UnpinImage(a)
	writeImage(t, s, c, 60<<10)
	if _, ok := s.Image(a); ok {
		t.Fatal("least recently used image dir kept")
	}
	if st := s.Stats(); st.Bytes > 100<<10 || st.Images != 1 || st.Evictions != 2 {
		t.Fatalf("stats %+v", st)
	}
	leftovers, _ := filepath.Glob(filepath.Join(s.Root(), "images", "*.tmp-*"))
	if len(leftovers) > 0 {
		t.Fatalf("eviction left %v", leftovers)
	}
}

// TestOpenMakesDirsPrivate opens a cache an older version left with 0755
// dirs: they become 0700.
func TestOpenMakesDirsPrivate(t *testing.T) {
	root := t.TempDir()
	for _, d := range []string{"chunks/sha256", "images"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
		os.Chmod(filepath.Join(root, d), 0o755)
	}
	os.Chmod(filepath.Join(root, "chunks"), 0o755)
	if _, err := Open(root, 0); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"chunks", "chunks/sha256", "images"} {
		if fi, _ := os.Stat(filepath.Join(root, d)); fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: %v, want 0700", d, fi.Mode().Perm())
		}
	}
}
