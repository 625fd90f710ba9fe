package transfer

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/cryo-oci/cryo/format"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/errdef"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
)

// Ranged is a repository that also reads byte ranges of its blobs
// (format.RangeFetcher), as format v2 reads chunk frames out of packs.
// oras-go's blob reader seeks with an open-ended Range and must then be
// closed before its end, which drops the connection; a bounded Range
// keeps it for the next request.
type Ranged struct {
	*remote.Repository
}

var _ format.RangeFetcher = Ranged{}

// FetchRange returns exactly the n bytes at off of blob desc: from a 206
// answer to `Range: bytes=off-(off+n-1)`, or, from a registry or mirror
// that ignores Range and sends the whole blob (200), by skipping to off.
func (r Ranged) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	if off < 0 || n <= 0 || (desc.Size > 0 && off+n > desc.Size) {
		return nil, fmt.Errorf("range [%d,+%d) of blob %s of %d bytes: %w", off, n, desc.Digest, desc.Size, format.ErrInvalid)
	}
	ref := r.Reference
	ctx = auth.AppendRepositoryScope(ctx, ref, auth.ActionPull)
	url := fmt.Sprintf("%s/v2/%s/blobs/%s", BaseURL(r.Repository), ref.Repository, desc.Digest)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Range", fmt.Sprintf("bytes=%d-%d", off, off+n-1))
	resp, err := r.Client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch %s range [%d,+%d): %w", desc.Digest, off, n, err)
	}
	body := resp.Body
	switch resp.StatusCode {
	case http.StatusPartialContent:
		if start, ok := rangeStart(resp.Header.Get("Content-Range")); !ok || start != off {
			body.Close()
			return nil, fmt.Errorf("fetch %s range [%d,+%d): answered Content-Range %q", desc.Digest, off, n, resp.Header.Get("Content-Range"))
		}
	case http.StatusOK:
		// The whole blob: skip to the range (a registry without Range).
		if _, err := io.CopyN(io.Discard, body, off); err != nil {
			body.Close()
			return nil, fmt.Errorf("fetch %s: skip to %d of the whole blob: %w", desc.Digest, off, err)
		}
	case http.StatusNotFound:
		body.Close()
		return nil, fmt.Errorf("fetch %s: %w", desc.Digest, errdef.ErrNotFound)
	default:
		body.Close()
		return nil, fmt.Errorf("fetch %s range [%d,+%d): %s %s: %s", desc.Digest, off, n, req.Method, url, resp.Status)
	}
	return limitedBody{Reader: io.LimitReader(body, n), body: body}, nil
}

// limitedBody reads the range and, on Close, drains what little is left
// of a 206 body so that its connection can be reused.
type limitedBody struct {
	io.Reader
	body io.ReadCloser
}

func (b limitedBody) Close() error {
	io.CopyN(io.Discard, b.body, 4096)
	return b.body.Close()
}

// rangeStart parses the first byte of a Content-Range "bytes a-b/size".
func rangeStart(h string) (int64, bool) {
	h, ok := strings.CutPrefix(h, "bytes ")
	if !ok {
		return 0, false
	}
	a, _, ok := strings.Cut(h, "-")
	if !ok {
		return 0, false
	}
	v, err := strconv.ParseInt(a, 10, 64)
	return v, err == nil
}
