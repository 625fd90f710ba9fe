package gofer

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// memFile returns a memfd holding data, as the sentry's memory file.
func memFile(t *testing.T, data []byte) int {
	t.Helper()
	fd, err := unix.MemfdCreate("sentry-memory", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.Pwrite(fd, data, 0); err != nil {
		t.Fatal(err)
	}
	return fd
}

// TestRefUploadReadsTheSentrysFile streams a file named by ranges of a
// passed fd, out of the file's order, and inline bytes, and checks that
// cryo packs exactly the bytes named, acknowledging each frame in order.
func TestRefUploadReadsTheSentrysFile(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(t, sink)
	mem := make([]byte, 8<<20)
	for i := range mem {
		mem[i] = byte(i/4096) ^ byte(i)
	}
	fd := memFile(t, mem)
	u, err := c.UploadRefs(context.Background(), "pages.img")
	if err != nil {
		t.Fatal(err)
	}
	h, err := u.Register(fd, uint64(len(mem)))
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	var mu sync.Mutex
	var acked []int
	ack := func(i int) func(error) {
		return func(err error) {
			if err != nil {
				t.Errorf("frame %d: %v", i, err)
			}
			mu.Lock()
			acked = append(acked, i)
			mu.Unlock()
		}
	}
	// 1 MiB writes of pages in reverse order, as a sentry's ranges may
	// be, then a few inline bytes.
	for i := range 8 {
		var ranges [][2]uint64
		for p := 255; p >= 0; p-- {
			off := uint64((7-i)<<20 + p*4096)
			ranges = append(ranges, [2]uint64{off, 4096})
			want.Write(mem[off : off+4096])
		}
		u.Send(h, ranges, ack(i))
	}
	tail := []byte("checkpoint tail")
	u.SendBytes(tail, ack(8))
	want.Write(tail)
	n, err := u.Finish()
	if err != nil || n != int64(want.Len()) {
		t.Fatalf("Finish: %d, %v; want %d", n, err, want.Len())
	}
	if sink.sums["pages.img"] != sha256.Sum256(want.Bytes()) {
		t.Fatal("cryo packed other bytes than the frames named")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(acked) != 9 {
		t.Fatalf("acknowledged %v, want frames 0 to 8", acked)
	}
	for i, a := range acked {
		if a != i {
			t.Fatalf("acknowledged %v, want frames in order", acked)
		}
	}
}

// TestRefUploadRefusesRangesOutsideTheFile checks that a range past the
// size a file was passed with fails the file, and its send, with a
// clear error: no byte past it is read.
func TestRefUploadRefusesRangesOutsideTheFile(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(t, sink)
	fd := memFile(t, make([]byte, 1<<20))
	u, err := c.UploadRefs(context.Background(), "pages.img")
	if err != nil {
		t.Fatal(err)
	}
	h, err := u.Register(fd, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	failed := make(chan error, 1)
	u.Send(h, [][2]uint64{{1<<20 - 4096, 8192}}, func(err error) { failed <- err })
	_, err = u.Finish()
	if err == nil || !strings.Contains(err.Error(), "outside file") {
		t.Fatalf("Finish: %v, want a range outside the file refused", err)
	}
	if err := <-failed; err == nil {
		t.Fatal("the refused frame's send succeeded")
	}
	if _, ok := sink.sums["pages.img"]; ok {
		t.Fatal("the sink took the file whole")
	}
}

// TestRefUploadAbortDropsTheFile checks that a stream cut before its end
// never reaches the sink as a whole file.
func TestRefUploadAbortDropsTheFile(t *testing.T) {
	sink := &endSink{Sink: &readSink{sums: map[string][32]byte{}}, ended: make(chan error, 1)}
	c := startUploads(t, sink)
	u, err := c.UploadRefs(context.Background(), "pages.img")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	u.SendBytes(bytes.Repeat([]byte{7}, 1<<20), func(err error) { done <- err })
	<-done
	u.Abort()
	if _, err := u.Finish(); err == nil {
		t.Fatal("Finish after Abort succeeded")
	}
	// The server's side ends on its own time: wait for the sink.
	if err := <-sink.ended; err == nil {
		t.Fatal("the sink took an aborted file whole")
	}
}

// endSink passes AddFile to Sink and sends its error on ended when it
// returns.
type endSink struct {
	Sink
	ended chan error
}

func (s *endSink) AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	n, err := s.Sink.AddFile(ctx, path, mode, r)
	s.ended <- err
	return n, err
}

// BenchmarkRefUpload streams 256 MiB of a memfd as references, in 1 MiB
// frames: BenchmarkUpload's bytes without the socket.
func BenchmarkRefUpload(b *testing.B) {
	sink := &readSink{sums: map[string][32]byte{}}
	c := startUploads(b, sink)
	fd, err := unix.MemfdCreate("sentry-memory", unix.MFD_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(fd)
	const size = 256 << 20
	if _, err := unix.Pwrite(fd, make([]byte, size), 0); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(size)
	for b.Loop() {
		u, err := c.UploadRefs(context.Background(), "pages.img")
		if err != nil {
			b.Fatal(err)
		}
		h, err := u.Register(fd, size)
		if err != nil {
			b.Fatal(err)
		}
		for off := uint64(0); off < size; off += 1 << 20 {
			u.Send(h, [][2]uint64{{off, 1 << 20}}, func(error) {})
		}
		if _, err := u.Finish(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestRefUploadAnOlderCryoRefuses checks that a cryo without the
// reference route answers in a way the gofer takes for "plain uploads
// only", without its plain upload route seeing a request.
func TestRefUploadAnOlderCryoRefuses(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	sink := &readSink{sums: map[string][32]byte{}}
	mux := http.NewServeMux()
	mux.HandleFunc("PUT /v1/checkpoints/{id}/files/{path...}", func(w http.ResponseWriter, r *http.Request) {
		sink.AddFile(r.Context(), r.PathValue("path"), FileMode, r.Body)
		w.WriteHeader(http.StatusCreated)
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	defer srv.Close()
	c := NewClient(sock, "c", testIndex, 0)
	defer c.Close()
	_, err = c.UploadRefs(context.Background(), "pages.img")
	if !IsNoRefs(err) {
		t.Fatalf("UploadRefs to an older cryo: %v, want a refusal IsNoRefs takes", err)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.sums) != 0 {
		t.Fatal("the older cryo's plain upload took a file")
	}
}

// TestSessionCloseEndsReferenceUploads starts a reference upload on a
// session's socket, closes the session halfway through the file, and
// checks that the upload ends with an error and the sink's reader with
// it. http.Server.Close forgets hijacked connections: before the session
// cancelled its requests' context, the stream stayed open and both sides
// waited forever.
func TestSessionCloseEndsReferenceUploads(t *testing.T) {
	sink := &readSink{sums: map[string][32]byte{}}
	mux := http.NewServeMux()
	RegisterUploads(mux, func(id string) (Sink, bool) { return sink, id == "c" })
	s, err := StartSession(t.TempDir(), filepath.Join(t.TempDir(), "runsc"), mux)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			s.Close()
		}
	})
	c := NewClient(s.Socket, "c", testIndex, 30*time.Second)
	t.Cleanup(c.Close)
	u, err := c.UploadRefs(context.Background(), "pages.img")
	if err != nil {
		t.Fatal(err)
	}
	acked := make(chan error, 1)
	u.SendBytes([]byte("the first half"), func(err error) { acked <- err })
	if err := <-acked; err != nil {
		t.Fatalf("first frame: %v", err)
	}
	closed = true
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	finished := make(chan error, 1)
	go func() {
		_, err := u.Finish()
		finished <- err
	}()
	select {
	case err := <-finished:
		if err == nil {
			t.Fatal("a reference upload cut by Session.Close finished without an error")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a reference upload still open 20 s after its session closed")
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if _, ok := sink.sums["pages.img"]; ok {
		t.Fatal("the sink took the cut file as whole")
	}
}

// TestRefReaderErrorsStick feeds a reference stream a frame naming a
// file never passed, then a valid inline frame, and checks that the
// reader keeps answering its first error: after a bad frame the stream
// is out of step, and bytes read past it would be packed as the file's.
func TestRefReaderErrorsStick(t *testing.T) {
	ours, theirs := socketPair(t)
	bad := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32([]byte{'R'}, 7), 1)
	bad = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(bad, 0), 4096)
	good := append(binary.LittleEndian.AppendUint32([]byte{'D'}, 5), "bytes"...)
	if _, err := theirs.Write(append(bad, good...)); err != nil {
		t.Fatal(err)
	}
	r := &refReader{conn: ours, files: map[uint32]*os.File{}}
	defer r.closeFiles()
	p := make([]byte, 64)
	_, first := r.Read(p)
	if first == nil {
		t.Fatal("a frame naming a file never passed was read")
	}
	if n, err := r.Read(p); err != first || n != 0 {
		t.Fatalf("read after an error: %d bytes %q, %v; want 0, %v", n, p[:n], err, first)
	}
}

// socketPair returns the two ends of a Unix stream socket pair.
func socketPair(t *testing.T) (ours, theirs *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "socketpair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c.(*net.UnixConn)
	}
	return conn(fds[0]), conn(fds[1])
}

// TestRefReaderTakesAFileFrameAcrossTheBufferEnd sends an inline frame
// that fills the reader's buffer but for one byte, then two file frames,
// each with its fd: the first file frame's fd arrives with its first
// byte, the rest of it with the second's fd, in one read. Both files'
// bytes must be read; the reader must not take two fds in hand as fds
// passed without their frames.
func TestRefReaderTakesAFileFrameAcrossTheBufferEnd(t *testing.T) {
	ours, theirs := socketPair(t)
	inline := bytes.Repeat([]byte("i"), 64<<10-5-1)
	one, two := bytes.Repeat([]byte("1"), 4096), bytes.Repeat([]byte("2"), 4096)
	file := func(h uint32, data []byte) {
		head := binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint32([]byte{'F'}, h), uint64(len(data)))
		if _, _, err := theirs.WriteMsgUnix(head, unix.UnixRights(memFile(t, data)), nil); err != nil {
			t.Fatal(err)
		}
		r := binary.LittleEndian.AppendUint32(binary.LittleEndian.AppendUint32([]byte{'R'}, h), 1)
		r = binary.LittleEndian.AppendUint64(binary.LittleEndian.AppendUint64(r, 0), uint64(len(data)))
		if _, err := theirs.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := theirs.Write(append(binary.LittleEndian.AppendUint32([]byte{'D'}, uint32(len(inline))), inline...)); err != nil {
		t.Fatal(err)
	}
	file(1, one)
	file(2, two)
	if _, err := theirs.Write([]byte{'E'}); err != nil {
		t.Fatal(err)
	}
	r := &refReader{conn: ours, files: map[uint32]*os.File{}}
	defer r.closeFiles()
	got, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	if want := slices.Concat(inline, one, two); !bytes.Equal(got, want) {
		t.Errorf("read %d bytes, want the %d sent", len(got), len(want))
	}
}

// TestRefReaderRefusesUnclaimedFds passes an fd with an inline frame:
// no file frame names it, so the stream is out of step and must end in
// an error, not be read as whole.
func TestRefReaderRefusesUnclaimedFds(t *testing.T) {
	ours, theirs := socketPair(t)
	d := append(binary.LittleEndian.AppendUint32([]byte{'D'}, 5), "bytes"...)
	if _, _, err := theirs.WriteMsgUnix(d, unix.UnixRights(memFile(t, []byte("x"))), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := theirs.Write([]byte{'E'}); err != nil {
		t.Fatal(err)
	}
	r := &refReader{conn: ours, files: map[uint32]*os.File{}}
	defer r.closeFiles()
	if got, err := io.ReadAll(r); err == nil {
		t.Errorf("a stream passing an fd no frame names read as whole (%q)", got)
	}
}
