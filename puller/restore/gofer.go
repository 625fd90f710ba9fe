package restore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/opencontainers/go-digest"
)

// goferMount is a snapshot served to cryo's checkpoint gofer by this
// process: a MountFiles mount, the file API on a private unix socket,
// and an image dir holding only gcs_opts.json that names them.
type goferMount struct {
	m *puller.Mount
	// pagesLoaded, closed when the sandbox has every page, lets the
	// mount write the materialized dir.
	pagesLoaded chan struct{}
	srv         *http.Server
	sockIn      string // the socket's private dir
	// sidecars is the sidecar dir runsc gets: cryo's gofer and runsc's
	// own other sidecars (gofer.SidecarDir).
	sidecars string
}

// goferMountID is the id the file API serves the one mount under.
const goferMountID = "restore"

// startGofer mounts src for the gofer and writes the image dir at dir.
// The socket lives in a 0700 dir of its own under the temp dir (a unix
// socket path must be short; the image dir's may not be).
func startGofer(ctx context.Context, p *puller.Puller, src puller.Source, dir string, opts Options) (*goferMount, error) {
	loaded := make(chan struct{})
	m, err := p.MountFiles(ctx, src, dir, puller.FilesOptions{MaterializeAfter: loaded})
	if err != nil {
		return nil, err
	}
	g := &goferMount{m: m, pagesLoaded: loaded}
	if err := g.serve(opts, src); err != nil {
		g.close()
		return nil, err
	}
	return g, nil
}

func (g *goferMount) serve(opts Options, src puller.Source) error {
	var err error
	if g.sockIn, err = os.MkdirTemp("", "cryo-gofer-"); err != nil {
		return fmt.Errorf("gofer socket dir: %w", err)
	}
	if g.sidecars, err = gofer.SidecarDir(filepath.Join(g.sockIn, "sidecars"), opts.GoferDir, opts.Runsc); err != nil {
		return err
	}
	sock := filepath.Join(g.sockIn, "files.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("gofer socket %s (a unix socket path must be short: set TMPDIR to a short dir): %w", sock, err)
	}
	if err := os.Chmod(sock, 0o600); err != nil {
		ln.Close()
		return fmt.Errorf("gofer socket: %w", err)
	}
	mux := http.NewServeMux()
	gofer.RegisterFiles(mux, func(id string) (gofer.Files, digest.Digest, bool) {
		return g.m, g.m.Digest(), id == goferMountID
	})
	g.srv = &http.Server{Handler: mux}
	go g.srv.Serve(ln)
	return gofer.WriteImageDir(g.m.Dir(), gofer.Config{
		MediaType: gofer.MediaType,
		Reference: opts.Name,
		Index:     src.Index.Digest,
		Socket:    sock,
		Mount:     goferMountID,
		Log:       opts.GoferLog,
	})
}

// sandboxLoaded says the sandbox has every page: the mount may
// materialize.
func (g *goferMount) sandboxLoaded() {
	select {
	case <-g.pagesLoaded:
	default:
		close(g.pagesLoaded)
	}
}

// close stops serving and releases the mount.
func (g *goferMount) close() error {
	var errs []error
	if g.srv != nil {
		errs = append(errs, g.srv.Close())
	}
	if g.sockIn != "" {
		errs = append(errs, os.RemoveAll(g.sockIn))
	}
	errs = append(errs, g.m.Unmount())
	os.Remove(filepath.Join(g.m.Dir(), gofer.ConfigFile))
	os.Remove(g.m.Dir())
	return errors.Join(errs...)
}

// releaseGofer ends a restore's gofer mount: the sandbox has every page
// and its gofer reads no more.
func (r *run) releaseGofer(g *goferMount) {
	r.report(Unmounted, g.m.Dir(), g.close())
}
