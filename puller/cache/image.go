package cache

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
)

// ImageMarker is the file a materialized image dir holds once complete:
// written, with every file and dir of the image flushed to disk, just
// before the dir is renamed into place. An image dir without it is the
// leftover of a crash and is never used.
const ImageMarker = ".cryo-complete"

// A materialized image dir is snapshot <hex>'s files as a plain image dir
// under <root>/images/<hex> (0700, files 0600), written by a puller once
// every chunk is local so that later restores need no FUSE (WriteImage).
// It is written in a temporary <hex>.tmp-* dir (NewImageDir), then
// committed (CommitImage). Image dirs count against the cap like chunks and are
// evicted least recently used first, never while pinned (PinImage) by a
// mount that uses it.

func (s *Store) imagesDir() string { return filepath.Join(s.root, "images") }

// ImagePath is where the image dir of snapshot d is (or would be).
func (s *Store) ImagePath(d digest.Digest) string {
	return filepath.Join(s.imagesDir(), d.Encoded())
}

// Image returns snapshot d's image dir if the cache holds it complete, and
// marks it used.
func (s *Store) Image(d digest.Digest) (string, bool) {
	e, ok := s.use(imageKey(d))
	if !ok {
		return "", false
	}
	dir := s.ImagePath(d)
	if _, err := os.Stat(filepath.Join(dir, ImageMarker)); err != nil {
		s.forget(imageKey(d), e)
		return "", false
	}
	return dir, true
}

// PinImage keeps snapshot d's image dir from eviction until UnpinImage,
// whether or not it exists yet: pin, then check with Image. Pins nest.
func (s *Store) PinImage(d digest.Digest) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pins[imageKey(d)]++
}

// UnpinImage releases what PinImage took.
func (s *Store) UnpinImage(d digest.Digest) {
	s.mu.Lock()
	s.unpinLocked(imageKey(d))
	s.mu.Unlock()
	s.evict()
}

// NewImageDir creates an empty temporary dir (0700) to write snapshot d's
// image dir in, before CommitImage. The caller removes it if it does not
// commit it; a crash leaves it for the next Open to remove.
func (s *Store) NewImageDir(d digest.Digest) (string, error) {
	if err := os.MkdirAll(s.imagesDir(), 0o700); err != nil {
		return "", fmt.Errorf("materialize %s: %w", d, err)
	}
	tmp, err := os.MkdirTemp(s.imagesDir(), d.Encoded()+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("materialize %s: %w", d, err)
	}
	return tmp, nil
}

// CommitImage makes tmp (from NewImageDir, every file in it written and
// flushed by the caller) snapshot d's image dir: it flushes tmp's dirs,
// writes the completion marker, renames tmp into place and flushes the
// images dir, then counts the dir against the cap. If another writer
// committed d first, tmp is removed and CommitImage succeeds.
func (s *Store) CommitImage(d digest.Digest, tmp string) error {
	_, err := s.commitImage(d, tmp, nil)
	s.evict()
	return err
}

// commitImage is CommitImage but for the eviction, which is the caller's;
// ours is false if another writer's dir was kept. If tmp is assembly a's
// dir, the bytes a counted are taken off the total as the dir's are added.
func (s *Store) commitImage(d digest.Digest, tmp string, a *Assembly) (ours bool, err error) {
	size, err := syncTree(tmp)
	if err != nil {
		return false, fmt.Errorf("materialize %s: %w", d, err)
	}
	if err := atomicfile.Write(tmp, filepath.Join(tmp, ImageMarker), []byte(d.String()+"\n"), 0o400); err != nil {
		return false, fmt.Errorf("materialize %s: completion marker: %w", d, err)
	}
	final := s.ImagePath(d)
	if err := os.Rename(tmp, final); err != nil {
		if _, serr := os.Stat(filepath.Join(final, ImageMarker)); serr == nil {
			// Committed by another writer: keep theirs.
			os.RemoveAll(tmp)
			if size, err = treeSize(final); err != nil {
				return false, fmt.Errorf("materialize %s: %w", d, err)
			}
			s.addImage(d, size, a)
			return false, nil
		}
		// A dir without its marker: a crash's leftover; take its place.
		if rerr := os.Rename(final, final+".tmp-stale"); rerr != nil {
			return false, fmt.Errorf("materialize %s: %w", d, err)
		}
		os.RemoveAll(final + ".tmp-stale")
		if err := os.Rename(tmp, final); err != nil {
			return false, fmt.Errorf("materialize %s: %w", d, err)
		}
	}
	if err := atomicfile.SyncDir(s.imagesDir()); err != nil {
		return false, fmt.Errorf("materialize %s: %w", d, err)
	}
	s.addImage(d, size, a)
	return true, nil
}

// addImage counts committed image dir d of size bytes, in place of what
// assembly a (if not nil) counted.
func (s *Store) addImage(d digest.Digest, size int64, a *Assembly) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a != nil {
		s.total -= a.bytes
		a.bytes = 0
	}
	if _, ok := s.entries[imageKey(d)]; !ok {
		s.entries[imageKey(d)] = &entry{size: size, lastUse: s.clock(), verified: true}
		s.total += size
	}
}

// syncTree flushes every dir under root (files are the writer's to flush)
// and returns the bytes root's files take on disk.
func syncTree(root string) (int64, error) {
	var size int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return atomicfile.SyncDir(p)
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		size += diskSize(info)
		return nil
	})
	return size, err
}

// diskSize is what a file takes on disk: materialized files are sparse
// where the snapshot is zero.
func diskSize(info fs.FileInfo) int64 {
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return info.Size()
}

// indexImages records the complete image dirs under images/ and removes
// what interrupted writes and evictions left: temporary dirs and dirs
// without their completion marker (a crash before the marker was flushed).
func (s *Store) indexImages() error {
	dir := s.imagesDir()
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, de := range ents {
		name := de.Name()
		p := filepath.Join(dir, name)
		// <hex>, <hex>.tmp-* (written, evicted: removed), <hex>.partial-*.
		hx, rest, dotted := strings.Cut(name, ".")
		if digest.NewDigestFromEncoded(digest.SHA256, hx).Validate() != nil {
			continue // not ours
		}
		if dotted && strings.HasPrefix(rest, "partial-") && !strings.Contains(rest, ".tmp-") && de.IsDir() {
			if err := s.indexPartial(name, p); err != nil {
				if err := os.RemoveAll(p); err != nil {
					return err
				}
			}
			continue
		}
		if dotted || !de.IsDir() {
			if err := os.RemoveAll(p); err != nil {
				return err
			}
			continue
		}
		marker, err := os.Stat(filepath.Join(p, ImageMarker))
		if err != nil {
			if err := os.RemoveAll(p); err != nil {
				return err
			}
			continue
		}
		size, err := treeSize(p)
		if err != nil {
			return err
		}
		d := digest.NewDigestFromEncoded(digest.SHA256, hx)
		s.entries[imageKey(d)] = &entry{size: size, lastUse: marker.ModTime(), verified: true}
		s.total += size
		s.indexImageChunks(d, p, false)
	}
	return nil
}

// indexPartial indexes the partial image dir name at p (Assembly.Release)
// for the chunks its list names, or fails if it cannot be used.
func (s *Store) indexPartial(name, p string) error {
	info, err := os.Lstat(p)
	if err != nil || !info.IsDir() {
		return fmt.Errorf("partial image dir %s: not a dir", p)
	}
	id := partialID(name)
	if err := s.indexImageChunks(id, p, true); err != nil {
		return err
	}
	size, err := treeSize(p)
	if err != nil {
		return err
	}
	s.entries[imageKey(id)] = &entry{size: size, lastUse: info.ModTime(), verified: true}
	s.total += size
	return nil
}

// treeSize returns the bytes root's files take on disk.
func treeSize(root string) (int64, error) {
	var size int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		info, err := d.Info()
		if err == nil {
			size += diskSize(info)
		}
		return err
	})
	return size, err
}

// unlinkImage moves snapshot d's evicted image dir out of its name (so no
// one finds it from now on) and returns where it went, for removal. Called
// with s.mu held.
func (s *Store) unlinkImage(d digest.Digest) string {
	final := s.ImagePath(d)
	if img := s.images[d]; img != nil && img.partial {
		final = img.dir
	}
	trash := fmt.Sprintf("%s.tmp-evicted-%d", final, time.Now().UnixNano())
	if err := os.Rename(final, trash); err != nil {
		return ""
	}
	return trash
}
