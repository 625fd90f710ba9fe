package format

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// Unpack restores the snapshot desc from src into dir, which must not exist
// or be an empty directory. Every chunk and every file is verified. The files
// are written into a temporary directory next to dir, synced, and renamed to
// dir only when all of them verified, so dir never holds a partial snapshot.
// Zero chunks are left as holes (sparse files).
func Unpack(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, dir string, concurrency int) (*Snapshot, error) {
	snap, err := LoadSnapshot(ctx, src, desc)
	if err != nil {
		return nil, err
	}
	if err := checkTarget(dir); err != nil {
		return nil, err
	}
	parent, base := filepath.Split(filepath.Clean(dir))
	if parent == "" {
		parent = "."
	}
	tmp, err := os.MkdirTemp(parent, "."+base+".cryo-tmp-")
	if err != nil {
		return nil, fmt.Errorf("unpack into %s: %w", dir, err)
	}
	done := false
	defer func() {
		if !done {
			os.RemoveAll(tmp)
		}
	}()
	r, err := NewReader(src, concurrency)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	for i := range snap.Files {
		if err := writeFile(ctx, r, tmp, &snap.Files[i]); err != nil {
			return nil, err
		}
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return nil, err
	}
	if err := syncDir(tmp); err != nil {
		return nil, err
	}
	if err := checkTarget(dir); err != nil {
		return nil, err
	}
	_ = os.Remove(dir) // an empty dir may be replaced; anything else was refused above
	if err := os.Rename(tmp, dir); err != nil {
		return nil, fmt.Errorf("move unpacked snapshot into place: %w", err)
	}
	done = true
	if err := syncDir(parent); err != nil {
		return nil, err
	}
	return snap, nil
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

// writeFile writes one verified file under root.
func writeFile(ctx context.Context, r *Reader, root string, f *File) error {
	// f.Path was validated by ParseIndex: relative, clean, no "..".
	name := filepath.Join(root, filepath.FromSlash(f.Path))
	if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
		return fmt.Errorf("create parent of %s: %w", f.Path, err)
	}
	fh, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", f.Path, err)
	}
	defer fh.Close()
	err = r.ReadFile(ctx, f, func(c Chunk, data []byte) error {
		if c.Encoding == EncodingZero {
			return nil // left as a hole; Truncate below sets the size
		}
		if _, err := fh.WriteAt(data, c.Offset); err != nil {
			return fmt.Errorf("write %s at %d: %w", f.Path, c.Offset, err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if err := fh.Truncate(f.Size); err != nil {
		return fmt.Errorf("size %s: %w", f.Path, err)
	}
	if err := fh.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", f.Path, err)
	}
	if err := fh.Chmod(f.Mode); err != nil {
		return fmt.Errorf("chmod %s: %w", f.Path, err)
	}
	return fh.Close()
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
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
	r, err := NewReader(src, concurrency)
	if err != nil {
		return nil, nil, err
	}
	defer r.Close()
	st := &VerifyStats{}
	for i := range snap.Files {
		f := &snap.Files[i]
		if err := r.ReadFile(ctx, f, func(Chunk, []byte) error { st.Chunks++; return nil }); err != nil {
			return snap, st, err
		}
		st.Files++
		st.LogicalBytes += f.Size
	}
	return snap, st, nil
}
