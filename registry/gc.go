package registry

import (
	"context"
	"fmt"

	"github.com/distribution/distribution/v3/registry/storage"
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
}

// GCResult says what GC freed.
type GCResult struct {
	BlobsBefore, BlobsAfter         int
	BlobBytesBefore, BlobBytesAfter int64
	// ChunkIndexPruned and ReferrersPruned count extension entries dropped
	// because their blob or manifest is gone.
	ChunkIndexPruned, ReferrersPruned int
}

// GC runs distribution's mark-and-sweep garbage collection over the
// registry's storage, then drops chunk index and referrers entries that
// point at deleted content. As with distribution, no pushes may run
// meanwhile: stop the registry or put it in read-only mode first.
func (s *Server) GC(ctx context.Context, opts GCOptions) (*GCResult, error) {
	before, err := s.Stats(ctx)
	if err != nil {
		return nil, err
	}
	res := &GCResult{BlobsBefore: before.Blobs, BlobBytesBefore: before.BlobBytes}
	if err := storage.MarkAndSweep(ctx, s.driver, s.ns, storage.GCOpts{DryRun: opts.DryRun, RemoveUntagged: opts.RemoveUntagged, Quiet: !opts.DryRun}); err != nil {
		return nil, fmt.Errorf("garbage collect: %w", err)
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
