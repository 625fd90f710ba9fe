// Package layout stores snapshots in an OCI image layout directory. It is
// oras-go's content/oci store plus one fast path: chunk blobs that the packer
// has just hashed are written straight into blobs/<alg>/<hex> without being
// hashed a second time on the way in.
package layout

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content/oci"
)

// Store is an OCI image layout on disk.
type Store struct {
	*oci.Store
	root string
}

// New opens the OCI image layout at root, creating it if needed.
func New(root string) (*Store, error) {
	s, err := oci.New(root)
	if err != nil {
		return nil, fmt.Errorf("open OCI layout %s: %w", root, err)
	}
	return &Store{Store: s, root: root}, nil
}

// WriteBlob stores data as desc. The caller vouches that desc.Digest and
// desc.Size were computed from data itself (format.Pack does so); use Push for
// content from anywhere else. The blob appears atomically (temporary file,
// then rename); an existing blob is left alone.
func (s *Store) WriteBlob(_ context.Context, desc ocispec.Descriptor, data []byte) error {
	if err := desc.Digest.Validate(); err != nil {
		return fmt.Errorf("write blob: %w", err)
	}
	if int64(len(data)) != desc.Size {
		return fmt.Errorf("write blob %s: %d bytes, descriptor says %d", desc.Digest, len(data), desc.Size)
	}
	dir := filepath.Join(s.root, ocispec.ImageBlobsDir, desc.Digest.Algorithm().String())
	target := filepath.Join(dir, desc.Digest.Encoded())
	if _, err := os.Stat(target); err == nil {
		return nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("write blob %s: %w", desc.Digest, err)
	}
	if err := writeAtomic(dir, target, data); err != nil {
		return fmt.Errorf("write blob %s: %w", desc.Digest, err)
	}
	return nil
}

// writeAtomic makes target hold data, appearing only when complete. On Linux
// it writes an unnamed O_TMPFILE inode and links it into place: one
// directory operation per blob instead of a create and a rename, which
// matters when a pack writes a thousand blobs per GiB into one directory.
// Elsewhere, or where the filesystem lacks O_TMPFILE, it writes a temporary
// file and renames it.
func writeAtomic(dir, target string, data []byte) error {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, 0o444)
	if err == nil {
		f := os.NewFile(uintptr(fd), target)
		defer f.Close()
		if _, err := f.Write(data); err != nil {
			return err
		}
		err = unix.Linkat(unix.AT_FDCWD, fmt.Sprintf("/proc/self/fd/%d", fd), unix.AT_FDCWD, target, unix.AT_SYMLINK_FOLLOW)
		if errors.Is(err, fs.ErrExist) {
			return nil // written meanwhile by someone else: same content
		}
		return err
	}
	tmp, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return err
	}
	_, err = tmp.Write(data)
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(tmp.Name(), 0o444)
	}
	if err == nil {
		err = os.Rename(tmp.Name(), target)
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return err
}
