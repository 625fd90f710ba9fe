package transfer

import (
	"context"
	"fmt"
	"io/fs"
	"path/filepath"
	"time"

	"github.com/cryo-oci/cryo/format"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote"
)

// PushOptions tune Push.
type PushOptions struct {
	// Pack are the packing options; Resolver and OnChunk are set by Push.
	Pack format.PackOptions
	// OnBytes, if set, is called with the logical bytes of every chunk
	// processed (for a progress bar).
	OnBytes func(n int64)
	// NoChunkIndex turns off the registry chunk index lookups.
	NoChunkIndex bool
}

// PushResult says what Push did.
type PushResult struct {
	Descriptor ocispec.Descriptor `json:"descriptor"`
	Stats      *format.PackStats  `json:"stats"`
	// ChunkIndexHits counts chunks the registry's chunk index supplied.
	ChunkIndexHits int64   `json:"chunkIndexHits"`
	Seconds        float64 `json:"seconds"`
}

// Push packs the image dir dir straight into repo (no copy of the image on
// disk), uploading only the chunk blobs the registry lacks, and tags the
// snapshot. The index is pushed last, after every manifest and blob it
// needs, so a failed push leaves no visible snapshot.
func Push(ctx context.Context, dir string, repo *remote.Repository, tag string, opts PushOptions) (*PushResult, error) {
	start := time.Now()
	popts := opts.Pack
	var resolver *indexResolver
	if !opts.NoChunkIndex {
		resolver = &indexResolver{repo: repo, base: BaseURL(repo)}
		popts.Resolver = resolver
	}
	if opts.OnBytes != nil {
		popts.OnChunk = func(c format.Chunk, _ bool) { opts.OnBytes(c.Size) }
	}
	desc, st, err := format.Pack(ctx, dir, repo, popts)
	if err != nil {
		return nil, explain(fmt.Errorf("push %s to %s: %w", dir, repo.Reference, err), repo)
	}
	if err := repo.Tag(ctx, desc, tag); err != nil {
		return nil, fmt.Errorf("tag %s: %w", tag, err)
	}
	res := &PushResult{Descriptor: desc, Stats: st, Seconds: time.Since(start).Seconds()}
	if resolver != nil {
		res.ChunkIndexHits = resolver.hits.Load()
	}
	return res, nil
}

// DirSize is the total size of the regular files under dir.
func DirSize(dir string) (int64, error) {
	_, n, err := dirStats(dir)
	return n, err
}

// dirStats counts the regular files under dir and their total size.
func dirStats(dir string) (files int, size int64, err error) {
	err = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			info, err := d.Info()
			if err != nil {
				return err
			}
			files++
			size += info.Size()
		}
		return nil
	})
	return files, size, err
}
