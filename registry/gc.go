package registry

import (
	"context"
	"fmt"
	"time"

	"github.com/distribution/distribution/v3/registry/storage"
	"github.com/opencontainers/go-digest"
)

// GCOptions tune GC.
type GCOptions struct {
	// DryRun reports what would be deleted and deletes nothing.
	DryRun bool
	// RemoveUntagged also deletes manifests that no tag reaches (with the
	// manifests and blobs only they reference), as distribution's
	// --delete-untagged does: deleting a snapshot's tag then frees its
	// chunks. Untagged referrers (signatures, prefetch profiles) go too.
	RemoveUntagged bool
	// ReadOnlyWait, when positive, puts every registry serving the same
	// storage in read-only mode for the sweep (EnterReadOnly) and waits
	// this long first, so that they all see it (they poll every
	// DefaultReadOnlyPoll) and uploads under way end. The mode ends when
	// GC returns, or after ReadOnlyTimeout if GC dies.
	ReadOnlyWait, ReadOnlyTimeout time.Duration
}

// GCResult says what GC freed.
type GCResult struct {
	BlobsBefore, BlobsAfter         int
	BlobBytesBefore, BlobBytesAfter int64
	// ChunkIndexPruned and ReferrersPruned count extension entries dropped
	// because their blob or manifest is gone.
	ChunkIndexPruned, ReferrersPruned int
	// CacheEntriesCleared counts redis blob descriptor cache entries of
	// deleted blobs that GC removed (0 without a redis cache).
	CacheEntriesCleared int
}

// GC runs distribution's mark-and-sweep garbage collection over the
// registry's storage, then drops chunk index and referrers entries that
// point at deleted content. As with distribution, no pushes may run
// meanwhile: stop the registry, or set opts.ReadOnlyWait.
func (s *Server) GC(ctx context.Context, opts GCOptions) (res *GCResult, err error) {
	if opts.ReadOnlyWait > 0 && !opts.DryRun {
		if opts.ReadOnlyTimeout <= 0 {
			opts.ReadOnlyTimeout = 2 * time.Hour
		}
		if _, err := s.EnterReadOnly(ctx, "garbage collection", opts.ReadOnlyTimeout); err != nil {
			return nil, err
		}
		defer func() {
			if lerr := s.LeaveReadOnly(context.WithoutCancel(ctx)); lerr != nil && err == nil {
				err = lerr
			}
		}()
		select {
		case <-time.After(opts.ReadOnlyWait):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	before, err := s.Stats(ctx)
	if err != nil {
		return nil, err
	}
	res = &GCResult{BlobsBefore: before.Blobs, BlobBytesBefore: before.BlobBytes}
	if before.Blobs == 0 {
		// Nothing was ever pushed (or everything is gone): distribution's
		// sweep fails on the missing blobs directory.
		return &GCResult{}, nil
	}
	var blobsBefore map[digest.Digest]bool
	if s.usesRedisCache() && !opts.DryRun {
		if blobsBefore, err = s.blobSet(ctx); err != nil {
			return nil, err
		}
	}
	if err := storage.MarkAndSweep(ctx, s.driver, s.ns, storage.GCOpts{DryRun: opts.DryRun, RemoveUntagged: opts.RemoveUntagged, Quiet: !opts.DryRun}); err != nil {
		return nil, fmt.Errorf("garbage collect: %w", err)
	}
	if blobsBefore != nil {
		after, err := s.blobSet(ctx)
		if err != nil {
			return nil, err
		}
		var deleted []digest.Digest
		for d := range blobsBefore {
			if !after[d] {
				deleted = append(deleted, d)
			}
		}
		if res.CacheEntriesCleared, err = s.clearCachedDescriptors(ctx, deleted); err != nil {
			return nil, fmt.Errorf("clear redis blob descriptor cache after gc (replicas may report deleted blobs as present until it is cleared): %w", err)
		}
	}
	if !opts.DryRun {
		if res.ChunkIndexPruned, err = s.chunks.prune(ctx); err != nil {
			return nil, fmt.Errorf("prune chunk index: %w", err)
		}
		if res.ReferrersPruned, err = s.refs.prune(ctx); err != nil {
			return nil, fmt.Errorf("prune referrers: %w", err)
		}
	}
	after, err := s.Stats(ctx)
	if err != nil {
		return nil, err
	}
	res.BlobsAfter, res.BlobBytesAfter = after.Blobs, after.BlobBytes
	return res, nil
}
