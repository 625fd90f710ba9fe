// Package maintenance keeps a cryo registry's storage collectable while
// replicas serve it: read-only mode as a lease in the shared storage
// (SPEC.md 12.4), the redis blob descriptor cache flush a sweep owes, and
// garbage collection (distribution's mark and sweep, with a grace period
// and the pruning of cryo's extension state).
//
// A Maintainer has two sides: a maintenance job (GC, EnterReadOnly,
// LeaveReadOnly) and every serving replica (Watch, WritesRefused), which
// see each other only through the storage.
package maintenance

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"

	"github.com/distribution/distribution/v3"
	"github.com/distribution/distribution/v3/configuration"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
)

// Pruner drops extension entries that point at deleted content and counts
// them (the chunk index and the referrers).
type Pruner interface {
	Prune(ctx context.Context) (int, error)
}

// Options say what a Maintainer works on.
type Options struct {
	// Driver and Namespace are the registry's storage.
	Driver    storagedriver.StorageDriver
	Namespace distribution.Namespace
	// Redis is the configuration's redis section when blob descriptors
	// are cached there (UsesRedisCache), else nil. It is read at each
	// flush.
	Redis *configuration.Redis
	// ChunkIndex and Referrers are pruned after a sweep (nil: nothing).
	ChunkIndex, Referrers Pruner
	// Count returns how many blobs the storage holds and their bytes.
	Count func(ctx context.Context) (blobs int, bytes int64, err error)
	// Logger: default slog.Default().
	Logger *slog.Logger
}

// Maintainer maintains one registry's storage.
type Maintainer struct {
	opts   Options
	driver storagedriver.StorageDriver
	ns     distribution.Namespace
	redis  *configuration.Redis
	log    *slog.Logger
	// readOnly is the marker this replica last saw.
	readOnly atomic.Pointer[ReadOnlyMarker]
	// flushPending is set while a blob descriptor cache flush a garbage
	// collection owes has not succeeded (rediscache.go).
	flushPending atomic.Bool
	// flushing is set while this replica settles owed flushes.
	flushing atomic.Bool
}

// New returns a Maintainer for the storage opts names.
func New(opts Options) (*Maintainer, error) {
	if opts.Driver == nil || opts.Namespace == nil || opts.Count == nil {
		return nil, fmt.Errorf("maintenance: a driver, a namespace and a blob count are required")
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Maintainer{opts: opts, driver: opts.Driver, ns: opts.Namespace, redis: opts.Redis, log: opts.Logger}, nil
}

func (m *Maintainer) count(ctx context.Context) (int, int64, error) {
	blobs, bytes, err := m.opts.Count(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("count blobs: %w", err)
	}
	return blobs, bytes, nil
}

func (m *Maintainer) prune(ctx context.Context, p Pruner) (int, error) {
	if p == nil {
		return 0, nil
	}
	return p.Prune(ctx)
}
