package gofer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"io/fs"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// readSink is a Sink that reads each file as the packer does (into a
// buffer of about its chunker's lookahead) and keeps its sha256, and
// counts the reads it needed.
type readSink struct {
	mu    sync.Mutex
	sums  map[string][32]byte
	reads int
}

func (s *readSink) AddFile(_ context.Context, path string, _ fs.FileMode, r io.Reader) (int64, error) {
	h := sha256.New()
	buf := make([]byte, 528<<10)
	var n int64
	reads := 0
	for {
		k, err := r.Read(buf)
		reads++
		h.Write(buf[:k])
		n += int64(k)
		if err == io.EOF {
			break
		}
		if err != nil {
			return n, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sums[path] = [32]byte(h.Sum(nil))
	s.reads += reads
	return n, nil
}

// startUploads serves the upload API of session "c" into sink on a unix
// socket and returns a client of it.
func startUploads(t testing.TB, sink Sink) *Client {
	sock := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	RegisterUploads(mux, func(id string) (Sink, bool) { return sink, id == "c" })
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	c := NewClient(sock, "c", testIndex, 30*time.Second)
	t.Cleanup(c.Close)
	return c
}

// TestUploadWritesAsTheSentryDoes streams a file in the sentry's 1 MiB
// writes and checks that the server gets exactly its bytes, in large
// pieces: a write is sent as one piece of the body, not cut in 32 KiB
// ones (io.Copy's buffer), which made a 1 GiB checkpoint 65,536 round
// trips of the socket on each side.
func TestUploadWritesAsTheSentryDoes(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(t, sink)
	data := make([]byte, 64<<20)
	for i := range data {
		data[i] = byte(i * 7 / 4096)
	}
	up := c.Upload(context.Background(), "pages.img")
	for off := 0; off < len(data); off += 1 << 20 {
		if _, err := up.Write(data[off : off+1<<20]); err != nil {
			t.Fatal(err)
		}
	}
	n, err := up.Finish()
	if err != nil || n != int64(len(data)) {
		t.Fatalf("Finish: %d, %v; want %d", n, err, len(data))
	}
	if sink.sums["pages.img"] != sha256.Sum256(data) {
		t.Fatal("the server read other bytes than were written")
	}
	// 64 MiB in 32 KiB pieces is 2,048 reads at least; in 1 MiB writes
	// the reads are bounded by the socket's buffer, not by the pieces.
	if sink.reads >= 2048 {
		t.Errorf("the server needed %d reads for 64 MiB: the body came in pieces of at most %d bytes", sink.reads, len(data)/sink.reads)
	}
	t.Logf("%d reads for %d MiB", sink.reads, len(data)>>20)
}

// TestUploadAbortLosesTheFile checks that an aborted upload never reaches
// the sink as a whole file.
func TestUploadAbortLosesTheFile(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(t, sink)
	up := c.Upload(context.Background(), "pages.img")
	if _, err := up.Write(bytes.Repeat([]byte{1}, 3<<20)); err != nil {
		t.Fatal(err)
	}
	up.Abort(io.ErrUnexpectedEOF)
	if _, err := up.Finish(); err == nil {
		t.Fatal("Finish after Abort succeeded")
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if _, ok := sink.sums["pages.img"]; ok {
		t.Fatal("the sink took an aborted file whole")
	}
}

// stuckSink reads nothing and returns when the request ends, as a cryo
// whose packer stopped.
type stuckSink struct{}

func (stuckSink) AddFile(ctx context.Context, _ string, _ fs.FileMode, _ io.Reader) (int64, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

// TestUploadAbortWhileAWriteIsStuck aborts an upload whose write waits on
// a server that stopped reading, and checks that Abort and the write
// return. Abort used to close the body and wait for a request that
// could only end when the server read again.
func TestUploadAbortWhileAWriteIsStuck(t *testing.T) {
	c := startUploads(t, stuckSink{})
	up := c.Upload(context.Background(), "pages.img")
	wrote := make(chan error, 1)
	go func() {
		// Far more than the socket's buffers hold.
		_, err := up.Write(make([]byte, 64<<20))
		wrote <- err
	}()
	// Let the write reach the connection and block there (the test
	// asserts nothing about time: an Abort that came first also passes).
	time.Sleep(200 * time.Millisecond)
	aborted := make(chan struct{})
	go func() {
		up.Abort(io.ErrUnexpectedEOF)
		close(aborted)
	}()
	select {
	case <-aborted:
	case <-time.After(20 * time.Second):
		t.Fatal("Abort still waiting 20 s after it was called, on a write the server never reads")
	}
	if err := <-wrote; err == nil {
		t.Fatal("a write cut by Abort succeeded")
	}
}

// BenchmarkUpload streams 256 MiB through the upload API in 1 MiB writes.
func BenchmarkUpload(b *testing.B) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(b, sink)
	data := make([]byte, 256<<20)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		up := c.Upload(context.Background(), "pages.img")
		for off := 0; off < len(data); off += 1 << 20 {
			if _, err := up.Write(data[off : off+1<<20]); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := up.Finish(); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(sink.reads)/float64(b.N), "reads/op")
}

// TestUploadToNoSessionFails streams to a session the server does not
// have: it answers 404 without reading the body, and the writes and
// Finish fail instead of waiting for a reader that is gone.
func TestUploadToNoSessionFails(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(t, sink)
	c.id = "other"
	up := c.Upload(context.Background(), "pages.img")
	chunk := make([]byte, 1<<20)
	for range 64 {
		if _, err := up.Write(chunk); err != nil {
			break
		}
	}
	_, err := up.Finish()
	if err == nil || !strings.Contains(err.Error(), "404") {
		t.Fatalf("Finish of an upload to no session: %v, want a 404", err)
	}
}
