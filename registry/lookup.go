package registry

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/distribution/distribution/v3/registry/auth"
	"github.com/distribution/reference"
	"github.com/gorilla/mux"
	"github.com/opencontainers/go-digest"
)

// handleChunkLookup answers GET /v2/_cryo/chunks/<digest>.
func (s *Server) handleChunkLookup(w http.ResponseWriter, r *http.Request) {
	if !s.authorize(w, r, "") {
		return
	}
	d, err := digest.Parse(mux.Vars(r)["digest"])
	if err != nil {
		writeRegistryError(w, http.StatusBadRequest, "DIGEST_INVALID", err.Error())
		return
	}
	s.answerLookup(w, r, []digest.Digest{d}, true)
}

// maxLookupBody bounds a batch lookup's body: MaxLookupDigests digests of
// 71 characters each, quoted, with commas, and room to spare.
const maxLookupBody = 2 << 20

// handleChunkBatch answers POST /v2/_cryo/chunks. The caller must reach the
// registry before its body is read.
func (s *Server) handleChunkBatch(w http.ResponseWriter, r *http.Request) {
	if !s.authorize(w, r, "") {
		return
	}
	var req api.LookupRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxLookupBody)).Decode(&req); err != nil {
		writeRegistryError(w, http.StatusBadRequest, "UNSUPPORTED", "decode lookup request: "+err.Error())
		return
	}
	if len(req.Digests) > api.MaxLookupDigests {
		writeRegistryError(w, http.StatusBadRequest, "UNSUPPORTED", fmt.Sprintf("at most %d digests per lookup", api.MaxLookupDigests))
		return
	}
	for _, d := range req.Digests {
		if err := d.Validate(); err != nil {
			writeRegistryError(w, http.StatusBadRequest, "DIGEST_INVALID", err.Error())
			return
		}
	}
	s.answerLookup(w, r, req.Digests, false)
}

// answerLookup answers a lookup of digests by a caller already allowed to
// reach the registry. Each repository's pull access is checked once, the
// first time an entry names it, before anything in it is looked at.
func (s *Server) answerLookup(w http.ResponseWriter, r *http.Request, digests []digest.Digest, single bool) {
	visible := s.canPull(r)
	resp := api.LookupResponse{Chunks: map[digest.Digest][]api.ChunkBlob{}}
	for _, d := range digests {
		blobs, err := s.chunks.Lookup(r.Context(), d, visible)
		if err != nil {
			writeRegistryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
			return
		}
		if len(blobs) > 0 {
			resp.Chunks[d] = blobs
			s.metrics.chunkLookups.WithLabelValues("hit").Inc()
		} else {
			s.metrics.chunkLookups.WithLabelValues("miss").Inc()
		}
	}
	if single && len(resp.Chunks) == 0 {
		writeRegistryError(w, http.StatusNotFound, "BLOB_UNKNOWN", "no blob carries chunk "+string(digests[0]))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(resp)
}

// canPull returns whether the request's credentials, already allowed to
// reach the registry, may pull from a repository: each repository is asked
// once, the first time, and those in known are taken as allowed.
func (s *Server) canPull(r *http.Request, known ...string) func(repo string) bool {
	answers := map[string]bool{}
	for _, repo := range known {
		answers[repo] = true
	}
	return func(repo string) bool {
		ok, seen := answers[repo]
		if !seen {
			ok = s.allowed(r, repo)
			answers[repo] = ok
		}
		return ok
	}
}

// allowed reports whether the request's credentials, already allowed to
// reach the registry, may pull from repo. htpasswd grants every
// authenticated user everything (and checks a bcrypt hash per question),
// so only other access controllers are asked per repository.
func (s *Server) allowed(r *http.Request, repo string) bool {
	if s.access == nil || s.cfg.Auth.Type() == "htpasswd" {
		return true
	}
	_, err := s.access.Authorized(r, auth.Access{Resource: auth.Resource{Type: "repository", Name: repo}, Action: "pull"})
	return err == nil
}

// maxComposeBody bounds a composition request's body: MaxComposeChunks
// chunks of about 100 bytes each, and room to spare.
const maxComposeBody = 1 << 20

// handleCompose answers POST /v2/_cryo/packs (SPEC.md 12.2.1): it makes, in
// the repository named, a pack of verified frames of the chunks asked for
// that the registry holds in repositories the caller may pull from. The
// caller needs push and pull access to the repository; a mirror keeps no
// chunk index and composes nothing.
func (s *Server) handleCompose(w http.ResponseWriter, r *http.Request) {
	if s.mirrorOf != "" {
		writeRegistryError(w, http.StatusNotFound, "UNSUPPORTED", "a mirror composes no packs")
		return
	}
	if !s.authorize(w, r, "") {
		return
	}
	var req api.ComposeRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, maxComposeBody)).Decode(&req); err != nil {
		writeRegistryError(w, http.StatusBadRequest, "UNSUPPORTED", "decode composition request: "+err.Error())
		return
	}
	if _, err := reference.WithName(req.Repository); err != nil {
		writeRegistryError(w, http.StatusBadRequest, "NAME_INVALID", fmt.Sprintf("repository %q: %v", req.Repository, err))
		return
	}
	if len(req.Chunks) > api.MaxComposeChunks {
		writeRegistryError(w, http.StatusBadRequest, "UNSUPPORTED", fmt.Sprintf("at most %d chunks per composition", api.MaxComposeChunks))
		return
	}
	if !s.authorize(w, r, req.Repository, "pull", "push") {
		return
	}
	resp, err := s.chunks.Compose(r.Context(), req.Repository, req.Chunks, req.MinLength, s.canPull(r, req.Repository))
	if chunkindex.IsBadRequest(err) {
		writeRegistryError(w, http.StatusBadRequest, "DIGEST_INVALID", err.Error())
		return
	}
	if err != nil {
		writeRegistryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
		return
	}
	s.metrics.composed(resp)
	w.Header().Set("Content-Type", "application/json")
	if resp.Pack != nil {
		w.WriteHeader(http.StatusCreated)
	}
	json.NewEncoder(w).Encode(resp)
}

// handleBase answers GET /v2/<name>/_cryo/base (SPEC.md 12.6): the format
// v2 snapshot index stored last in the repository under a tag, for a push
// to a tag that names nothing yet. The caller needs pull and push access
// to it (only a pusher has a use for it); a mirror keeps no such record.
func (s *Server) handleBase(w http.ResponseWriter, r *http.Request) {
	repo := mux.Vars(r)["name"]
	if s.mirrorOf != "" {
		writeRegistryError(w, http.StatusNotFound, "UNSUPPORTED", "a mirror records no latest snapshots")
		return
	}
	if !s.authorize(w, r, repo, "pull", "push") {
		return
	}
	desc, ok, err := s.bases.Latest(r.Context(), repo)
	if err != nil {
		writeRegistryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
		return
	}
	if !ok {
		writeRegistryError(w, http.StatusNotFound, "MANIFEST_UNKNOWN", "no format v2 snapshot stored in "+repo)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(desc)
}
