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
	"sync"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/distribution/distribution/v3"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/semaphore"
)

// chunkIndex maps a chunk's uncompressed sha256 to the blobs that carry it.
// It is filled when a cryo file manifest is pushed, from the manifest's
// chunk table, and stored in the registry's storage driver, one small entry
// per (chunk, blob): /cryo/v1/chunks/sha256/<hh>/<chunk hex>/<blob hex>.
//
// A chunk table is the pusher's word, and the index serves other users: an
// entry is written only after the registry has read the blob from its
// storage and found that it decodes to the chunk (size and sha256), and
// only entries so marked are answered (SPEC.md 12.2). A lookup checks that
// each blob still exists and is linked in the recorded repository, and
// drops entries whose blob is gone, so the index stays true after deletes
// and garbage collection.
type chunkIndex struct {
	driver  storagedriver.StorageDriver
	ns      distribution.Namespace
	log     *slog.Logger
	metrics *metrics
	codec   *format.Codec
	// mem bounds the bytes of blobs and decoded chunks held by
	// verifications under way, across all manifest PUTs.
	mem  *semaphore.Weighted
	bufs sync.Pool
}

const chunksRoot = "/cryo/v1/chunks"

// Verification bounds. indexParallelism is how many chunks of one manifest
// are checked at once (storage round trips overlap; decoding is bounded by
// the codec's decoders); verifyMemory is the most bytes (blob plus decoded
// chunk) all verifications hold at once, at least one largest chunk.
const (
	indexParallelism = 8
	verifyMemory     = 64 << 20
)

func newChunkIndex(driver storagedriver.StorageDriver, ns distribution.Namespace, log *slog.Logger, m *metrics, codec *format.Codec) *chunkIndex {
	ci := &chunkIndex{driver: driver, ns: ns, log: log, metrics: m, codec: codec,
		mem: semaphore.NewWeighted(max(verifyMemory, 2*format.MaxChunkSize))}
	ci.bufs.New = func() any { return new([]byte) }
	return ci
}

// indexEntry is a stored chunk index entry. Verified marks entries whose
// blob the registry decoded and checked; entries written before
// verification existed lack it and are never answered.
type indexEntry struct {
	api.ChunkBlob
	Verified bool `json:"verified,omitempty"`
}

func chunkDir(d digest.Digest) string {
	hex := d.Encoded()
	return path.Join(chunksRoot, d.Algorithm().String(), hex[:2], hex)
}

func entryPath(chunk, blob digest.Digest) string {
	return path.Join(chunkDir(chunk), blob.Encoded())
}

// indexManifest records the chunks of a cryo file manifest pushed to repo,
// each after verifying that its blob holds it. A chunk whose blob does not
// is left out (and logged); it fails nothing else.
func (ci *chunkIndex) indexManifest(ctx context.Context, repo string, body []byte) error {
	var m ocispec.Manifest
	if err := json.Unmarshal(body, &m); err != nil || m.ArtifactType != format.ArtifactTypeFile || m.Config.MediaType != format.MediaTypeChunkTable {
		return nil
	}
	if m.Config.Size <= 0 || m.Config.Size > format.MaxTableSize || m.Config.Digest.Validate() != nil {
		return nil
	}
	r, err := ci.repository(ctx, repo)
	if err != nil {
		return err
	}
	bp := ci.bufs.Get().(*[]byte)
	data, err := ci.readBlob(ctx, r, m.Config.Digest, m.Config.Size, *bp)
	*bp = data
	if err != nil {
		ci.bufs.Put(bp)
		return fmt.Errorf("read chunk table: %w", err)
	}
	if digest.FromBytes(data) != m.Config.Digest {
		ci.bufs.Put(bp)
		return fmt.Errorf("chunk table %s does not match its digest", m.Config.Digest)
	}
	t, err := format.ParseTable(data)
	ci.bufs.Put(bp)
	if err != nil {
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(indexParallelism)
	type key struct{ chunk, blob digest.Digest }
	seen := map[key]bool{}
	for _, c := range t.Chunks {
		k := key{c.Digest, c.Blob}
		if c.Encoding == format.EncodingZero || seen[k] {
			continue
		}
		seen[k] = true
		g.Go(func() error { return ci.indexChunk(gctx, repo, r, c) })
	}
	return g.Wait()
}

// indexChunk records that chunk c is carried by its blob in repo, unless a
// verified entry for that blob exists, after verifying it.
func (ci *chunkIndex) indexChunk(ctx context.Context, repo string, r distribution.Repository, c format.Chunk) error {
	p := entryPath(c.Digest, c.Blob)
	if data, err := ci.driver.GetContent(ctx, p); err == nil {
		var old indexEntry
		if json.Unmarshal(data, &old) == nil && old.Verified && old.Digest == c.Blob {
			// Verified once: a blob's content never changes. Only its
			// repository may have let it go.
			if old.Repository == repo {
				return nil
			}
			if live, err := ci.linked(ctx, old.ChunkBlob); err != nil || live {
				return err
			}
			if _, err := r.Blobs(ctx).Stat(ctx, c.Blob); err != nil {
				return nil
			}
			old.Repository = repo
			return ci.put(ctx, p, old)
		}
	}
	if err := ci.verify(ctx, r, c); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		ci.metrics.chunkVerifications.WithLabelValues("refused").Inc()
		ci.log.Warn("chunk index: chunk table names a blob that does not hold the chunk; not indexed",
			"repository", repo, "chunk", c.Digest, "blob", c.Blob, "err", err)
		return nil
	}
	ci.metrics.chunkVerifications.WithLabelValues("ok").Inc()
	return ci.put(ctx, p, indexEntry{Verified: true, ChunkBlob: api.ChunkBlob{
		Encoding: string(c.Encoding), MediaType: c.MediaType(), Digest: c.Blob, Size: c.BlobSize, ChunkSize: c.Size, Repository: repo}})
}

// verify checks that chunk c's blob is linked in r, has the size the table
// says, and decodes to exactly the chunk's c.Size bytes with sha256
// c.Digest. A raw blob is the chunk itself: its digest is the chunk's
// (ParseTable checked that), and the registry checked the digest of the
// bytes when they were uploaded, so its size is all that is left to check.
// A zstd blob is read and decoded, never into more than c.Size bytes.
func (ci *chunkIndex) verify(ctx context.Context, r distribution.Repository, c format.Chunk) error {
	if c.Encoding == format.EncodingRaw {
		desc, err := r.Blobs(ctx).Stat(ctx, c.Blob)
		if err != nil {
			return fmt.Errorf("stat blob: %w", err)
		}
		if desc.Size != c.Size || c.Blob != c.Digest {
			return fmt.Errorf("raw blob %s has %d bytes, chunk %s has %d", c.Blob, desc.Size, c.Digest, c.Size)
		}
		return nil
	}
	if c.Encoding != format.EncodingZstd {
		return fmt.Errorf("encoding %q", c.Encoding)
	}
	weight := c.BlobSize + c.Size
	if err := ci.mem.Acquire(ctx, weight); err != nil {
		return err
	}
	defer ci.mem.Release(weight)
	bp, dp := ci.bufs.Get().(*[]byte), ci.bufs.Get().(*[]byte)
	defer ci.bufs.Put(bp)
	defer ci.bufs.Put(dp)
	blob, err := ci.readBlob(ctx, r, c.Blob, c.BlobSize, *bp)
	*bp = blob
	if err != nil {
		return err
	}
	out, err := ci.codec.Decode(c, blob, *dp)
	*dp = out
	return err
}

// readBlob reads blob d, linked in r, into buf, after checking that its
// real size is the size claimed for it: a manifest that claims a small
// blob cannot make the registry read a large one.
func (ci *chunkIndex) readBlob(ctx context.Context, r distribution.Repository, d digest.Digest, size int64, buf []byte) ([]byte, error) {
	desc, err := r.Blobs(ctx).Stat(ctx, d)
	if err != nil {
		return buf, fmt.Errorf("stat blob %s: %w", d, err)
	}
	if desc.Size != size {
		return buf, fmt.Errorf("blob %s has %d bytes, not the %d claimed", d, desc.Size, size)
	}
	rc, err := r.Blobs(ctx).Open(ctx, d)
	if err != nil {
		return buf, fmt.Errorf("read blob %s: %w", d, err)
	}
	defer rc.Close()
	if int64(cap(buf)) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	if _, err := io.ReadFull(rc, buf); err != nil {
		return buf, fmt.Errorf("read blob %s: %w", d, err)
	}
	return buf, nil
}

func (ci *chunkIndex) put(ctx context.Context, p string, e indexEntry) error {
	data, _ := json.Marshal(e)
	if err := ci.driver.PutContent(ctx, p, data); err != nil {
		return fmt.Errorf("index chunk: %w", err)
	}
	return nil
}

// lookup returns the verified live blobs that carry chunk d in the
// repositories visible says the caller may pull from, dropping stale
// entries. The repositories the caller may not see cost no blob stat.
func (ci *chunkIndex) lookup(ctx context.Context, d digest.Digest, visible func(repo string) bool) ([]api.ChunkBlob, error) {
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
		var b indexEntry
		if json.Unmarshal(data, &b) != nil || !b.Verified || b.Digest.Validate() != nil || !visible(b.Repository) {
			continue
		}
		live, err := ci.linked(ctx, b.ChunkBlob)
		if err != nil {
			return nil, err
		}
		if !live {
			_ = ci.driver.Delete(ctx, e)
			continue
		}
		out = append(out, b.ChunkBlob)
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
	return repositoryOf(ctx, ci.ns, repo)
}

// repositoryOf opens repository repo of ns.
func repositoryOf(ctx context.Context, ns distribution.Namespace, repo string) (distribution.Repository, error) {
	named, err := reference.WithName(repo)
	if err != nil {
		return nil, err
	}
	return ns.Repository(ctx, named)
}

// prune drops entries whose blob is no longer linked, and entries written
// before verification existed; gc calls it.
func (ci *chunkIndex) prune(ctx context.Context) (int, error) {
	return pruneEntries(ctx, ci.driver, chunksRoot, func(p string) bool {
		data, err := ci.driver.GetContent(ctx, p)
		if err != nil {
			return false
		}
		var b indexEntry
		if json.Unmarshal(data, &b) != nil {
			return false
		}
		if !b.Verified {
			return true
		}
		live, err := ci.linked(ctx, b.ChunkBlob)
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
	if !s.authorize(w, r, "") {
		return
	}
	d, err := digest.Parse(r.PathValue("digest"))
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
	canPull := map[string]bool{}
	visible := func(repo string) bool {
		ok, seen := canPull[repo]
		if !seen {
			ok = s.allowed(r, repo)
			canPull[repo] = ok
		}
		return ok
	}
	resp := api.LookupResponse{Chunks: map[digest.Digest][]api.ChunkBlob{}}
	for _, d := range digests {
		blobs, err := s.chunks.lookup(r.Context(), d, visible)
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

// allowed reports whether the request's credentials, already allowed to
// reach the registry, may pull from repo. htpasswd grants every
// authenticated user everything (and checks a bcrypt hash per probe), so
// only other access controllers are asked per repository.
func (s *Server) allowed(r *http.Request, repo string) bool {
	switch s.cfg.Auth.Type() {
	case "", "htpasswd":
		return true
	}
	return s.authorize(discardWriter{header: http.Header{}}, r, repo)
}

// discardWriter is a ResponseWriter that keeps nothing.
type discardWriter struct{ header http.Header }

func (d discardWriter) Header() http.Header       { return d.header }
func (discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (discardWriter) WriteHeader(int)             {}
