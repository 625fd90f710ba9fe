// Package atomicfile writes files that appear only when complete and
// durable, for content-addressed stores (layout blobs, the node cache) where
// a partial file under a digest's name would be served as that content.
package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Write makes target (in directory dir) hold data with permissions perm,
// appearing atomically and only once its bytes are on disk: the data is
// flushed (fdatasync) before the file gets its name, and dir is flushed
// (fsync) after, so after a crash target is either absent or whole.
//
// On Linux it writes an unnamed O_TMPFILE inode and links it into place: one
// directory operation instead of a create and a rename, which matters when
// thousands of chunks land in one directory, and nothing to clean up after a
// crash. Where O_TMPFILE is not supported it writes a temporary ".tmp-*"
// file and renames it. If target appears meanwhile (the same content,
// written by someone else), Write succeeds.
func Write(dir, target string, data []byte, perm os.FileMode) error {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, uint32(perm))
	if err == nil {
		f := os.NewFile(uintptr(fd), target)
		defer f.Close()
		if _, err := f.Write(data); err != nil {
			return err
		}
		if err := unix.Fdatasync(fd); err != nil {
			return fmt.Errorf("sync %s: %w", target, err)
		}
		err = unix.Linkat(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", fd), unix.AT_FDCWD, target, unix.AT_SYMLINK_FOLLOW)
		if errors.Is(err, fs.ErrExist) {
			return nil
		}
		if err != nil {
			return err
		}
		return SyncDir(dir)
	}
	tmp, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if err == nil {
		err = unix.Fdatasync(int(tmp.Fd()))
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), perm)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), target)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return SyncDir(dir)
}

// Replace writes data to path with mode perm in place of what path held:
// to a temporary name in its dir, flushed, then renamed over path and the
// dir flushed, so that a reader finds the old file or the new one whole,
// and the new one only once it is on disk. Unlike Write, an existing path
// is replaced.
func Replace(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if err == nil {
		err = tmp.Chmod(perm)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return SyncDir(dir)
}

// SyncDir flushes directory dir (its entries: names created, renamed or
// removed in it) to disk.
func SyncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync dir: %w", err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("sync dir %s: %w", dir, err)
	}
	return nil
}
