package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/oci"
)

// layoutRef is an OCI layout dir and a tag or digest in it.
type layoutRef struct {
	dir       string
	reference string // tag or digest
}

// parseLayoutRef splits "DIR[:TAG|@DIGEST]". A DIR that exists as given is
// taken whole, so paths holding ':' still work.
func parseLayoutRef(s string) layoutRef {
	if i := strings.LastIndex(s, "@"); i > 0 {
		if _, err := digest.Parse(s[i+1:]); err == nil {
			return layoutRef{dir: s[:i], reference: s[i+1:]}
		}
	}
	if _, err := os.Stat(s); err == nil {
		return layoutRef{dir: s, reference: transfer.DefaultTag}
	}
	if i := strings.LastIndex(s, ":"); i > 0 && !strings.Contains(s[i+1:], "/") {
		return layoutRef{dir: s[:i], reference: s[i+1:]}
	}
	return layoutRef{dir: s, reference: transfer.DefaultTag}
}

func (r layoutRef) String() string {
	if strings.Contains(r.reference, ":") {
		return r.dir + "@" + r.reference
	}
	return r.dir + ":" + r.reference
}

// isLayout reports whether arg names an existing OCI image layout.
func isLayout(arg string) bool {
	_, err := os.Stat(parseLayoutRef(arg).dir + "/oci-layout")
	return err == nil
}

// openSource opens arg as an OCI layout if one exists there, else as a
// registry reference, and resolves it.
func openSource(ctx context.Context, arg string, ro *remoteOptions) (content.ReadOnlyStorage, ocispec.Descriptor, error) {
	if isLayout(arg) {
		return openLayout(ctx, arg)
	}
	repo, ref, err := ro.repository(arg)
	if err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("%s is neither an OCI layout nor a registry reference: %w", arg, err)
	}
	desc, err := repo.Resolve(ctx, ref)
	if err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("resolve %s: %w", arg, err)
	}
	// Ranged: format v2 reads frames of packs by bounded range requests.
	return transfer.Ranged{Repository: repo}, desc, nil
}

// openLayout opens an existing OCI layout read-only and resolves the ref.
func openLayout(ctx context.Context, arg string) (content.ReadOnlyStorage, ocispec.Descriptor, error) {
	ref := parseLayoutRef(arg)
	if _, err := os.Stat(ref.dir + "/oci-layout"); err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("%s is not an OCI image layout: %w", ref.dir, err)
	}
	store, err := oci.NewFromFS(ctx, os.DirFS(ref.dir))
	if err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("open layout %s: %w", ref.dir, err)
	}
	desc, err := store.Resolve(ctx, ref.reference)
	if err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("resolve %s: %w", ref, err)
	}
	return store, desc, nil
}
