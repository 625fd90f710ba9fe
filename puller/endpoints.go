package puller

import (
	"bytes"
	"context"
	"fmt"
	"io"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// maxFailoverSize bounds what the failover fetcher reads into memory: it
// serves manifests, indexes and chunk tables, never chunk blobs.
const maxFailoverSize = max(format.MaxManifestSize, format.MaxTableSize)

// Failover returns a content.Fetcher over endpoints in order, for the
// small objects of a snapshot (indexes, manifests, chunk tables): it reads
// an object whole from the first endpoint, checks its size and digest, and
// moves on to the next endpoint when the read fails or the bytes are not
// the ones asked for, so a mirror serving a corrupt or wrong object costs a
// round trip, not the mount. What it returns has been verified.
func Failover(eps []fetch.Endpoint) content.Fetcher { return failover(eps) }

type failover []fetch.Endpoint

func (f failover) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	if desc.Size < 0 || desc.Size > maxFailoverSize {
		return nil, fmt.Errorf("fetch %s: size %d: %w (limit %d)", desc.Digest, desc.Size, format.ErrTooLarge, maxFailoverSize)
	}
	if err := desc.Digest.Validate(); err != nil {
		return nil, fmt.Errorf("fetch %q: %w", desc.Digest, err)
	}
	data, err := fetch.FirstOf(ctx, f, func(ctx context.Context, ep fetch.Endpoint) ([]byte, error) {
		return fetchVerified(ctx, ep.Store, desc)
	})
	if err == nil {
		return io.NopCloser(bytes.NewReader(data)), nil
	}
	if ctx.Err() != nil {
		return nil, fmt.Errorf("fetch %s: %w", desc.Digest, ctx.Err())
	}
	return nil, fmt.Errorf("fetch %s: %w", desc.Digest, err)
}

// fetchVerified reads desc from one store, refusing more than desc.Size
// bytes, and checks its size and digest.
func fetchVerified(ctx context.Context, store content.Fetcher, desc ocispec.Descriptor) ([]byte, error) {
	rc, err := store.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, desc.Size+1))
	if err != nil {
		return nil, err
	}
	if n := int64(len(data)); n > desc.Size {
		return nil, fmt.Errorf("served more than the %d bytes asked for: %w", desc.Size, format.ErrDigestMismatch)
	} else if n < desc.Size {
		return nil, fmt.Errorf("served %d bytes, want %d: %w", n, desc.Size, format.ErrDigestMismatch)
	}
	if got := desc.Digest.Algorithm().FromBytes(data); got != desc.Digest {
		return nil, fmt.Errorf("served bytes hash to %s: %w", got, format.ErrDigestMismatch)
	}
	return data, nil
}
