package registry

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// Distribution's pull-through cache fetches a blob from the remote once per
// request while another request for the same blob is still fetching it
// ("served from the remote directly" for every concurrent request). When a
// region's nodes restore the same new snapshot at once, every chunk would
// cross the inter-region link once per node instead of once per mirror.
// fillMirror puts concurrent first requests for a blob behind one fetch
// into the mirror's storage; they are then served from there.

// mirrorFillTimeout bounds one blob's fetch from the upstream registry.
const mirrorFillTimeout = 10 * time.Minute

// fillMirror fetches blob ref of repo into the mirror's storage unless it
// is there, once however many requests ask at the same time. It reports
// whether the caller should serve the request now rather than pass it on
// (the fetch ended; the request was not cancelled); errors are left to the
// request itself, which distribution then answers.
func (s *Server) fillMirror(r *http.Request, repo, ref string) bool {
	ctx := r.Context()
	// On filesystem storage serveBlobFile has just found the blob missing;
	// elsewhere look first.
	if s.driver.Name() != "filesystem" {
		d, derr := digest.Parse(ref)
		named, nerr := reference.WithName(repo)
		if derr != nil || nerr != nil {
			return false
		}
		if local, err := s.ns.Repository(ctx, named); err == nil {
			if _, err := local.Blobs(ctx).Stat(ctx, d); err == nil {
				return false
			}
		}
	}
	ch := s.mirrorFills.DoChan(repo+"@"+ref, func() (_ any, err error) {
		// singleflight re-panics in a goroutine of its own, which would
		// end the process: a fill that panics fails only its requests.
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("mirror fill of %s@%s: %v", repo, ref, r)
				s.log.Error("mirror fill panicked", "repository", repo, "digest", ref, "panic", r)
			}
		}()
		// The fetch outlives the request that started it (others wait on
		// it), but not a stalled upstream.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), mirrorFillTimeout)
		defer cancel()
		fill := r.Clone(fctx)
		fill.Method = http.MethodGet
		fill.Header.Del("Range")
		s.app.ServeHTTP(discardWriter{header: http.Header{}}, fill)
		return nil, nil
	})
	select {
	case <-ch:
		return true
	case <-ctx.Done():
		return false
	}
}

// discardWriter is a ResponseWriter that keeps nothing: a mirror fill's
// response is the blob stored, not bytes for anyone.
type discardWriter struct{ header http.Header }

func (d discardWriter) Header() http.Header       { return d.header }
func (discardWriter) Write(b []byte) (int, error) { return len(b), nil }
func (discardWriter) WriteHeader(int)             {}
