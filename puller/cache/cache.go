// Package cache is the node cache of a puller: chunks stored by the sha256
// of their uncompressed bytes under <root>/chunks/sha256/<hh>/<hex>, shared
// by every snapshot and mount on the node, so a chunk two snapshots share is
// fetched once.
//
// Every chunk is verified before it is stored and appears atomically (an
// unnamed O_TMPFILE inode linked into place, or a temporary file renamed),
// so after a crash or kill -9 the cache holds only whole, verified chunks.
// The cache keeps its total size under a cap by evicting the least recently
// used chunks, but never a chunk pinned by a live mount.
package cache

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
)

// ErrNotFound is returned for a chunk the cache does not hold.
var ErrNotFound = errors.New("chunk not in cache")

// Store is a node cache. It is safe for concurrent use by many mounts.
type Store struct {
	root     string
	capBytes int64

	mu        sync.Mutex
	entries   map[digest.Digest]*entry
	total     int64
	pins      map[digest.Digest]int
	evictions int64
	clock     func() time.Time
}

type entry struct {
	size    int64
	lastUse time.Time
}

// Stats describe the cache.
type Stats struct {
	Chunks    int   `json:"chunks"`
	Bytes     int64 `json:"bytes"`
	CapBytes  int64 `json:"capBytes"`
	Pinned    int   `json:"pinned"`
	Evictions int64 `json:"evictions"`
}

// Open opens (creating if needed) the cache under root with a size cap in
// bytes (0: no cap). It indexes the chunks already there, taking their
// modification time as their last use, and drops leftovers of interrupted
// writes.
func Open(root string, capBytes int64) (*Store, error) {
	s := &Store{root: root, capBytes: capBytes, entries: map[digest.Digest]*entry{}, pins: map[digest.Digest]int{}, clock: time.Now}
	dir := filepath.Join(root, "chunks", "sha256")
	if err := os.MkdirAll(dir, 0o700); err != nil {
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
		s.entries[dg] = &entry{size: info.Size(), lastUse: info.ModTime()}
		s.total += info.Size()
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("index cache %s: %w", root, err)
	}
	return s, nil
}

// Root is the cache's directory.
func (s *Store) Root() string { return s.root }

// Path is where chunk d is (or would be) stored.
func (s *Store) Path(d digest.Digest) string {
	hx := d.Encoded()
	return filepath.Join(s.root, "chunks", "sha256", hx[:2], hx)
}

// Has reports whether the cache holds chunk d.
func (s *Store) Has(d digest.Digest) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, ok := s.entries[d]
	return ok
}

// Get reads chunk d into buf (grown as needed) and marks it used. The bytes
// were verified when they were stored; Get re-verifies them only if verify
// is true (a chunk file could have been damaged on disk since).
func (s *Store) Get(d digest.Digest, buf []byte, verify bool) ([]byte, error) {
	f, size, err := s.open(d)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if int64(cap(buf)) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	if _, err := f.ReadAt(buf, 0); err != nil {
		return nil, fmt.Errorf("read cached chunk %s: %w", d, err)
	}
	if verify && hexSum(buf) != d.Encoded() {
		os.Remove(s.Path(d))
		s.forget(d)
		return nil, fmt.Errorf("cached chunk %s is damaged; dropped: %w", d, ErrNotFound)
	}
	return buf, nil
}

// open opens chunk d's file, marks it used and returns its size.
func (s *Store) open(d digest.Digest) (*os.File, int64, error) {
	s.mu.Lock()
	e, ok := s.entries[d]
	if ok {
		e.lastUse = s.clock()
	}
	s.mu.Unlock()
	if !ok {
		return nil, 0, ErrNotFound
	}
	f, err := os.Open(s.Path(d))
	if errors.Is(err, fs.ErrNotExist) {
		s.forget(d)
		return nil, 0, ErrNotFound
	}
	if err != nil {
		return nil, 0, fmt.Errorf("read cached chunk %s: %w", d, err)
	}
	return f, e.size, nil
}

// ReadAt reads len(p) bytes of chunk d at offset off straight from its file
// (a FUSE read of part of a chunk costs one pread) and marks it used.
func (s *Store) ReadAt(d digest.Digest, p []byte, off int64) (int, error) {
	f, _, err := s.open(d)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, err := f.ReadAt(p, off)
	if err != nil {
		return n, fmt.Errorf("read cached chunk %s at %d: %w", d, off, err)
	}
	return n, nil
}

// Put stores data as chunk d after checking that it hashes to d. It is a
// no-op if the chunk is already there.
func (s *Store) Put(d digest.Digest, data []byte) error {
	if hexSum(data) != d.Encoded() {
		return fmt.Errorf("cache put %s: content hashes to sha256:%s", d, hexSum(data))
	}
	return s.PutVerified(d, data)
}

// PutVerified stores data as chunk d; the caller has just verified that
// data hashes to d (the fetcher does, before anything is served).
func (s *Store) PutVerified(d digest.Digest, data []byte) error {
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
	s.mu.Lock()
	if _, ok := s.entries[d]; !ok {
		s.entries[d] = &entry{size: int64(len(data)), lastUse: s.clock()}
		s.total += int64(len(data))
	}
	s.mu.Unlock()
	s.evict()
	return nil
}

// Pin marks chunks as used by a live mount: they are not evicted until
// Unpin. Pins nest.
func (s *Store) Pin(ds []digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range ds {
		s.pins[d]++
	}
}

// Unpin releases what Pin took.
func (s *Store) Unpin(ds []digest.Digest) {
	s.mu.Lock()
	for _, d := range ds {
		if s.pins[d] <= 1 {
			delete(s.pins, d)
		} else {
			s.pins[d]--
		}
	}
	s.mu.Unlock()
	s.evict()
}

// Stats returns the cache's size and counts.
func (s *Store) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Stats{Chunks: len(s.entries), Bytes: s.total, CapBytes: s.capBytes, Pinned: len(s.pins), Evictions: s.evictions}
}

func (s *Store) forget(d digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if e, ok := s.entries[d]; ok {
		s.total -= e.size
		delete(s.entries, d)
	}
}

// evict removes least recently used unpinned chunks until the cache is
// under 90% of its cap (or nothing unpinned is left).
func (s *Store) evict() {
	s.mu.Lock()
	if s.capBytes <= 0 || s.total <= s.capBytes {
		s.mu.Unlock()
		return
	}
	type cand struct {
		d digest.Digest
		e *entry
	}
	var cands []cand
	for d, e := range s.entries {
		if s.pins[d] == 0 {
			cands = append(cands, cand{d, e})
		}
	}
	sort.Slice(cands, func(i, j int) bool { return cands[i].e.lastUse.Before(cands[j].e.lastUse) })
	target := s.capBytes - s.capBytes/10
	var victims []digest.Digest
	for _, c := range cands {
		if s.total <= target {
			break
		}
		s.total -= c.e.size
		delete(s.entries, c.d)
		victims = append(victims, c.d)
		s.evictions++
	}
	s.mu.Unlock()
	for _, d := range victims {
		os.Remove(s.Path(d))
	}
}

func hexSum(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
