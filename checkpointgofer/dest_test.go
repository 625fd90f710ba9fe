package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"strconv"
	"testing"

	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/memmap"
	"gvisor.dev/gvisor/pkg/sentry/state/stateio"
)

// memFiles is a snapshot of one file, pages.img, held in memory.
type memFiles struct{ data []byte }

func (m memFiles) FileSize(path string) (int64, bool) {
	return int64(len(m.data)), path == "pages.img"
}

func (m memFiles) ReadAt(_ context.Context, _ string, p []byte, off int64, _ fetch.Priority) error {
	copy(p, m.data[off:])
	return nil
}

// destination is a memory file as the sentry registers one: a memfd, and
// the buffer the stateipc server would hand the reader as its mapping.
// The test passes a decoy as the mapping, so that bytes written through
// it and bytes written through the fd can be told apart.
type destination struct {
	fd    int
	decoy []byte
}

func newDestination(t *testing.T, size int) destination {
	t.Helper()
	fd, err := unix.MemfdCreate("cryo-dest-test", unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatal(err)
	}
	return destination{fd: fd, decoy: make([]byte, size)}
}

func (d destination) contents(t *testing.T) []byte {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, st.Size)
	if _, err := unix.Pread(d.fd, b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// readv issues one AddReadv of the file at off into frs of df (mapped as
// d's decoy) and waits for its completion.
func readv(t *testing.T, r *reader, off int64, df stateio.DestinationFile, d destination, frs []memmap.FileRange) stateio.Completion {
	t.Helper()
	iovecs := make([]unix.Iovec, len(frs))
	total := uint64(0)
	for i, fr := range frs {
		iovecs[i].Base = &d.decoy[fr.Start]
		iovecs[i].SetLen(int(fr.Length()))
		total += fr.Length()
	}
	r.AddReadv(1, off, total, df, frs, iovecs)
	cs, err := r.Wait(nil, 1)
	if err != nil || len(cs) != 1 {
		t.Fatalf("Wait: %v, %v", cs, err)
	}
	return cs[0]
}

func testReader(t *testing.T, data []byte) *reader {
	t.Helper()
	s := &server{
		ctx:        context.Background(),
		log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		src:        gofer.Local(memFiles{data}),
		allowReads: true,
		sizes:      map[string]int64{"pages.img": int64(len(data))},
		bufs:       newBufPool(),
	}
	ar, err := s.OpenRead("pages.img")
	if err != nil {
		t.Fatal(err)
	}
	return ar.(*reader)
}

func pattern(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*131 + i>>12)
	}
	return b
}

// TestReadsWriteIntoTheFileByFD: a read into a registered destination is
// written into the file through the gofer's own fd, at the ranges the
// sentry named (neighbours merged, gaps left alone), and the server's
// mapping is not written; a read past the end of the file writes what
// the file has and completes with EOF; Close closes the gofer's fd.
func TestReadsWriteIntoTheFileByFD(t *testing.T) {
	page := unix.Getpagesize()
	data := pattern(40 * page)
	r := testReader(t, data)
	d := newDestination(t, 64*page)
	df, err := r.RegisterDestinationFD(int32(d.fd), uint64(64*page), nil)
	if err != nil || df == nil {
		t.Fatalf("RegisterDestinationFD: %v, %v", df, err)
	}
	kept := df.(*destFile).fd

	// 8 pages of the file at offset 4 pages, into pages 10-11 and 12-13
	// (neighbours) and 30-33 of the memory file.
	frs := []memmap.FileRange{
		{Start: uint64(10 * page), End: uint64(12 * page)},
		{Start: uint64(12 * page), End: uint64(14 * page)},
		{Start: uint64(30 * page), End: uint64(34 * page)},
	}
	c := readv(t, r, int64(4*page), df, d, frs)
	if c.Err != nil || c.N != uint64(8*page) {
		t.Fatalf("completion %+v, want %d bytes", c, 8*page)
	}
	want := make([]byte, 64*page)
	copy(want[10*page:14*page], data[4*page:8*page])
	copy(want[30*page:34*page], data[8*page:12*page])
	if got := d.contents(t); !bytes.Equal(got, want) {
		t.Errorf("the memory file does not hold the bytes read at the ranges asked")
	}
	if !bytes.Equal(d.decoy, make([]byte, len(d.decoy))) {
		t.Errorf("bytes were written through the mapping")
	}

	// One range, as the server submits most reads (AddRead).
	r.AddRead(2, int64(20*page), df, memmap.FileRange{Start: uint64(40 * page), End: uint64(42 * page)}, d.decoy[40*page:42*page])
	if cs, err := r.Wait(nil, 1); err != nil || len(cs) != 1 || cs[0].Err != nil || cs[0].N != uint64(2*page) {
		t.Fatalf("AddRead: %v, %v", cs, err)
	}
	copy(want[40*page:42*page], data[20*page:22*page])
	if got := d.contents(t); !bytes.Equal(got, want) || !bytes.Equal(d.decoy, make([]byte, len(d.decoy))) {
		t.Errorf("AddRead: not written into the memory file by fd alone")
	}

	// 4 pages asked at 38 pages: the file has 2.
	c = readv(t, r, int64(38*page), df, d, []memmap.FileRange{{Start: uint64(50 * page), End: uint64(54 * page)}})
	if c.Err != io.EOF || c.N != uint64(2*page) {
		t.Fatalf("read past the end: completion %+v, want %d bytes and EOF", c, 2*page)
	}
	copy(want[50*page:], data[38*page:])
	if got := d.contents(t); !bytes.Equal(got, want) {
		t.Errorf("read past the end: the memory file holds other bytes than the file's last pages")
	}

	var st unix.Stat_t
	if err := unix.Fstat(d.fd, &st); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	// The fd number may have been reused since; then it is another file.
	var after unix.Stat_t
	if err := unix.Fstat(kept, &after); err == nil && after.Ino == st.Ino && after.Dev == st.Dev {
		t.Errorf("the gofer's fd of the destination is still open after Close")
	}
	if df, err := r.RegisterDestinationFD(int32(d.fd), uint64(64*page), nil); df != nil || err != nil {
		t.Errorf("registered after Close: %v, %v", df, err)
	}
}

// TestFailedWriteGoesThroughTheMapping: a pwrite into the destination that
// fails (here: the memfd sealed against writes after it was registered)
// writes the read through the mapping instead, whole, and marks the
// destination so that its later reads go there too; a destination open
// read-only or O_APPEND is never written by fd.
func TestFailedWriteGoesThroughTheMapping(t *testing.T) {
	page := unix.Getpagesize()
	data := pattern(8 * page)
	r := testReader(t, data)
	defer r.Close()
	d := newDestination(t, 16*page)
	df, err := r.RegisterDestinationFD(int32(d.fd), uint64(16*page), nil)
	if err != nil || df == nil {
		t.Fatalf("RegisterDestinationFD: %v, %v", df, err)
	}
	if _, err := unix.FcntlInt(uintptr(d.fd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE); err != nil {
		t.Fatalf("seal: %v", err)
	}
	frs := []memmap.FileRange{{Start: 0, End: uint64(2 * page)}, {Start: uint64(4 * page), End: uint64(6 * page)}}
	if c := readv(t, r, 0, df, d, frs); c.Err != nil || c.N != uint64(4*page) {
		t.Fatalf("completion %+v", c)
	}
	if !bytes.Equal(d.decoy[:2*page], data[:2*page]) || !bytes.Equal(d.decoy[4*page:6*page], data[2*page:4*page]) {
		t.Errorf("a read whose pwrite failed was not written through the mapping, whole")
	}
	if !df.(*destFile).failed.Load() {
		t.Errorf("the failed destination is not marked: its later reads would try pwrite again")
	}

	for _, flags := range []int{unix.O_RDONLY, unix.O_RDWR | unix.O_APPEND} {
		fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(d.fd), flags, 0)
		if err != nil {
			t.Fatal(err)
		}
		if df, err := r.RegisterDestinationFD(int32(fd), uint64(16*page), nil); df != nil || err != nil {
			t.Errorf("an fd opened with flags %#x was registered for writes by fd: %v, %v", flags, df, err)
		}
		unix.Close(fd)
	}
}

// TestAdvisedRangesGoThroughTheMapping: a read into a range the sentry
// gave a huge-page setting (MADV_HUGEPAGE on hosts whose shmem_enabled is
// "advise", MADV_NOHUGEPAGE on "always" and "within_size" ones, which the
// kernel heeds only for pages allocated through a mapping) is written
// through the mapping; a read elsewhere by fd; a read into an
// unregistered destination through the mapping, as before.
func TestAdvisedRangesGoThroughTheMapping(t *testing.T) {
	page := unix.Getpagesize()
	data := pattern(16 * page)
	r := testReader(t, data)
	defer r.Close()
	d := newDestination(t, 24*page)
	df, err := r.RegisterDestinationFD(int32(d.fd), uint64(24*page), []stateio.ClientFileRangeSetting{
		{FileRange: memmap.FileRange{Start: 0, End: uint64(8 * page)}, Property: stateio.PropertyHugepage},
		{FileRange: memmap.FileRange{Start: uint64(16 * page), End: uint64(24 * page)}, Property: stateio.PropertyNoHugepage},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, at := range []int{4, 18} {
		if c := readv(t, r, 0, df, d, []memmap.FileRange{{Start: uint64(at * page), End: uint64((at + 2) * page)}}); c.Err != nil {
			t.Fatal(c.Err)
		}
		if !bytes.Equal(d.decoy[at*page:(at+2)*page], data[:2*page]) {
			t.Errorf("a read into the advised range at page %d was not written through the mapping", at)
		}
	}
	if c := readv(t, r, 0, df, d, []memmap.FileRange{{Start: uint64(10 * page), End: uint64(12 * page)}}); c.Err != nil {
		t.Fatal(c.Err)
	}
	if !bytes.Equal(d.contents(t)[10*page:12*page], data[:2*page]) || !bytes.Equal(d.decoy[10*page:12*page], make([]byte, 2*page)) {
		t.Errorf("a read outside the advised ranges was not written by fd")
	}
	if c := readv(t, r, int64(page), nil, d, []memmap.FileRange{{Start: uint64(12 * page), End: uint64(13 * page)}}); c.Err != nil {
		t.Fatal(c.Err)
	}
	if !bytes.Equal(d.decoy[12*page:13*page], data[page:2*page]) {
		t.Errorf("a read into an unregistered destination was not written through the mapping")
	}
}
