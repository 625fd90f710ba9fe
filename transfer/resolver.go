package transfer

import (
	"context"
	"errors"
	"io"
	"sync/atomic"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote"
)

// indexResolver resolves chunks through a cryo registry's chunk index: a
// chunk the registry holds under another blob (another zstd version, or
// another repository) is reused by a cross-repository mount instead of
// being uploaded. On a registry without the index it turns itself off
// after the first lookup.
type indexResolver struct {
	repo     *remote.Repository
	base     string
	disabled atomic.Bool
	hits     atomic.Int64
}

var errNoUpload = errors.New("mount refused; not uploading another repository's blob")

func (r *indexResolver) ResolveChunk(ctx context.Context, c format.Chunk) (format.Chunk, bool, error) {
	if r.disabled.Load() {
		return c, false, nil
	}
	found, err := api.Lookup(ctx, r.repo.Client, r.base, []digest.Digest{c.Digest})
	if err != nil {
		// Any registry without the extension (or an error in it) just
		// means the normal path: HEAD, then upload.
		r.disabled.Store(errors.Is(err, api.ErrUnsupported))
		return c, false, nil
	}
	for _, b := range found[c.Digest] {
		if b.ChunkSize != c.Size || (b.Encoding != string(format.EncodingRaw) && b.Encoding != string(format.EncodingZstd)) {
			continue
		}
		desc := ocispec.Descriptor{MediaType: b.MediaType, Digest: b.Digest, Size: b.Size}
		if b.Repository != r.repo.Reference.Repository {
			err := r.repo.Mount(ctx, desc, b.Repository, func() (io.ReadCloser, error) { return nil, errNoUpload })
			if err != nil {
				continue
			}
		}
		r.hits.Add(1)
		return format.Chunk{Size: c.Size, Encoding: format.Encoding(b.Encoding), Digest: c.Digest, Blob: b.Digest, BlobSize: b.Size}, true, nil
	}
	return c, false, nil
}

// packComposer asks a cryo registry to compose format v2 packs from
// chunks it holds in repositories the pusher may pull from (SPEC.md
// 12.2.1), instead of uploading them. A failed composition just means the
// pack is uploaded; on a registry without the extension, or after
// composeFailures failures in a row, it turns itself off.
type packComposer struct {
	repo     *remote.Repository
	base     string
	disabled atomic.Bool
	failures atomic.Int32
}

// composeFailures is how many compositions in a row may fail before a
// push stops asking.
const composeFailures = 3

// composeMinDivisor sets the least share of a pack's bytes (1/8, 512 KiB
// of a 4 MiB pack) a composition must cover to be made: a pack split into
// a composed and an uploaded part costs readers two requests where one
// would do, but a pack that holds a contiguous edit among unchanged
// chunks (a pause's rewritten heap) is mostly new, and uploading its
// unchanged part too cost a cross-repository push as much again as the
// edit (SPEC.md 15.4).
const composeMinDivisor = 8

func (pc *packComposer) ComposePack(ctx context.Context, chunks []format.Chunk, packSize int64) (map[digest.Digest]format.Chunk, error) {
	if pc.disabled.Load() || len(chunks) > api.MaxComposeChunks {
		return nil, nil
	}
	req := api.ComposeRequest{Repository: pc.repo.Reference.Repository, MinLength: packSize / composeMinDivisor,
		Chunks: make([]api.ComposeChunk, len(chunks))}
	for i, c := range chunks {
		req.Chunks[i] = api.ComposeChunk{Digest: c.Digest, Size: c.Size}
	}
	resp, err := api.Compose(ctx, pc.repo.Client, pc.base, req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if errors.Is(err, api.ErrUnsupported) || pc.failures.Add(1) >= composeFailures {
			pc.disabled.Store(true)
		}
		return nil, nil
	}
	pc.failures.Store(0)
	if resp.Pack == nil || resp.Pack.MediaType != format.MediaTypePack {
		return nil, nil
	}
	out := make(map[digest.Digest]format.Chunk, len(resp.Frames))
	for _, f := range resp.Frames {
		out[f.Digest] = format.Chunk{Size: f.Size, Encoding: format.Encoding(f.Encoding), Digest: f.Digest,
			Blob: resp.Pack.Digest, PackSize: resp.Pack.Size, PackOffset: f.PackOffset, BlobSize: f.PackLength}
	}
	return out, nil
}
