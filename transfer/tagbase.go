package transfer

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/format"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2/registry/remote"
)

// Bounds of the search for a base among a repository's tags.
const (
	// maxTagsListed stops listing a repository's tags.
	maxTagsListed = 10_000
	// tagCandidates is how many of the last tags, in natural order, are
	// looked at.
	tagCandidates = 16
)

// errEnoughTags stops the tag listing.
var errEnoughTags = errors.New("enough tags")

// newestTaggedV2 finds, on a registry without cryo's latest-snapshot
// extension (SPEC.md 12.6), a base for a push under a new tag: of the
// repository's last tagCandidates tags in natural order ("pause-9" before
// "pause-10"), skipping skip, the format v2 snapshot created last (by its
// org.opencontainers.image.created; among equal or missing times, the
// later tag). It returns the snapshot, loaded by digest (verified), or
// false: any failure only means no base.
func newestTaggedV2(ctx context.Context, repo *remote.Repository, skip string) (ocispec.Descriptor, *format.Snapshot, bool) {
	var tags []string
	err := repo.Tags(ctx, "", func(page []string) error {
		tags = append(tags, page...)
		if len(tags) >= maxTagsListed {
			return errEnoughTags
		}
		return nil
	})
	if err != nil && !errors.Is(err, errEnoughTags) {
		return ocispec.Descriptor{}, nil, false
	}
	tags = tags[:min(len(tags), maxTagsListed)]
	tags = slices.DeleteFunc(tags, func(t string) bool { return t == skip })
	slices.SortFunc(tags, naturalCompare)
	tags = tags[max(0, len(tags)-tagCandidates):]

	type found struct {
		desc    ocispec.Descriptor
		snap    *format.Snapshot
		created time.Time
		order   int
	}
	var (
		mu   sync.Mutex
		best *found
	)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(4)
	for i, t := range tags {
		g.Go(func() error {
			desc, err := repo.Resolve(gctx, t)
			if err != nil || desc.MediaType != ocispec.MediaTypeImageIndex {
				return nil
			}
			snap, err := format.LoadSnapshot(gctx, repo, desc)
			if err != nil || snap.Version != format.V2 {
				return nil
			}
			f := &found{desc: desc, snap: snap, order: i}
			f.created, _ = time.Parse(time.RFC3339Nano, snap.Created())
			mu.Lock()
			defer mu.Unlock()
			if best == nil || f.created.After(best.created) || (f.created.Equal(best.created) && f.order > best.order) {
				best = f
			}
			return nil
		})
	}
	g.Wait()
	if best == nil {
		return ocispec.Descriptor{}, nil, false
	}
	return best.desc, best.snap, true
}

// naturalCompare orders strings as people number tags: runs of digits by
// their value ("v9" < "v10"), everything else byte by byte; strings equal
// so ("v010", "v10") byte by byte. Written here: it is a few lines, and
// the libraries that do it pull in more than this.
func naturalCompare(a, b string) int {
	if c := naturalOrder(a, b); c != 0 {
		return c
	}
	return strings.Compare(a, b)
}

func naturalOrder(a, b string) int {
	for a != "" && b != "" {
		da, db := digitRun(a), digitRun(b)
		if da > 0 && db > 0 {
			na, nb := trimZeros(a[:da]), trimZeros(b[:db])
			if c := len(na) - len(nb); c != 0 {
				return c
			}
			if na != nb {
				if na < nb {
					return -1
				}
				return 1
			}
			a, b = a[da:], b[db:]
			continue
		}
		if a[0] != b[0] {
			return int(a[0]) - int(b[0])
		}
		a, b = a[1:], b[1:]
	}
	return len(a) - len(b)
}

// digitRun is the length of the run of ASCII digits s starts with.
func digitRun(s string) int {
	n := 0
	for n < len(s) && s[n] >= '0' && s[n] <= '9' {
		n++
	}
	return n
}

func trimZeros(s string) string {
	for len(s) > 1 && s[0] == '0' {
		s = s[1:]
	}
	return s
}
