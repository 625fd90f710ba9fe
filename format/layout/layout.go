// Package layout stores snapshots in an OCI image layout directory. It is
// oras-go's content/oci store plus one fast path: chunk blobs that the packer
// has just hashed are written straight into blobs/<alg>/<hex> without being
// hashed a second time on the way in.
package layout

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cryo-oci/cryo/internal/atomicfile"

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
	if err := atomicfile.Write(dir, target, data, 0o444); err != nil {
		return fmt.Errorf("write blob %s: %w", desc.Digest, err)
	}
	return nil
}
