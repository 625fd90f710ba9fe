// Package bases records, for each repository of a registry, the format v2
// snapshot stored in it last under a tag: the base a v2 push to a tag that names
// nothing yet takes (SPEC.md 12.6), so that a pause pushed under a new tag
// references the packs of the pause before it instead of having the
// registry copy their frames into new packs.
//
// Only a snapshot put under a tag is recorded (a tag is what others see;
// a push by digest alone is not), and the record is a hint: it names a
// digest of the same repository, and the pusher loads that snapshot by
// digest, verified, as any base. A manifest gone since is never answered
// (an untagged one stays until garbage collection removes it).
package bases

import (
	"context"
	"encoding/json"
	"fmt"
	"path"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Root is where the records live in the storage driver:
// Root/<repository>/_latest (a leading underscore cannot start a
// repository name's component, so no repository's record lies in
// another's path).
const Root = "/cryo/v1/bases"

// Store keeps the records in a registry's storage driver.
type Store struct {
	driver extstore.Driver
	ns     distribution.Namespace
}

// New returns the records kept in driver; ns (the registry's namespace over
// the same storage) says which manifests still exist.
func New(driver extstore.Driver, ns distribution.Namespace) *Store {
	return &Store{driver: driver, ns: ns}
}

func recordPath(repo string) string { return path.Join(Root, repo, "_latest") }

// snapshotIndex holds the fields that make a manifest a v2 snapshot index.
type snapshotIndex struct {
	MediaType    string `json:"mediaType"`
	ArtifactType string `json:"artifactType"`
}

// Record notes manifest body, of digest d and just stored in repo under
// tag, as the repository's latest v2 snapshot if it is a v2 snapshot
// index; a manifest put by digest alone (tag "") is not recorded.
func (s *Store) Record(ctx context.Context, repo, tag string, d digest.Digest, body []byte) error {
	var m snapshotIndex
	if tag == "" || json.Unmarshal(body, &m) != nil || m.MediaType != ocispec.MediaTypeImageIndex || m.ArtifactType != format.ArtifactTypeSnapshotV2 {
		return nil
	}
	desc := ocispec.Descriptor{MediaType: m.MediaType, ArtifactType: m.ArtifactType, Digest: d, Size: int64(len(body))}
	data, err := json.Marshal(desc)
	if err != nil {
		return err
	}
	if err := s.driver.PutContent(ctx, recordPath(repo), data); err != nil {
		return fmt.Errorf("record latest v2 snapshot of %s: %w", repo, err)
	}
	return nil
}

// Latest returns the v2 snapshot index stored last in repo, if it is still
// there.
func (s *Store) Latest(ctx context.Context, repo string) (ocispec.Descriptor, bool, error) {
	data, err := s.driver.GetContent(ctx, recordPath(repo))
	if extstore.IsNotFound(err) {
		return ocispec.Descriptor{}, false, nil
	}
	if err != nil {
		return ocispec.Descriptor{}, false, err
	}
	var desc ocispec.Descriptor
	if json.Unmarshal(data, &desc) != nil || desc.Digest.Validate() != nil {
		return ocispec.Descriptor{}, false, nil
	}
	r, err := extstore.Repository(ctx, s.ns, repo)
	if err != nil {
		return ocispec.Descriptor{}, false, err
	}
	manifests, err := r.Manifests(ctx)
	if err != nil {
		return ocispec.Descriptor{}, false, err
	}
	ok, err := manifests.Exists(ctx, desc.Digest)
	if err != nil || !ok {
		return ocispec.Descriptor{}, false, err
	}
	return desc, true, nil
}
