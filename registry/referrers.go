package registry

import (
	"encoding/json"
	"net/http"

	"github.com/distribution/reference"
	"github.com/gorilla/mux"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// handleReferrers answers GET /v2/<name>/referrers/<digest>.
func (s *Server) handleReferrers(w http.ResponseWriter, r *http.Request) {
	vars := mux.Vars(r)
	repo, ref := vars["name"], vars["digest"]
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
	descs, err := s.refs.List(r.Context(), repo, d, artifactType)
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
