package main

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

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
// machines are VMs that shadow them) that costs several times the copy
// itself: 256 MiB of page cache read into a fresh memfd took 0.61 s
// through a prefaulted mapping and 0.08 s with pread into a buffer and
// pwrite (docs/benchmarks.md, `go run ./bench/firsttouch -fill 256`). The
// bytes and the file are the same either way; only whose page tables
// learn of them differs.
type destFile struct {
	fd int
	// advised are the ranges the sentry gave a huge-page setting
	// (MADV_HUGEPAGE or MADV_NOHUGEPAGE, which the stateipc server applied
	// to its mapping; gVisor sends them only where the host's
	// shmem_enabled makes them matter). The kernel heeds them only for
	// pages allocated through a mapping, so reads into them go through it.
	advised []memmap.FileRange
	// failed is set once a pwrite into the file failed: its reads go
	// through the mapping from then on.
	failed atomic.Bool
}

// covers reports whether frs are the ranges that dsts map, one for one
// and of the same lengths, as the stateipc server hands them over.
func (d *destFile) covers(frs []memmap.FileRange, dsts [][]byte) bool {
	if len(frs) != len(dsts) {
		return false
	}
	for i, fr := range frs {
		if fr.Length() != uint64(len(dsts[i])) {
			return false
		}
	}
	return true
}

// takesPwrite reports whether a read into frs of d is written by fd:
// unless a pwrite into d failed before or frs overlap an advised range.
func (d *destFile) takesPwrite(frs []memmap.FileRange) bool {
	if d.failed.Load() {
		return false
	}
	for _, a := range d.advised {
		for _, fr := range frs {
			if fr.Start < a.End && a.Start < fr.End {
				return false
			}
		}
	}
	return true
}

// NeedRegisterDestinationFD implements
// stateio.AsyncReader.NeedRegisterDestinationFD: the gofer writes into
// the files the sentry registers by fd (destFile).
func (r *reader) NeedRegisterDestinationFD() bool { return true }

// RegisterDestinationFD implements stateio.AsyncReader.RegisterDestinationFD.
// fd is valid only during the call: the gofer keeps a duplicate until
// Close. If it cannot, or the fd is not open for writing at any offset
// (read-only, or O_APPEND, where pwrite writes at the end), the file's
// reads go through the mapping.
func (r *reader) RegisterDestinationFD(fd int32, _ uint64, settings []stateio.ClientFileRangeSetting) (stateio.DestinationFile, error) {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil || fl&unix.O_ACCMODE == unix.O_RDONLY || fl&unix.O_APPEND != 0 {
		r.s.log.Info("read destination not written by fd: its reads go through the mapping", "path", r.path, "flags", fl, "err", err)
		return nil, nil
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		r.s.log.Info("read destination not kept: its reads go through the mapping", "path", r.path, "err", err)
		return nil, nil
	}
	d := &destFile{fd: dup}
	for _, st := range settings {
		d.advised = append(d.advised, st.FileRange)
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
// rest is copied through maps, and so are d's later reads.
func (r *reader) readThrough(d *destFile, frs []memmap.FileRange, maps [][]byte, n int, off int64, prio fetch.Priority) error {
	b, err := r.s.bufs.get(r.ctx, n)
	if err != nil {
		return err
	}
	defer r.s.bufs.put(b)
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
			if !d.failed.Swap(true) {
				r.s.log.Warn("writing into the sandbox's memory file by fd failed: its reads go through the mapping", "path", r.path, "off", off, "err", err)
			}
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

// bufPool holds the buffers of reads written into destFiles. The sentry
// keeps at most maxParallel reads in flight per file, or farParallel of
// pages.img when the registry is far (pagesReads), and reads the other
// files while pages.img loads; the pool lends at most maxBuffers at once,
// one per read, a read waiting for one past that, and keeps at most
// maxBuffers between reads, so the gofer's memory (charged to the
// sandbox's cgroup) is bounded: at most maxBuffers buffers of at most
// maxIOBytes, 48 MiB. A read holds one buffer and never asks for a
// second, so the wait cannot deadlock.
type bufPool struct {
	free  chan []byte
	slots chan struct{}
}

// maxBuffers bounds the buffers a gofer lends at once: one per read the
// sentry may have in flight of pages.img and of another file.
const maxBuffers = farParallel + maxParallel

func newBufPool() *bufPool {
	return &bufPool{free: make(chan []byte, maxBuffers), slots: make(chan struct{}, maxBuffers)}
}

// get lends a buffer of n bytes (at most maxIOBytes), waiting for one
// while maxBuffers are lent, until ctx ends.
func (p *bufPool) get(ctx context.Context, n int) ([]byte, error) {
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	select {
	case b := <-p.free:
		if cap(b) >= n {
			return b[:n], nil
		}
	default:
	}
	return make([]byte, n), nil
}

// put returns a buffer lent by get.
func (p *bufPool) put(b []byte) {
	select {
	case p.free <- b:
	default:
	}
	<-p.slots
}
