package main

import (
	"bytes"
	"errors"
	"fmt"
	"os"

	"github.com/cryo-oci/cryo/puller/fetch"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/memmap"
	"gvisor.dev/gvisor/pkg/sentry/state/stateio"
)

// destFile is a file the sentry registered as the destination of its
// reads (its memory file, or a buffer file of its own), kept open by an fd
// of the gofer's own. A read into it is written with pwrite(2) from a
// buffer of the gofer's, not through the stateipc server's mapping of the
// file: writing through a mapping fills in the gofer's page tables for
// every page of the sandbox's memory, which the gofer never touches again,
// and on hosts where building page tables is dear (this project's CI
// machines are VMs that shadow them) that cost several times the copy
// itself: 256 MiB of page cache read into a fresh memfd took 0.47 s
// through a prefaulted mapping and 0.09 s with pread into a buffer and
// pwrite (docs/benchmarks.md). The bytes and the file are the same either
// way; only whose page tables learn of them differs.
type destFile struct {
	fd int
	// huge are the ranges the sentry asked huge pages for, on a host that
	// gives shared memory huge pages only where a mapping asks for them
	// (shmem_enabled "advise"): reads into them go through the mapping,
	// which the stateipc server advised so, as before.
	huge []memmap.FileRange
}

// covers reports whether frs are the ranges of d that dsts map, one each,
// as the stateipc server hands them over.
func (d *destFile) covers(frs []memmap.FileRange, dsts [][]byte) bool {
	if len(frs) != len(dsts) {
		return false
	}
	for i, fr := range frs {
		if fr.End < fr.Start || fr.Length() != uint64(len(dsts[i])) {
			return false
		}
	}
	return true
}

// wantsHuge reports whether any of frs overlaps a range of d that must be
// written through the mapping.
func (d *destFile) wantsHuge(frs []memmap.FileRange) bool {
	for _, h := range d.huge {
		for _, fr := range frs {
			if fr.Start < h.End && h.Start < fr.End {
				return true
			}
		}
	}
	return false
}

// NeedRegisterDestinationFD implements
// stateio.AsyncReader.NeedRegisterDestinationFD: the gofer writes into
// the files the sentry registers by fd (destFile).
func (r *reader) NeedRegisterDestinationFD() bool { return true }

// RegisterDestinationFD implements stateio.AsyncReader.RegisterDestinationFD.
// fd is valid only during the call: the gofer keeps a duplicate until
// Close. If it cannot, the file's reads go through the mapping.
func (r *reader) RegisterDestinationFD(fd int32, _ uint64, settings []stateio.ClientFileRangeSetting) (stateio.DestinationFile, error) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		r.s.log.Info("read destination not kept: its reads go through the mapping", "path", r.path, "err", err)
		return nil, nil
	}
	d := &destFile{fd: dup}
	if r.s.hugeOnlyByAdvice {
		for _, st := range settings {
			if st.Property == stateio.PropertyHugepage {
				d.huge = append(d.huge, st.FileRange)
			}
		}
	}
	r.destMu.Lock()
	defer r.destMu.Unlock()
	if r.closed {
		unix.Close(dup)
		return nil, nil
	}
	r.dests = append(r.dests, d)
	return d, nil
}

// closeDests closes the fds of the registered destinations, once no read
// is in flight.
func (r *reader) closeDests() {
	r.destMu.Lock()
	defer r.destMu.Unlock()
	r.closed = true
	for _, d := range r.dests {
		unix.Close(d.fd)
	}
	r.dests = nil
}

// readThrough reads n bytes of the file at off into a buffer and writes
// them into d at frs; maps are the same ranges as the server mapped them
// (clipped at the end of the file, n bytes in all). If a write fails, the
// rest is copied through maps.
func (r *reader) readThrough(d *destFile, frs []memmap.FileRange, maps [][]byte, n int, off int64, prio fetch.Priority) error {
	buf := r.s.bufs.get()
	defer r.s.bufs.put(buf)
	b := buf[:n]
	if err := r.s.src.ReadAt(r.ctx, r.path, [][]byte{b}, off, prio); err != nil {
		return err
	}
	for i := 0; i < len(maps); {
		// Ranges that follow each other in the file are one write; only
		// the last of maps may be shorter than its range.
		start, length, j := frs[i].Start, len(maps[i]), i+1
		for j < len(maps) && frs[j].Start == start+uint64(length) {
			length += len(maps[j])
			j++
		}
		if err := pwriteFull(d.fd, b[:length], int64(start)); err != nil {
			r.s.log.Warn("writing into the sandbox's memory file failed: copying through its mapping", "path", r.path, "off", off, "err", err)
			for _, m := range maps[i:] {
				b = b[copy(m, b):]
			}
			return nil
		}
		b, i = b[length:], j
	}
	return nil
}

// pwriteFull writes all of b at off in fd.
func pwriteFull(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		n, err := unix.Pwrite(fd, b, off)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("pwrite at %d: %w", off, unix.EIO)
		}
		b, off = b[n:], off+int64(n)
	}
	return nil
}

// bufPool holds the buffers of reads written through destFiles: at most
// one per read in flight (the sentry keeps at most maxParallel in flight
// per file), and at most maxParallel kept between reads, so the memory
// the gofer holds (charged to the sandbox's cgroup) is bounded.
type bufPool struct{ free chan []byte }

func newBufPool() *bufPool { return &bufPool{free: make(chan []byte, maxParallel)} }

func (p *bufPool) get() []byte {
	if p == nil {
		return make([]byte, maxIOBytes)
	}
	select {
	case b := <-p.free:
		return b
	default:
		return make([]byte, maxIOBytes)
	}
}

func (p *bufPool) put(b []byte) {
	if p == nil {
		return
	}
	select {
	case p.free <- b:
	default:
	}
}

// shmemHugeOnlyByAdvice reports whether this host gives shared memory
// huge pages only to mappings advised so (the bracketed word of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled is "advise"). With
// "never" or "deny" there are none; with "always", "within_size" or
// "force" pwrite gets them too.
func shmemHugeOnlyByAdvice() bool {
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	return err == nil && bytes.Contains(b, []byte("[advise]"))
}
