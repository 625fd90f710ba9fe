package registry

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"slices"

	"github.com/distribution/distribution/v3"
	"github.com/distribution/distribution/v3/configuration"
	registrymiddleware "github.com/distribution/distribution/v3/registry/middleware/registry"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// cryo's extensions see the registry through distribution's registry
// middleware: the app hands the middleware its namespace (with the
// configured blob descriptor cache) and its storage driver (with the
// configured storage middleware), and every repository the app opens
// passes through it, so manifest PUTs and DELETEs are seen after
// distribution has checked and stored them, whatever route they took.
//
// The middleware is registered under middlewareName, the one package-level
// registration distribution requires. The Server it serves is not global:
// New puts it in the middleware's options, which only Go code can set.
const (
	middlewareName   = "cryo"
	extensionsOption = "cryo.server"
)

func init() {
	if err := registrymiddleware.Register(middlewareName, initExtensions); err != nil {
		panic(err)
	}
}

// withExtensions appends cryo's registry middleware, for s, to cfg's
// middleware, in a map and list of cfg's own (not shared with the
// configuration cfg was copied from).
func withExtensions(cfg *configuration.Configuration, s *Server) error {
	registry := cfg.Middleware["registry"]
	for _, mw := range registry {
		if mw.Name == middlewareName {
			return fmt.Errorf("registry middleware %q is cryo's own and cannot be configured", middlewareName)
		}
	}
	cfg.Middleware = maps.Clone(cfg.Middleware)
	if cfg.Middleware == nil {
		cfg.Middleware = map[string][]configuration.Middleware{}
	}
	cfg.Middleware["registry"] = append(slices.Clone(registry), configuration.Middleware{
		Name: middlewareName, Options: configuration.Parameters{extensionsOption: s}})
	return nil
}

// initExtensions is the registry middleware's constructor: it gives the
// Server the app's namespace and driver and wraps the namespace.
func initExtensions(ctx context.Context, ns distribution.Namespace, driver storagedriver.StorageDriver, options map[string]any) (distribution.Namespace, error) {
	s, ok := options[extensionsOption].(*Server)
	if !ok {
		return nil, fmt.Errorf("registry middleware %q is set up by cryo's registry.New, not by configuration", middlewareName)
	}
	s.ns, s.driver = ns, driver
	return extendedNamespace{Namespace: ns, s: s}, nil
}

// extendedNamespace is the app's namespace with manifest writes recorded.
type extendedNamespace struct {
	distribution.Namespace
	s *Server
}

func (n extendedNamespace) Repository(ctx context.Context, name reference.Named) (distribution.Repository, error) {
	r, err := n.Namespace.Repository(ctx, name)
	if err != nil || n.s.mirrorOf != "" {
		// A mirror stores what upstream says, unverified until a puller
		// checks it; it keeps no extension state.
		return r, err
	}
	return extendedRepository{Repository: r, s: n.s}, nil
}

// Remove keeps repository deletion working: distribution looks for it on
// the namespace it is given.
func (n extendedNamespace) Remove(ctx context.Context, name reference.Named) error {
	rr, ok := n.Namespace.(distribution.RepositoryRemover)
	if !ok {
		return fmt.Errorf("storage cannot remove repositories")
	}
	return rr.Remove(ctx, name)
}

// Enumerate keeps the catalog's fast path.
func (n extendedNamespace) Enumerate(ctx context.Context, ingester func(string) error) error {
	re, ok := n.Namespace.(distribution.RepositoryEnumerator)
	if !ok {
		return fmt.Errorf("storage cannot enumerate repositories")
	}
	return re.Enumerate(ctx, ingester)
}

type extendedRepository struct {
	distribution.Repository
	s *Server
}

func (r extendedRepository) Manifests(ctx context.Context, options ...distribution.ManifestServiceOption) (distribution.ManifestService, error) {
	ms, err := r.Repository.Manifests(ctx, options...)
	if err != nil {
		return nil, err
	}
	return recordingManifests{ManifestService: ms, repo: r.Named().Name(), s: r.s}, nil
}

// recordingManifests records, for every manifest stored, its subject
// (referrers), for a cryo file manifest its verified chunks (chunk index),
// and for a v2 snapshot index put under a tag that it is the repository's
// latest (bases); and drops a deleted manifest's referrer entry.
type recordingManifests struct {
	distribution.ManifestService
	repo string
	s    *Server
}

func (m recordingManifests) Put(ctx context.Context, manifest distribution.Manifest, options ...distribution.ManifestServiceOption) (digest.Digest, error) {
	d, err := m.ManifestService.Put(ctx, manifest, options...)
	if err != nil {
		return d, err
	}
	mediaType, payload, err := manifest.Payload()
	if err != nil {
		m.s.log.Error("manifest payload", "repository", m.repo, "digest", d, "err", err)
		return d, nil
	}
	// The manifest is stored: recording must finish even if the client
	// goes away now.
	rctx := context.WithoutCancel(ctx)
	if subject, err := m.s.refs.Record(rctx, m.repo, d, payload, mediaType); err != nil {
		m.s.log.Error("record referrer", "repository", m.repo, "digest", d, "err", err)
	} else if note, ok := ctx.Value(subjectNoteKey{}).(*subjectNote); ok && subject != "" {
		note.subject = subject
	}
	if err := m.s.chunks.IndexManifest(rctx, m.repo, payload); err != nil {
		// The manifest is stored and the client told so: its chunks
		// are recorded by the next PUT that names them.
		m.s.log.Error("index chunks", "repository", m.repo, "digest", d, "err", err)
		m.s.metrics.indexFailures.Inc()
	}
	if err := m.s.bases.Record(rctx, m.repo, taggedAs(options), d, payload); err != nil {
		m.s.log.Error("record latest v2 snapshot", "repository", m.repo, "digest", d, "err", err)
	}
	return d, nil
}

// taggedAs returns the tag a manifest PUT names (distribution passes it
// as a WithTag option), "" for a PUT by digest.
func taggedAs(options []distribution.ManifestServiceOption) string {
	for _, o := range options {
		if t, ok := o.(distribution.WithTagOption); ok {
			return t.Tag
		}
	}
	return ""
}

func (m recordingManifests) Delete(ctx context.Context, d digest.Digest) error {
	var payload []byte
	if man, err := m.ManifestService.Get(ctx, d); err == nil {
		_, payload, _ = man.Payload()
	}
	if err := m.ManifestService.Delete(ctx, d); err != nil {
		return err
	}
	if payload != nil {
		if err := m.s.refs.Forget(context.WithoutCancel(ctx), m.repo, d, payload); err != nil {
			m.s.log.Error("drop referrer", "repository", m.repo, "digest", d, "err", err)
		}
	}
	return nil
}

// subjectNote carries, from a manifest PUT's storage to its response, the
// subject recorded for it: the OCI-Subject response header.
type subjectNote struct{ subject digest.Digest }

type subjectNoteKey struct{}

// handleManifestPut hands a manifest PUT to distribution untouched and,
// when the manifest had a subject that was recorded, answers with the
// OCI-Subject header.
func (s *Server) handleManifestPut(w http.ResponseWriter, r *http.Request) {
	note := &subjectNote{}
	r = r.WithContext(context.WithValue(r.Context(), subjectNoteKey{}, note))
	s.app.ServeHTTP(&subjectHeader{ResponseWriter: w, note: note}, r)
}

// subjectHeader sets OCI-Subject on a 201 Created when one was noted.
type subjectHeader struct {
	http.ResponseWriter
	note  *subjectNote
	wrote bool
}

func (h *subjectHeader) WriteHeader(code int) {
	if !h.wrote && code == http.StatusCreated && h.note.subject != "" {
		h.Header().Set("OCI-Subject", h.note.subject.String())
	}
	h.wrote = true
	h.ResponseWriter.WriteHeader(code)
}

func (h *subjectHeader) Write(b []byte) (int, error) {
	if !h.wrote {
		h.WriteHeader(http.StatusOK)
	}
	return h.ResponseWriter.Write(b)
}

func (h *subjectHeader) Unwrap() http.ResponseWriter { return h.ResponseWriter }
