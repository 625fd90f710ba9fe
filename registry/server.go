package registry

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"sync/atomic"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/distribution/distribution/v3"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/handlers"
	"github.com/distribution/distribution/v3/registry/storage"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/distribution/v3/registry/storage/driver/factory"

	// Storage drivers selectable in the configuration.
	_ "github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/inmemory"
	_ "github.com/distribution/distribution/v3/registry/storage/driver/s3-aws"

	// Auth backends selectable in the configuration.
	_ "github.com/distribution/distribution/v3/registry/auth/htpasswd"
	_ "github.com/distribution/distribution/v3/registry/auth/token"

	// Proxy (pull-through) support.
	_ "github.com/distribution/distribution/v3/registry/proxy"
	"golang.org/x/sync/singleflight"
)

// Options tune a Server beyond its distribution configuration.
type Options struct {
	// Logger receives cryo's own logs (distribution logs through logrus as
	// its configuration says). Default: slog.Default().
	Logger *slog.Logger
	// DistributionMetrics turns on distribution's own Prometheus HTTP
	// metrics. They register in the process-wide Prometheus registry, so
	// only one Server per process may have them.
	DistributionMetrics bool
	// ReadOnlyPoll is how often the read-only marker (see EnterReadOnly)
	// is re-read: 0 means DefaultReadOnlyPoll, negative never (for
	// one-off maintenance commands that serve nothing).
	ReadOnlyPoll time.Duration
	// StallTimeout is how long a client may stop sending a request body or
	// taking a response before its connection is closed (see
	// DefaultStallTimeout, the default when 0).
	StallTimeout time.Duration
}

// Server is a running registry's HTTP handler and storage.
type Server struct {
	cfg      *configuration.Configuration
	app      *handlers.App
	driver   storagedriver.StorageDriver
	ns       distribution.Namespace
	log      *slog.Logger
	chunks   *chunkIndex
	codec    *format.Codec
	refs     *referrers
	metrics  *metrics
	handler  http.Handler
	mirrorOf string
	readOnly readOnlyState
	// flushPending is set while a blob descriptor cache flush a garbage
	// collection owes has not succeeded (rediscache.go).
	flushPending atomic.Bool
	// flushing is set while this replica settles owed flushes.
	flushing atomic.Bool
	stop     context.CancelFunc
	// mirrorFills joins concurrent first requests for a blob in mirror
	// mode (fillMirror).
	mirrorFills singleflight.Group
}

// New builds a Server from a distribution configuration. A configuration
// that distribution would panic on is an error here.
func New(ctx context.Context, cfg *configuration.Configuration, opts Options) (s *Server, err error) {
	if err := validate(cfg); err != nil {
		return nil, fmt.Errorf("registry config: %w", err)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	cfg.HTTP.Debug.Prometheus.Enabled = opts.DistributionMetrics
	defer func() {
		// handlers.NewApp panics on configuration it cannot use.
		if r := recover(); r != nil {
			err = fmt.Errorf("registry config: %v", r)
		}
	}()
	driver, err := factory.Create(ctx, cfg.Storage.Type(), cfg.Storage.Parameters())
	if err != nil {
		return nil, fmt.Errorf("storage driver %s: %w", cfg.Storage.Type(), err)
	}
	ns, err := storage.NewRegistry(ctx, driver, storage.EnableDelete)
	if err != nil {
		return nil, fmt.Errorf("open storage: %w", err)
	}
	app := handlers.NewApp(ctx, cfg)
	s = &Server{cfg: cfg, app: app, driver: driver, ns: ns, log: opts.Logger, mirrorOf: cfg.Proxy.RemoteURL}
	s.metrics = newMetrics(s)
	codec, err := format.NewCodec(0)
	if err != nil {
		return nil, err
	}
	s.codec = codec
	s.chunks = newChunkIndex(driver, ns, opts.Logger, s.metrics, codec)
	s.refs = &referrers{driver: driver, ns: ns}
	if opts.StallTimeout <= 0 {
		opts.StallTimeout = DefaultStallTimeout
	}
	s.handler = withStallTimeouts(s.routes(), opts.StallTimeout)
	wctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stop = stop
	if opts.ReadOnlyPoll >= 0 {
		if opts.ReadOnlyPoll == 0 {
			opts.ReadOnlyPoll = DefaultReadOnlyPoll
		}
		s.refreshReadOnly(wctx)
		go s.watchReadOnly(wctx, opts.ReadOnlyPoll)
	}
	return s, nil
}

// Handler returns the registry's HTTP handler: the distribution API plus
// cryo's extensions.
func (s *Server) Handler() http.Handler { return s.handler }

// MetricsHandler returns the Prometheus handler for /metrics.
func (s *Server) MetricsHandler() http.Handler { return s.metrics.handler() }

// Driver returns the storage driver the registry uses.
func (s *Server) Driver() storagedriver.StorageDriver { return s.driver }

// Namespace returns the registry's storage namespace.
func (s *Server) Namespace() distribution.Namespace { return s.ns }

// Close stops background work of the distribution app.
func (s *Server) Close() error {
	s.stop()
	err := s.app.Shutdown()
	s.codec.Close()
	return err
}

var (
	referrersPath = regexp.MustCompile(`^/v2/(.+)/referrers/([^/]+)$`)
	manifestPath  = regexp.MustCompile(`^/v2/(.+)/manifests/([^/]+)$`)
)

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v2/_cryo/chunks/{digest}", s.handleChunkLookup)
	mux.HandleFunc("POST /v2/_cryo/chunks", s.handleChunkBatch)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("GET /readyz", s.handleReady)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if m := referrersPath.FindStringSubmatch(r.URL.Path); m != nil && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
			s.handleReferrers(w, r, m[1], m[2])
			return
		}
		if m := blobPath.FindStringSubmatch(r.URL.Path); m != nil && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
			if s.serveBlobFile(w, r, m[1], m[2]) {
				return
			}
			// A mirror's blob not fetched yet: fetch it once, then serve it
			// like any other.
			if s.mirrorOf != "" && r.Method == http.MethodGet && s.fillMirror(r, m[1], m[2]) && s.serveBlobFile(w, r, m[1], m[2]) {
				return
			}
		}
		if m := manifestPath.FindStringSubmatch(r.URL.Path); m != nil && r.Method == http.MethodPut {
			s.handleManifestPut(w, r, m[1], m[2])
			return
		}
		s.app.ServeHTTP(w, r)
	})
	return s.metrics.instrument(s.refuseWritesWhileReadOnly(mux))
}

// handleReady answers 200 when the storage backend answers, 503 otherwise.
func (s *Server) handleReady(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	_, err := s.driver.Stat(ctx, "/")
	var notFound storagedriver.PathNotFoundError
	if err != nil && !errors.As(err, &notFound) {
		http.Error(w, fmt.Sprintf("storage %s unreachable: %v", s.driver.Name(), err), http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// authorize asks distribution whether the request's credentials may pull
// from repo (or reach the registry at all if repo is ""), by running a cheap
// probe request through the app. On refusal it writes distribution's answer
// (401 with WWW-Authenticate, or 403) and returns false.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request, repo string) bool {
	return s.authorizeAs(w, r, http.MethodHead, repo)
}

// zeroManifest is a manifest path no content has: a probe on it reaches
// distribution's access check and then finds nothing to do.
const zeroManifest = "/manifests/sha256:0000000000000000000000000000000000000000000000000000000000000000"

// authorizeAs is authorize for the access a request of method needs: HEAD
// or GET for pull, PUT for push. A PUT probe carries no body; should the
// caller have push access, distribution refuses it as an invalid manifest
// without storing anything.
func (s *Server) authorizeAs(w http.ResponseWriter, r *http.Request, method, repo string) bool {
	if s.cfg.Auth.Type() == "" {
		return true
	}
	probe := r.Clone(r.Context())
	probe.Method = method
	probe.Body = http.NoBody
	probe.ContentLength = 0
	probe.Header.Del("Content-Type")
	probe.URL.Path = "/v2/"
	if repo != "" {
		probe.URL.Path = "/v2/" + repo + zeroManifest
	}
	probe.URL.RawQuery = ""
	rec := httptest.NewRecorder()
	s.app.ServeHTTP(rec, probe)
	if rec.Code == http.StatusUnauthorized || rec.Code == http.StatusForbidden {
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		return false
	}
	return true
}

// maxManifestBody bounds what the manifest PUT hook buffers; distribution
// refuses larger manifests itself.
const maxManifestBody = 4<<20 + 1

// handleManifestPut passes a manifest upload to distribution and, when it
// succeeds, records the manifest's subject (referrers API) and, for a cryo
// file manifest, its chunks (chunk index).
//
// The body is buffered only for a caller with push access to repo: anyone
// else gets distribution's 401 or 403 before a byte of it is read.
func (s *Server) handleManifestPut(w http.ResponseWriter, r *http.Request, repo, reference string) {
	if !s.authorizeAs(w, r, http.MethodPut, repo) {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxManifestBody))
	if err != nil {
		http.Error(w, "read manifest: "+err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	hooked := &putHook{ResponseWriter: w, onCreated: func(h http.Header) {
		ctx := context.WithoutCancel(r.Context())
		if subject, err := s.refs.record(ctx, repo, body, r.Header.Get("Content-Type")); err != nil {
			s.log.Error("record referrer", "repository", repo, "reference", reference, "err", err)
		} else if subject != "" {
			h.Set("OCI-Subject", subject)
		}
		if err := s.chunks.indexManifest(ctx, repo, body); err != nil {
			s.log.Error("index chunks", "repository", repo, "reference", reference, "err", err)
		}
	}}
	s.app.ServeHTTP(hooked, r)
}

// putHook runs onCreated just before a 201 Created is written.
type putHook struct {
	http.ResponseWriter
	onCreated func(http.Header)
	wrote     bool
}

func (p *putHook) WriteHeader(code int) {
	if !p.wrote && code == http.StatusCreated {
		p.onCreated(p.Header())
	}
	p.wrote = true
	p.ResponseWriter.WriteHeader(code)
}

func (p *putHook) Write(b []byte) (int, error) {
	if !p.wrote {
		p.WriteHeader(http.StatusOK)
	}
	return p.ResponseWriter.Write(b)
}

// Serve serves the registry on ln (TLS if the configuration has a
// certificate) and the metrics handler on metricsLn if it is not nil, until
// ctx is done; then it shuts down gracefully.
func (s *Server) Serve(ctx context.Context, ln, metricsLn net.Listener) error {
	// Timeouts: see timeouts.go.
	srv := &http.Server{Handler: s.handler, ReadHeaderTimeout: ReadHeaderTimeout, IdleTimeout: IdleTimeout}
	errc := make(chan error, 2)
	tlsCfg := s.cfg.HTTP.TLS
	go func() {
		if tlsCfg.Certificate != "" {
			srv.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
			errc <- srv.ServeTLS(ln, tlsCfg.Certificate, tlsCfg.Key)
			return
		}
		errc <- srv.Serve(ln)
	}()
	var msrv *http.Server
	if metricsLn != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", s.MetricsHandler())
		msrv = &http.Server{Handler: mux, ReadHeaderTimeout: ReadHeaderTimeout, IdleTimeout: IdleTimeout}
		go func() { errc <- msrv.Serve(metricsLn) }()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if msrv != nil {
		msrv.Shutdown(shutdown)
	}
	return srv.Shutdown(shutdown)
}
