package puller

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote"
)

// ResolveOptions say where Resolve looks.
type ResolveOptions struct {
	// Mirrors are registries (host[:port]) that hold copies of the
	// primary's snapshots under the same repository names, tried in order
	// before the primary for everything fetched by digest. They are never
	// asked what a tag means.
	Mirrors []string
	// Client reaches the registries (default: a new transfer.Client with
	// default options). Explicit credentials in it go only to the
	// registry they are for, never to a mirror.
	Client *transfer.Client
}

// Resolve turns a reference ("host[:port]/repo[:tag|@digest]") into a
// Source whose endpoints are the mirrors, in order, then the registry the
// reference names (the primary).
//
// Only the primary says what a tag means: a tag is resolved there, and if
// the primary cannot answer, the tag does not resolve, whatever a mirror
// holds under it. A reference by digest needs no trust: the index is read
// from the first endpoint that serves bytes of that digest, so it resolves
// through the mirrors alone when the primary is down.
func Resolve(ctx context.Context, ref string, opts ResolveOptions) (Source, error) {
	parsed, err := transfer.ParseReference(ref)
	if err != nil {
		return Source{}, err
	}
	client := opts.Client
	if client == nil {
		if client, err = transfer.NewClient(transfer.ClientOptions{}); err != nil {
			return Source{}, err
		}
	}
	primary, _, err := client.Repository(parsed.String())
	if err != nil {
		return Source{}, err
	}
	withMirrors := func(digest.Digest) ([]fetch.Endpoint, error) {
		return endpoints(client, parsed.Registry, parsed.Repository, primary, opts.Mirrors)
	}

	if d, err := parsed.Digest(); err == nil {
		if err := d.Validate(); err != nil {
			return Source{}, fmt.Errorf("reference %q: %w", ref, err)
		}
		eps, err := withMirrors(d)
		if err != nil {
			return Source{}, err
		}
		desc, err := fetch.FirstOf(ctx, eps, func(ctx context.Context, ep fetch.Endpoint) (ocispec.Descriptor, error) {
			return resolveDigest(ctx, ep, d)
		})
		if err != nil {
			return Source{}, fmt.Errorf("resolve %s: %w", ref, err)
		}
		return Source{Index: desc, Endpoints: eps, Repository: parsed.Registry + "/" + parsed.Repository}, nil
	}

	desc, err := primary.Resolve(ctx, parsed.Reference)
	if err != nil {
		return Source{}, fmt.Errorf("resolve tag %q at %s, the registry %s names (only it says what a tag means; mirrors are asked for digests only): %w",
			parsed.Reference, parsed.Registry, ref, err)
	}
	if err := desc.Digest.Validate(); err != nil {
		return Source{}, fmt.Errorf("resolve %s: %s answered digest %q: %w", ref, parsed.Registry, desc.Digest, err)
	}
	eps, err := withMirrors(desc.Digest)
	if err != nil {
		return Source{}, err
	}
	return Source{Index: desc, Endpoints: eps, Repository: parsed.Registry + "/" + parsed.Repository}, nil
}

// Endpoints returns the endpoints of repository ("host[:port]/name") for
// fetches by digest: the mirrors, in order, then its registry. They are
// what a node that serves its peers (Options.PeerUpstream) fetches from.
func Endpoints(repository string, opts ResolveOptions) ([]fetch.Endpoint, error) {
	parsed, err := transfer.ParseReference(repository)
	if err != nil {
		return nil, err
	}
	if parsed.Reference != transfer.DefaultTag || strings.ContainsAny(repository[strings.LastIndex(repository, "/")+1:], ":@") {
		return nil, fmt.Errorf("repository %q: want host[:port]/name, without a tag or digest", repository)
	}
	client := opts.Client
	if client == nil {
		if client, err = transfer.NewClient(transfer.ClientOptions{}); err != nil {
			return nil, err
		}
	}
	primary, _, err := client.Repository(parsed.String())
	if err != nil {
		return nil, err
	}
	return endpoints(client, parsed.Registry, parsed.Repository, primary, opts.Mirrors)
}

// endpoints are the mirrors of repository name, then primary, its
// registry's.
func endpoints(client *transfer.Client, registry, name string, primary *remote.Repository, mirrors []string) ([]fetch.Endpoint, error) {
	eps := make([]fetch.Endpoint, 0, len(mirrors)+1)
	for _, m := range mirrors {
		repo, _, err := client.Repository(m + "/" + name)
		if err != nil {
			return nil, fmt.Errorf("mirror %s: %w", m, err)
		}
		eps = append(eps, fetch.Endpoint{Name: m, Store: transfer.Ranged{Repository: repo}})
	}
	return append(eps, fetch.Endpoint{Name: registry, Store: transfer.Ranged{Repository: primary}}), nil
}

// resolveDigest reads the manifest d from ep, checks that its bytes hash
// to d, and returns its descriptor, its media type taken from the
// verified bytes (an endpoint's headers are not trusted).
func resolveDigest(ctx context.Context, ep fetch.Endpoint, d digest.Digest) (ocispec.Descriptor, error) {
	type referenceFetcher interface {
		FetchReference(ctx context.Context, reference string) (ocispec.Descriptor, io.ReadCloser, error)
	}
	rf, ok := ep.Store.(referenceFetcher)
	if !ok {
		return ocispec.Descriptor{}, errors.New("endpoint cannot fetch a manifest by reference")
	}
	desc, rc, err := rf.FetchReference(ctx, d.String())
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, format.MaxManifestSize+1))
	if err != nil {
		return ocispec.Descriptor{}, fmt.Errorf("read manifest %s: %w", d, err)
	}
	if len(data) > format.MaxManifestSize {
		return ocispec.Descriptor{}, fmt.Errorf("manifest %s: over %d bytes: %w", d, format.MaxManifestSize, format.ErrTooLarge)
	}
	if got := d.Algorithm().FromBytes(data); got != d {
		return ocispec.Descriptor{}, fmt.Errorf("manifest %s: served bytes hash to %s: %w", d, got, format.ErrDigestMismatch)
	}
	var head struct {
		MediaType string `json:"mediaType"`
	}
	if err := json.Unmarshal(data, &head); err == nil && head.MediaType != "" {
		desc.MediaType = head.MediaType
	}
	desc.Digest, desc.Size = d, int64(len(data))
	return desc, nil
}
