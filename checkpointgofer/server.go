package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/profile"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/memmap"
	"gvisor.dev/gvisor/pkg/sentry/state/stateio"
)

// Read sizes and parallelism the gofer offers the sentry. The sentry
// reads pages.img in pieces of at most maxIOBytes (cryo's chunk size),
// maxParallel at a time, its background sweep filling every slot its
// page-fault reads do not take. 16 keeps the puller's 12 fetch workers
// busy; more only lengthens the time a sweep read spends queued, and a
// page fault on a page whose sweep read has started waits for that read
// (gVisor issues no priority read for it): with 48 in flight on a 100
// Mbit/s link, such a fault waited seconds (48 MiB; where the registry is
// far, reads are smaller and more, below). The bytes land in the
// sandbox's memory file, written with pwrite from a buffer per read in
// flight (destFile), or through the stateipc server's mapping of it.
const (
	maxIOBytes  = 1 << 20
	maxParallel = 16
)

// Where the registry is far the gofer offers smaller reads of pages.img,
// more of them at once. The sentry fixes the read size when it opens the
// file (before any of it is fetched) and admits a page fault's reads only
// as its reads in flight complete; over a far link each read completes
// only once its bytes have crossed (80 ms for 1 MiB at 100 Mbit/s), and
// on the node's cores small reads cost more than large ones. So where
// the mount's round trip (gofer.LinkReporter) is farRoundTrip or more,
// reads of pages.img are at most farReadBytes (gVisor's own size for a
// local image), farParallel at a time: 8 MiB in flight, enough to keep a
// 1 Gbit/s link full. The round trip is what a mount knows by then (its
// small files are a few fetches of a few KiB, which say nothing of the
// link's rate); a slow link with a short round trip is not told apart.
// docs/benchmarks.md, "The gofer's read size follows the round trip",
// has the measurements behind each number.
const (
	farRoundTrip = 6 * time.Millisecond
	farReadBytes = 256 << 10
	farParallel  = 2 * maxParallel
)

// pagesReads is the read size and parallelism the gofer offers the
// sentry for pages.img, given the round trip its source measured (0 if
// it measured none: then maxIOBytes and maxParallel, as for the other
// files).
func pagesReads(rtt time.Duration) (size uint64, parallel int) {
	if rtt >= farRoundTrip {
		return farReadBytes, farParallel
	}
	return maxIOBytes, maxParallel
}

// server implements stateipc.AsyncFileServerImpl: reads from a
// gofer.Source (a restore), or writes to a cryo process's upload API (a
// checkpoint).
type server struct {
	ctx        context.Context
	log        *slog.Logger
	src        gofer.Source
	allowReads bool
	// image is what runsc asked the gofer for: the sentry may open the
	// files of its kind of image only (image.files()).
	image imageMode
	// sizes are the sizes of the checkpoint files the snapshot has, asked
	// before serving (statFiles).
	sizes   map[string]int64
	uploads *gofer.Client

	// rtt is the round trip the source measured (sizeReads), which sizes
	// the reads of pages.img (pagesReads).
	rtt time.Duration

	reads, faults, served, written atomic.Int64
	// noPopulate is set once the kernel refused MADV_POPULATE_WRITE.
	noPopulate atomic.Bool
	// bufs are the buffers of reads written into destFiles.
	bufs *bufPool
}

// sizeReads takes the round trip src says (0: none) for the reads of
// pages.img (pagesReads).
func (s *server) sizeReads(src gofer.Source) {
	if lr, ok := src.(gofer.LinkReporter); ok {
		s.rtt = lr.LinkRoundTrip()
	}
}

// Destroy implements stateipc.AsyncFileServerImpl.Destroy.
func (s *server) Destroy() {}

// OpenRead implements stateipc.AsyncFileServerImpl.OpenRead.
func (s *server) OpenRead(path string) (stateio.AsyncReader, error) {
	if !s.allowReads {
		return nil, fmt.Errorf("cryo checkpoint gofer: reads not allowed (runsc asked for a %s)", s.image)
	}
	if !slices.Contains(s.image.files(), path) {
		return nil, fmt.Errorf("cryo checkpoint gofer: %q is no file of a %s image (%s)", path, s.image.kind(), strings.Join(s.image.files(), ", "))
	}
	size, ok := s.sizes[path]
	if !ok {
		// Only pages_meta.img and pages.img may be missing (a checkpoint
		// without a pages file); the sentry takes an error opening
		// pages_meta.img for that.
		s.log.Info("open", "path", path, "err", "not in the snapshot")
		return nil, fmt.Errorf("%s: %w", path, os.ErrNotExist)
	}
	maxRead, parallel := uint64(maxIOBytes), maxParallel
	if path == "pages.img" {
		maxRead, parallel = pagesReads(s.rtt)
	}
	ctx, cancel := context.WithCancel(s.ctx)
	r := &reader{s: s, path: path, size: size, maxRead: maxRead, parallel: parallel, ctx: ctx, cancel: cancel, done: make(chan stateio.Completion, parallel)}
	if path == "pages.img" {
		r.classify = &profile.Classifier{}
	}
	s.log.Info("open", "path", path, "size", size, "max read", maxRead, "parallel", parallel)
	return r, nil
}

// OpenWrite implements stateipc.AsyncFileServerImpl.OpenWrite.
func (s *server) OpenWrite(path string) (stateio.AsyncWriter, error) {
	if s.uploads == nil {
		return nil, fmt.Errorf("cryo checkpoint gofer: writes not allowed (runsc asked for a %s)", s.image)
	}
	if !slices.Contains(s.image.files(), path) {
		return nil, fmt.Errorf("cryo checkpoint gofer: %q is no file of a %s image (%s)", path, s.image.kind(), strings.Join(s.image.files(), ", "))
	}
	refs, err := s.uploads.UploadRefs(s.ctx, path)
	if err == nil {
		s.log.Info("open for writing", "path", path, "upload", "references")
		return &refWriter{s: s, path: path, up: refs, done: make(chan stateio.Completion, maxParallel)}, nil
	}
	if !gofer.IsNoRefs(err) {
		return nil, fmt.Errorf("cryo checkpoint gofer: %w", err)
	}
	s.log.Info("open for writing", "path", path, "upload", "bytes", "why", err)
	w := &writer{s: s, path: path, up: s.uploads.Upload(s.ctx, path),
		queue: make(chan writeJob, maxParallel), done: make(chan stateio.Completion, maxParallel), stopped: make(chan struct{})}
	go w.run()
	return w, nil
}

// reader is a stateio.AsyncReader of one file of the snapshot. Each read
// runs in a goroutine of its own, into its destination (the sandbox's
// memory file: written by fd where it can be, destFile, else through the
// stateipc server's mapping), and completes only when every byte asked
// for (clipped at the end of the file) is there and verified.
type reader struct {
	s        *server
	path     string
	size     int64
	maxRead  uint64
	parallel int
	classify *profile.Classifier

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	done   chan stateio.Completion

	// dests are the registered destinations, closed (and closed set)
	// by Close.
	destMu sync.Mutex
	dests  []*destFile
	closed bool
}

var _ stateio.AsyncReader = (*reader)(nil)

// MaxReadBytes implements stateio.AsyncReader.MaxReadBytes.
func (r *reader) MaxReadBytes() uint64 { return r.maxRead }

// MaxRanges implements stateio.AsyncReader.MaxRanges: one range per page
// of a read, as gVisor's own pages file reader offers.
func (r *reader) MaxRanges() int { return int(r.maxRead) / unix.Getpagesize() }

// MaxParallel implements stateio.AsyncReader.MaxParallel.
func (r *reader) MaxParallel() int { return r.parallel }

// AddRead implements stateio.AsyncReader.AddRead.
func (r *reader) AddRead(id int, off int64, df stateio.DestinationFile, fr memmap.FileRange, dst []byte) {
	r.start(id, off, df, []memmap.FileRange{fr}, [][]byte{dst})
}

// AddReadv implements stateio.AsyncReader.AddReadv.
func (r *reader) AddReadv(id int, off int64, total uint64, df stateio.DestinationFile, frs []memmap.FileRange, iovecs []unix.Iovec) {
	dsts := make([][]byte, len(iovecs))
	for i, iov := range iovecs {
		dsts[i] = stateio.SliceFromIovec(iov)
	}
	r.start(id, off, df, frs, dsts)
}

// start reads the file at off into dsts (the ranges frs of df, as
// mapped), one after the other, and sends the completion. Reads are
// classified here, in the order the sentry submits them: the sweep's come
// in ascending order. Every read of checkpoint.img and pages_meta.img is
// one the whole restore waits on.
func (r *reader) start(id int, off int64, df stateio.DestinationFile, frs []memmap.FileRange, dsts [][]byte) {
	prio := fetch.Fault
	if r.classify != nil {
		total := int64(0)
		for _, d := range dsts {
			total += int64(len(d))
		}
		prio = r.classify.Classify(off, total)
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		r.done <- r.read(id, off, df, frs, dsts, prio)
	}()
}

func (r *reader) read(id int, off int64, df stateio.DestinationFile, frs []memmap.FileRange, dsts [][]byte, prio fetch.Priority) stateio.Completion {
	r.s.reads.Add(1)
	if prio == fetch.Fault {
		r.s.faults.Add(1)
	}
	// Clip at the end of the file: the sentry's buffered readers read
	// past it and expect EOF there.
	var want [][]byte
	n, eof := 0, false
	for _, d := range dsts {
		left := r.size - off - int64(n)
		if left <= 0 {
			eof = true
			break
		}
		if int64(len(d)) > left {
			d, eof = d[:left], true
		}
		want = append(want, d)
		n += len(d)
		if eof {
			break
		}
	}
	if n > 0 {
		var err error
		if d, ok := df.(*destFile); ok && d.covers(frs, dsts) && d.takesPwrite(frs) {
			err = r.readThrough(d, frs, want, n, off, prio)
		} else {
			r.s.populate(want)
			err = r.s.src.ReadAt(r.ctx, r.path, want, off, prio)
		}
		if err != nil {
			if !errors.Is(err, context.Canceled) {
				r.s.log.Error("read failed: the sandbox will stop", "path", r.path, "off", off, "len", n, "err", err)
			}
			return stateio.Completion{ID: id, Err: unix.EIO}
		}
		r.s.served.Add(int64(n))
	}
	c := stateio.Completion{ID: id, N: uint64(n)}
	if eof {
		c.Err = io.EOF
	}
	return c
}

// Wait implements stateio.AsyncReader.Wait.
func (r *reader) Wait(cs []stateio.Completion, minCompletions int) ([]stateio.Completion, error) {
	return stateio.CompletionChanWait(r.done, cs, minCompletions)
}

// Close implements stateio.AsyncReader.Close: it cancels the reads in
// flight and waits for them.
func (r *reader) Close() error {
	r.cancel()
	go func() {
		for range r.done {
		}
	}()
	r.wg.Wait()
	close(r.done)
	r.closeDests()
	return nil
}

// writer is a stateio.AsyncWriter of one file of a checkpoint: the
// sentry's appending writes are streamed, in the order they were added,
// to the upload API, where the file is packed and pushed as it comes. A
// write completes once its bytes are handed to the connection (the
// sentry may then reuse its memory); Finalize completes once the file is
// packed. Nothing is buffered here beyond the socket's own buffers.
type writer struct {
	stateio.NoRegisterClientFD
	s    *server
	path string
	up   *gofer.Upload

	queue   chan writeJob
	done    chan stateio.Completion
	stopped chan struct{}
	failed  atomic.Bool
}

var _ stateio.AsyncWriter = (*writer)(nil)

type writeJob struct {
	id   int
	srcs [][]byte
}

// MaxWriteBytes implements stateio.AsyncWriter.MaxWriteBytes.
func (w *writer) MaxWriteBytes() uint64 { return maxIOBytes }

// MaxRanges implements stateio.AsyncWriter.MaxRanges.
func (w *writer) MaxRanges() int { return maxIOBytes / unix.Getpagesize() }

// MaxParallel implements stateio.AsyncWriter.MaxParallel.
func (w *writer) MaxParallel() int { return maxParallel }

// AddWrite implements stateio.AsyncWriter.AddWrite.
func (w *writer) AddWrite(id int, _ stateio.SourceFile, _ memmap.FileRange, src []byte) {
	w.queue <- writeJob{id: id, srcs: [][]byte{src}}
}

// AddWritev implements stateio.AsyncWriter.AddWritev.
func (w *writer) AddWritev(id int, total uint64, _ stateio.SourceFile, _ []memmap.FileRange, iovecs []unix.Iovec) {
	srcs := make([][]byte, len(iovecs))
	for i, iov := range iovecs {
		srcs[i] = stateio.SliceFromIovec(iov)
	}
	w.queue <- writeJob{id: id, srcs: srcs}
}

// run streams the queued writes in order.
func (w *writer) run() {
	defer close(w.stopped)
	for j := range w.queue {
		var n uint64
		var err error
		for _, b := range j.srcs {
			if w.failed.Load() {
				err = unix.EIO
				break
			}
			if _, err = w.up.Write(b); err != nil {
				// After Close's abort a write fails with io.ErrClosedPipe:
				// nothing to report then.
				if !w.failed.Load() {
					w.s.log.Error("write failed: the checkpoint fails", "path", w.path, "err", err)
				}
				w.failed.Store(true)
				err = unix.EIO
				break
			}
			n += uint64(len(b))
		}
		w.s.written.Add(int64(n))
		w.done <- stateio.Completion{ID: j.id, N: n, Err: err}
	}
}

// Wait implements stateio.AsyncWriter.Wait.
func (w *writer) Wait(cs []stateio.Completion, minCompletions int) ([]stateio.Completion, error) {
	return stateio.CompletionChanWait(w.done, cs, minCompletions)
}

// Reserve implements stateio.AsyncWriter.Reserve: the upload needs no
// room reserved.
func (w *writer) Reserve(n uint64) {}

// Finalize implements stateio.AsyncWriter.Finalize: it ends the file and
// waits until cryo has packed it.
func (w *writer) Finalize() error {
	close(w.queue)
	<-w.stopped
	w.queue = nil
	return w.s.finalized(w.path)(w.up.Finish())
}

// Close implements stateio.AsyncWriter.Close. A file not finalized is
// aborted first (a write waiting for cryo returns once cryo reads again
// or the request ends):
// cryo drops it, and the snapshot is never tagged.
func (w *writer) Close() error {
	if w.queue != nil {
		w.failed.Store(true)
		w.up.Abort(errAborted)
		close(w.queue)
		go func() {
			for range w.done {
			}
		}()
		<-w.stopped
		close(w.done)
	}
	return nil
}

// finalized logs the end of path's upload, n bytes packed or err, and
// returns err.
func (s *server) finalized(path string) func(n int64, err error) error {
	return func(n int64, err error) error {
		if err != nil {
			s.log.Error("finalize failed: the checkpoint fails", "path", path, "err", err)
			return err
		}
		s.log.Info("written", "path", path, "size", n)
		return nil
	}
}

// errAborted ends the upload of a file the sentry closed unfinalized.
var errAborted = errors.New("the sentry closed the file before finalizing it")

// refWriter is a stateio.AsyncWriter of one file of a checkpoint, sent
// to cryo as a reference upload (gofer.RefsProtocol): the sentry's files
// that its writes come from are passed to cryo once, as they are
// registered, and each write is sent as the ranges of them it names, which
// cryo reads itself. A write completes when cryo has read its bytes (the
// sentry may then reuse them); Finalize once cryo has packed the file.
type refWriter struct {
	s    *server
	path string
	up   *gofer.RefUpload
	done chan stateio.Completion

	failed    atomic.Bool
	finalized bool
}

var _ stateio.AsyncWriter = (*refWriter)(nil)

// refFile is the stateio.SourceFile of a file passed to cryo.
type refFile uint32

// MaxWriteBytes implements stateio.AsyncWriter.MaxWriteBytes.
func (w *refWriter) MaxWriteBytes() uint64 { return maxIOBytes }

// MaxRanges implements stateio.AsyncWriter.MaxRanges.
func (w *refWriter) MaxRanges() int { return maxIOBytes / unix.Getpagesize() }

// MaxParallel implements stateio.AsyncWriter.MaxParallel.
func (w *refWriter) MaxParallel() int { return maxParallel }

// NeedRegisterSourceFD implements stateio.AsyncWriter.NeedRegisterSourceFD.
func (w *refWriter) NeedRegisterSourceFD() bool { return true }

// RegisterSourceFD implements stateio.AsyncWriter.RegisterSourceFD: the
// file is passed to cryo (the kernel gives cryo its own fd).
func (w *refWriter) RegisterSourceFD(fd int32, size uint64, _ []stateio.ClientFileRangeSetting) (stateio.SourceFile, error) {
	h, err := w.up.Register(int(fd), size)
	if err != nil {
		w.s.log.Error("passing a source file failed: the checkpoint fails", "path", w.path, "err", err)
		return nil, err
	}
	return refFile(h), nil
}

// complete is a write's end, once cryo answered for it.
func (w *refWriter) complete(id int, n uint64) func(error) {
	return func(err error) {
		if err != nil {
			if !w.failed.Swap(true) {
				w.s.log.Error("write failed: the checkpoint fails", "path", w.path, "err", err)
			}
			w.done <- stateio.Completion{ID: id, Err: unix.EIO}
			return
		}
		w.s.written.Add(int64(n))
		w.done <- stateio.Completion{ID: id, N: n}
	}
}

// AddWrite implements stateio.AsyncWriter.AddWrite.
func (w *refWriter) AddWrite(id int, srcFile stateio.SourceFile, srcFR memmap.FileRange, src []byte) {
	w.add(id, uint64(len(src)), srcFile, []memmap.FileRange{srcFR}, [][]byte{src})
}

// AddWritev implements stateio.AsyncWriter.AddWritev.
func (w *refWriter) AddWritev(id int, total uint64, srcFile stateio.SourceFile, srcFRs []memmap.FileRange, iovecs []unix.Iovec) {
	srcs := make([][]byte, len(iovecs))
	for i, iov := range iovecs {
		srcs[i] = stateio.SliceFromIovec(iov)
	}
	w.add(id, total, srcFile, srcFRs, srcs)
}

// add sends one write: as ranges of its source file if that was passed to
// cryo, else as its bytes.
func (w *refWriter) add(id int, total uint64, srcFile stateio.SourceFile, frs []memmap.FileRange, srcs [][]byte) {
	if total == 0 {
		w.done <- stateio.Completion{ID: id}
		return
	}
	if h, ok := srcFile.(refFile); ok && len(frs) == len(srcs) {
		ranges := make([][2]uint64, 0, len(frs))
		for _, fr := range frs {
			if fr.Length() > 0 {
				ranges = append(ranges, [2]uint64{fr.Start, fr.Length()})
			}
		}
		w.up.Send(uint32(h), ranges, w.complete(id, total))
		return
	}
	// The bytes themselves, one frame per piece: the last answer is the
	// write's.
	last := 0
	for i, b := range srcs {
		if len(b) > 0 {
			last = i
		}
	}
	for i, b := range srcs {
		if len(b) == 0 {
			continue
		}
		done := func(error) {}
		if i == last {
			done = w.complete(id, total)
		}
		w.up.SendBytes(b, done)
	}
}

// Wait implements stateio.AsyncWriter.Wait.
func (w *refWriter) Wait(cs []stateio.Completion, minCompletions int) ([]stateio.Completion, error) {
	return stateio.CompletionChanWait(w.done, cs, minCompletions)
}

// Reserve implements stateio.AsyncWriter.Reserve: the upload needs no
// room reserved.
func (w *refWriter) Reserve(n uint64) {}

// Finalize implements stateio.AsyncWriter.Finalize: it ends the file and
// waits until cryo has packed it.
func (w *refWriter) Finalize() error {
	w.finalized = true
	return w.s.finalized(w.path)(w.up.Finish())
}

// Close implements stateio.AsyncWriter.Close. A file not finalized is
// aborted (cryo drops it, and the snapshot is never tagged); writes
// still in flight complete with errors nobody waits for.
func (w *refWriter) Close() error {
	if !w.finalized {
		w.failed.Store(true)
		// Answers to writes still in flight must not block the abort.
		stop := make(chan struct{})
		go func() {
			for {
				select {
				case <-w.done:
				case <-stop:
					return
				}
			}
		}()
		w.up.Abort()
		close(stop)
	}
	return nil
}

// populate faults in the pages of dsts (the sandbox's memory file, mapped
// by the stateipc server) before the bytes arrive: one
// madvise(MADV_POPULATE_WRITE) per range, as gVisor's own allocator fills
// memory (pgalloc's tryPopulate), instead of a page fault per 4 KiB page
// in the middle of each socket read. Measured on a 2 GiB restore, this
// took a sixth off the time until every page is loaded
// (docs/benchmarks.md). It is an optimization only: a kernel without
// MADV_POPULATE_WRITE (before 5.14) answers EINVAL, and the gofer stops
// asking; any other error leaves the pages to fault in as before.
func (s *server) populate(dsts [][]byte) {
	if s.noPopulate.Load() {
		return
	}
	page := uintptr(unix.Getpagesize())
	for _, d := range dsts {
		// Whole pages only: a range's first partial page faults in as
		// before.
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(d)))
		skip := int((page - addr%page) % page)
		if len(d) <= skip+int(page) {
			continue
		}
		if err := unix.Madvise(d[skip:], unix.MADV_POPULATE_WRITE); errors.Is(err, unix.EINVAL) {
			s.log.Info("MADV_POPULATE_WRITE not supported: pages fault in as they are written", "err", err)
			s.noPopulate.Store(true)
			return
		}
	}
}
