package restore

import (
	"context"
	"errors"
	"net/http"
	"os"
	"path/filepath"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/opencontainers/go-digest"
)

// goferMount is a snapshot served to cryo's checkpoint gofer by this
// process: a MountFiles mount, a gofer session serving its file API, and
// an image dir holding only gcs_opts.json that names them.
type goferMount struct {
	m *puller.Mount
	// pagesLoaded, closed when the sandbox has every page, lets the
	// mount write the materialized dir.
	pagesLoaded chan struct{}
	session     *gofer.Session
}

// goferMountID is the id the file API serves the one mount under.
const goferMountID = "restore"

// startGofer mounts src for the gofer, serves it and writes the image dir
// at dir.
func startGofer(ctx context.Context, p *puller.Puller, src puller.Source, dir string, opts Options) (*goferMount, error) {
	loaded := make(chan struct{})
	m, err := p.MountFiles(ctx, src, dir, puller.FilesOptions{MaterializeAfter: loaded, AwaitSandbox: puller.AwaitRestore, RunsWhenTold: true})
	if err != nil {
		return nil, err
	}
	g := &goferMount{m: m, pagesLoaded: loaded}
	mux := http.NewServeMux()
	gofer.RegisterFiles(mux, func(id string) (gofer.Files, digest.Digest, bool) {
		return m, m.Digest(), id == goferMountID
	})
	if g.session, err = gofer.StartSession(opts.GoferDir, opts.Runsc, mux); err == nil {
		err = gofer.WriteImageDir(dir, gofer.Config{
			MediaType: gofer.MediaType,
			Reference: opts.Name,
			Index:     src.Index.Digest,
			Socket:    g.session.Socket,
			Mount:     goferMountID,
			Log:       opts.GoferLog,
		})
	}
	if err != nil {
		g.close()
		return nil, err
	}
	return g, nil
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
	if g.session != nil {
		errs = append(errs, g.session.Close())
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

// GoferMount is a snapshot served to cryo's checkpoint gofer by this
// process, for a runsc that the caller runs: `cryo mount --backend gofer`.
type GoferMount struct{ g *goferMount }

// ServeGofer checks that opts.GoferDir holds a gofer of the release of
// the runsc at opts.Runsc, mounts src for it at dir (puller.MountFiles),
// serves the mount's file API on a private socket and writes dir's
// gcs_opts.json. Restore from dir with runsc restore --image-path=dir
// and Env in runsc's environment. The snapshot materializes once every
// chunk is local. opts.Name names it in the config; opts.GoferLog is the
// gofer's log.
func ServeGofer(ctx context.Context, p *puller.Puller, src puller.Source, dir string, opts Options) (*GoferMount, error) {
	v, err := RunscVersion(ctx, opts.Runsc)
	if err != nil {
		return nil, err
	}
	if err := gofer.Check(ctx, opts.GoferDir, v); err != nil {
		return nil, err
	}
	if opts.Name == "" {
		opts.Name = src.Index.Digest.String()
	}
	g, err := startGofer(ctx, p, src, dir, opts)
	if err != nil {
		return nil, err
	}
	g.sandboxLoaded()
	return &GoferMount{g}, nil
}

// Mount is the mount the gofer reads.
func (g *GoferMount) Mount() *puller.Mount { return g.g.m }

// Env is the variable that points runsc at cryo's gofer
// (GVISOR_SIDECAR_BINARIES_DIR=...), for runsc restore's environment.
func (g *GoferMount) Env() string { return g.g.session.Env() }

// Close stops serving, unmounts and removes the image dir's config.
func (g *GoferMount) Close() error { return g.g.close() }
