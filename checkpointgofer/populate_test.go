package main

import (
	"errors"
	"io"
	"log/slog"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestPopulateFaultsInPages: populate makes the whole pages of a read's
// destination (a shared mapping of a memory file, as the stateipc server
// maps the sandbox's) resident before any byte is written, and leaves
// the partial page a range starts in alone.
func TestPopulateFaultsInPages(t *testing.T) {
	page := unix.Getpagesize()
	const pages = 64
	fd, err := unix.MemfdCreate("cryo-populate-test", 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, int64(pages*page)); err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(fd, 0, pages*page, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	resident := func() []bool {
		vec := make([]byte, pages)
		// x/sys/unix has no Mincore on Linux.
		if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
			t.Fatalf("mincore: %v", errno)
		}
		out := make([]bool, pages)
		for i, v := range vec {
			out[i] = v&1 != 0
		}
		return out
	}
	for i, in := range resident() {
		if in {
			t.Fatalf("page %d resident before populate", i)
		}
	}
	s := &server{log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	// Two ranges, as one read's iovecs: pages 0-15 from mid-page 0, and
	// pages 32-47 whole.
	s.populate([][]byte{m[100 : 16*page], m[32*page : 48*page]})
	if s.noPopulate.Load() {
		if err := unix.Madvise(m, unix.MADV_POPULATE_WRITE); errors.Is(err, unix.EINVAL) {
			t.Skipf("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): %v", err)
		}
		t.Fatal("populate gave up on a kernel that has MADV_POPULATE_WRITE")
	}
	got := resident()
	for i, in := range got {
		want := (i >= 1 && i < 16) || (i >= 32 && i < 48)
		if in != want {
			t.Errorf("page %d: resident %v, want %v", i, in, want)
		}
	}
}
