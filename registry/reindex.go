package registry

import (
	"context"
	"fmt"
	"time"

	"github.com/opencontainers/go-digest"
)

// ReindexResult says what Reindex did.
type ReindexResult struct {
	Repositories int `json:"repositories"`
	// Manifests counts the manifests found; Failed those that could not
	// be read, or whose chunks or referrer entry could not be recorded
	// (each logged).
	Manifests int `json:"manifests"`
	Failed    int `json:"failed"`
}

// Reindex rebuilds cryo's extension state from the manifests in the
// storage: every manifest of every repository is recorded again as a PUT
// of it records it: its referrer entry if it has a subject, and for a cryo
// file manifest its chunks, a v1 chunk only after the registry has read
// its blob and found that it holds the chunk (SPEC.md 12.2), a v2 pack's
// frame list and anchors as its PUT records them (12.2.1: hints, checked
// at use). What is recorded already stays. It brings back an index lost
// (its redis flushed, its storage prefix deleted) or never recorded
// (storage filled by other means than pushes to a cryo registry); it
// reads every v1 chunk blob once. Registries may serve meanwhile: it
// writes only what their PUTs would. It refuses to start while the
// storage is in read-only mode (a garbage collection sweeping), and
// records one manifest at a time, so that manifests sharing packs do not
// race on a pack's frame list.
//
// The repositories' latest v2 snapshots (bases, SPEC.md 12.6) are not
// rebuilt: which snapshot was pushed last is not in the manifests, and a
// pusher without one falls back to the repository's newest tags.
func (s *Server) Reindex(ctx context.Context) (*ReindexResult, error) {
	marker, err := s.maint.ReadOnly(ctx)
	if err != nil {
		return nil, fmt.Errorf("reindex: read-only mode: %w", err)
	}
	if marker.Active(time.Now()) {
		return nil, fmt.Errorf("reindex: the storage is in read-only mode (%s, held by %s until %s): run reindex once it ends", marker.Reason, marker.Holder, marker.Expires.Format(time.RFC3339))
	}
	res := &ReindexResult{}
	err = s.eachManifest(ctx, func(string) { res.Repositories++ }, func(repo string, d digest.Digest, mediaType string, payload []byte) error {
		res.Manifests++
		ok := true
		if _, err := s.refs.Record(ctx, repo, d, payload, mediaType); err != nil {
			s.log.Error("reindex: record referrer", "repository", repo, "digest", d, "err", err)
			ok = false
		}
		if err := s.chunks.IndexManifest(ctx, repo, payload); err != nil {
			s.log.Error("reindex: index chunks", "repository", repo, "digest", d, "err", err)
			ok = false
		}
		if !ok {
			res.Failed++
		}
		return ctx.Err()
	}, func(repo string, d digest.Digest, err error) {
		s.log.Error("reindex: read manifest", "repository", repo, "digest", d, "err", err)
		res.Manifests++
		res.Failed++
	})
	if err != nil {
		return nil, fmt.Errorf("reindex: %w", err)
	}
	return res, nil
}
