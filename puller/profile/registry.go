package profile

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/errdef"
	"oras.land/oras-go/v2/registry"
)

// Annotations of a profile's manifest: its ranges and bytes, so that a
// listing tells them without fetching the profile.
const (
	AnnotationRanges = "vnd.cryo.profile.ranges"
	AnnotationBytes  = "vnd.cryo.profile.bytes"
)

// maxManifestSize bounds a profile manifest's bytes: one layer, a subject
// and a few annotations.
const maxManifestSize = 64 << 10

// MaxMerged is how many of a snapshot's profiles Lookup merges, the
// newest first.
const MaxMerged = 8

// Repository is what profiles need of a registry repository
// (oras-go's remote.Repository): pushing, fetching and listing referrers
// (remote.Repository falls back to the referrers tag schema where the
// referrers API is missing).
type Repository interface {
	content.Storage
	content.Resolver
	registry.ReferrerLister
}

// Push stores p in repo as an artifact whose subject is the snapshot
// index subject, and returns its manifest's descriptor. p must be of that
// snapshot.
func Push(ctx context.Context, repo content.Pusher, subject ocispec.Descriptor, p *Profile, created time.Time) (ocispec.Descriptor, error) {
	if p.Subject != subject.Digest {
		return ocispec.Descriptor{}, fmt.Errorf("profile is of snapshot %s, not %s: %w", p.Subject, subject.Digest, ErrInvalid)
	}
	data, err := p.Encode()
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	layer := content.NewDescriptorFromBytes(MediaType, data)
	if err := repo.Push(ctx, layer, bytes.NewReader(data)); err != nil && !errors.Is(err, errdef.ErrAlreadyExists) {
		return ocispec.Descriptor{}, fmt.Errorf("push profile blob: %w", err)
	}
	sub := ocispec.Descriptor{MediaType: subject.MediaType, Digest: subject.Digest, Size: subject.Size}
	desc, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, ArtifactType, oras.PackManifestOptions{
		Subject: &sub,
		Layers:  []ocispec.Descriptor{layer},
		ManifestAnnotations: map[string]string{
			ocispec.AnnotationCreated: created.UTC().Format(time.RFC3339),
			AnnotationRanges:          strconv.Itoa(len(p.Ranges)),
			AnnotationBytes:           strconv.FormatInt(p.Bytes(), 10),
		},
	})
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("push profile manifest: %w", err)
	}
	return desc, nil
}

// List returns the descriptors of snapshot subject's profiles in repo,
// newest first (by their created annotation, as the registry reports it:
// an order, not a trust decision).
func List(ctx context.Context, repo registry.ReferrerLister, subject ocispec.Descriptor) ([]ocispec.Descriptor, error) {
	var out []ocispec.Descriptor
	err := repo.Referrers(ctx, subject, ArtifactType, func(rs []ocispec.Descriptor) error {
		for _, d := range rs {
			if d.ArtifactType == ArtifactType {
				out = append(out, d)
			}
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list the profiles of %s: %w", subject.Digest, err)
	}
	sort.SliceStable(out, func(i, j int) bool {
		return out[i].Annotations[ocispec.AnnotationCreated] > out[j].Annotations[ocispec.AnnotationCreated]
	})
	return out, nil
}

// Fetch reads the profile whose manifest is desc from repo, verifying both
// the manifest and the profile by digest and refusing one whose subject
// is not subject (in its manifest or in the profile itself).
func Fetch(ctx context.Context, repo content.Fetcher, desc ocispec.Descriptor, subject digest.Digest) (*Profile, error) {
	if desc.Size > maxManifestSize {
		return nil, fmt.Errorf("profile manifest %s: %d bytes, over %d: %w", desc.Digest, desc.Size, maxManifestSize, ErrInvalid)
	}
	if desc.MediaType == "" {
		desc.MediaType = ocispec.MediaTypeImageManifest
	}
	data, err := content.FetchAll(ctx, repo, desc) // verified: size and digest
	if err != nil {
		return nil, fmt.Errorf("fetch profile manifest %s: %w", desc.Digest, err)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("profile manifest %s: %v: %w", desc.Digest, err, ErrInvalid)
	}
	switch {
	case m.ArtifactType != ArtifactType:
		return nil, fmt.Errorf("manifest %s: artifactType %q, not a profile: %w", desc.Digest, m.ArtifactType, ErrInvalid)
	case m.Subject == nil || m.Subject.Digest != subject:
		return nil, fmt.Errorf("profile %s is not of snapshot %s: %w", desc.Digest, subject, ErrInvalid)
	case len(m.Layers) != 1 || m.Layers[0].MediaType != MediaType:
		return nil, fmt.Errorf("profile manifest %s: want one layer of %s: %w", desc.Digest, MediaType, ErrInvalid)
	case m.Layers[0].Size > MaxSize:
		return nil, fmt.Errorf("profile %s: %d bytes, over %d: %w", desc.Digest, m.Layers[0].Size, MaxSize, ErrInvalid)
	}
	doc, err := content.FetchAll(ctx, repo, m.Layers[0])
	if err != nil {
		return nil, fmt.Errorf("fetch profile %s: %w", desc.Digest, err)
	}
	p, err := Parse(doc)
	if err != nil {
		return nil, fmt.Errorf("profile %s: %w", desc.Digest, err)
	}
	if p.Subject != subject {
		return nil, fmt.Errorf("profile %s names snapshot %s, its manifest %s: %w", desc.Digest, p.Subject, subject, ErrInvalid)
	}
	return p, nil
}

// Info says which profile a restore uses.
type Info struct {
	// Digest is the profile's manifest digest, or a local file's sha256;
	// for several merged, the newest's.
	Digest digest.Digest `json:"digest"`
	// Merged is how many profiles were merged into it (1: one).
	Merged int `json:"merged"`
	// Ranges and Bytes are the merged profile's.
	Ranges int   `json:"ranges"`
	Bytes  int64 `json:"bytes"`
}

// Finder finds the profile of a snapshot to replay. Find returns nil and
// no error when there is none; its warnings are about profiles it found
// and ignored (corrupt, oversize, of another snapshot).
type Finder interface {
	Find(ctx context.Context, subject ocispec.Descriptor) (*Profile, Info, []string, error)
}

// Auto finds the profiles of a snapshot in its repository and merges the
// newest MaxMerged that are valid.
type Auto struct{ Repo Repository }

// Find implements Finder. Profiles are fetched MaxMerged at a time, at
// once: each is two round trips.
func (a Auto) Find(ctx context.Context, subject ocispec.Descriptor) (*Profile, Info, []string, error) {
	descs, err := List(ctx, a.Repo, subject)
	if err != nil {
		return nil, Info{}, nil, err
	}
	// A listing of many bad profiles costs a bounded number of fetches.
	descs = descs[:min(len(descs), 2*MaxMerged)]
	var ps []*Profile
	var warnings []string
	var info Info
	for len(descs) > 0 && len(ps) < MaxMerged {
		batch := descs[:min(len(descs), MaxMerged-len(ps))]
		descs = descs[len(batch):]
		got := make([]*Profile, len(batch))
		errs := make([]error, len(batch))
		var wg sync.WaitGroup
		for i, d := range batch {
			wg.Add(1)
			go func() {
				defer wg.Done()
				got[i], errs[i] = Fetch(ctx, a.Repo, d, subject.Digest)
			}()
		}
		wg.Wait()
		for i, d := range batch {
			if errs[i] != nil {
				warnings = append(warnings, fmt.Sprintf("profile %s ignored: %v", d.Digest, errs[i]))
				continue
			}
			if len(ps) == 0 {
				info.Digest = d.Digest
			}
			ps = append(ps, got[i])
		}
	}
	m := merged(ps)
	return m, info.of(m, len(ps)), warnings, nil
}

// ByDigest finds the profile whose manifest has this digest in the
// snapshot's repository.
type ByDigest struct {
	Repo   Repository
	Digest digest.Digest
}

// Find implements Finder.
func (b ByDigest) Find(ctx context.Context, subject ocispec.Descriptor) (*Profile, Info, []string, error) {
	desc, err := b.Repo.Resolve(ctx, b.Digest.String())
	if err != nil {
		return nil, Info{}, nil, fmt.Errorf("profile %s: %w", b.Digest, err)
	}
	// The size is the registry's word; the digest is checked on fetch.
	desc.Digest = b.Digest
	p, err := Fetch(ctx, b.Repo, desc, subject.Digest)
	if err != nil {
		return nil, Info{}, nil, err
	}
	info := Info{Digest: b.Digest}
	return p, info.of(p, 1), nil, nil
}

// File is a profile in a local file.
type File string

// Find implements Finder.
func (f File) Find(ctx context.Context, subject ocispec.Descriptor) (*Profile, Info, []string, error) {
	data, err := ReadFile(string(f))
	if err != nil {
		return nil, Info{}, nil, err
	}
	p, err := Parse(data)
	if err != nil {
		return nil, Info{}, nil, fmt.Errorf("%s: %w", f, err)
	}
	if p.Subject != subject.Digest {
		return nil, Info{}, nil, fmt.Errorf("%s is a profile of snapshot %s, not %s: %w", f, p.Subject, subject.Digest, ErrInvalid)
	}
	info := Info{Digest: digest.FromBytes(data)}
	return p, info.of(p, 1), nil, nil
}

// ReadFile reads a profile file, at most MaxSize bytes of it.
func ReadFile(path string) ([]byte, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("profile: %w", err)
	}
	defer fh.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(fh, MaxSize+1)); err != nil {
		return nil, fmt.Errorf("profile %s: %w", path, err)
	}
	if buf.Len() > MaxSize {
		return nil, fmt.Errorf("profile %s: over %d bytes: %w", path, MaxSize, ErrInvalid)
	}
	return buf.Bytes(), nil
}

// merged merges ps (nil for none, the one for one).
func merged(ps []*Profile) *Profile {
	switch len(ps) {
	case 0:
		return nil
	case 1:
		return ps[0]
	}
	return Merge(ps...)
}

// of fills in i for the profile p, merged from n (nil: none).
func (i Info) of(p *Profile, n int) Info {
	if p == nil {
		return Info{}
	}
	i.Merged, i.Ranges, i.Bytes = n, len(p.Ranges), p.Bytes()
	return i
}
