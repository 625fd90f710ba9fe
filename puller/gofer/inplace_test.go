package gofer

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
)

// placedFiles serves pages.img from memory (ReadAt) and says it lies in
// place in the file at path (Place), whose inode it reports as ino plus
// inoOffset (nonzero: a file replaced since the answer). It counts both.
type placedFiles struct {
	data      []byte
	path      string
	inoOffset uint64
	// gone: the file answered is not there (a gofer that cannot see the
	// node store's files).
	gone bool

	mu            sync.Mutex
	reads, places int
}

func (f *placedFiles) FileSize(path string) (int64, bool) {
	return int64(len(f.data)), path == "pages.img"
}

func (f *placedFiles) ReadAt(_ context.Context, _ string, p []byte, off int64, _ fetch.Priority) error {
	f.mu.Lock()
	f.reads++
	f.mu.Unlock()
	copy(p, f.data[off:])
	return nil
}

func (f *placedFiles) Place(_ context.Context, _ string, _, _ int64, _ fetch.Priority) (cache.InPlace, bool) {
	f.mu.Lock()
	f.places++
	f.mu.Unlock()
	if f.gone {
		return cache.InPlace{Path: f.path + ".gone", Dev: 1, Ino: 1}, true
	}
	info, err := os.Stat(f.path)
	if err != nil {
		return cache.InPlace{}, false
	}
	st := info.Sys().(*syscall.Stat_t)
	return cache.InPlace{Path: f.path, Dev: uint64(st.Dev), Ino: st.Ino + f.inoOffset}, true
}

func (f *placedFiles) counts() (reads, places int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reads, f.places
}

// serveFiles serves f on the file API at a new unix socket, as mount "m"
// of testIndex.
func serveFiles(t *testing.T, f Files) string {
	t.Helper()
	mux := http.NewServeMux()
	RegisterFiles(mux, func(id string) (Files, digest.Digest, bool) { return f, testIndex, id == "m" })
	sock := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return sock
}

// TestClientReadsInPlace reads a range that the server answers in place:
// a client that accepts such answers reads the bytes from the file named
// (the server reads nothing), into several buffers, and counts them; one
// that does not accept them never gets one; and an answer naming a file
// whose inode is not the one given (replaced since) is read through the
// socket instead, right.
func TestClientReadsInPlace(t *testing.T) {
	data := randomPages(1 << 20)
	path := filepath.Join(t.TempDir(), "pages.img")
	// The file in place holds the same bytes; the server's memory copy
	// is what a read through the socket returns.
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	read := func(c *Client) []byte {
		t.Helper()
		got := make([]byte, len(data)-8192)
		dsts := [][]byte{got[:1000], got[1000 : 300<<10], got[300<<10:]}
		if err := c.ReadAt(ctx, "pages.img", dsts, 8192, fetch.Read); err != nil {
			t.Fatal(err)
		}
		return got
	}

	f := &placedFiles{data: data, path: path}
	c := NewClient(serveFiles(t, f), "m", testIndex, 10*time.Second)
	c.InPlace = true
	if got := read(c); !bytes.Equal(got, data[8192:]) {
		t.Fatal("bytes read in place differ")
	}
	c.Close()
	if reads, places := f.counts(); reads != 0 || places != 1 {
		t.Errorf("server read %d times and answered %d in place, want 0 and 1", reads, places)
	}
	if n := c.PlacedBytes(); n != int64(len(data)-8192) {
		t.Errorf("%d bytes counted as read in place, want %d", n, len(data)-8192)
	}

	f = &placedFiles{data: data, path: path}
	c = NewClient(serveFiles(t, f), "m", testIndex, 10*time.Second)
	if got := read(c); !bytes.Equal(got, data[8192:]) {
		t.Fatal("bytes read through the socket differ")
	}
	c.Close()
	if reads, places := f.counts(); reads != 1 || places != 0 {
		t.Errorf("a client not accepting in-place answers: server read %d times and placed %d, want 1 and 0", reads, places)
	}

	f = &placedFiles{data: data, path: path, inoOffset: 1}
	c = NewClient(serveFiles(t, f), "m", testIndex, 10*time.Second)
	c.InPlace = true
	var logged []string
	c.Logf = func(format string, args ...any) { logged = append(logged, format) }
	if got := read(c); !bytes.Equal(got, data[8192:]) {
		t.Fatal("bytes read after a refused in-place answer differ")
	}
	c.Close()
	if reads, places := f.counts(); reads != 1 || places != 1 {
		t.Errorf("an answer naming another inode: server read %d times and placed %d, want 1 and 1", reads, places)
	}
	if n := c.PlacedBytes(); n != 0 {
		t.Errorf("%d bytes counted as read in place from a file that is not the one answered", n)
	}
	if len(logged) != 1 {
		t.Errorf("logged %d lines for the refused answer, want 1", len(logged))
	}

	// A client that can never open the files answered stops asking after
	// maxPlaceFailures answers in a row; every read is right.
	f = &placedFiles{data: data, path: path, gone: true}
	c = NewClient(serveFiles(t, f), "m", testIndex, 10*time.Second)
	c.InPlace = true
	for range maxPlaceFailures + 4 {
		if got := read(c); !bytes.Equal(got, data[8192:]) {
			t.Fatal("bytes read after an unreadable in-place answer differ")
		}
	}
	c.Close()
	if reads, places := f.counts(); reads != maxPlaceFailures+4 || places != maxPlaceFailures {
		t.Errorf("%d reads of files it cannot open: server read %d times and placed %d, want %d and %d", maxPlaceFailures+4, reads, places, maxPlaceFailures+4, maxPlaceFailures)
	}
}

// randomPages returns n bytes that differ from page to page.
func randomPages(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + i/4096)
	}
	return b
}
