// Package api holds the types of cryo's registry extension API and a small
// client for it. The API is optional: cryo's client works with any OCI
// registry and uses it only as a speed-up when a registry answers it. It is
// specified in SPEC.md ("Registry extensions").
package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// ChunksPath is the path of the chunk index lookup, relative to the
// registry's base URL.
const ChunksPath = "/v2/_cryo/chunks"

// MaxLookupDigests is the most digests one batch lookup may ask for.
const MaxLookupDigests = 10000

// ChunkBlob is a blob in the registry that carries a chunk.
type ChunkBlob struct {
	// Encoding is the chunk encoding of the blob: "raw" or "zstd".
	Encoding string `json:"encoding"`
	// MediaType is the blob's media type.
	MediaType string `json:"mediaType"`
	// Digest and Size identify the blob.
	Digest digest.Digest `json:"digest"`
	Size   int64         `json:"size"`
	// ChunkSize is the uncompressed size of the chunk.
	ChunkSize int64 `json:"chunkSize"`
	// Repository is a repository the blob is linked in, to mount it from.
	Repository string `json:"repository"`
}

// LookupRequest is the body of POST /v2/_cryo/chunks.
type LookupRequest struct {
	// Digests are uncompressed chunk digests.
	Digests []digest.Digest `json:"digests"`
}

// LookupResponse answers a lookup: for each known chunk digest, the blobs
// that carry it. Unknown digests are absent.
type LookupResponse struct {
	Chunks map[digest.Digest][]ChunkBlob `json:"chunks"`
}

// Doer sends HTTP requests; oras-go's auth.Client is one.
type Doer interface {
	Do(*http.Request) (*http.Response, error)
}

// ErrUnsupported is returned by Lookup when the registry does not serve the
// extension API (any OCI registry but cryo's).
var ErrUnsupported = fmt.Errorf("registry has no cryo chunk index")

// Lookup asks the registry at baseURL (scheme://host) which of digests it
// holds, in batches of MaxLookupDigests.
func Lookup(ctx context.Context, c Doer, baseURL string, digests []digest.Digest) (map[digest.Digest][]ChunkBlob, error) {
	out := map[digest.Digest][]ChunkBlob{}
	for start := 0; start < len(digests); start += MaxLookupDigests {
		batch := digests[start:min(start+MaxLookupDigests, len(digests))]
		body, _ := json.Marshal(LookupRequest{Digests: batch})
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+ChunksPath, bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := c.Do(req)
		if err != nil {
			return nil, fmt.Errorf("chunk index lookup: %w", err)
		}
		data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
		resp.Body.Close()
		if resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed {
			return nil, ErrUnsupported
		}
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("chunk index lookup: %s", resp.Status)
		}
		if err != nil {
			return nil, fmt.Errorf("chunk index lookup: %w", err)
		}
		var lr LookupResponse
		if err := json.Unmarshal(data, &lr); err != nil {
			return nil, fmt.Errorf("chunk index lookup: decode answer: %w", err)
		}
		for d, blobs := range lr.Chunks {
			out[d] = blobs
		}
	}
	return out, nil
}

// PacksPath is the path of pack composition (format v2), relative to the
// registry's base URL.
const PacksPath = "/v2/_cryo/packs"

// Bounds of one composition: at most MaxComposeChunks chunks asked for,
// and a pack of at most MaxComposePack bytes of frames (the format v2
// pack limit; chunks past it are left out).
const (
	MaxComposeChunks = 4096
	MaxComposePack   = 16 << 20
)

// ComposeRequest is the body of POST /v2/_cryo/packs: make, in Repository,
// a pack of frames of the chunks listed (in this order) that the registry
// holds in repositories the caller may pull from.
type ComposeRequest struct {
	// Repository is where the pack is stored; the caller needs push and
	// pull access to it.
	Repository string `json:"repository"`
	// Chunks are the chunks wanted, by uncompressed digest and size.
	Chunks []ComposeChunk `json:"chunks"`
	// MinLength, if positive, is the fewest frame bytes worth a pack: if
	// the registry finds fewer, it makes none.
	MinLength int64 `json:"minLength,omitempty"`
}

// ComposeChunk names a chunk wanted in a composed pack.
type ComposeChunk struct {
	Digest digest.Digest `json:"digest"`
	Size   int64         `json:"size"`
}

// ComposeResponse answers a composition: the pack made (absent if none)
// and, in pack order, the frames it holds.
type ComposeResponse struct {
	Pack   *PackDescriptor `json:"pack,omitempty"`
	Frames []ComposedFrame `json:"frames"`
}

// PackDescriptor identifies a composed pack blob.
type PackDescriptor struct {
	MediaType string        `json:"mediaType"`
	Digest    digest.Digest `json:"digest"`
	Size      int64         `json:"size"`
}

// ComposedFrame is a chunk's frame in a composed pack.
type ComposedFrame struct {
	Digest     digest.Digest `json:"digest"`
	Size       int64         `json:"size"`
	Encoding   string        `json:"encoding"`
	PackOffset int64         `json:"packOffset"`
	PackLength int64         `json:"packLength"`
}

// Compose asks the registry at baseURL to compose a pack (SPEC.md 12.2.1).
// A registry without the extension gives ErrUnsupported.
func Compose(ctx context.Context, c Doer, baseURL string, creq ComposeRequest) (*ComposeResponse, error) {
	if len(creq.Chunks) > MaxComposeChunks {
		return nil, fmt.Errorf("compose pack: %d chunks, at most %d", len(creq.Chunks), MaxComposeChunks)
	}
	body, _ := json.Marshal(creq)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+PacksPath, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("compose pack: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	switch {
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		return nil, ErrUnsupported
	case resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusCreated:
		return nil, fmt.Errorf("compose pack: %s", resp.Status)
	case err != nil:
		return nil, fmt.Errorf("compose pack: %w", err)
	}
	var cr ComposeResponse
	if err := json.Unmarshal(data, &cr); err != nil {
		return nil, fmt.Errorf("compose pack: decode answer: %w", err)
	}
	return &cr, nil
}

// BaseSuffix follows /v2/<repository> in the path of the latest format v2
// snapshot of a repository (SPEC.md 12.6).
const BaseSuffix = "/_cryo/base"

// ErrNoBase is returned by LatestSnapshot when the repository holds no v2
// snapshot the registry recorded.
var ErrNoBase = errors.New("no format v2 snapshot recorded in the repository")

// LatestSnapshot asks the registry at baseURL for the format v2 snapshot
// index stored last in repository under a tag. A registry without the extension gives
// ErrUnsupported; one that knows none, ErrNoBase. The descriptor is the
// registry's word: load the snapshot by its digest, verified.
func LatestSnapshot(ctx context.Context, c Doer, baseURL, repository string) (ocispec.Descriptor, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/v2/"+repository+BaseSuffix, nil)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("latest v2 snapshot: %w", err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	switch {
	case resp.StatusCode == http.StatusNotFound && bytes.Contains(data, []byte(`"MANIFEST_UNKNOWN"`)):
		return ocispec.Descriptor{}, ErrNoBase
	case resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed:
		return ocispec.Descriptor{}, ErrUnsupported
	case resp.StatusCode != http.StatusOK:
		return ocispec.Descriptor{}, fmt.Errorf("latest v2 snapshot: %s", resp.Status)
	case err != nil:
		return ocispec.Descriptor{}, fmt.Errorf("latest v2 snapshot: %w", err)
	}
	var desc ocispec.Descriptor
	if err := json.Unmarshal(data, &desc); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("latest v2 snapshot: decode answer: %w", err)
	}
	if err := desc.Digest.Validate(); err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("latest v2 snapshot: %w", err)
	}
	return desc, nil
}
