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
