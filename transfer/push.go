package transfer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path/filepath"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/errdef"
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
	// Base names (by tag or digest) a format v2 snapshot in the same
	// repository whose packs the new one may reference, storing only the
	// chunks the base lacks. Empty: the tag pushed to, if it names a v2
	// snapshot, else the v2 snapshot the registry stored last in the
	// repository (SPEC.md 12.6), else the newest v2 snapshot among the
	// repository's last tags (SPEC.md 15.4). Only for Pack.Format V2.
	Base string
	// NoBase turns the base off: every chunk goes into new packs.
	NoBase bool
}

// PushResult says what Push did.
type PushResult struct {
	Descriptor ocispec.Descriptor `json:"descriptor"`
	Stats      *format.PackStats  `json:"stats"`
	// ChunkIndexHits counts chunks the registry's chunk index supplied.
	ChunkIndexHits int64 `json:"chunkIndexHits"`
	// Base is the snapshot whose packs a v2 push reused, if any.
	Base    *ocispec.Descriptor `json:"base,omitempty"`
	Seconds float64             `json:"seconds"`
}

// Push packs the image dir dir straight into repo (no copy of the image on
// disk), uploading only the chunk blobs the registry lacks, and tags the
// snapshot. The index is pushed last, after every manifest and blob it
// needs, so a failed push leaves no visible snapshot.
func Push(ctx context.Context, dir string, repo *remote.Repository, tag string, opts PushOptions) (*PushResult, error) {
	start := time.Now()
	popts, resolver := packOptions(repo, opts)
	base, err := useBase(ctx, repo, tag, opts, &popts)
	if err != nil {
		return nil, err
	}
	desc, st, err := format.Pack(ctx, dir, repo, popts)
	if err != nil {
		return nil, explain(fmt.Errorf("push %s to %s: %w", dir, repo.Reference, err), repo)
	}
	if err := repo.Tag(ctx, desc, tag); err != nil {
		return nil, fmt.Errorf("tag %s: %w", tag, err)
	}
	res := &PushResult{Descriptor: desc, Stats: st, Base: base, Seconds: time.Since(start).Seconds()}
	if resolver != nil {
		res.ChunkIndexHits = resolver.hits.Load()
	}
	return res, nil
}

// useBase sets popts' resolver to the frames of the base snapshot of a
// format v2 push and returns the base's descriptor, or nil if there is
// none. The base is the snapshot opts.Base names; by default, the v2
// snapshot tag names now, else the v2 snapshot the registry says it stored
// last in the repository (SPEC.md 12.6), else, on a registry that cannot
// say, the newest v2 snapshot among the repository's last tags, so that a
// pause pushed under a new tag still references the packs of the one
// before. A base is only
// ever taken from the repository pushed to: a pack holds other chunks of
// the snapshot it was made for, and the new snapshot's readers may read
// every pack it lists.
func useBase(ctx context.Context, repo *remote.Repository, tag string, opts PushOptions, popts *format.PackOptions) (*ocispec.Descriptor, error) {
	if popts.Format != format.V2 || opts.NoBase {
		if opts.Base != "" && !opts.NoBase {
			return nil, fmt.Errorf("a base snapshot (%s) is only used by format v2 pushes", opts.Base)
		}
		return nil, nil
	}
	if opts.Base != "" {
		if strings.Contains(opts.Base, "/") {
			return nil, fmt.Errorf("base %q: name a tag or digest of %s only: packs are never shared across repositories", opts.Base, repo.Reference.Repository)
		}
		desc, err := repo.Resolve(ctx, opts.Base)
		if err != nil {
			return nil, explain(fmt.Errorf("base %s: %w", opts.Base, err), repo)
		}
		snap, err := format.LoadSnapshot(ctx, repo, desc)
		if err != nil {
			return nil, fmt.Errorf("base %s: %w", opts.Base, err)
		}
		if snap.Version != format.V2 {
			return nil, fmt.Errorf("base %s is a format %s snapshot: only v2 packs can be reused", opts.Base, snap.Version)
		}
		return loadBase(ctx, repo, desc, snap, opts.Base, popts)
	}
	// The default: whatever fails here just means no base (a first push).
	if tag != "" && !strings.Contains(tag, "/") {
		if desc, err := repo.Resolve(ctx, tag); err == nil {
			if snap, err := format.LoadSnapshot(ctx, repo, desc); err == nil && snap.Version == format.V2 {
				return loadBase(ctx, repo, desc, snap, tag, popts)
			}
		} else if !errors.Is(err, errdef.ErrNotFound) {
			// Not a base the user named: the tag is looked up to find
			// one, so say that, not "base TAG".
			return nil, explain(fmt.Errorf("look up %s:%s (its snapshot would be the push's base): %w", repo.Reference.Repository, tag, err), repo)
		}
	}
	if !opts.NoChunkIndex {
		desc, err := api.LatestSnapshot(ctx, repo.Client, BaseURL(repo), repo.Reference.Repository)
		switch {
		case err == nil:
			snap, err := format.LoadSnapshot(ctx, repo, desc)
			if err != nil || snap.Version != format.V2 {
				return nil, nil
			}
			base, err := loadBase(ctx, repo, desc, snap, desc.Digest.String(), popts)
			if err != nil {
				return nil, nil
			}
			return base, nil
		case errors.Is(err, api.ErrNoBase):
			// cryo's registry knows the repository holds no v2 snapshot.
			return nil, nil
		}
	}
	// A registry without the extension: the newest v2 snapshot among the
	// repository's last tags.
	desc, snap, ok := newestTaggedV2(ctx, repo, tag)
	if !ok {
		return nil, nil
	}
	if base, err := loadBase(ctx, repo, desc, snap, desc.Digest.String(), popts); err == nil {
		return base, nil
	}
	return nil, nil
}

// loadBase loads the tables of snap (of desc, named name) and makes them
// popts' resolver.
func loadBase(ctx context.Context, repo *remote.Repository, desc ocispec.Descriptor, snap *format.Snapshot, name string, popts *format.PackOptions) (*ocispec.Descriptor, error) {
	tables, err := format.LoadTables(ctx, repo, snap)
	if err != nil {
		return nil, fmt.Errorf("base %s: %w", name, err)
	}
	popts.Resolver = format.NewTableResolver(tables)
	return &desc, nil
}

// Pusher packs an image dir given as one stream per file straight into a
// repository, uploading only the chunk blobs the registry lacks (as
// Push), and tags the snapshot once every file is in: what `cryo
// checkpoint` does while the sentry writes its files. A Pusher that is not
// finished leaves no tag.
type Pusher struct {
	repo     *remote.Repository
	pk       *format.Packer
	resolver *indexResolver
	base     *ocispec.Descriptor
	start    time.Time
	// index and stats, once the index is pushed: Finish tries the tag
	// again without packing again.
	index *ocispec.Descriptor
	stats *format.PackStats
}

// NewPusher returns a Pusher into repo of a snapshot to be tagged tag
// (whose v2 snapshot, if any, is its base unless opts names another).
// Call Close when done with it.
func NewPusher(ctx context.Context, repo *remote.Repository, tag string, opts PushOptions) (*Pusher, error) {
	popts, resolver := packOptions(repo, opts)
	base, err := useBase(ctx, repo, tag, opts, &popts)
	if err != nil {
		return nil, err
	}
	pk, err := format.NewPacker(repo, popts)
	if err != nil {
		return nil, err
	}
	return &Pusher{repo: repo, pk: pk, resolver: resolver, base: base, start: time.Now()}, nil
}

// AddFile packs the file at path from r, read to its end, pushing its
// chunks and manifests as they come; it returns the file's size. Files
// may be added concurrently.
func (p *Pusher) AddFile(ctx context.Context, path string, mode fs.FileMode, r io.Reader) (int64, error) {
	n, err := p.pk.AddFile(ctx, path, mode, r)
	if err != nil {
		return n, explain(fmt.Errorf("push %s to %s: %w", path, p.repo.Reference, err), p.repo)
	}
	return n, nil
}

// Finish pushes the snapshot index, checks that the registry has it, and
// then, only then, tags it. It may be called again after it failed: the
// index is pushed once, the check and the tag are tried again. A snapshot
// that cannot be finished (a file failed, or is still being added) is an
// error that wraps format.ErrInvalid; trying again does not help.
func (p *Pusher) Finish(ctx context.Context, tag string) (*PushResult, error) {
	if p.index == nil {
		desc, st, err := p.pk.Finish(ctx)
		if err != nil {
			return nil, explain(fmt.Errorf("push to %s: %w", p.repo.Reference, err), p.repo)
		}
		p.index, p.stats = &desc, st
	}
	desc, st := *p.index, p.stats
	if _, err := p.repo.Resolve(ctx, desc.Digest.String()); err != nil {
		return nil, fmt.Errorf("snapshot index %s not in the registry after its push: %w", desc.Digest, err)
	}
	if err := p.repo.Tag(ctx, desc, tag); err != nil {
		return nil, fmt.Errorf("tag %s: %w", tag, err)
	}
	res := &PushResult{Descriptor: desc, Stats: st, Base: p.base, Seconds: time.Since(p.start).Seconds()}
	if p.resolver != nil {
		res.ChunkIndexHits = p.resolver.hits.Load()
	}
	return res, nil
}

// Close releases the Pusher's encoders.
func (p *Pusher) Close() { p.pk.Close() }

// packOptions are opts' packing options with Push's chunk index resolver
// (nil with NoChunkIndex) and progress callback set.
func packOptions(repo *remote.Repository, opts PushOptions) (format.PackOptions, *indexResolver) {
	popts := opts.Pack
	var resolver *indexResolver
	// The chunk index names v1 blobs; a v2 push reuses its base's packs
	// and has the registry compose packs of chunks held elsewhere.
	switch {
	case opts.NoChunkIndex:
	case popts.Format == format.V2:
		popts.Composer = &packComposer{repo: repo, base: BaseURL(repo)}
	default:
		resolver = &indexResolver{repo: repo, base: BaseURL(repo)}
		popts.Resolver = resolver
	}
	if opts.OnBytes != nil {
		popts.OnChunk = func(c format.Chunk, _ bool) { opts.OnBytes(c.Size) }
	}
	return popts, resolver
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
