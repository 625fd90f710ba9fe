package transfer

import (
	"context"
	"fmt"
	"time"

	"github.com/cryo-oci/cryo/format"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote"
)

// PullOptions tune Pull.
type PullOptions struct {
	// Concurrency is how many chunks are fetched at once (default 8).
	Concurrency int
	// OnBytes, if set, is called with logical bytes as they are written.
	OnBytes func(n int64)
}

// PullResult says what Pull did.
type PullResult struct {
	Descriptor ocispec.Descriptor `json:"descriptor"`
	// Kind is "cryo" for a cryo snapshot, "files" for a plain artifact of
	// whole files (oras push).
	Kind         string  `json:"kind"`
	Files        int     `json:"files"`
	LogicalBytes int64   `json:"logicalBytes"`
	FetchedBytes int64   `json:"fetchedBytes"`
	ReusedBytes  int64   `json:"reusedBytes"`
	Seconds      float64 `json:"seconds"`
}

// Pull downloads the snapshot ref of repo into dir, verified, in parallel,
// resuming from what an interrupted pull into dir left. It also takes a
// plain artifact of whole files pushed with `oras push`.
func Pull(ctx context.Context, repo *remote.Repository, ref, dir string, opts PullOptions) (*PullResult, error) {
	start := time.Now()
	if opts.Concurrency <= 0 {
		opts.Concurrency = 8
	}
	desc, err := repo.Resolve(ctx, ref)
	if err != nil {
		return nil, explain(fmt.Errorf("resolve %s: %w", repo.Reference, err), repo)
	}
	res := &PullResult{Descriptor: desc}
	switch desc.MediaType {
	case ocispec.MediaTypeImageIndex:
		uopts := format.UnpackOptions{Concurrency: opts.Concurrency}
		if opts.OnBytes != nil {
			uopts.OnChunk = func(c format.Chunk, _ bool) { opts.OnBytes(c.Size) }
		}
		snap, st, err := format.Unpack(ctx, Ranged{repo}, desc, dir, uopts)
		if err != nil {
			return nil, explain(fmt.Errorf("pull %s: %w", repo.Reference, err), repo)
		}
		res.Kind, res.Files, res.LogicalBytes = "cryo", len(snap.Files), snap.LogicalSize()
		res.FetchedBytes, res.ReusedBytes = st.FetchedBytes, st.ReusedBytes
	default:
		n, err := format.UnpackFiles(ctx, repo, desc, dir, opts.OnBytes)
		if err != nil {
			return nil, explain(fmt.Errorf("pull %s: %w", repo.Reference, err), repo)
		}
		files, size, _ := dirStats(dir)
		res.Kind, res.Files, res.LogicalBytes, res.FetchedBytes = "files", files, size, n
	}
	res.Seconds = time.Since(start).Seconds()
	return res, nil
}
