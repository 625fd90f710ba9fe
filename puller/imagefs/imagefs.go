// Package imagefs presents a snapshot as a read-only FUSE filesystem that
// runsc can restore from (--image-path). Small files are held in memory,
// fetched and verified before the mount is ready; large files (pages.img)
// are served lazily: a read of bytes that are not local yet blocks until the
// chunks covering them are fetched, decompressed and verified, ahead of the
// background prefetch. Reads run concurrently without a global lock: each
// resolves its chunks by binary search and reads them from the node cache
// with pread.
//
// The filesystem serves only the uid that runs the puller: it is mounted
// with default_permissions, so the kernel checks the modes it reports, and
// every file is 0400 and every dir 0500, owned by that uid, whatever modes
// the snapshot records (a snapshot is a process's memory). The mount keeps
// allow_other, so FUSE's own same-uid-and-gid check does not stand between
// runsc and the files; the mode check refuses every other user.
package imagefs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// File is a file of the image dir.
type File struct {
	// Path is slash-separated, relative to the mount point.
	Path string
	// Size and Mode as recorded in the snapshot. Mode is not served: the
	// filesystem shows every file as 0400, owned by the puller.
	Size int64
	Mode uint32
	// Data holds a small file's verified bytes; nil for a lazy file.
	Data []byte
	// Chunks are a lazy file's chunks in offset order (all parts); or,
	// if nil, Span gives the chunks a read needs.
	Chunks []format.Chunk
	// Span returns the chunks that hold [off, off+n) of a lazy file, in
	// offset order, n > 0 (a mount that loads its chunk tables part by
	// part, as reads need them).
	Span func(ctx context.Context, off, n int64) ([]format.Chunk, error)
	// Near, if set, returns the chunks of [off, off+n) of a lazy file
	// whose tables are at hand, without waiting for any (the
	// neighbourhood of a page fault, NearWanter); without it, a fault's
	// neighbourhood is taken from Chunks only.
	Near func(off, n int64) []format.Chunk
	// Faults, if set, remembers the file's last page faults, to size the
	// neighbourhood a fault brings along (NearWanter).
	Faults *FaultHistory
}

// Sources supply the chunks a read needs that the node cache does not
// hold: a page fault's (a read shorter than FaultBelow, or one the FS's
// observer says the sandbox waits on) from Fault, the background
// loader's from Read (a fetch scheduler at those priorities).
// The bytes they return may be shared with other readers: imagefs copies
// them out and never writes into them.
type Sources struct {
	Fault, Read format.ChunkSource
}

// FaultBelow: a read of a lazy file shorter than this is taken for a page
// fault, a read the application is blocked on (fetch.Fault); longer ones
// are too if the FS's observer says so (the sweep classifier: gVisor
// reads a faulting window in pieces of 256 KiB, as its background sweep
// does), else they are the background loader's (fetch.Read).
const FaultBelow = 256 << 10

// Stats count what the filesystem served.
type Stats struct {
	Reads       atomic.Int64
	BytesServed atomic.Int64
	// DemandChunks counts chunk reads that missed the node cache and
	// waited for a fetch.
	DemandChunks atomic.Int64
}

// FS is the root of an image filesystem.
type FS struct {
	fs.Inode
	files []File
	cache *cache.Store
	src   Sources
	stats *Stats
	// readLog, if set, gets a line per read: file, offset, length, start
	// and duration (where a restore's milliseconds go).
	readLog io.Writer
	// observe, if set, is told of every read, in the order they come
	// (to record a working set: profile.Recorder.Read), and reports
	// whether the sandbox waits on it: such a read is served as a page
	// fault's, whatever its size.
	observe func(path string, off, n int64) (waited bool)
}

var (
	_ = (fs.NodeOnAdder)((*FS)(nil))
	_ = (fs.NodeGetattrer)((*FS)(nil))
	_ = (fs.NodeGetattrer)((*dirNode)(nil))
)

// The modes everything is served with: readable (and dirs searchable) by
// the owner only.
const (
	fileMode = 0o400
	dirMode  = 0o500
)

// setOwner makes the puller's uid and gid own an attribute.
func setOwner(a *fuse.Attr) {
	a.Owner = fuse.Owner{Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid())}
}

// Getattr describes the root dir.
func (f *FS) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	return dirAttr(out)
}

// dirNode is a directory of the image below the root.
type dirNode struct{ fs.Inode }

// Getattr describes the dir.
func (n *dirNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	return dirAttr(out)
}

func dirAttr(out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFDIR | dirMode
	out.Nlink = 2
	setOwner(&out.Attr)
	out.SetTimeout(time.Hour)
	return 0
}

// New returns the root of a filesystem holding files, whose lazy chunks are
// read from c or, on a miss, from src. readLog, if not nil, gets a line per
// read; observe, if not nil, is told of every read of a lazy file, in the
// order they come, and reports whether the sandbox waits on it (served
// from src.Fault, as a read shorter than FaultBelow is).
func New(files []File, c *cache.Store, src Sources, stats *Stats, readLog io.Writer, observe func(path string, off, n int64) (waited bool)) *FS {
	return &FS{files: files, cache: c, src: src, stats: stats, readLog: readLog, observe: observe}
}

// OnAdd builds the directory tree.
func (f *FS) OnAdd(ctx context.Context) {
	for i := range f.files {
		file := &f.files[i]
		dir, base := path.Split(file.Path)
		p := &f.Inode
		for _, comp := range strings.Split(strings.Trim(dir, "/"), "/") {
			if comp == "" {
				continue
			}
			ch := p.GetChild(comp)
			if ch == nil {
				ch = p.NewPersistentInode(ctx, &dirNode{}, fs.StableAttr{Mode: fuse.S_IFDIR})
				p.AddChild(comp, ch, true)
			}
			p = ch
		}
		node := &fileNode{fs: f, file: file}
		p.AddChild(base, p.NewPersistentInode(ctx, node, fs.StableAttr{Mode: fuse.S_IFREG}), true)
	}
}

// fileNode is one file of the image.
type fileNode struct {
	fs.Inode
	fs   *FS
	file *File
}

var (
	_ = (fs.NodeGetattrer)((*fileNode)(nil))
	_ = (fs.NodeOpener)((*fileNode)(nil))
	_ = (fs.NodeReader)((*fileNode)(nil))
)

func (n *fileNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = fuse.S_IFREG | fileMode
	setOwner(&out.Attr)
	out.Size = uint64(n.file.Size)
	out.Blocks = (out.Size + 511) / 512
	out.Nlink = 1
	out.SetTimeout(time.Hour)
	return 0
}

func (n *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC|syscall.O_APPEND) != 0 {
		return nil, 0, syscall.EROFS
	}
	if n.file.Data != nil {
		return nil, fuse.FOPEN_KEEP_CACHE, 0
	}
	// Lazy files bypass the kernel page cache: the node cache already holds
	// the bytes, and runsc reads each page once.
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

// Read serves a read. It ignores the request's cancellation: the kernel
// interrupts a FUSE read whenever a signal reaches the reading thread, and
// gVisor kills the sandbox on a failed pages.img read. The fetch
// scheduler's deadline bounds the wait instead.
func (n *fileNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	n.fs.stats.Reads.Add(1)
	if n.fs.readLog != nil {
		t0 := time.Now()
		defer func() {
			fmt.Fprintf(n.fs.readLog, "read %s off=%d len=%d start=%s took=%s\n", n.file.Path, off, len(dest), t0.Format("15:04:05.000000"), time.Since(t0))
		}()
	}
	if off >= n.file.Size {
		return fuse.ReadResultData(nil), 0
	}
	waited := len(dest) < FaultBelow
	if n.fs.observe != nil && n.file.Data == nil && n.fs.observe(n.file.Path, off, min(int64(len(dest)), n.file.Size-off)) {
		// gVisor's reads of a faulting window are as large as its sweep's.
		waited = true
	}
	src := n.fs.src.Read
	if waited {
		src = n.fs.src.Fault
	}
	dest = dest[:min(int64(len(dest)), n.file.Size-off)]
	if err := ReadAt(context.WithoutCancel(ctx), n.fs.cache, n.file, dest, off, src, n.fs.stats); err != nil {
		// Never serve unverified or partial data: fail the read. The fetch
		// scheduler has already retried until its deadline.
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(dest), 0
}

// ReadAt fills dest with file's bytes at off, which must lie within the
// file: a small file's from memory, a lazy file's from the node cache c or,
// for chunks c lacks, from src. Every byte is verified before it is
// copied into dest; on an error dest holds nothing to serve. The FUSE
// filesystem reads through it, and so do the other presenters of a mount
// (the checkpoint gofer's file API).
func ReadAt(ctx context.Context, c *cache.Store, file *File, dest []byte, off int64, src format.ChunkSource, stats *Stats) error {
	if off < 0 || off+int64(len(dest)) > file.Size {
		return fmt.Errorf("%s: read of %d bytes at %d past its %d bytes", file.Path, len(dest), off, file.Size)
	}
	if file.Data != nil {
		copy(dest, file.Data[off:])
	} else if err := readChunks(ctx, c, file, dest, off, src, stats); err != nil {
		return err
	}
	stats.BytesServed.Add(int64(len(dest)))
	return nil
}

// Wanter is a ChunkSource that can be told, before the first Chunk call,
// every chunk a read needs: a fetch scheduler then fetches the ones that
// follow each other in a pack in one request.
type Wanter interface {
	Want(chunks []format.Chunk)
}

// NearWanter is a Wanter that, as a source of page faults (a fetch
// scheduler at fetch.Fault), can also be told the chunks near a fault's:
// it fetches those along with the fault, and the application's next
// faults, mostly nearby, find them fetched. It calls near (which records
// the fault in its file's FaultHistory) only if it is such a source, and
// only with the chunks a read needs otherwise.
type NearWanter interface {
	WantNear(read []format.Chunk, near func() []format.Chunk)
}

// A page fault's neighbourhood is the aligned NearSpan of the file around
// it when one of the file's last RecentFaults faults lies in that span
// too: the application works in a region, and its next faults will
// mostly be there (v1's 1 MiB chunks brought that much along; through
// FUSE a 2 GiB v2 restore ran again 1.2-2x as late as v1 without it). A
// fault with no recent one near it brings nothing along: a random 4 KiB
// read moves its own chunk (issue 12: at most 256 KiB).
const (
	NearSpan     = 1 << 20
	RecentFaults = 8
)

// FaultHistory remembers the offsets of a file's last page faults. It is
// safe for concurrent use; its zero value is empty.
type FaultHistory struct {
	mu   sync.Mutex
	last [RecentFaults]int64
	n    int
}

// Near records a fault at off and returns the span of the file ([lo, hi)
// before clamping to its size) whose chunks it brings along: empty
// (lo == hi) if no recent fault lies in its NearSpan.
func (h *FaultHistory) Near(off int64) (lo, hi int64) {
	lo = off &^ (NearSpan - 1)
	h.mu.Lock()
	defer h.mu.Unlock()
	hit := false
	for _, o := range h.last[:min(h.n, RecentFaults)] {
		hit = hit || o&^(NearSpan-1) == lo
	}
	h.last[h.n%RecentFaults] = off
	h.n++
	if !hit {
		return lo, lo
	}
	return lo, lo + NearSpan
}

// nearChunks returns the chunks of file's neighbourhood of a page fault
// at off (FaultHistory.Near) whose tables are at hand.
func nearChunks(file *File, off int64) []format.Chunk {
	if file.Faults == nil {
		return nil
	}
	lo, hi := file.Faults.Near(off)
	hi = min(hi, file.Size)
	if lo >= hi {
		return nil
	}
	if file.Chunks != nil {
		a := sort.Search(len(file.Chunks), func(j int) bool { return file.Chunks[j].End() > lo })
		b := sort.Search(len(file.Chunks), func(j int) bool { return file.Chunks[j].Offset >= hi })
		return file.Chunks[a:b]
	}
	if file.Near == nil {
		return nil
	}
	return file.Near(lo, hi-lo)
}

// readChunks fills dest with the file's bytes at off.
func readChunks(ctx context.Context, cc *cache.Store, file *File, dest []byte, off int64, src format.ChunkSource, stats *Stats) error {
	chunks := file.Chunks
	if chunks == nil && file.Span != nil && len(dest) > 0 {
		var err error
		if chunks, err = file.Span(ctx, off, int64(len(dest))); err != nil {
			return err
		}
	}
	i := sort.Search(len(chunks), func(i int) bool { return chunks[i].End() > off })
	last := sort.Search(len(chunks), func(i int) bool { return chunks[i].Offset >= off+int64(len(dest)) })
	if w, ok := src.(NearWanter); ok && last > i && chunks[i].Packed() {
		w.WantNear(chunks[i:last], func() []format.Chunk { return nearChunks(file, off) })
	} else if w, ok := src.(Wanter); ok && last-i > 1 {
		w.Want(chunks[i:last])
	}
	done := 0
	for done < len(dest) {
		if i >= len(chunks) {
			return fmt.Errorf("%s: no chunk at offset %d", file.Path, off+int64(done))
		}
		c := chunks[i]
		pos := off + int64(done) - c.Offset
		part := dest[done:min(len(dest), done+int(c.Size-pos))]
		if err := readChunk(ctx, cc, c, part, pos, src, stats); err != nil {
			return err
		}
		done += len(part)
		i++
	}
	return nil
}

// readChunk fills p with chunk c's bytes from offset pos within it.
func readChunk(ctx context.Context, cc *cache.Store, c format.Chunk, p []byte, pos int64, src format.ChunkSource, stats *Stats) error {
	if c.Encoding == format.EncodingZero {
		clear(p)
		return nil
	}
	if _, err := cc.ReadAt(c.Digest, p, pos); err == nil {
		return nil
	} else if !errors.Is(err, cache.ErrNotFound) {
		return err
	}
	stats.DemandChunks.Add(1)
	// The fetched bytes are shared with other readers of the chunk: copy
	// out, never write into them.
	data, err := src.Chunk(ctx, c, nil)
	if err != nil {
		return err
	}
	// A table that lies about the chunk's size: never serve part of it.
	if int64(len(data)) != c.Size || pos < 0 || pos+int64(len(p)) > c.Size {
		return fmt.Errorf("chunk %s: %d bytes, table says %d (read at %d+%d)", c.Digest, len(data), c.Size, pos, len(p))
	}
	copy(p, data[pos:])
	return nil
}

// FSType is the FUSE subtype of image filesystems: the mount table lists
// them as type "fuse.cryo".
const FSType = "cryo"

// MountOptions are the FUSE options an image filesystem is mounted with:
// large reads (1 MiB), many requests in flight, long attribute timeouts
// (nothing ever changes), read-only, permissions checked by the kernel
// against the modes served (default_permissions): only the puller's uid
// reads.
func MountOptions(name string) *fs.Options {
	timeout := time.Hour
	return &fs.Options{
		EntryTimeout: &timeout,
		AttrTimeout:  &timeout,
		MountOptions: fuse.MountOptions{
			FsName:        name,
			Name:          FSType,
			MaxWrite:      1 << 20,
			MaxReadAhead:  1 << 20,
			MaxBackground: 128,
			AllowOther:    true,
			DirectMount:   true,
			Options:       []string{"ro", "default_permissions"},
		},
	}
}
