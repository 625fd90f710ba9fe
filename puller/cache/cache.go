// Package cache is the node store of a puller, shared by every snapshot and
// mount on the node, so a chunk two snapshots share is fetched once. It
// holds materialized image dirs, whole snapshots as plain files under
// <root>/images/<hex> (see image.go), each written once, in place, as its
// chunks arrive (see assemble.go), and found again by digest through its
// chunk list; and, for chunks no snapshot being assembled holds, chunk
// files under <root>/chunks/sha256/<hh>/<hex>.
//
// Every chunk is verified before it is stored. A chunk file appears
// atomically and durably (an unnamed O_TMPFILE inode, flushed, then linked
// into place and its directory flushed), and an image dir only once every
// file in it is verified and flushed, so a crash or kill -9 leaves no
// partial chunk or dir under its name. The disk is not trusted across processes all the
// same: a chunk found on disk is verified (sha256) the first time a process
// uses it, and a bad or short one is dropped and reported as not found, so
// the caller fetches it again. The store keeps its total size (chunks and
// image dirs) under a cap by evicting the least recently used, but never
// one pinned by a live mount.
//
// Everything under root is the puller's alone: directories are 0700 and
// files 0600 or 0400, since a snapshot is a process's memory.
package cache

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/singleflight"
)

// ErrNotFound is returned for a chunk the cache does not hold, or held
// damaged and has dropped.
var ErrNotFound = errors.New("chunk not in cache")

// Store is a node cache. It is safe for concurrent use by many mounts.
type Store struct {
	root     string
	capBytes int64

	// verifying joins the first-use verifications of one chunk by
	// concurrent readers.
	verifying singleflight.Group
	// verifyBufs holds buffers for verifying chunks read in part.
	verifyBufs sync.Pool

	// asmMu orders the creation, release and commit of assemblies.
	asmMu sync.Mutex

	mu sync.Mutex
	// closed is set by Close: assemblies stop their writeback.
	closed    bool
	entries   map[key]*entry
	total     int64
	pins      map[key]int
	evictions int64
	clock     func() time.Time
	// assembling holds the live assemblies by snapshot, wanted the chunks
	// they still want, placing the chunks being written into them.
	assembling map[digest.Digest]*Assembly
	wanted     map[digest.Digest][]slot
	placing    map[digest.Digest]chan struct{}
	// placed finds chunks in image dirs (assemblies and materialized
	// dirs), images the materialized dirs holding chunks, by snapshot.
	placed map[digest.Digest][]*place
	images map[digest.Digest]*image
}

// key names a chunk (by the digest of its bytes) or an image dir (by the
// digest of its snapshot's index): two namespaces.
type key struct {
	d     digest.Digest
	image bool
}

func chunkKey(d digest.Digest) key { return key{d: d} }
func imageKey(d digest.Digest) key { return key{d: d, image: true} }

type entry struct {
	size    int64
	lastUse time.Time
	// verified: this process wrote the chunk (verified before storing) or
	// has checked its file's sha256 since it opened the store.
	verified bool
}

// Stats describe the cache.
type Stats struct {
	Chunks int `json:"chunks"`
	// Images counts materialized image dirs; Partial the image dirs kept
	// from loads that did not finish, for their chunks.
	Images  int `json:"images"`
	Partial int `json:"partial"`
	// Bytes is what chunks and image dirs take together.
	Bytes     int64 `json:"bytes"`
	CapBytes  int64 `json:"capBytes"`
	Pinned    int   `json:"pinned"`
	Evictions int64 `json:"evictions"`
}

// Open opens (creating if needed) the cache under root with a size cap in
// bytes (0: no cap). It indexes the chunks and complete image dirs already
// there, taking their modification time as their last use, and drops
// leftovers of interrupted writes: temporary chunk files, and image dirs
// that are temporary or lack their completion marker.
func Open(root string, capBytes int64) (*Store, error) {
	s := &Store{root: root, capBytes: capBytes, entries: map[key]*entry{}, pins: map[key]int{}, clock: time.Now}
	dir := filepath.Join(root, "chunks", "sha256")
	if err := mkdirPrivate(root, filepath.Join(root, "chunks"), dir, s.imagesDir()); err != nil {
		return nil, fmt.Errorf("open cache: %w", err)
	}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		name := d.Name()
		if strings.HasPrefix(name, ".tmp-") {
			return os.Remove(p)
		}
		dg := digest.NewDigestFromEncoded(digest.SHA256, name)
		if dg.Validate() != nil {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil
		}
		s.entries[chunkKey(dg)] = &entry{size: info.Size(), lastUse: info.ModTime()}
		s.total += info.Size()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index cache %s: %w", root, err)
	}
	if err := s.indexImages(); err != nil {
		return nil, fmt.Errorf("index cache %s: %w", root, err)
	}
	return s, nil
}

// mkdirPrivate creates dirs (mode 0700) where missing, and makes the ones
// after the first 0700 where they are not: an older cache left them 0755.
// The first, the cache root, is the operator's to choose.
func mkdirPrivate(dirs ...string) error {
	for i, d := range dirs {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return err
		}
		if i == 0 {
			continue
		}
		if err := os.Chmod(d, 0o700); err != nil {
			return err
		}
	}
	return nil
}

// Root is the cache's directory.
func (s *Store) Root() string { return s.root }

// Path is where chunk d is (or would be) stored.
func (s *Store) Path(d digest.Digest) string {
	hx := d.Encoded()
	return filepath.Join(s.root, "chunks", "sha256", hx[:2], hx)
}

// Has reports whether the cache holds chunk d, in a chunk file or in an
// image dir (not whether it is intact: a chunk not yet used by this
// process is verified when it is read).
func (s *Store) Has(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.entries[chunkKey(d)]
	return ok || len(s.placed[d]) > 0
}

// Get reads chunk d into buf (grown as needed) and marks it used. A chunk
// this process has not used before is verified first (its sha256), as it
// is whenever verify is true; a damaged or short one is dropped and Get
// returns ErrNotFound, so the caller fetches it again.
func (s *Store) Get(d digest.Digest, buf []byte, verify bool) ([]byte, error) {
	f, e, err := s.open(d)
	if errors.Is(err, ErrNotFound) {
		for {
			p, pf, err := s.usePlace(d)
			if err != nil {
				return nil, err
			}
			data, err := s.readPlace(d, p, pf, buf, verify)
			s.endUse(p)
			if !errors.Is(err, ErrNotFound) {
				return data, err
			}
			// Damaged there: another image dir may hold it.
		}
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if int64(cap(buf)) < e.size {
		buf = make([]byte, e.size)
	}
	buf = buf[:e.size]
	if _, err := f.ReadAt(buf, 0); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, s.drop(d, e, "short")
		}
		return nil, fmt.Errorf("read cached chunk %s: %w", d, err)
	}
	if verify || !s.isVerified(e) {
		if digest.FromBytes(buf) != d {
			return nil, s.drop(d, e, "damaged")
		}
		s.setVerified(e)
	}
	return buf, nil
}

// ReadAt reads len(p) bytes of chunk d at offset off straight from its file
// (a FUSE read of part of a chunk costs one pread) and marks it used. The
// first read of a chunk in this process reads and verifies the whole chunk
// first; a damaged or short one is dropped and ReadAt returns ErrNotFound.
// A range past the chunk's end is an error: the caller's table does not
// describe this chunk.
func (s *Store) ReadAt(d digest.Digest, p []byte, off int64) (int, error) {
	f, e, err := s.open(d)
	if errors.Is(err, ErrNotFound) {
		return s.readAtPlace(d, p, off)
	}
	if err != nil {
		return 0, err
	}
	defer f.Close()
	if !s.isVerified(e) {
		if err := s.verifyFile(d, e, f); err != nil {
			return 0, err
		}
	}
	if off < 0 || off+int64(len(p)) > e.size {
		return 0, fmt.Errorf("read cached chunk %s at %d+%d: past its %d bytes", d, off, len(p), e.size)
	}
	n, err := f.ReadAt(p, off)
	if err != nil {
		return n, fmt.Errorf("read cached chunk %s at %d: %w", d, off, err)
	}
	return n, nil
}

// readAtPlace is ReadAt of a chunk in an image dir.
func (s *Store) readAtPlace(d digest.Digest, p []byte, off int64) (int, error) {
	for {
		pl, f, err := s.usePlace(d)
		if err != nil {
			return 0, err
		}
		n, err := s.readAtPlaceOnce(d, pl, f, p, off)
		s.endUse(pl)
		if !errors.Is(err, ErrNotFound) {
			return n, err
		}
	}
}

func (s *Store) readAtPlaceOnce(d digest.Digest, pl *place, f *os.File, p []byte, off int64) (int, error) {
	s.mu.Lock()
	verified := pl.verified
	s.mu.Unlock()
	if !verified {
		_, err, _ := s.verifying.Do(fmt.Sprintf("place:%p", pl), func() (any, error) {
			bp, buf := s.buffer(pl.size)
			defer s.verifyBufs.Put(bp)
			_, err := s.readPlace(d, pl, f, buf, false)
			return nil, err
		})
		if err != nil {
			return 0, err
		}
	}
	if off < 0 || off+int64(len(p)) > pl.size {
		return 0, fmt.Errorf("read cached chunk %s at %d+%d: past its %d bytes", d, off, len(p), pl.size)
	}
	n, err := f.ReadAt(p, pl.off+off)
	if err != nil {
		return n, fmt.Errorf("read cached chunk %s at %d: %w", d, off, err)
	}
	return n, nil
}

// buffer returns a buffer of n bytes from the store's pool, and its
// pointer to put back (verifyBufs.Put) once done with it.
func (s *Store) buffer(n int64) (*[]byte, []byte) {
	bp, _ := s.verifyBufs.Get().(*[]byte)
	if bp == nil {
		bp = new([]byte)
	}
	if int64(cap(*bp)) < n {
		*bp = make([]byte, n)
	}
	return bp, (*bp)[:n]
}

// verifyFile reads chunk d's whole file and checks its sha256, once however
// many readers of the chunk arrive together; a bad chunk is dropped.
func (s *Store) verifyFile(d digest.Digest, e *entry, f *os.File) error {
	_, err, _ := s.verifying.Do(d.String(), func() (any, error) {
		if s.isVerified(e) {
			return nil, nil
		}
		bp, buf := s.buffer(e.size)
		defer s.verifyBufs.Put(bp)
		if _, err := f.ReadAt(buf, 0); err != nil {
			if errors.Is(err, io.EOF) {
				return nil, s.drop(d, e, "short")
			}
			return nil, fmt.Errorf("read cached chunk %s: %w", d, err)
		}
		if digest.FromBytes(buf) != d {
			return nil, s.drop(d, e, "damaged")
		}
		s.setVerified(e)
		return nil, nil
	})
	return err
}

func (s *Store) isVerified(e *entry) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return e.verified
}

func (s *Store) setVerified(e *entry) {
	s.mu.Lock()
	e.verified = true
	s.mu.Unlock()
}

// drop removes chunk d, found damaged, unless it was replaced meanwhile,
// and returns the ErrNotFound to report.
func (s *Store) drop(d digest.Digest, e *entry, what string) error {
	s.mu.Lock()
	if s.entries[chunkKey(d)] == e {
		os.Remove(s.Path(d))
		s.total -= e.size
		delete(s.entries, chunkKey(d))
	}
	s.mu.Unlock()
	return fmt.Errorf("cached chunk %s is %s; dropped: %w", d, what, ErrNotFound)
}

// use returns k's entry, if there is one, and marks it used.
func (s *Store) use(k key) (*entry, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.entries[k]
	if ok {
		e.lastUse = s.clock()
	}
	return e, ok
}

// open opens chunk d's file, marks it used and returns its entry.
func (s *Store) open(d digest.Digest) (*os.File, *entry, error) {
	e, ok := s.use(chunkKey(d))
	if !ok {
		return nil, nil, ErrNotFound
	}
	f, err := os.Open(s.Path(d))
	if errors.Is(err, fs.ErrNotExist) {
		s.forget(chunkKey(d), e)
		return nil, nil, ErrNotFound
	}
	if err != nil {
		return nil, nil, fmt.Errorf("read cached chunk %s: %w", d, err)
	}
	return f, e, nil
}

// Put stores data as chunk d after checking that it hashes to d. It is a
// no-op if the chunk is already there.
func (s *Store) Put(d digest.Digest, data []byte) error {
	if got := digest.FromBytes(data); got != d {
		return fmt.Errorf("cache put %s: content hashes to %s", d, got)
	}
	return s.PutVerified(d, data)
}

// PutVerified stores data as chunk d; the caller has just verified that
// data hashes to d (the fetcher does, before anything is served). A chunk
// that snapshots being assembled hold (Assemble) is written into their
// files, at its offsets, and nowhere else; any other is stored as a chunk
// file of its own, flushed before it is linked under its digest.
func (s *Store) PutVerified(d digest.Digest, data []byte) error {
	placed, err := s.place(d, data)
	if placed || err != nil {
		s.evict()
		return err
	}
	if s.Has(d) {
		return nil
	}
	p := s.Path(d)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("cache put %s: %w", d, err)
	}
	if err := atomicfile.Write(filepath.Dir(p), p, data, 0o400); err != nil {
		return fmt.Errorf("cache put %s: %w", d, err)
	}
	s.add(chunkKey(d), int64(len(data)))
	s.evict()
	return nil
}

// add records a verified entry of size bytes unless there is one.
func (s *Store) add(k key, size int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.entries[k]; !ok {
		s.entries[k] = &entry{size: size, lastUse: s.clock(), verified: true}
		s.total += size
	}
}

// Pin marks chunks as used by a live mount: they are not evicted until
// Unpin. Pins nest.
func (s *Store) Pin(ds []digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range ds {
		s.pins[chunkKey(d)]++
	}
}

// Unpin releases what Pin took.
func (s *Store) Unpin(ds []digest.Digest) {
	s.mu.Lock()
	for _, d := range ds {
		s.unpinLocked(chunkKey(d))
	}
	s.mu.Unlock()
	s.evict()
}

func (s *Store) unpinLocked(k key) {
	if s.pins[k] <= 1 {
		delete(s.pins, k)
	} else {
		s.pins[k]--
	}
}

// Stats returns the cache's size and counts.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Bytes: s.total, CapBytes: s.capBytes, Pinned: len(s.pins), Evictions: s.evictions}
	for k := range s.entries {
		switch {
		case !k.image:
			st.Chunks++
		case s.images[k.d] != nil && s.images[k.d].partial:
			st.Partial++
		default:
			st.Images++
		}
	}
	for d := range s.placed {
		if _, ok := s.entries[chunkKey(d)]; !ok {
			st.Chunks++
		}
	}
	return st
}

// forget drops k's entry if it is still e.
func (s *Store) forget(k key, e *entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.entries[k] == e {
		s.total -= e.size
		delete(s.entries, k)
	}
}

// holdsPinnedLocked reports whether materialized dir d holds the only
// copy of a chunk a live mount pinned: it is kept until that mount has
// its own.
func (s *Store) holdsPinnedLocked(d digest.Digest) bool {
	img := s.images[d]
	if img == nil {
		return false
	}
	for _, cd := range img.digests {
		if s.pins[chunkKey(cd)] == 0 {
			continue
		}
		if _, ok := s.entries[chunkKey(cd)]; ok || len(s.placed[cd]) > 1 {
			continue
		}
		return true
	}
	return false
}

// evict removes least recently used unpinned chunks and image dirs until
// the cache is under 90% of its cap (or nothing unpinned is left).
func (s *Store) evict() {
	s.mu.Lock()
	if s.capBytes <= 0 || s.total <= s.capBytes {
		s.mu.Unlock()
		return
	}
	type cand struct {
		k key
		e *entry
	}
	var cands []cand
	for k, e := range s.entries {
		if s.pins[k] == 0 {
			cands = append(cands, cand{k, e})
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].e.lastUse.Before(cands[j].e.lastUse) })
	target := s.capBytes - s.capBytes/10
	var victims []key
	// Image dirs leave their name under the lock: a mount pinning one
	// right after must not find it half removed.
	var trash []string
	for _, c := range cands {
		if s.total <= target {
			break
		}
		// After the victims before it: two dirs may hold the only two
		// copies of a pinned chunk.
		if c.k.image && s.holdsPinnedLocked(c.k.d) {
			continue
		}
		s.total -= c.e.size
		delete(s.entries, c.k)
		victims = append(victims, c.k)
		s.evictions++
		if c.k.image {
			if t := s.unlinkImage(c.k.d); t != "" {
				trash = append(trash, t)
			}
			if img := s.images[c.k.d]; img != nil {
				s.removeImageLocked(img)
			}
		}
	}
	s.mu.Unlock()
	for _, k := range victims {
		if !k.image {
			os.Remove(s.Path(k.d))
		}
	}
	for _, t := range trash {
		os.RemoveAll(t)
	}
}
