package format

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// UnpackOptions tune Unpack and UnpackFrom.
type UnpackOptions struct {
	// Concurrency is how many chunks are fetched and decoded at once
	// (default GOMAXPROCS).
	Concurrency int
	// OnChunk, if set, is called for every chunk written, from several
	// goroutines and in no particular order, with fetched false for chunks
	// that were already on disk from an interrupted run and for zero chunks.
	OnChunk func(c Chunk, fetched bool)
	// Private makes every file 0600 and every dir 0700, whatever modes the
	// snapshot records (a snapshot is a process's memory: the puller's
	// materialized dirs are its alone). By default files get the modes the
	// snapshot records and dirs 0755.
	Private bool
	// Staging, if set, is the dir to write in instead of PartialDir(dir):
	// one the caller created, that only it can write (it is neither locked
	// nor checked like a partial dir). Files found in it are resumed from.
	Staging string
	// Commit, if set, moves the staging dir into place instead of renaming
	// it to dir: it is called with every file of the snapshot written,
	// verified and flushed, every other file removed, and every dir
	// flushed. It must leave dir absent or complete after a crash.
	Commit func(staging string) error
	// InPlace, if set, reports that chunk c of file f is already at its
	// offset in the staging dir's file, written by the caller in this
	// process from bytes it verified: UnpackFrom reads it back for the
	// file's sha256 but does not hash it on its own again. Every other
	// chunk found in a staging file is verified before it is kept. A chunk
	// InPlace vouches for wrongly still fails the whole file's check (when
	// Verified did not vouch for the file).
	InPlace func(f *File, c Chunk) bool
	// Verified, if set, reports that file f, opened in the staging dir as
	// opened, is complete and that the caller has verified every byte of
	// that very file (os.SameFile): its sha256, or each chunk's before the
	// caller wrote it at the offset f's table gives. UnpackFrom only gives
	// it its size and mode and flushes it.
	Verified func(f *File, opened fs.FileInfo) bool
}

// UnpackStats counts what Unpack did.
type UnpackStats struct {
	Files int `json:"files"`
	// LogicalBytes is the size of all files.
	LogicalBytes int64 `json:"logicalBytes"`
	// FetchedBytes is the size of the blobs fetched; ReusedBytes the bytes
	// found already verified on disk from an interrupted run.
	FetchedBytes int64 `json:"fetchedBytes"`
	ReusedBytes  int64 `json:"reusedBytes"`
	// ChunksFetched and ChunksReused count non-zero chunks.
	ChunksFetched int `json:"chunksFetched"`
	ChunksReused  int `json:"chunksReused"`
}

// PartialDir is where Unpack writes before renaming into dir: a hidden
// directory next to dir. An interrupted Unpack leaves it; the next Unpack
// into the same dir resumes from it.
func PartialDir(dir string) string {
	parent, base := filepath.Split(filepath.Clean(dir))
	return filepath.Join(parent, "."+base+".cryo-partial")
}

// Unpack restores the snapshot desc from src into dir, which must not exist
// or be an empty directory: it loads the snapshot and every chunk table,
// then writes the files with UnpackFrom, reading chunks with a Reader over
// src. Every chunk and file is verified, the files are written in
// PartialDir(dir) (resuming from what an interrupted Unpack left there, if
// it is safe to reuse) and renamed into place: after a crash, dir is absent
// or complete.
func Unpack(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, dir string, opts UnpackOptions) (*Snapshot, *UnpackStats, error) {
	// Fail before any fetch on a target that cannot be used.
	if err := checkTarget(dir); err != nil {
		return nil, nil, err
	}
	snap, err := LoadSnapshot(ctx, src, desc)
	if err != nil {
		return nil, nil, err
	}
	chunks, err := LoadChunks(ctx, src, snap)
	if err != nil {
		return nil, nil, err
	}
	r, err := NewReader(src)
	if err != nil {
		return nil, nil, err
	}
	defer r.Close()
	// Frames in runs of up to a pack per range request, half the unpack's
	// concurrency of them fetched ahead (2 to maxRunsAhead). When resuming,
	// the chunks found in the partial dir are taken out of the plan as
	// they are found (Reader.skipChunk). Not when the caller's options
	// may take chunks from elsewhere.
	if opts.Staging == "" && opts.InPlace == nil && opts.Verified == nil {
		r.plan(ctx, chunks, runsAhead(opts.Concurrency))
	}
	st, err := UnpackFrom(ctx, snap, chunks, r, dir, opts)
	if err != nil {
		return nil, st, err
	}
	return snap, st, nil
}

// runsAhead is how many runs of frames an unpack or a verify reading
// concurrency chunks at once (0: GOMAXPROCS, as UnpackFrom) fetches ahead
// of the one it reads: half of them, 2 to maxRunsAhead.
func runsAhead(concurrency int) int {
	if concurrency <= 0 {
		concurrency = runtime.GOMAXPROCS(0)
	}
	return min(max(2, concurrency/2), maxRunsAhead)
}

// UnpackFrom writes snapshot snap, whose files' chunks are chunks (from
// LoadChunks), into dir, reading every chunk from src. Every chunk is
// verified and every whole file checked against its sha256 (but a file
// UnpackOptions.Verified vouches for, whose caller verified every byte of
// it); zero chunks
// are left as holes (sparse files). Files are written into PartialDir(dir)
// and moved into place by one rename only when all of them verified, so
// dir never holds a partial or corrupt snapshot. If an earlier unpack into
// dir was interrupted, the chunks it left on disk are verified and kept
// instead of being read again, if that partial dir is safe to reuse: it and
// everything in it belong to the current user, no dir in it is writable by
// group or others, and it holds no symlink or special file; otherwise
// UnpackFrom fails with ErrUnsafePartial. Every file is flushed (fdatasync)
// and every dir (fsync) before the rename, and the parent after it, so
// after a crash dir is absent or complete. opts.Staging and opts.Commit
// replace the partial dir and the rename (the puller's node cache commits
// its image dirs its own way).
func UnpackFrom(ctx context.Context, snap *Snapshot, chunks [][]Chunk, src ChunkSource, dir string, opts UnpackOptions) (*UnpackStats, error) {
	if len(chunks) != len(snap.Files) {
		return nil, fmt.Errorf("unpack %s: chunks of %d files for %d files", snap.Descriptor.Digest, len(chunks), len(snap.Files))
	}
	staging := opts.Staging
	if staging == "" {
		partial, unlock, err := openPartial(dir)
		if err != nil {
			return nil, err
		}
		defer unlock()
		staging = partial
	}
	if opts.Concurrency <= 0 {
		opts.Concurrency = runtime.GOMAXPROCS(0)
	}
	w := &writer{fr: newFileReader(src, opts.Concurrency), root: staging, opts: opts, st: &UnpackStats{}}
	keep := map[string]bool{}
	for i := range snap.Files {
		f := &snap.Files[i]
		keep[filepath.FromSlash(f.Path)] = true
		if err := w.writeFile(ctx, f, chunks[i]); err != nil {
			return w.st, err
		}
		w.st.Files++
		w.st.LogicalBytes += f.Size
	}
	if err := w.finish(keep); err != nil {
		return w.st, err
	}
	commit := opts.Commit
	if commit == nil {
		commit = func(staging string) error { return renameInto(staging, dir) }
	}
	return w.st, commit(staging)
}

// openPartial creates or reopens PartialDir(dir), after checking that dir
// can be replaced, and locks it against a concurrent unpack into dir. A
// partial dir left by an earlier run is reused only if it is safe to write
// into (checkPartial).
func openPartial(dir string) (string, func(), error) {
	if err := checkTarget(dir); err != nil {
		return "", nil, err
	}
	partial := PartialDir(dir)
	if err := os.MkdirAll(filepath.Dir(partial), 0o700); err != nil {
		return "", nil, fmt.Errorf("unpack into %s: %w", dir, err)
	}
	if err := os.Mkdir(partial, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return "", nil, fmt.Errorf("unpack into %s: %w", dir, err)
	}
	// O_NOFOLLOW: a symlink planted at the partial dir's name is not
	// followed; the checks below are on the dir actually opened.
	fd, err := syscall.Open(partial, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if errors.Is(err, syscall.ELOOP) || errors.Is(err, syscall.ENOTDIR) {
		return "", nil, fmt.Errorf("unpack into %s: %s is not a directory (a symlink?): %w", dir, partial, ErrUnsafePartial)
	}
	if err != nil {
		return "", nil, fmt.Errorf("unpack into %s: open %s: %w", dir, partial, err)
	}
	lock := os.NewFile(uintptr(fd), partial)
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		lock.Close()
		return "", nil, fmt.Errorf("unpack into %s: another unpack holds %s: %w", dir, partial, err)
	}
	if err := checkPartial(lock, partial); err != nil {
		lock.Close()
		return "", nil, fmt.Errorf("unpack into %s: %w", dir, err)
	}
	return partial, func() { lock.Close() }, nil
}

// ErrUnsafePartial marks a partial dir that Unpack will not reuse.
var ErrUnsafePartial = errors.New("unsafe partial unpack dir: remove it to unpack")

// checkPartial refuses to reuse a partial dir that someone else could have
// planted or can still change: the dir (already open as d) and every dir
// inside it must belong to the current user and not be writable by group
// or others, and it may hold only such dirs and regular files of the
// current user (no symlink that would redirect a write out of it).
func checkPartial(d *os.File, partial string) error {
	uid := uint32(os.Getuid())
	check := func(name string, info fs.FileInfo) error {
		st, ok := info.Sys().(*syscall.Stat_t)
		switch {
		case !ok:
			return fmt.Errorf("%s: no owner information: %w", name, ErrUnsafePartial)
		case info.Mode()&fs.ModeSymlink != 0:
			return fmt.Errorf("%s is a symlink: %w", name, ErrUnsafePartial)
		case !info.IsDir() && !info.Mode().IsRegular():
			return fmt.Errorf("%s is a %s, not a regular file or directory: %w", name, info.Mode().Type(), ErrUnsafePartial)
		case st.Uid != uid:
			return fmt.Errorf("%s belongs to uid %d, not to this user (uid %d): %w", name, st.Uid, uid, ErrUnsafePartial)
		case info.IsDir() && info.Mode().Perm()&0o022 != 0:
			return fmt.Errorf("%s has mode %04o, writable by group or others: %w", name, info.Mode().Perm(), ErrUnsafePartial)
		}
		return nil
	}
	info, err := d.Stat()
	if err != nil {
		return err
	}
	if err := check(partial, info); err != nil {
		return err
	}
	// WalkDir does not follow symlinks; it reports them as entries.
	return filepath.WalkDir(partial, func(p string, e fs.DirEntry, err error) error {
		if err != nil || p == partial {
			return err
		}
		info, err := e.Info()
		if err != nil {
			return err
		}
		return check(p, info)
	})
}

// The modes UnpackFrom gives dirs, and files with opts.Private.
const (
	dirMode         = 0o755
	privateDirMode  = 0o700
	privateFileMode = 0o600
)

// targetDirMode is the mode an unpack's target dir gets: dirMode less
// the umask, as the dirs implied by the paths get it from MkdirAll. The
// staging dir is created 0700 (no one else may write into it while it
// fills), so its final mode is set by Chmod, which ignores the umask.
func targetDirMode() fs.FileMode {
	return fs.FileMode(dirMode) &^ processUmask()
}

// processUmask reads the process's umask from /proc/self/status (Linux
// 4.7 on), 022 if it cannot. Written by hand because the only other way,
// syscall.Umask, sets it to read it, process-wide: a file another
// goroutine creates in that moment would get the wrong mode.
func processUmask() fs.FileMode {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0o022
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "Umask:"); ok {
			if m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil {
				return fs.FileMode(m) & fs.ModePerm
			}
		}
	}
	return 0o022
}

// finishDir removes the files under root that are not in keep (left by an
// interrupted unpack of another snapshot), gives root its mode and syncs
// every dir under it (the files were synced when written), children first.
func finishDir(root string, keep map[string]bool, mode fs.FileMode) error {
	var dirs []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, p)
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		if !keep[rel] {
			return os.Remove(p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("clean %s: %w", root, err)
	}
	if err := os.Chmod(root, mode); err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := atomicfile.SyncDir(dirs[i]); err != nil {
			return err
		}
	}
	return nil
}

// renameInto renames the finished dir partial to dir, which must be absent
// or an empty dir, then syncs dir's parent: after a crash, dir is either
// absent or complete.
func renameInto(partial, dir string) error {
	if err := checkTarget(dir); err != nil {
		return err
	}
	_ = os.Remove(dir) // an empty dir may be replaced; anything else was refused above
	if err := os.Rename(partial, dir); err != nil {
		return fmt.Errorf("move unpacked snapshot into place: %w", err)
	}
	return atomicfile.SyncDir(filepath.Dir(filepath.Clean(dir)))
}

// checkTarget refuses a dir that exists and is not an empty directory.
func checkTarget(dir string) error {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("unpack target %s: %w", dir, err)
	}
	if len(entries) > 0 {
		return fmt.Errorf("unpack target %s exists and is not empty: %w", dir, fs.ErrExist)
	}
	return nil
}

// writer writes the files of one UnpackFrom into its staging dir.
type writer struct {
	fr   *fileReader
	root string
	opts UnpackOptions
	mu   sync.Mutex // guards st
	st   *UnpackStats
}

// finish readies the staging dir for the commit (finishDir).
func (w *writer) finish(keep map[string]bool) error {
	mode := targetDirMode()
	if w.opts.Private {
		mode = privateDirMode
	}
	return finishDir(w.root, keep, mode)
}

// writeFile writes file f, whose chunks are chunks, under the staging dir,
// verified and flushed, reusing the verified chunks that an interrupted
// unpack left in it.
func (w *writer) writeFile(ctx context.Context, f *File, chunks []Chunk) error {
	// f.Path was validated by ParseIndex: relative, clean, no "..".
	name := filepath.Join(w.root, filepath.FromSlash(f.Path))
	dmode, fmode := fs.FileMode(dirMode), f.Mode
	if w.opts.Private {
		dmode, fmode = privateDirMode, privateFileMode
	}
	if err := os.MkdirAll(filepath.Dir(name), dmode); err != nil {
		return fmt.Errorf("create parent of %s: %w", f.Path, err)
	}
	fh, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW, privateFileMode)
	if err != nil {
		return fmt.Errorf("create %s: %w", f.Path, err)
	}
	defer fh.Close()
	info, err := fh.Stat()
	if err != nil {
		return fmt.Errorf("stat %s: %w", f.Path, err)
	}
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%s in %s is not a regular file", f.Path, w.root)
	}
	if w.opts.Verified != nil && w.opts.Verified(f, info) {
		w.mu.Lock()
		w.st.ReusedBytes += f.Size
		w.mu.Unlock()
		return w.flushFile(fh, f, fmode)
	}
	var local *localFile
	resumed := info.Size() > 0
	if resumed {
		local = &localFile{r: fh}
		if w.opts.InPlace != nil {
			local.inPlace = func(c Chunk) bool { return w.opts.InPlace(f, c) }
		}
	}
	err = w.fr.readFile(ctx, f, chunks, local, func(c Chunk, data []byte, fromLocal bool) error {
		if c.Encoding != EncodingZero {
			w.mu.Lock()
			if fromLocal {
				w.st.ChunksReused++
				w.st.ReusedBytes += c.Size
			} else {
				w.st.ChunksFetched++
				w.st.FetchedBytes += c.BlobSize
			}
			w.mu.Unlock()
		}
		if w.opts.OnChunk != nil {
			w.opts.OnChunk(c, !fromLocal && c.Encoding != EncodingZero)
		}
		// A fresh file's zero chunks stay holes (Truncate below sets the
		// size); in a resumed file they are written unless already zero.
		if fromLocal || (c.Encoding == EncodingZero && !resumed) {
			return nil
		}
		if _, err := fh.WriteAt(data, c.Offset); err != nil {
			return fmt.Errorf("write %s at %d: %w", f.Path, c.Offset, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	return w.flushFile(fh, f, fmode)
}

// flushFile gives file f, open as fh, its size and mode fmode, flushes it
// and closes it.
func (w *writer) flushFile(fh *os.File, f *File, fmode fs.FileMode) error {
	if err := fh.Truncate(f.Size); err != nil {
		return fmt.Errorf("size %s: %w", f.Path, err)
	}
	if err := fh.Chmod(fmode); err != nil {
		return fmt.Errorf("chmod %s: %w", f.Path, err)
	}
	// fsync, not fdatasync: the mode is metadata a crash must not lose.
	if err := fh.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", f.Path, err)
	}
	return fh.Close()
}

// VerifyStats counts what Verify checked.
type VerifyStats struct {
	// Files is the number of files verified.
	Files int `json:"files"`
	// Chunks is the number of chunks verified, zero chunks included.
	Chunks int `json:"chunks"`
	// LogicalBytes is the total size of the files.
	LogicalBytes int64 `json:"logicalBytes"`
}

// Verify fetches every manifest, chunk table and chunk of the snapshot desc
// and checks every digest, every rule of SPEC.md and every file's sha256,
// without writing anything.
func Verify(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, concurrency int) (*Snapshot, *VerifyStats, error) {
	snap, err := LoadSnapshot(ctx, src, desc)
	if err != nil {
		return nil, nil, err
	}
	chunks, err := LoadChunks(ctx, src, snap)
	if err != nil {
		return snap, nil, err
	}
	r, err := NewReader(src)
	if err != nil {
		return nil, nil, err
	}
	defer r.Close()
	if concurrency <= 0 {
		concurrency = runtime.GOMAXPROCS(0)
	}
	r.plan(ctx, chunks, runsAhead(concurrency)) // as Unpack
	fr := newFileReader(r, concurrency)
	st := &VerifyStats{}
	for i := range snap.Files {
		f := &snap.Files[i]
		var n atomic.Int64
		if err := fr.readFile(ctx, f, chunks[i], nil, func(Chunk, []byte, bool) error { n.Add(1); return nil }); err != nil {
			return snap, st, err
		}
		st.Files++
		st.Chunks += int(n.Load())
		st.LogicalBytes += f.Size
	}
	return snap, st, nil
}

// AnnotationTitle names a layer's file in artifacts that `oras push FILE...`
// writes.
const AnnotationTitle = ocispec.AnnotationTitle

// UnpackFiles restores a plain OCI artifact, as `oras push checkpoint.img
// pages_meta.img pages.img` writes it (one layer per whole file, named by
// its org.opencontainers.image.title annotation), into dir with the same
// guarantees as Unpack: every layer's digest verified, nothing visible in
// dir until all files are complete, and a file an interrupted run left
// complete and verified is not fetched again. It returns the bytes fetched.
func UnpackFiles(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, dir string, onBytes func(int64)) (int64, error) {
	if desc.MediaType != ocispec.MediaTypeImageManifest {
		return 0, fmt.Errorf("%s is %q, neither a cryo snapshot nor an image manifest: %w", desc.Digest, desc.MediaType, ErrInvalid)
	}
	data, err := FetchVerified(ctx, src, desc, MaxManifestSize)
	if err != nil {
		return 0, fmt.Errorf("fetch manifest: %w", err)
	}
	var m ocispec.Manifest
	if err := strictUnmarshal(data, &m); err != nil {
		return 0, fmt.Errorf("decode manifest %s: %v: %w", desc.Digest, err, ErrInvalid)
	}
	seen := map[string]bool{}
	for _, l := range m.Layers {
		name := l.Annotations[AnnotationTitle]
		if err := ValidatePath(name); err != nil {
			return 0, fmt.Errorf("layer %s: %w", l.Digest, err)
		}
		if seen[name] {
			return 0, fmt.Errorf("two layers are named %q: %w", name, ErrInvalid)
		}
		seen[name] = true
		if err := l.Digest.Validate(); err != nil || l.Size < 0 {
			return 0, fmt.Errorf("layer %q: bad digest or size: %w", name, ErrInvalid)
		}
	}
	if len(seen) == 0 {
		return 0, fmt.Errorf("manifest %s has no layer named by %s: %w", desc.Digest, AnnotationTitle, ErrInvalid)
	}
	partial, unlock, err := openPartial(dir)
	if err != nil {
		return 0, err
	}
	defer unlock()
	var fetched int64
	keep := map[string]bool{}
	for _, l := range m.Layers {
		name := l.Annotations[AnnotationTitle]
		keep[filepath.FromSlash(name)] = true
		n, err := fetchLayerFile(ctx, src, l, filepath.Join(partial, filepath.FromSlash(name)), onBytes)
		fetched += n
		if err != nil {
			return fetched, fmt.Errorf("%s: %w", name, err)
		}
	}
	if err := finishDir(partial, keep, targetDirMode()); err != nil {
		return fetched, err
	}
	return fetched, renameInto(partial, dir)
}

// fetchLayerFile writes layer l to name, verifying its digest while it
// streams, unless name already holds exactly that content.
func fetchLayerFile(ctx context.Context, src content.Fetcher, l ocispec.Descriptor, name string, onBytes func(int64)) (int64, error) {
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return 0, err
	}
	if f, err := os.OpenFile(name, os.O_RDONLY|syscall.O_NOFOLLOW, 0); err == nil {
		info, _ := f.Stat()
		ok := info.Mode().IsRegular() && info.Size() == l.Size && digestOf(f, l.Digest.Algorithm()) == l.Digest
		if ok {
			// An interrupted run may have written it without syncing.
			ok = f.Sync() == nil
		}
		f.Close()
		if ok {
			if onBytes != nil {
				onBytes(l.Size)
			}
			return 0, nil
		}
	}
	rc, err := src.Fetch(ctx, l)
	if err != nil {
		return 0, fmt.Errorf("fetch %s: %w", l.Digest, err)
	}
	defer rc.Close()
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW, 0o644)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	h := l.Digest.Algorithm().Hash()
	var w io.Writer = io.MultiWriter(f, h)
	if onBytes != nil {
		w = io.MultiWriter(w, countFunc(onBytes))
	}
	n, err := io.Copy(w, io.LimitReader(rc, l.Size+1))
	if err != nil {
		return n, fmt.Errorf("fetch %s: %w", l.Digest, err)
	}
	got := digest.NewDigest(l.Digest.Algorithm(), h)
	if n != l.Size || got != l.Digest {
		os.Remove(name)
		return n, fmt.Errorf("layer %s: got %d bytes hashing to %s: %w", l.Digest, n, got, ErrDigestMismatch)
	}
	if err := f.Sync(); err != nil {
		return n, err
	}
	return n, f.Close()
}

func digestOf(r io.Reader, alg digest.Algorithm) digest.Digest {
	if !alg.Available() {
		return ""
	}
	d, err := alg.FromReader(r)
	if err != nil {
		return ""
	}
	return d
}

// countFunc is an io.Writer that reports how many bytes pass.
type countFunc func(int64)

func (c countFunc) Write(b []byte) (int, error) { c(int64(len(b))); return len(b), nil }
