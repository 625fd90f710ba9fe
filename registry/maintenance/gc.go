package maintenance

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/distribution/distribution/v3/registry/storage"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
)

// GCOptions tune GC.
type GCOptions struct {
	// DryRun reports what would be deleted and deletes nothing.
	DryRun bool
	// RemoveUntagged also deletes manifests that no tag reaches (with the
	// manifests and blobs only they reference), as distribution's
	// --delete-untagged does: deleting a snapshot's tag then frees its
	// chunks. Untagged referrers (signatures, prefetch profiles) go too.
	// A tag moved to a new snapshot leaves the old one untagged: nodes
	// still loading it would lose its chunks.
	RemoveUntagged bool
	// ReadOnlyWait, when positive, puts every registry serving the same
	// storage in read-only mode for the sweep (EnterReadOnly) and waits
	// this long first, so that they all see it (they poll every
	// DefaultReadOnlyPoll) and uploads under way end. The mode is a lease
	// of ReadOnlyLease (default DefaultReadOnlyLease), renewed while GC
	// runs; GC stops if it cannot renew it, and the mode ends one lease
	// after a GC that dies.
	ReadOnlyWait, ReadOnlyLease time.Duration
	// Grace keeps what was pushed less than Grace ago, by the storage's
	// modification times: blobs uploaded or linked (mounted, re-uploaded)
	// into any repository and manifests put since then, and, with
	// RemoveUntagged, everything such a manifest references. A push
	// uploads its chunks before the manifests and the tagged index that
	// reference them; a collection in between keeps them. 0 keeps nothing
	// for its age (distribution's behaviour); the CLI's default is
	// DefaultGCGrace.
	Grace time.Duration
}

// GCResult says what GC freed.
type GCResult struct {
	BlobsBefore, BlobsAfter         int
	BlobBytesBefore, BlobBytesAfter int64
	// ChunkIndexPruned and ReferrersPruned count extension entries dropped
	// because their blob or manifest is gone.
	ChunkIndexPruned, ReferrersPruned int
	// CacheEntriesCleared counts the redis blob descriptor cache keys GC
	// flushed after the sweep (0 without a redis cache).
	CacheEntriesCleared int
	// BlobsKeptForGrace counts unreferenced blobs (manifests included)
	// kept because they are younger than GCOptions.Grace.
	BlobsKeptForGrace int
}

// GC runs distribution's mark-and-sweep garbage collection over the
// registry's storage, flushes the shared redis blob descriptor cache if the
// configuration has one, then drops chunk index and referrers entries that
// point at deleted content. As with distribution, no pushes may run
// meanwhile: stop the registries, or set opts.ReadOnlyWait.
func (m *Maintainer) GC(ctx context.Context, opts GCOptions) (res *GCResult, err error) {
	work := ctx
	holder := "gc-" + newToken()
	leaseHeld := func() bool { return true } // no lease: the registries are stopped
	if opts.ReadOnlyWait > 0 && !opts.DryRun {
		if opts.ReadOnlyLease <= 0 {
			opts.ReadOnlyLease = DefaultReadOnlyLease
		}
		lease, err := m.acquireReadOnly(ctx, "garbage collection", opts.ReadOnlyLease)
		if err != nil {
			return nil, err
		}
		holder = lease.Marker().Holder
		var cancel context.CancelCauseFunc
		work, cancel = context.WithCancelCause(ctx)
		stop := lease.Keep(ctx, cancel)
		leaseHeld = func() bool { return work.Err() == nil }
		defer func() {
			stop()
			cancel(nil)
			// After the cache flush below (and a flush still owed keeps
			// the registries refusing writes anyway).
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
			defer rcancel()
			if rerr := lease.Release(rctx); rerr != nil && err == nil {
				err = rerr
			}
		}()
		select {
		case <-time.After(opts.ReadOnlyWait):
		case <-work.Done():
			return nil, context.Cause(work)
		}
	}
	blobsBefore, bytesBefore, err := m.count(work)
	if err != nil {
		return nil, err
	}
	res = &GCResult{BlobsBefore: blobsBefore, BlobBytesBefore: bytesBefore}
	if blobsBefore == 0 {
		// Nothing was ever pushed (or everything is gone): distribution's
		// sweep fails on the missing blobs directory.
		return res, nil
	}
	flush := m.redis != nil && !opts.DryRun
	var ownFlag string
	if flush {
		if ownFlag, err = m.oweCacheFlush(work, holder); err != nil {
			return nil, err
		}
	}
	// The sweep's deletes stop as soon as the lease is lost: the driver
	// checks work before each one (distribution's sweep does not look at
	// its context, and the filesystem driver ignores it).
	sd := stoppableDriver{StorageDriver: m.driver, stop: work}
	if opts.Grace > 0 {
		// After the read-only wait: no push writes from here on, except
		// through a registry that does not see the mode (the keeper
		// checks a blob's data again before deleting it).
		if sd.grace, err = newGraceKeeper(work, m.driver, m.ns, time.Now().Add(-opts.Grace), opts.RemoveUntagged); err != nil {
			return nil, err
		}
	}
	sns, err := storage.NewRegistry(work, sd, storage.EnableDelete)
	if err != nil {
		return nil, fmt.Errorf("open storage for gc: %w", err)
	}
	sweepErr := storage.MarkAndSweep(work, sd, sns, storage.GCOpts{DryRun: opts.DryRun, RemoveUntagged: opts.RemoveUntagged, Quiet: !opts.DryRun})
	if flush {
		// Also after a failed sweep: it may have deleted some blobs.
		n, ferr := m.settleCache(context.WithoutCancel(ctx), ownFlag, leaseHeld)
		res.CacheEntriesCleared = n
		if ferr != nil {
			return nil, fmt.Errorf("%w (the registries flush it themselves, refusing pushes until they can)", errors.Join(sweepErr, ferr))
		}
	}
	if sweepErr != nil {
		if cause := context.Cause(work); cause != nil && !errors.Is(cause, ctx.Err()) {
			sweepErr = fmt.Errorf("%w (stopped: %v)", sweepErr, cause)
		}
		return nil, fmt.Errorf("garbage collect: %w", sweepErr)
	}
	if !opts.DryRun {
		if res.ChunkIndexPruned, err = m.prune(work, m.opts.ChunkIndex); err != nil {
			return nil, fmt.Errorf("prune chunk index: %w", err)
		}
		if res.ReferrersPruned, err = m.prune(work, m.opts.Referrers); err != nil {
			return nil, fmt.Errorf("prune referrers: %w", err)
		}
	}
	if res.BlobsAfter, res.BlobBytesAfter, err = m.count(work); err != nil {
		return nil, err
	}
	if sd.grace != nil {
		res.BlobsKeptForGrace = sd.grace.keptBlobs()
	}
	return res, nil
}

// acquireReadOnly enters read-only mode, waiting up to one lease for a
// marker another holder left (a GC that died, or this job's previous run
// restarted by its controller) to expire.
func (m *Maintainer) acquireReadOnly(ctx context.Context, reason string, lease time.Duration) (*ReadOnlyLease, error) {
	deadline := time.Now().Add(lease + DefaultReadOnlyPoll)
	for {
		l, err := m.EnterReadOnly(ctx, reason, lease)
		if err == nil || !errors.Is(err, ErrReadOnlyHeld) || time.Now().After(deadline) {
			return l, err
		}
		select {
		case <-time.After(DefaultReadOnlyPoll):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// settleCache flushes the blob descriptor cache after a sweep, twice: the
// second flush, a moment later, catches entries written by reads that
// looked a blob up just before the sweep deleted it. Then it clears its own
// flag and, while it holds read-only mode (so no other sweep runs), the
// flags of maintainers that died owing a flush.
func (m *Maintainer) settleCache(ctx context.Context, own string, leaseHeld func() bool) (int, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*owedFlushTimeout)
	defer cancel()
	prior, err := m.owedFlushes(ctx)
	if err != nil {
		return 0, err
	}
	n, err := m.FlushBlobDescriptorCache(ctx)
	if err != nil {
		return n, err
	}
	select {
	case <-time.After(2 * time.Second):
	case <-ctx.Done():
		return n, ctx.Err()
	}
	settle := []string{own}
	if leaseHeld() {
		settle = prior
	}
	more, err := m.flushAndSettle(ctx, settle)
	return n + more, err
}

// stoppableDriver refuses deletes and writes once stop is done, and skips
// (reporting success) the deletes of content younger than the grace period.
type stoppableDriver struct {
	storagedriver.StorageDriver
	stop  context.Context
	grace *graceKeeper // nil: no grace period
}

func (d stoppableDriver) Delete(ctx context.Context, path string) error {
	if err := context.Cause(d.stop); err != nil {
		return err
	}
	if d.grace != nil {
		keep, err := d.grace.keep(ctx, path)
		if err != nil || keep {
			return err
		}
	}
	return d.StorageDriver.Delete(ctx, path)
}

func (d stoppableDriver) PutContent(ctx context.Context, path string, content []byte) error {
	if err := context.Cause(d.stop); err != nil {
		return err
	}
	return d.StorageDriver.PutContent(ctx, path, content)
}

func (d stoppableDriver) Move(ctx context.Context, src, dst string) error {
	if err := context.Cause(d.stop); err != nil {
		return err
	}
	return d.StorageDriver.Move(ctx, src, dst)
}
