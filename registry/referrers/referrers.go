// Package referrers keeps the OCI 1.1 referrers of a registry's manifests
// (distribution-spec "Listing Referrers"), which distribution v3 lacks, in
// the registry's storage driver.
package referrers

import (
	"context"
	"encoding/json"
	"fmt"
	"path"
	"sort"
	"strings"

	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Store holds the referrers of a registry's manifests. When a manifest with
// a subject is pushed, a descriptor of it is stored at
// <Root>/<repo>/<alg>/<subject>/<referrer>; List returns them. Entries
// whose manifest was deleted are dropped when the manifest is deleted
// through the registry, when read, and by Prune.
type Store struct {
	driver extstore.Driver
	ns     distribution.Namespace
}

// Root is where referrer entries live in the storage driver.
const Root = "/cryo/v1/referrers"

// New returns the referrers kept in driver; ns (the registry's namespace
// over the same storage) says which manifests still exist.
func New(driver extstore.Driver, ns distribution.Namespace) *Store {
	return &Store{driver: driver, ns: ns}
}

// manifestWithSubject holds the fields of a manifest or index that the
// referrers API reports.
type manifestWithSubject struct {
	MediaType    string              `json:"mediaType"`
	ArtifactType string              `json:"artifactType"`
	Config       *ocispec.Descriptor `json:"config"`
	Subject      *ocispec.Descriptor `json:"subject"`
	Annotations  map[string]string   `json:"annotations"`
}

func subjectDir(repo string, subject digest.Digest) string {
	return path.Join(Root, repo, subject.Algorithm().String(), subject.Encoded())
}

// subjectOf returns the subject a manifest or index names, if any.
func subjectOf(body []byte) (manifestWithSubject, bool) {
	var m manifestWithSubject
	if err := json.Unmarshal(body, &m); err != nil || m.Subject == nil || m.Subject.Digest.Validate() != nil {
		return m, false
	}
	return m, true
}

// Record stores a referrer entry for the manifest body of digest d (of
// media type contentType if it does not say) pushed to repo, if it has a
// subject, and returns the subject's digest ("" if none).
func (rf *Store) Record(ctx context.Context, repo string, d digest.Digest, body []byte, contentType string) (digest.Digest, error) {
	m, ok := subjectOf(body)
	if !ok {
		return "", nil
	}
	mediaType := m.MediaType
	if mediaType == "" {
		mediaType = contentType
	}
	desc := ocispec.Descriptor{
		MediaType:    mediaType,
		ArtifactType: m.ArtifactType,
		Digest:       d,
		Size:         int64(len(body)),
		Annotations:  m.Annotations,
	}
	// OCI 1.1: without artifactType, an image manifest's config media type
	// stands in for it.
	if desc.ArtifactType == "" && m.Config != nil && mediaType == ocispec.MediaTypeImageManifest {
		desc.ArtifactType = m.Config.MediaType
	}
	data, err := json.Marshal(desc)
	if err != nil {
		return "", err
	}
	p := path.Join(subjectDir(repo, m.Subject.Digest), desc.Digest.Encoded())
	if err := rf.driver.PutContent(ctx, p, data); err != nil {
		return "", fmt.Errorf("store referrer %s of %s: %w", desc.Digest, m.Subject.Digest, err)
	}
	return m.Subject.Digest, nil
}

// Forget drops the entry of manifest body of digest d, deleted from repo,
// if it has a subject.
func (rf *Store) Forget(ctx context.Context, repo string, d digest.Digest, body []byte) error {
	m, ok := subjectOf(body)
	if !ok {
		return nil
	}
	p := path.Join(subjectDir(repo, m.Subject.Digest), d.Encoded())
	if err := rf.driver.Delete(ctx, p); err != nil && !extstore.IsNotFound(err) {
		return fmt.Errorf("drop referrer of %s: %w", m.Subject.Digest, err)
	}
	return nil
}

// List returns the referrers of subject in repo whose manifests still
// exist, sorted by digest, optionally only those of artifactType.
func (rf *Store) List(ctx context.Context, repo string, subject digest.Digest, artifactType string) ([]ocispec.Descriptor, error) {
	dir := subjectDir(repo, subject)
	entries, err := rf.driver.List(ctx, dir)
	if extstore.IsNotFound(err) {
		return []ocispec.Descriptor{}, nil
	}
	if err != nil {
		return nil, err
	}
	manifests, err := rf.manifestService(ctx, repo)
	if err != nil {
		return nil, err
	}
	out := []ocispec.Descriptor{}
	for _, e := range entries {
		data, err := rf.driver.GetContent(ctx, e)
		if err != nil {
			continue
		}
		var d ocispec.Descriptor
		if json.Unmarshal(data, &d) != nil || d.Digest.Validate() != nil {
			continue
		}
		if ok, err := manifests.Exists(ctx, d.Digest); err == nil && !ok {
			_ = rf.driver.Delete(ctx, e) // the referrer was deleted
			continue
		}
		if artifactType != "" && d.ArtifactType != artifactType {
			continue
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Digest < out[j].Digest })
	return out, nil
}

func (rf *Store) manifestService(ctx context.Context, repo string) (distribution.ManifestService, error) {
	r, err := extstore.Repository(ctx, rf.ns, repo)
	if err != nil {
		return nil, err
	}
	return r.Manifests(ctx)
}

// Prune drops entries whose referrer manifest no longer exists; gc calls
// it.
func (rf *Store) Prune(ctx context.Context) (int, error) {
	return extstore.Prune(ctx, rf.driver, Root, func(p string) bool {
		// <root>/<repo...>/<alg>/<subject>/<referrer>
		parts := strings.Split(strings.TrimPrefix(p, Root+"/"), "/")
		n := len(parts)
		if n < 4 {
			return false
		}
		d := digest.NewDigestFromEncoded(digest.Algorithm(parts[n-3]), parts[n-1])
		if d.Validate() != nil {
			return false
		}
		manifests, err := rf.manifestService(ctx, strings.Join(parts[:n-3], "/"))
		if err != nil {
			return false
		}
		ok, err := manifests.Exists(ctx, d)
		return err == nil && !ok
	})
}
