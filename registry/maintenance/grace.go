package maintenance

import (
	"context"
	"fmt"
	"path"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/opencontainers/go-digest"
)

// DefaultGCGrace is how long `cryo registry gc` keeps what was pushed
// recently: a push uploads its chunks before the manifests that reference
// them, and a collection between the two must not take them.
const DefaultGCGrace = time.Hour

// graceKeeper decides which of the deletes distribution's mark-and-sweep
// asks for are refused because the content is younger than the grace
// period. Age is the storage driver's modification time (the object store's
// for S3, not this host's clock):
//
//   - a blob is young if its data was written after the cutoff (its
//     upload), or any repository linked it after the cutoff: distribution
//     rewrites a repository's _layers/<alg>/<hex>/link on every upload or
//     mount of the blob into it, so a reused blob's age counts from its
//     newest link;
//   - a manifest is young if its revision link in a repository was written
//     after the cutoff (its PUT); with untagged manifests removed, what it
//     references is kept too, for it was not marked (it has no tag yet: the
//     snapshot's index, which carries the tag, is pushed last).
//
// A young blob keeps its data and every link to it; a young manifest keeps
// its revision and tag history entries. The sweep's other deletes go ahead.
type graceKeeper struct {
	driver storagedriver.StorageDriver
	cutoff time.Time

	mu    sync.Mutex
	young map[digest.Digest]bool // digests known young: keep
	old   map[digest.Digest]bool // blobs whose data is known old
	kept  map[digest.Digest]bool // blobs whose deletion was refused
}

var (
	graceBlobPath     = regexp.MustCompile(`^/docker/registry/v2/blobs/([a-z0-9]+)/[a-f0-9]{2}/([a-f0-9]+)$`)
	graceLayerPath    = regexp.MustCompile(`^/docker/registry/v2/repositories/.+/_layers/([a-z0-9]+)/([a-f0-9]+)(/link)?$`)
	graceRevisionPath = regexp.MustCompile(`^/docker/registry/v2/repositories/.+/_manifests/revisions/([a-z0-9]+)/([a-f0-9]+)(/link)?$`)
	graceTagIndexPath = regexp.MustCompile(`^/docker/registry/v2/repositories/.+/_manifests/tags/[^/]+/index/([a-z0-9]+)/([a-f0-9]+)(/link)?$`)
	// graceLinkFile matches the link files the start-up walk reads:
	// repository, kind (_layers or revisions) and digest.
	graceLinkFile = regexp.MustCompile(`^/docker/registry/v2/repositories/(.+)/(_layers|_manifests/revisions)/([a-z0-9]+)/([a-f0-9]+)/link$`)
)

// newGraceKeeper finds, before the sweep, the blobs and manifests linked
// into a repository after cutoff and, if closure is set (untagged
// manifests are removed), everything those manifests reference.
func newGraceKeeper(ctx context.Context, driver storagedriver.StorageDriver, ns distribution.Namespace, cutoff time.Time, closure bool) (*graceKeeper, error) {
	g := &graceKeeper{driver: driver, cutoff: cutoff, young: map[digest.Digest]bool{}, old: map[digest.Digest]bool{}, kept: map[digest.Digest]bool{}}
	type manifest struct {
		repo string
		d    digest.Digest
	}
	var manifests []manifest
	err := driver.Walk(ctx, distlayout.RepositoriesRoot, func(fi storagedriver.FileInfo) error {
		if fi.IsDir() {
			// Uploads under way have no link yet; tag history is not needed.
			if path.Base(fi.Path()) == "_uploads" || strings.HasSuffix(fi.Path(), "/_manifests/tags") {
				return storagedriver.ErrSkipDir
			}
			return nil
		}
		m := graceLinkFile.FindStringSubmatch(fi.Path())
		if m == nil || !fi.ModTime().After(cutoff) {
			return nil
		}
		d := digest.NewDigestFromEncoded(digest.Algorithm(m[3]), m[4])
		if d.Validate() != nil {
			return nil
		}
		g.young[d] = true
		if m[2] != "_layers" && closure {
			manifests = append(manifests, manifest{m[1], d})
		}
		return nil
	})
	if err != nil && !extstore.IsNotFound(err) {
		return nil, fmt.Errorf("find content younger than the grace period: %w", err)
	}
	for _, m := range manifests {
		if err := g.keepReferences(ctx, ns, m.repo, m.d, map[digest.Digest]bool{}); err != nil {
			return nil, err
		}
	}
	return g, nil
}

// keepReferences marks young everything manifest d of repo references,
// through child manifests.
func (g *graceKeeper) keepReferences(ctx context.Context, ns distribution.Namespace, repo string, d digest.Digest, seen map[digest.Digest]bool) error {
	if seen[d] {
		return nil
	}
	seen[d] = true
	r, err := extstore.Repository(ctx, ns, repo)
	if err != nil {
		return nil
	}
	ms, err := r.Manifests(ctx)
	if err != nil {
		return fmt.Errorf("manifests of %s: %w", repo, err)
	}
	m, err := ms.Get(ctx, d)
	if err != nil {
		// Gone, or unreadable: nothing to keep for it; the sweep decides.
		return nil
	}
	for _, ref := range m.References() {
		g.young[ref.Digest] = true
		if ok, _ := ms.Exists(ctx, ref.Digest); ok {
			if err := g.keepReferences(ctx, ns, repo, ref.Digest, seen); err != nil {
				return err
			}
		}
	}
	return nil
}

// keep reports whether the delete of p must be refused, and records a blob
// kept.
func (g *graceKeeper) keep(ctx context.Context, p string) (bool, error) {
	if m := graceBlobPath.FindStringSubmatch(p); m != nil {
		d := digest.NewDigestFromEncoded(digest.Algorithm(m[1]), m[2])
		young, err := g.blobYoung(ctx, d)
		if young {
			g.mu.Lock()
			g.kept[d] = true
			g.mu.Unlock()
		}
		return young, err
	}
	if m := graceLayerPath.FindStringSubmatch(p); m != nil {
		d := digest.NewDigestFromEncoded(digest.Algorithm(m[1]), m[2])
		if young, err := g.blobYoung(ctx, d); young || err != nil {
			return young, err
		}
		return g.modifiedAfterCutoff(ctx, linkFile(p))
	}
	if m := graceRevisionPath.FindStringSubmatch(p); m != nil {
		d := digest.NewDigestFromEncoded(digest.Algorithm(m[1]), m[2])
		if g.isYoung(d) {
			return true, nil
		}
		return g.modifiedAfterCutoff(ctx, linkFile(p))
	}
	if m := graceTagIndexPath.FindStringSubmatch(p); m != nil {
		return g.isYoung(digest.NewDigestFromEncoded(digest.Algorithm(m[1]), m[2])), nil
	}
	return false, nil
}

func linkFile(p string) string {
	if path.Base(p) == "link" {
		return p
	}
	return path.Join(p, "link")
}

func (g *graceKeeper) isYoung(d digest.Digest) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.young[d]
}

// blobYoung reports whether blob d was linked after the cutoff (found by the
// start-up walk) or its data was written after it (checked now, so that a
// blob uploaded while the sweep runs is kept too).
func (g *graceKeeper) blobYoung(ctx context.Context, d digest.Digest) (bool, error) {
	g.mu.Lock()
	young, old := g.young[d], g.old[d]
	g.mu.Unlock()
	if young || old {
		return young, nil
	}
	young, err := g.modifiedAfterCutoff(ctx, distlayout.BlobDataPath(d))
	if err != nil {
		return false, err
	}
	g.mu.Lock()
	if young {
		g.young[d] = true
	} else {
		g.old[d] = true
	}
	g.mu.Unlock()
	return young, nil
}

// modifiedAfterCutoff reports whether the file at p was written after the
// cutoff; a missing file was not.
func (g *graceKeeper) modifiedAfterCutoff(ctx context.Context, p string) (bool, error) {
	fi, err := g.driver.Stat(ctx, p)
	if extstore.IsNotFound(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("grace period: stat %s: %w", p, err)
	}
	return fi.ModTime().After(g.cutoff), nil
}

// keptBlobs counts the blobs whose deletion was refused.
func (g *graceKeeper) keptBlobs() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.kept)
}
