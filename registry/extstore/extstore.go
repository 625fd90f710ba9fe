// Package extstore holds what cryo's registry extensions share about the
// state they keep in the registry's own storage driver (under /cryo/v1/,
// beside distribution's /docker/registry/v2/): the part of the driver they
// use and the walk that drops stale entries.
package extstore

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/distribution/distribution/v3"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
)

// Driver is the part of a distribution storage driver the extensions use
// for their own entries, and Reader for ranges of blob data they have
// checked a repository links. Every storagedriver.StorageDriver is one.
type Driver interface {
	GetContent(ctx context.Context, path string) ([]byte, error)
	Reader(ctx context.Context, path string, offset int64) (io.ReadCloser, error)
	PutContent(ctx context.Context, path string, content []byte) error
	List(ctx context.Context, path string) ([]string, error)
	Stat(ctx context.Context, path string) (storagedriver.FileInfo, error)
	Delete(ctx context.Context, path string) error
	Walk(ctx context.Context, path string, f storagedriver.WalkFn, options ...func(*storagedriver.WalkOptions)) error
}

// IsNotFound reports whether err is a storage driver's "no such path".
func IsNotFound(err error) bool {
	var notFound storagedriver.PathNotFoundError
	return errors.As(err, &notFound)
}

// Prune deletes the files under root for which stale is true and counts
// them. A missing root has nothing to prune.
func Prune(ctx context.Context, d Driver, root string, stale func(path string) bool) (int, error) {
	removed := 0
	err := d.Walk(ctx, root, func(fi storagedriver.FileInfo) error {
		if !fi.IsDir() && stale(fi.Path()) && d.Delete(ctx, fi.Path()) == nil {
			removed++
		}
		return nil
	})
	if IsNotFound(err) {
		return removed, nil
	}
	if err != nil {
		return removed, fmt.Errorf("prune %s: %w", root, err)
	}
	return removed, nil
}

// Repository opens repository name of ns.
func Repository(ctx context.Context, ns distribution.Namespace, name string) (distribution.Repository, error) {
	named, err := reference.WithName(name)
	if err != nil {
		return nil, fmt.Errorf("repository %q: %w", name, err)
	}
	return ns.Repository(ctx, named)
}
