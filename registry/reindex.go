package registry

import (
	"context"
	"sync"

	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/errgroup"
)

// ReindexResult says what Reindex did.
type ReindexResult struct {
	Repositories int
	// Manifests counts the manifests read; Failed those whose chunks or
	// referrer entry could not be recorded (each logged).
	Manifests, Failed int
}

// reindexParallelism is how many manifests Reindex records at once; each
// verifies up to chunkindex's own parallelism of chunks.
const reindexParallelism = 4

// Reindex rebuilds cryo's extension state from the manifests in the
// storage: every manifest of every repository is recorded again as a PUT
// of it records it, its referrer entry if it has a subject, and for a cryo
// file manifest its chunks, each only after the registry has read its
// blob and found that it holds the chunk (SPEC.md 12.2, 12.2.1). What is
// recorded already stays. It brings back an index lost (its redis
// flushed, its storage prefix deleted) or never recorded (storage filled
// by other means than pushes to a cryo registry). It reads every chunk
// blob, so it takes as long as reading the storage once. Registries may
// serve meanwhile: it writes only what their PUTs would.
//
// The repositories' latest v2 snapshots (bases, SPEC.md 12.6) are not
// rebuilt: which snapshot was pushed last is not in the manifests, and a
// pusher without one falls back to the repository's newest tags.
func (s *Server) Reindex(ctx context.Context) (*ReindexResult, error) {
	res := &ReindexResult{}
	var mu sync.Mutex
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(reindexParallelism)
	err := s.eachManifest(gctx, func(string) { res.Repositories++ }, func(repo string, d digest.Digest, mediaType string, payload []byte) error {
		res.Manifests++
		g.Go(func() error {
			ok := true
			if _, err := s.refs.Record(gctx, repo, d, payload, mediaType); err != nil {
				s.log.Error("reindex: record referrer", "repository", repo, "digest", d, "err", err)
				ok = false
			}
			if err := s.chunks.IndexManifest(gctx, repo, payload); err != nil {
				s.log.Error("reindex: index chunks", "repository", repo, "digest", d, "err", err)
				ok = false
			}
			if !ok {
				mu.Lock()
				res.Failed++
				mu.Unlock()
			}
			return gctx.Err()
		})
		return gctx.Err()
	})
	if werr := g.Wait(); err == nil {
		err = werr
	}
	if err != nil {
		return nil, err
	}
	return res, nil
}
