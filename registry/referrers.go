package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"path"
	"sort"
	"strings"

	"github.com/distribution/distribution/v3"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// referrers implements the OCI 1.1 referrers API, which distribution v3
// lacks. When a manifest with a subject is pushed, a descriptor of it is
// stored at /cryo/v1/referrers/<repo>/<alg>/<subject>/<referrer>; GET lists
// them. Entries whose manifest was deleted are dropped when read and by gc.
type referrers struct {
	driver storagedriver.StorageDriver
	ns     distribution.Namespace
}

const referrersRoot = "/cryo/v1/referrers"

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
	return path.Join(referrersRoot, repo, subject.Algorithm().String(), subject.Encoded())
}

// record stores a referrer entry if body has a subject and returns the
// subject's digest ("" if none).
func (rf *referrers) record(ctx context.Context, repo string, body []byte, contentType string) (string, error) {
	var m manifestWithSubject
	if err := json.Unmarshal(body, &m); err != nil || m.Subject == nil {
		return "", nil
	}
	if err := m.Subject.Digest.Validate(); err != nil {
		return "", nil
	}
	mediaType := m.MediaType
	if mediaType == "" {
		mediaType = contentType
	}
	desc := ocispec.Descriptor{
		MediaType:    mediaType,
		ArtifactType: m.ArtifactType,
		Digest:       digest.FromBytes(body),
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
	return m.Subject.Digest.String(), nil
}

// list returns the referrers of subject in repo whose manifests still exist,
// sorted by digest, optionally only those of artifactType.
func (rf *referrers) list(ctx context.Context, repo string, subject digest.Digest, artifactType string) ([]ocispec.Descriptor, error) {
	dir := subjectDir(repo, subject)
	entries, err := rf.driver.List(ctx, dir)
	var notFound storagedriver.PathNotFoundError
	if errors.As(err, &notFound) {
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

func (rf *referrers) manifestService(ctx context.Context, repo string) (distribution.ManifestService, error) {
	named, err := reference.WithName(repo)
	if err != nil {
		return nil, err
	}
	r, err := rf.ns.Repository(ctx, named)
	if err != nil {
		return nil, err
	}
	return r.Manifests(ctx)
}

// prune drops entries whose referrer manifest no longer exists; gc calls it.
func (rf *referrers) prune(ctx context.Context) (int, error) {
	return pruneEntries(ctx, rf.driver, referrersRoot, func(p string) bool {
		// <root>/<repo...>/<alg>/<subject>/<referrer>
		parts := strings.Split(strings.TrimPrefix(p, referrersRoot+"/"), "/")
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

// handleReferrers answers GET /v2/<name>/referrers/<digest>.
func (s *Server) handleReferrers(w http.ResponseWriter, r *http.Request, repo, ref string) {
	if !s.authorize(w, r, repo) {
		return
	}
	d, err := digest.Parse(ref)
	if err != nil {
		writeRegistryError(w, http.StatusBadRequest, "DIGEST_INVALID", "invalid digest "+ref)
		return
	}
	if _, err := reference.WithName(repo); err != nil {
		writeRegistryError(w, http.StatusBadRequest, "NAME_INVALID", "invalid repository name")
		return
	}
	artifactType := r.URL.Query().Get("artifactType")
	descs, err := s.refs.list(r.Context(), repo, d, artifactType)
	if err != nil {
		writeRegistryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
		return
	}
	idx := ocispec.Index{MediaType: ocispec.MediaTypeImageIndex, Manifests: descs}
	idx.SchemaVersion = 2
	body, _ := json.Marshal(idx)
	w.Header().Set("Content-Type", ocispec.MediaTypeImageIndex)
	if artifactType != "" {
		w.Header().Set("OCI-Filters-Applied", "artifactType")
	}
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodGet {
		w.Write(body)
	}
}

// writeRegistryError writes an error in the distribution-spec's format.
func writeRegistryError(w http.ResponseWriter, status int, code, message string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(map[string]any{"errors": []map[string]string{{"code": code, "message": message}}})
}
