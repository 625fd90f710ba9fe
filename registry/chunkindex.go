package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/distribution/distribution/v3"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
)

// chunkIndex maps a chunk's uncompressed sha256 to the blobs that carry it.
// It is filled when a cryo file manifest is pushed, from the manifest's
// chunk table, and stored in the registry's storage driver, one small entry
// per (chunk, blob): /cryo/v1/chunks/sha256/<hh>/<chunk hex>/<blob hex>.
// A lookup checks that each blob still exists and is linked in the recorded
// repository, and drops entries whose blob is gone, so the index stays true
// after deletes and garbage collection.
type chunkIndex struct {
	driver  storagedriver.StorageDriver
	ns      distribution.Namespace
	log     *slog.Logger
	metrics *metrics
}

const chunksRoot = "/cryo/v1/chunks"

func chunkDir(d digest.Digest) string {
	hex := d.Encoded()
	return path.Join(chunksRoot, d.Algorithm().String(), hex[:2], hex)
}

// indexManifest records the chunks of a cryo file manifest pushed to repo.
func (ci *chunkIndex) indexManifest(ctx context.Context, repo string, body []byte) error {
	var m ocispec.Manifest
	if err := json.Unmarshal(body, &m); err != nil || m.ArtifactType != format.ArtifactTypeFile || m.Config.MediaType != format.MediaTypeChunkTable {
		return nil
	}
	if m.Config.Size > format.MaxTableSize || m.Config.Digest.Validate() != nil {
		return nil
	}
	r, err := ci.repository(ctx, repo)
	if err != nil {
		return err
	}
	data, err := r.Blobs(ctx).Get(ctx, m.Config.Digest)
	if err != nil {
		return fmt.Errorf("read chunk table %s: %w", m.Config.Digest, err)
	}
	if digest.FromBytes(data) != m.Config.Digest {
		return fmt.Errorf("chunk table %s does not match its digest", m.Config.Digest)
	}
	t, err := format.ParseTable(data)
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	seen := map[digest.Digest]bool{}
	for _, c := range t.Chunks {
		if c.Encoding == format.EncodingZero || seen[c.Blob] {
			continue
		}
		seen[c.Blob] = true
		entry := api.ChunkBlob{Encoding: string(c.Encoding), MediaType: c.MediaType(), Digest: c.Blob, Size: c.BlobSize, ChunkSize: c.Size, Repository: repo}
		chunk := c.Digest
		g.Go(func() error { return ci.put(gctx, chunk, entry) })
	}
	return g.Wait()
}

func (ci *chunkIndex) put(ctx context.Context, chunk digest.Digest, entry api.ChunkBlob) error {
	p := path.Join(chunkDir(chunk), entry.Digest.Encoded())
	if _, err := ci.driver.Stat(ctx, p); err == nil {
		return nil
	}
	data, _ := json.Marshal(entry)
	if err := ci.driver.PutContent(ctx, p, data); err != nil {
		return fmt.Errorf("index chunk %s: %w", chunk, err)
	}
	return nil
}

// lookup returns the live blobs that carry chunk d, dropping stale entries.
func (ci *chunkIndex) lookup(ctx context.Context, d digest.Digest) ([]api.ChunkBlob, error) {
	entries, err := ci.driver.List(ctx, chunkDir(d))
	var notFound storagedriver.PathNotFoundError
	if errors.As(err, &notFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []api.ChunkBlob
	for _, e := range entries {
		data, err := ci.driver.GetContent(ctx, e)
		if err != nil {
			continue
		}
		var b api.ChunkBlob
		if json.Unmarshal(data, &b) != nil || b.Digest.Validate() != nil {
			continue
		}
		live, err := ci.linked(ctx, b)
		if err != nil {
			return nil, err
		}
		if !live {
			_ = ci.driver.Delete(ctx, e)
			continue
		}
		out = append(out, b)
	}
	return out, nil
}

// linked reports whether blob b exists and is linked in its repository.
func (ci *chunkIndex) linked(ctx context.Context, b api.ChunkBlob) (bool, error) {
	r, err := ci.repository(ctx, b.Repository)
	if err != nil {
		return false, nil
	}
	_, err = r.Blobs(ctx).Stat(ctx, b.Digest)
	if errors.Is(err, distribution.ErrBlobUnknown) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat blob %s: %w", b.Digest, err)
	}
	return true, nil
}

func (ci *chunkIndex) repository(ctx context.Context, repo string) (distribution.Repository, error) {
	named, err := reference.WithName(repo)
	if err != nil {
		return nil, err
	}
	return ci.ns.Repository(ctx, named)
}

// prune drops entries whose blob is no longer linked; gc calls it.
func (ci *chunkIndex) prune(ctx context.Context) (int, error) {
	return pruneEntries(ctx, ci.driver, chunksRoot, func(p string) bool {
		data, err := ci.driver.GetContent(ctx, p)
		if err != nil {
			return false
		}
		var b api.ChunkBlob
		if json.Unmarshal(data, &b) != nil {
			return false
		}
		live, err := ci.linked(ctx, b)
		return err == nil && !live
	})
}

// pruneEntries deletes the files under root for which stale is true and
// counts them. A missing root has nothing to prune.
func pruneEntries(ctx context.Context, driver storagedriver.StorageDriver, root string, stale func(path string) bool) (int, error) {
	removed := 0
	err := driver.Walk(ctx, root, func(fi storagedriver.FileInfo) error {
		if !fi.IsDir() && stale(fi.Path()) && driver.Delete(ctx, fi.Path()) == nil {
			removed++
		}
		return nil
	})
	var notFound storagedriver.PathNotFoundError
	if errors.As(err, &notFound) {
		return removed, nil
	}
	return removed, err
}

// handleChunkLookup answers GET /v2/_cryo/chunks/<digest>.
func (s *Server) handleChunkLookup(w http.ResponseWriter, r *http.Request) {
	d, err := digest.Parse(r.PathValue("digest"))
	if err != nil {
		writeRegistryError(w, http.StatusBadRequest, "DIGEST_INVALID", err.Error())
		return
	}
	s.answerLookup(w, r, []digest.Digest{d}, true)
}

// handleChunkBatch answers POST /v2/_cryo/chunks.
func (s *Server) handleChunkBatch(w http.ResponseWriter, r *http.Request) {
	var req api.LookupRequest
	if err := json.NewDecoder(io.LimitReader(r.Body, 2<<20)).Decode(&req); err != nil {
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

func (s *Server) answerLookup(w http.ResponseWriter, r *http.Request, digests []digest.Digest, single bool) {
	if !s.authorize(w, r, "") {
		return
	}
	canPull := map[string]bool{}
	resp := api.LookupResponse{Chunks: map[digest.Digest][]api.ChunkBlob{}}
	for _, d := range digests {
		blobs, err := s.chunks.lookup(r.Context(), d)
		if err != nil {
			writeRegistryError(w, http.StatusInternalServerError, "UNKNOWN", err.Error())
			return
		}
		var visible []api.ChunkBlob
		for _, b := range blobs {
			ok, seen := canPull[b.Repository]
			if !seen {
				ok = s.allowed(r, b.Repository)
				canPull[b.Repository] = ok
			}
			if ok {
				visible = append(visible, b)
			}
		}
		if len(visible) > 0 {
			resp.Chunks[d] = visible
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

// allowed reports whether the request's credentials may pull from repo.
func (s *Server) allowed(r *http.Request, repo string) bool {
	if s.cfg.Auth.Type() == "" {
		return true
	}
	return s.authorize(discardWriter{header: http.Header{}}, r, repo)
}

// discardWriter is a ResponseWriter that keeps nothing.
type discardWriter struct{ header http.Header }

func (d discardWriter) Header() http.Header       { return d.header }
func (discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (discardWriter) WriteHeader(int)             {}
