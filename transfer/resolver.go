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
