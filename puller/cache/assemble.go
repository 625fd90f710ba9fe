package cache

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// The node store writes each byte of a snapshot once. A snapshot being
// loaded is assembled in place (Assemble): its image dir is created at
// once as images/<hex>.tmp-*, every file at its full size (sparse), and a
// verified chunk handed to the store (PutVerified) is written straight to
// its offsets in every file being assembled that holds it, instead of into
// a chunk file of its own. Reads of a chunk by digest (Get, ReadAt) find
// it there, in the assembly of any snapshot, and in materialized image
// dirs, through their chunk lists (ChunkList). When every chunk is in
// place, WriteImage flushes the files (each of whose chunks was written
// from verified bytes; any other is verified chunk by chunk and whole)
// and commits the dir:
// the assembly becomes the snapshot's materialized dir with no second
// copy. Chunks not written in place (the store had them already, in
// another image dir, or their write failed) are copied or fetched then.
//
// Crash safety is the image dir's: an assembly is a temporary dir until it
// is committed, and a crash leaves it for Open to remove; its chunks are
// readable only by the process that wrote them, from bytes it verified.

// image is an image dir holding chunks that reads by digest can use: an
// assembly's temporary dir, or a materialized dir (committed, or found at
// Open with a chunk list).
type image struct {
	d     digest.Digest
	dir   string
	paths []string
	// fds are the image's files, by index: open for writing while it is
	// assembled, opened for reading when first needed once committed.
	fds []*os.File
	// digests are the chunks placed in it (for removal).
	digests []digest.Digest
	// ids are the files' places while assembled, by index, found on
	// first use (Assembly.InPlace).
	ids []InPlace
	// users counts reads and writes using fds; once gone (evicted, found
	// damaged or discarded) the last user closes them. Under Store.mu.
	users int
	gone  bool
	// asm is the assembly writing the image, until it is committed.
	asm *Assembly
	// partial: an assembly its loads gave up (images/<hex>.partial-*),
	// kept for the chunks it holds, never a materialized dir; d is then
	// an id of its own (partialID).
	partial bool
}

// partialID names the partial image dir called name in the store's maps.
func partialID(name string) digest.Digest { return digest.FromString("partial:" + name) }

// place is a chunk at an offset of a file of an image.
type place struct {
	img  *image
	file int
	off  int64
	size int64
	// verified: written by this process from verified bytes, or hashed
	// since the store was opened. Under Store.mu.
	verified bool
}

// file returns the image's file i, opening it for reading if needed.
// Called with s.mu held.
func (img *image) file(i int) (*os.File, error) {
	if img.fds[i] != nil {
		return img.fds[i], nil
	}
	f, err := os.OpenFile(filepath.Join(img.dir, filepath.FromSlash(img.paths[i])), os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return nil, err
	}
	img.fds[i] = f
	return f, nil
}

// closeFiles closes the image's files. Called with s.mu held, once gone
// and unused.
func (img *image) closeFiles() {
	for i, f := range img.fds {
		if f != nil {
			f.Close()
			img.fds[i] = nil
		}
	}
}

// release ends one use of img's files. Called with s.mu held.
func (img *image) release() {
	img.users--
	if img.gone && img.users == 0 {
		img.closeFiles()
	}
}

// Assembly is a snapshot's image dir being written in place by its loads:
// see Assemble. Every load of the snapshot shares one.
type Assembly struct {
	s      *Store
	img    *image
	chunks [][]format.Chunk
	// Under s.mu: refs counts Assemble calls not yet released; filled
	// marks the chunks written in place from verified bytes, by file and
	// chunk index; bytes is what was written (counted in the store's
	// total); done is set once committed or discarded.
	refs    int
	filled  [][]bool
	tainted []bool
	bytes   int64
	done    bool
	// commitMu makes WriteImages of one assembly take turns.
	commitMu sync.Mutex
	// digests are the files' sha256s (from the snapshot).
	digests []digest.Digest
	// wroteBack is closed once writeback returned.
	wroteBack chan struct{}
}

// slot is a chunk an assembly still wants: file and chunk index.
type slot struct {
	a           *Assembly
	file, chunk int
}

// Assemble starts, or joins, assembling snapshot snap (whose files' chunks
// are chunks, from format.LoadChunks) in place: from now on every verified
// chunk of it handed to PutVerified is written into its files, and
// WriteImage commits them as its materialized dir. Call Release when the
// load ends; the last release of an assembly not committed removes it.
// If the store holds the snapshot's image dir already, the assembly is
// empty and WriteImage has nothing to do.
func (s *Store) Assemble(snap *format.Snapshot, chunks [][]format.Chunk) (*Assembly, error) {
	d := snap.Descriptor.Digest
	if len(chunks) != len(snap.Files) {
		return nil, fmt.Errorf("assemble %s: chunks of %d files for %d files", d, len(chunks), len(snap.Files))
	}
	s.asmMu.Lock()
	defer s.asmMu.Unlock()
	s.mu.Lock()
	if a := s.assembling[d]; a != nil {
		a.refs++
		s.mu.Unlock()
		return a, nil
	}
	s.mu.Unlock()
	if _, ok := s.Image(d); ok {
		return &Assembly{s: s, done: true}, nil
	}
	tmp, err := s.NewImageDir(d)
	if err != nil {
		return nil, err
	}
	img := &image{d: d, dir: tmp, fds: make([]*os.File, len(snap.Files))}
	a := &Assembly{s: s, img: img, chunks: chunks, refs: 1, filled: make([][]bool, len(chunks)), tainted: make([]bool, len(chunks)), wroteBack: make(chan struct{})}
	img.asm = a
	for i, f := range snap.Files {
		img.paths = append(img.paths, f.Path)
		a.digests = append(a.digests, f.Digest)
		fd, err := createSized(tmp, f.Path, f.Size)
		if err != nil {
			img.closeFiles()
			os.RemoveAll(tmp)
			return nil, fmt.Errorf("assemble %s: %w", d, err)
		}
		img.fds[i] = fd
		a.filled[i] = make([]bool, len(chunks[i]))
	}
	s.mu.Lock()
	if s.assembling == nil {
		s.assembling = map[digest.Digest]*Assembly{}
		s.wanted = map[digest.Digest][]slot{}
	}
	s.assembling[d] = a
	go a.writeback()
	for fi, fc := range chunks {
		for ci, c := range fc {
			if c.Encoding != format.EncodingZero {
				s.wanted[c.Digest] = append(s.wanted[c.Digest], slot{a: a, file: fi, chunk: ci})
			}
		}
	}
	s.mu.Unlock()
	return a, nil
}

// writebackEvery is how often an assembly's files are handed to the
// kernel's writeback.
const writebackEvery = 250 * time.Millisecond

// writeback starts the kernel's writeback of the assembly's files
// (sync_file_range SYNC_FILE_RANGE_WRITE, which waits for nothing) every
// writebackEvery until the assembly is done, so that the commit's flush
// finds little left to write. Without it the kernel writes a snapshot of
// less than its dirty threshold only when the commit asks, and a 1 GiB
// cold restore was stored 0.7 s after its last page loaded, against 0.1 s
// with it (docs/benchmarks.md; at 2 GiB the load itself took longer, with
// the registry on the same disk). It runs on a goroutine of its own: the
// writers never wait for the disk.
func (a *Assembly) writeback() {
	defer close(a.wroteBack)
	s := a.s
	t := time.NewTicker(writebackEvery)
	defer t.Stop()
	for range t.C {
		s.mu.Lock()
		if a.done || a.img.gone || s.closed {
			s.mu.Unlock()
			return
		}
		a.img.users++
		fds := append([]*os.File(nil), a.img.fds...)
		s.mu.Unlock()
		for _, f := range fds {
			if f == nil {
				continue
			}
			// Through the file's own reference to its fd: closed
			// meanwhile (Store.Close closes regardless of users), the fd
			// stays open until the call returns.
			if rc, err := f.SyscallConn(); err == nil {
				rc.Control(func(fd uintptr) { unix.SyncFileRange(int(fd), 0, 0, unix.SYNC_FILE_RANGE_WRITE) })
			}
		}
		s.mu.Lock()
		a.img.release()
		s.mu.Unlock()
	}
}

// createSized creates file rel (slash-separated, validated by
// format.ParseIndex) under root, 0600, its parents 0700, at size bytes: a
// sparse file that chunks are written into.
func createSized(root, rel string, size int64) (*os.File, error) {
	name := filepath.Join(root, filepath.FromSlash(rel))
	if err := os.MkdirAll(filepath.Dir(name), 0o700); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, err
	}
	if err := f.Truncate(size); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Release ends one Assemble. The last release of an assembly that was not
// committed (its loads failed, were canceled or unmounted) keeps the
// chunks written into it, as a partial image dir that other loads take
// them from (verified on first use after a restart) until it is evicted:
// bytes once fetched are not fetched again. One that holds none is
// removed.
func (a *Assembly) Release() {
	if a == nil || a.img == nil {
		return
	}
	s := a.s
	s.asmMu.Lock()
	s.mu.Lock()
	a.refs--
	if a.refs > 0 || a.done {
		s.mu.Unlock()
		s.asmMu.Unlock()
		return
	}
	a.finishLocked()
	img := a.img
	delete(s.assembling, img.d)
	s.unwantLocked(a)
	img.asm = nil
	var kept []placement
	for fi, fc := range a.chunks {
		for ci, c := range fc {
			if a.filled[fi][ci] && !a.tainted[fi] {
				kept = append(kept, placement{d: c.Digest, file: fi, off: c.Offset, size: c.Size})
			}
		}
	}
	bytes, dir := a.bytes, img.dir
	a.bytes = 0
	s.mu.Unlock()
	s.asmMu.Unlock()
	if len(kept) > 0 {
		if err := s.keepPartial(img, kept, bytes); err == nil {
			return
		}
	}
	s.mu.Lock()
	s.removeImageLocked(img)
	s.total -= bytes
	s.mu.Unlock()
	os.RemoveAll(dir)
}

// keepPartial makes img, an assembly given up holding the chunks kept
// (bytes in all), a partial image dir: its chunk list written, renamed to
// images/<hex>.partial-*, counted and evicted like a materialized dir.
func (s *Store) keepPartial(img *image, kept []placement, bytes int64) error {
	seen := map[digest.Digest]bool{}
	var ps []placement
	for _, p := range kept {
		if !seen[p.d] {
			seen[p.d] = true
			ps = append(ps, p)
		}
	}
	if err := atomicfile.Write(img.dir, filepath.Join(img.dir, ChunkList), encodeChunkList(img.paths, ps), 0o400); err != nil {
		return err
	}
	name := strings.Replace(filepath.Base(img.dir), ".tmp-", ".partial-", 1)
	final := filepath.Join(s.imagesDir(), name)
	if err := os.Rename(img.dir, final); err != nil {
		return err
	}
	id := partialID(name)
	s.mu.Lock()
	img.dir, img.d, img.partial = final, id, true
	if s.images == nil {
		s.images = map[digest.Digest]*image{}
	}
	s.images[id] = img
	// The bytes stay counted, now as the dir's.
	s.entries[imageKey(id)] = &entry{size: bytes, lastUse: s.clock(), verified: true}
	s.mu.Unlock()
	s.evict()
	return nil
}

// unwantLocked removes a's slots from the store's wanted chunks.
func (s *Store) unwantLocked(a *Assembly) {
	for _, fc := range a.chunks {
		for _, c := range fc {
			ss := s.wanted[c.Digest]
			if len(ss) == 0 {
				continue
			}
			kept := ss[:0]
			for _, sl := range ss {
				if sl.a != a {
					kept = append(kept, sl)
				}
			}
			if len(kept) == 0 {
				delete(s.wanted, c.Digest)
			} else {
				s.wanted[c.Digest] = kept
			}
		}
	}
}

// removeImageLocked makes img's chunks unreachable by digest and marks it
// gone: its files close when their last user is done.
func (s *Store) removeImageLocked(img *image) {
	if img.gone {
		return
	}
	img.gone = true
	for _, d := range img.digests {
		ps := s.placed[d]
		kept := ps[:0]
		for _, p := range ps {
			if p.img != img {
				kept = append(kept, p)
			}
		}
		if len(kept) == 0 {
			delete(s.placed, d)
		} else {
			s.placed[d] = kept
		}
	}
	if s.images[img.d] == img {
		delete(s.images, img.d)
	}
	if img.users == 0 {
		img.closeFiles()
	}
}

// addPlaceLocked makes chunk d at file fi, offset off of img readable by
// digest (once per image).
func (s *Store) addPlaceLocked(img *image, d digest.Digest, fi int, off, size int64, verified bool) {
	for _, p := range s.placed[d] {
		if p.img == img {
			return
		}
	}
	if s.placed == nil {
		s.placed = map[digest.Digest][]*place{}
	}
	s.placed[d] = append(s.placed[d], &place{img: img, file: fi, off: off, size: size, verified: verified})
	img.digests = append(img.digests, d)
}

// place writes verified chunk d into every assembly that wants it and
// reports whether one did. Writers of one chunk take turns, so that a
// second write of it finds the first done.
func (s *Store) place(d digest.Digest, data []byte) (bool, error) {
	s.mu.Lock()
	for s.placing[d] != nil {
		ch := s.placing[d]
		s.mu.Unlock()
		<-ch
		s.mu.Lock()
	}
	slots := s.wanted[d]
	if len(slots) == 0 {
		s.mu.Unlock()
		return false, nil
	}
	delete(s.wanted, d)
	ch := make(chan struct{})
	if s.placing == nil {
		s.placing = map[digest.Digest]chan struct{}{}
	}
	s.placing[d] = ch
	for _, sl := range slots {
		sl.a.img.users++
	}
	s.mu.Unlock()

	errs := make([]error, len(slots))
	for i, sl := range slots {
		c := sl.a.chunks[sl.file][sl.chunk]
		if int64(len(data)) != c.Size {
			errs[i] = fmt.Errorf("chunk %s: %d bytes, the table of %s says %d", d, len(data), sl.a.img.d, c.Size)
			continue
		}
		// Not flushed here: the commit flushes each file once, after
		// Assembly.writeback started the disk on it. (Starting writeback
		// here, every few MiB, made the sandbox's first page faults and
		// its load slower on this machine's disk, docs/benchmarks.md.)
		if _, err := sl.a.img.fds[sl.file].WriteAt(data, c.Offset); err != nil {
			errs[i] = fmt.Errorf("write chunk %s into %s: %w", d, sl.a.img.paths[sl.file], err)
		}
	}

	s.mu.Lock()
	placed := false
	var err error
	for i, sl := range slots {
		if s.endWriteLocked(sl, d, errs[i]) {
			placed = true
		} else {
			err = errs[i]
		}
	}
	delete(s.placing, d)
	close(ch)
	s.mu.Unlock()
	return placed, err
}

// endWriteLocked ends the write of chunk d into slot sl, taken from
// s.wanted (err: how it went): the image's use ends, and the slot is
// filled, or wanted again if the write failed (left to WriteImage, or to
// the next fetch of the chunk). It reports whether the slot needs the
// chunk no more: written, or its assembly is over. s.mu is held.
func (s *Store) endWriteLocked(sl slot, d digest.Digest, err error) bool {
	a := sl.a
	a.img.release()
	switch {
	case a.done:
		return true
	case err != nil:
		s.wanted[d] = append(s.wanted[d], sl)
		return false
	}
	c := a.chunks[sl.file][sl.chunk]
	a.filled[sl.file][sl.chunk] = true
	a.bytes += c.Size
	s.total += c.Size
	s.addPlaceLocked(a.img, d, sl.file, c.Offset, c.Size, true)
	return true
}

// placeHeld writes into the assembly's files, in place, the chunks they
// still lack that the store holds elsewhere: chunk files written before
// the assembly existed (a mount's first reads come before its chunk
// tables are all loaded), and other image dirs. Each is read as any read
// is (Get: verified, unless this process verified it already), then
// placed as a fetched chunk is. Files so complete from verified bytes are
// committed without their sha256 computed again (verifiedWhole): on a
// 2 GiB restore whose first reads came early, that was 1.6 s of CPU. A
// chunk it cannot read is left to the commit, which fetches it; a
// damaged (tainted) file gets the commit's whole check anyway.
func (a *Assembly) placeHeld(ctx context.Context) {
	s := a.s
	var missing []digest.Digest
	seen := map[digest.Digest]bool{}
	s.mu.Lock()
	for fi, fc := range a.chunks {
		if a.tainted[fi] {
			continue
		}
		for ci, c := range fc {
			if c.Encoding != format.EncodingZero && !a.filled[fi][ci] && !seen[c.Digest] {
				seen[c.Digest] = true
				missing = append(missing, c.Digest)
			}
		}
	}
	s.mu.Unlock()
	var buf []byte
	for _, d := range missing {
		if ctx.Err() != nil {
			return
		}
		if !s.Has(d) {
			continue
		}
		data, err := s.Get(d, buf, false)
		if err != nil {
			continue
		}
		s.place(d, data) // a failed write: the commit copies the chunk
		buf = data[:0]
	}
}

// finishLocked marks the assembly committed or discarded. Called with
// s.mu held.
func (a *Assembly) finishLocked() { a.done = true }

// verifiedWhole reports whether file f of the assembly is complete in
// place from bytes this process verified (for
// format.UnpackOptions.Verified): the file it created, never found
// damaged, with every non-zero chunk written into it from verified bytes
// (place) and its zero chunks left as the holes it was created with.
// Every byte of it was then checked (its chunk's sha256, before it was
// written) and written where the snapshot's validated table puts it, so
// the file is the snapshot's without its sha256 computed again: that
// would be a second sha256 of every restored byte, on cores the sandbox
// is loading on.
func (a *Assembly) verifiedWhole(f *format.File, opened fs.FileInfo) bool {
	fi := a.fileIndex(f)
	if fi < 0 || a.digests[fi] != f.Digest || opened.Size() != f.Size || !a.sameFile(fi, opened) {
		return false
	}
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	if a.tainted[fi] {
		return false
	}
	for ci, c := range a.chunks[fi] {
		if c.Encoding != format.EncodingZero && !a.filled[fi][ci] {
			return false
		}
	}
	return true
}

// sameFile reports whether opened is the assembly's file fi: not so if
// its dir was removed under it (by another process sharing the cache dir,
// which Open clears of temporary dirs) and the path made again, empty.
func (a *Assembly) sameFile(fi int, opened fs.FileInfo) bool {
	a.s.mu.Lock()
	f := a.img.fds[fi]
	a.s.mu.Unlock()
	if f == nil {
		return false
	}
	info, err := f.Stat()
	return err == nil && os.SameFile(info, opened)
}

// fileIndex returns the index of file f in the assembly, or -1.
func (a *Assembly) fileIndex(f *format.File) int {
	for i, p := range a.img.paths {
		if p == f.Path {
			return i
		}
	}
	return -1
}

// Localize writes chunk d, which the store holds in another image dir or
// a chunk file, into the assemblies that want it (verified on first use,
// as every read of it is), and reports whether it did. A load calls it
// for the chunks it need not fetch, so that its files are complete in
// place when it commits.
func (s *Store) Localize(d digest.Digest) bool {
	s.mu.Lock()
	want := len(s.wanted[d]) > 0
	s.mu.Unlock()
	if !want {
		return false
	}
	data, err := s.Get(d, nil, false)
	if err != nil {
		return false
	}
	placed, _ := s.place(d, data)
	return placed
}

// inPlace reports whether chunk c of file f was written in place by this
// process (for format.UnpackOptions.InPlace).
func (a *Assembly) inPlace(f *format.File, c format.Chunk) bool {
	fi := a.fileIndex(f)
	if fi < 0 {
		return false
	}
	fc := a.chunks[fi]
	ci := sort.Search(len(fc), func(i int) bool { return fc[i].Offset >= c.Offset })
	if ci == len(fc) || fc[ci].Offset != c.Offset || fc[ci].Digest != c.Digest {
		return false
	}
	a.s.mu.Lock()
	defer a.s.mu.Unlock()
	return a.filled[fi][ci] && !a.tainted[fi]
}

// InPlace is a file of the node store that holds a range of a snapshot's
// file at the same offsets: the file at Path, whose device and inode
// numbers are Dev and Ino.
type InPlace struct {
	Path     string
	Dev, Ino uint64
}

// InPlace reports where bytes [off, off+n) of the assembly's file fi lie
// in place, for a reader that reads them itself (the checkpoint gofer): in
// the assembly's own file, if every chunk the range overlaps was written
// there from verified bytes (place) or is a zero chunk (the file's holes),
// the file was never found damaged, and the assembly is neither committed
// nor given up. Those bytes are never written again: a reader that opens
// Path and finds Dev and Ino reads them, verified, as ReadAt would.
func (a *Assembly) InPlace(fi int, off, n int64) (InPlace, bool) {
	if a == nil || a.img == nil || fi < 0 || fi >= len(a.chunks) || n <= 0 {
		return InPlace{}, false
	}
	fc := a.chunks[fi]
	// The first chunk that ends past off.
	ci := sort.Search(len(fc), func(i int) bool { return fc[i].Offset+fc[i].Size > off })
	s := a.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if a.done || a.tainted[fi] || a.img.gone || a.img.fds[fi] == nil {
		return InPlace{}, false
	}
	end := off + n
	covered := off
	for ; ci < len(fc) && fc[ci].Offset < end; ci++ {
		c := fc[ci]
		if c.Offset > covered || c.Encoding != format.EncodingZero && !a.filled[fi][ci] {
			return InPlace{}, false
		}
		covered = c.Offset + c.Size
	}
	if covered < end {
		return InPlace{}, false
	}
	if a.img.ids == nil {
		a.img.ids = make([]InPlace, len(a.img.fds))
	}
	id := &a.img.ids[fi]
	if id.Path == "" {
		info, err := a.img.fds[fi].Stat()
		if err != nil {
			return InPlace{}, false
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return InPlace{}, false
		}
		*id = InPlace{Path: filepath.Join(a.img.dir, filepath.FromSlash(a.img.paths[fi])), Dev: uint64(st.Dev), Ino: st.Ino}
	}
	return *id, true
}

// assembly returns snapshot d's live assembly, with a reference the caller
// releases, or nil.
func (s *Store) assembly(d digest.Digest) *Assembly {
	s.asmMu.Lock()
	defer s.asmMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.assembling[d]
	if a == nil || a.done {
		return nil
	}
	a.refs++
	return a
}

// commit writes the chunk list into the assembly's dir and commits it as
// snapshot d's materialized dir (CommitImage); its chunks stay readable
// by digest there.
func (s *Store) commitAssembly(a *Assembly) error {
	d := a.img.d
	ps := chunkPlacements(a.chunks)
	s.mu.Lock()
	dir := a.img.dir
	s.mu.Unlock()
	if err := atomicfile.Write(dir, filepath.Join(dir, ChunkList), encodeChunkList(a.img.paths, ps), 0o400); err != nil {
		return fmt.Errorf("materialize %s: chunk list: %w", d, err)
	}
	s.mu.Lock()
	staging := a.img.dir
	s.mu.Unlock()
	// The dir's size replaces what the assembly counted, in one step.
	ours, err := s.commitImage(d, staging, a)
	// Evicted once its chunks are known: it may hold pinned ones.
	defer s.evict()
	if err != nil {
		return err
	}
	s.asmMu.Lock()
	defer s.asmMu.Unlock()
	s.mu.Lock()
	defer s.mu.Unlock()
	a.finishLocked()
	a.img.asm = nil
	delete(s.assembling, d)
	s.unwantLocked(a)
	if !ours {
		// Another writer committed d first: its dir was kept.
		s.removeImageLocked(a.img)
		return nil
	}
	a.img.dir = s.ImagePath(d)
	// Every chunk was verified: by this process before it wrote it in
	// place, or by UnpackFrom.
	for _, p := range ps {
		s.addPlaceLocked(a.img, p.d, p.file, p.off, p.size, true)
	}
	if s.images == nil {
		s.images = map[digest.Digest]*image{}
	}
	s.images[d] = a.img
	return nil
}

// indexImageChunks makes the chunks of materialized dir dir (snapshot d),
// listed in its chunk list, readable by digest, to be verified on first
// use. A dir without a readable list is still used as an image dir.
// Called from Open.
func (s *Store) indexImageChunks(d digest.Digest, dir string, partial bool) error {
	paths, _, ps, err := readChunkList(dir)
	if err != nil {
		return err
	}
	img := &image{d: d, dir: dir, paths: paths, fds: make([]*os.File, len(paths)), partial: partial}
	for _, p := range ps {
		s.addPlaceLocked(img, p.d, p.file, p.off, p.size, false)
	}
	if s.images == nil {
		s.images = map[digest.Digest]*image{}
	}
	s.images[d] = img
	return nil
}

// Close closes the files the store holds open: those of the image dirs it
// reads chunks from and of its assemblies. Call it once nothing uses the
// store any more (every load released); the store stays on disk.
func (s *Store) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	for _, img := range s.images {
		img.closeFiles()
	}
	for _, a := range s.assembling {
		a.img.closeFiles()
	}
}

// usePlace returns a place holding chunk d and its open file, with a use
// the caller ends with s.endUse, marking its image dir used. It returns
// ErrNotFound if no image holds d.
func (s *Store) usePlace(d digest.Digest) (*place, *os.File, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, p := range s.placed[d] {
		f, err := p.img.file(p.file)
		if err != nil {
			continue
		}
		p.img.users++
		if e, ok := s.entries[imageKey(p.img.d)]; ok && s.images[p.img.d] == p.img {
			e.lastUse = s.clock()
		}
		return p, f, nil
	}
	return nil, nil, ErrNotFound
}

func (s *Store) endUse(p *place) {
	s.mu.Lock()
	p.img.release()
	s.mu.Unlock()
}

// readPlace reads chunk d from place p (file f) into buf (grown as
// needed), verifying it if p is not verified yet or verify is set. A
// damaged chunk in a materialized dir means the dir is damaged: it is
// removed (no later mount uses it) and ErrNotFound returned.
func (s *Store) readPlace(d digest.Digest, p *place, f *os.File, buf []byte, verify bool) ([]byte, error) {
	if int64(cap(buf)) < p.size {
		buf = make([]byte, p.size)
	}
	buf = buf[:p.size]
	n, err := f.ReadAt(buf, p.off)
	if n < len(buf) {
		if err == nil {
			err = errors.New("short read")
		}
		return nil, s.dropPlace(d, p, fmt.Sprintf("unreadable (%v)", err))
	}
	s.mu.Lock()
	ok := p.verified && !verify
	s.mu.Unlock()
	if !ok {
		if digest.FromBytes(buf) != d {
			return nil, s.dropPlace(d, p, "damaged")
		}
		s.mu.Lock()
		p.verified = true
		s.mu.Unlock()
	}
	return buf, nil
}

// dropPlace handles chunk d found damaged at p: the image dir holding it
// is damaged, so it is removed from the store (and from disk, unless an
// assembly, which its loads fill again) and ErrNotFound is returned.
func (s *Store) dropPlace(d digest.Digest, p *place, what string) error {
	s.mu.Lock()
	img := p.img
	var trash, unmark string
	if !img.gone && s.images[img.d] == img {
		if e, ok := s.entries[imageKey(img.d)]; ok {
			s.total -= e.size
			delete(s.entries, imageKey(img.d))
		}
		if s.pins[imageKey(img.d)] > 0 {
			// A live mount reads it: its files stay for it, but without
			// the marker no later mount or process uses the dir (Open
			// removes it).
			unmark = filepath.Join(img.dir, ImageMarker)
		} else {
			trash = s.unlinkImage(img.d)
		}
		s.removeImageLocked(img)
	} else if !img.gone {
		// In an assembly: the commit verifies the file's chunks again
		// and fetches this one.
		if a := img.asm; a != nil && !a.done {
			a.tainted[p.file] = true
		}
		ps := s.placed[d]
		kept := ps[:0]
		for _, q := range ps {
			if q != p {
				kept = append(kept, q)
			}
		}
		if len(kept) == 0 {
			delete(s.placed, d)
		} else {
			s.placed[d] = kept
		}
	}
	s.mu.Unlock()
	if trash != "" {
		os.RemoveAll(trash)
	}
	if unmark != "" {
		os.Remove(unmark)
		atomicfile.SyncDir(filepath.Dir(unmark))
	}
	return fmt.Errorf("chunk %s in the image dir of %s is %s; dropped: %w", d, img.d, what, ErrNotFound)
}

// WriteImage materializes snapshot snap, whose files' chunks are chunks
// (format.LoadChunks), as its image dir, unless the cache holds that dir
// complete already. With a live assembly of the snapshot (Assemble), that
// is the assembly's dir: a file each of whose chunks was written in place
// from verified bytes is only flushed (verifiedWhole); in any other, the
// chunks not written in place are taken from src (another image dir of
// the node, or a fetch) and written, and the whole file's sha256 checked;
// then the dir is committed (CommitImage) with its chunk list. Without
// one, every chunk comes from src into a new dir. Either way it is
// format.UnpackFrom's write: every chunk verified, zero chunks left as
// holes, files 0600 and dirs 0700 whatever modes the snapshot records.
func (s *Store) WriteImage(ctx context.Context, snap *format.Snapshot, chunks [][]format.Chunk, src format.ChunkSource) error {
	d := snap.Descriptor.Digest
	if _, ok := s.Image(d); ok {
		return nil
	}
	a := s.assembly(d)
	if a == nil {
		// A throwaway assembly nobody else writes into.
		var err error
		if a, err = s.Assemble(snap, chunks); err != nil {
			return err
		}
		if a.img == nil {
			return nil
		}
	}
	defer a.Release()
	a.commitMu.Lock()
	defer a.commitMu.Unlock()
	s.mu.Lock()
	done, staging := a.done, a.img.dir
	s.mu.Unlock()
	if done {
		if _, ok := s.Image(d); ok {
			return nil
		}
		return fmt.Errorf("materialize %s: its assembly was discarded", d)
	}
	a.placeHeld(ctx)
	_, err := format.UnpackFrom(ctx, snap, chunks, src, s.ImagePath(d), format.UnpackOptions{
		Private:  true,
		Staging:  staging,
		InPlace:  a.inPlace,
		Verified: a.verifiedWhole,
		Commit:   func(string) error { return s.commitAssembly(a) },
	})
	return err
}
