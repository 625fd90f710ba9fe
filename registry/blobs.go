package registry

import (
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// serveBlobFile serves a blob GET or HEAD from filesystem storage with
// sendfile, after distribution's own storage API has checked that the blob
// is linked in the repository. distribution v3 reads every blob through a
// freshly allocated 4 MiB bufio.Reader and copies it in user space, which
// for a puller's many 1 MiB chunk requests costs more CPU than the bytes
// (measured: 1.3 ms of server CPU per chunk request, against 0.3 ms here).
// It reports false, having written nothing, when the request should go to
// distribution instead: other storage drivers, a blob a mirror has not
// fetched from upstream yet (fillMirror runs first), or any error, which distribution then reports in its
// own format. Blob pull notifications are not sent for blobs served here.
func (s *Server) serveBlobFile(w http.ResponseWriter, r *http.Request, repo, ref string) bool {
	if s.driver.Name() != "filesystem" {
		return false
	}
	d, err := digest.Parse(ref)
	if err != nil {
		return false
	}
	named, err := reference.WithName(repo)
	if err != nil {
		return false
	}
	if !s.authorize(w, r, repo) {
		return true
	}
	ctx := r.Context()
	repository, err := s.ns.Repository(ctx, named)
	if err != nil {
		return false
	}
	desc, err := repository.Blobs(ctx).Stat(ctx, d)
	if err != nil {
		return false
	}
	rc, err := s.driver.Reader(ctx, distlayout.BlobDataPath(desc.Digest), 0)
	if err != nil {
		return false
	}
	f, ok := rc.(*os.File)
	if !ok {
		rc.Close()
		return false
	}
	defer f.Close()
	h := w.Header()
	h.Set("ETag", fmt.Sprintf(`"%s"`, desc.Digest))
	h.Set("Cache-Control", "max-age=31536000")
	h.Set("Docker-Content-Digest", desc.Digest.String())
	h.Set("Content-Type", "application/octet-stream")
	http.ServeContent(w, r, "", time.Time{}, f)
	return true
}
