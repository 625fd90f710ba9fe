package transfer

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/registry/remote"
)

// CopyResult says what Copy did.
type CopyResult struct {
	Descriptor  ocispec.Descriptor `json:"descriptor"`
	Copied      int64              `json:"copied"`
	CopiedBytes int64              `json:"copiedBytes"`
	Skipped     int64              `json:"skipped"`
	Mounted     int64              `json:"mounted"`
	Seconds     float64            `json:"seconds"`
}

// Copy replicates the graph of srcRef (a snapshot, or any OCI artifact)
// from src to dst and tags it dstRef. Nodes dst already has are skipped;
// within one registry, blobs are cross-mounted instead of copied. Children
// are copied before parents, so dst never shows a partial snapshot.
func Copy(ctx context.Context, src *remote.Repository, srcRef string, dst *remote.Repository, dstRef string, concurrency int) (*CopyResult, error) {
	start := time.Now()
	if concurrency <= 0 {
		concurrency = 8
	}
	var copied, bytes, skipped, mounted atomic.Int64
	opts := oras.CopyOptions{}
	opts.Concurrency = concurrency
	opts.PostCopy = func(_ context.Context, d ocispec.Descriptor) error {
		copied.Add(1)
		bytes.Add(d.Size)
		return nil
	}
	opts.OnCopySkipped = func(context.Context, ocispec.Descriptor) error { skipped.Add(1); return nil }
	if src.Reference.Registry == dst.Reference.Registry && src.Reference.Repository != dst.Reference.Repository {
		opts.MountFrom = func(context.Context, ocispec.Descriptor) ([]string, error) {
			return []string{src.Reference.Repository}, nil
		}
		opts.OnMounted = func(context.Context, ocispec.Descriptor) error { mounted.Add(1); return nil }
	}
	desc, err := oras.Copy(ctx, src, srcRef, dst, dstRef, opts)
	if err != nil {
		return nil, explain(fmt.Errorf("copy %s to %s: %w", src.Reference, dst.Reference, err), dst)
	}
	return &CopyResult{Descriptor: desc, Copied: copied.Load(), CopiedBytes: bytes.Load(), Skipped: skipped.Load(), Mounted: mounted.Load(), Seconds: time.Since(start).Seconds()}, nil
}
