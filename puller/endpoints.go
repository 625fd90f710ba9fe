package puller

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/cryo-oci/cryo/puller/fetch"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// failover is a content.Fetcher over endpoints in order: the first one that
// answers serves (manifests and tables are verified by digest by their
// readers, so a bad endpoint is caught there).
type failover []fetch.Endpoint

func (f failover) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	var errs []string
	for _, ep := range f {
		rc, err := ep.Store.Fetch(ctx, desc)
		if err == nil {
			return rc, nil
		}
		errs = append(errs, fmt.Sprintf("%s: %v", ep.Name, err))
	}
	if len(errs) == 0 {
		return nil, errors.New("no endpoints")
	}
	return nil, fmt.Errorf("fetch %s: %s", desc.Digest, strings.Join(errs, "; "))
}
