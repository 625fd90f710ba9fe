package registry

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/bases"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/registry/referrers"
	"github.com/distribution/distribution/v3"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/api/errcode"
	v2 "github.com/distribution/distribution/v3/registry/api/v2"
	"github.com/distribution/distribution/v3/registry/auth"
	"github.com/distribution/distribution/v3/registry/handlers"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/gorilla/mux"
	"github.com/opencontainers/go-digest"
	"github.com/redis/go-redis/v9"

	// Storage drivers selectable in the configuration.
	"github.com/distribution/distribution/v3/registry/storage/driver/factory"
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
	// ReadOnlyPoll is how often the read-only marker (see maintenance.Maintainer.EnterReadOnly)
	// is re-read: 0 means maintenance.DefaultReadOnlyPoll, negative never (for
	// one-off maintenance commands that serve nothing).
	ReadOnlyPoll time.Duration
	// StallTimeout is how long a client may stop sending a request body or
	// taking a response before its connection is closed (see
	// DefaultStallTimeout, the default when 0).
	StallTimeout time.Duration
	// Anchors is where the chunk index keeps the anchors of format v2
	// tables: AnchorsStorage (the default when empty), beside the rest of
	// the index in the storage driver, or AnchorsRedis, in the redis of
	// the configuration, which replicas share (docs/scale.md).
	Anchors string
}

// Where the chunk index keeps anchors (Options.Anchors).
const (
	AnchorsStorage = "storage"
	AnchorsRedis   = "redis"
)

// Server is a running registry's HTTP handler and storage.
type Server struct {
	cfg *configuration.Configuration
	app *handlers.App
	// access authorizes cryo's extension requests: the access controller
	// distribution builds from the same configuration (nil without auth).
	access auth.AccessController
	// driver and ns are the app's own storage driver and namespace, handed
	// over by cryo's registry middleware (extensions.go).
	driver   storagedriver.StorageDriver
	ns       distribution.Namespace
	log      *slog.Logger
	chunks   *chunkindex.Index
	codec    *format.Codec
	refs     *referrers.Store
	bases    *bases.Store
	metrics  *metrics
	handler  http.Handler
	mirrorOf string
	maint    *maintenance.Maintainer
	// anchorRedis keeps the chunk index's anchors (Options.Anchors), if
	// they are in redis.
	anchorRedis redis.UniversalClient
	stop        context.CancelFunc
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
	// The caller's configuration is left as it was: New may be called with
	// it again.
	c := *cfg
	cfg = &c
	cfg.HTTP.Debug.Prometheus.Enabled = opts.DistributionMetrics
	defer func() {
		// handlers.NewApp panics on configuration it cannot use.
		if r := recover(); r != nil {
			var bad factory.InvalidStorageDriverError
			if e, ok := r.(error); ok && errors.As(e, &bad) {
				err = fmt.Errorf("registry config: storage driver %s: %w", cfg.Storage.Type(), e)
			} else if ok {
				err = fmt.Errorf("registry config: %w", e)
			} else {
				err = fmt.Errorf("registry config: %v", r)
			}
		}
	}()
	s = &Server{cfg: cfg, log: opts.Logger, mirrorOf: cfg.Proxy.RemoteURL}
	if err := withExtensions(cfg, s); err != nil {
		return nil, fmt.Errorf("registry config: %w", err)
	}
	s.app = handlers.NewApp(ctx, cfg)
	if s.ns == nil {
		return nil, fmt.Errorf("registry: distribution did not apply cryo's registry middleware")
	}
	if t := cfg.Auth.Type(); t != "" && !strings.EqualFold(t, "none") {
		if s.access, err = auth.GetAccessController(t, cfg.Auth.Parameters()); err != nil {
			return nil, fmt.Errorf("registry config: auth %s: %w", t, err)
		}
	}
	s.metrics = newMetrics(s)
	if s.codec, err = format.NewCodec(0); err != nil {
		return nil, err
	}
	ciOpts := chunkindex.Options{Logger: opts.Logger, OnVerify: s.metrics.chunkVerified}
	switch opts.Anchors {
	case "", AnchorsStorage:
	case AnchorsRedis:
		if len(cfg.Redis.Options.Addrs) == 0 {
			return nil, fmt.Errorf("registry: chunk index anchors in redis, but the configuration names no redis (redis.addrs)")
		}
		if s.anchorRedis, err = maintenance.RedisClient(&cfg.Redis); err != nil {
			return nil, fmt.Errorf("registry: redis for chunk index anchors: %w", err)
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := s.anchorRedis.Ping(pctx).Err()
		cancel()
		if err != nil {
			// Anchors are hints: while redis is away, pushes upload
			// what compositions would have reused (and say so).
			opts.Logger.Warn("redis for chunk index anchors does not answer; pushes across repositories dedup less until it does",
				"addrs", strings.Join(cfg.Redis.Options.Addrs, ","), "err", err)
		}
		ciOpts.Redis = s.anchorRedis
	default:
		return nil, fmt.Errorf("registry: chunk index anchors in %q: want %q or %q", opts.Anchors, AnchorsStorage, AnchorsRedis)
	}
	s.chunks = chunkindex.New(s.driver, s.ns, s.codec, ciOpts)
	s.refs = referrers.New(s.driver, s.ns)
	s.bases = bases.New(s.driver, s.ns)
	var redis *configuration.Redis
	if maintenance.UsesRedisCache(cfg) {
		redis = &cfg.Redis
	}
	s.maint, err = maintenance.New(maintenance.Options{Driver: s.driver, Namespace: s.ns, Redis: redis,
		ChunkIndex: s.chunks, Referrers: s.refs, Logger: opts.Logger, Count: s.countBlobs})
	if err != nil {
		if s.anchorRedis != nil {
			s.anchorRedis.Close()
		}
		return nil, err
	}
	if opts.StallTimeout <= 0 {
		opts.StallTimeout = DefaultStallTimeout
	}
	s.handler = withStallTimeouts(s.routes(), opts.StallTimeout)
	wctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stop = stop
	if opts.ReadOnlyPoll >= 0 {
		if opts.ReadOnlyPoll == 0 {
			opts.ReadOnlyPoll = maintenance.DefaultReadOnlyPoll
		}
		s.maint.Refresh(wctx)
		go s.maint.Watch(wctx, opts.ReadOnlyPoll)
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

// Maintenance returns the registry's maintenance: garbage collection and
// read-only mode.
func (s *Server) Maintenance() *maintenance.Maintainer { return s.maint }

// Namespace returns the registry's storage namespace.
func (s *Server) Namespace() distribution.Namespace { return s.ns }

// Close stops background work of the distribution app.
func (s *Server) Close() error {
	s.stop()
	err := s.app.Shutdown()
	s.codec.Close()
	if s.anchorRedis != nil {
		s.anchorRedis.Close()
	}
	return err
}

// routes sends cryo's own endpoints to their handlers and everything else
// to distribution's app untouched. Three distribution routes pass through a
// handler of cryo's first: blob GET/HEAD (sendfile and mirror fills,
// blobs.go), manifest PUT (the OCI-Subject header) and the referrers API
// distribution lacks. Routes use distribution's own name and digest
// patterns.
func (s *Server) routes() http.Handler {
	r := mux.NewRouter()
	r.HandleFunc("/v2/_cryo/chunks/{digest}", s.handleChunkLookup).Methods(http.MethodGet)
	r.HandleFunc("/v2/_cryo/chunks", s.handleChunkBatch).Methods(http.MethodPost)
	r.HandleFunc(api.PacksPath, s.handleCompose).Methods(http.MethodPost)
	r.HandleFunc("/v2/{name:"+reference.NameRegexp.String()+"}"+api.BaseSuffix, s.handleBase).Methods(http.MethodGet)
	r.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) }).Methods(http.MethodGet)
	r.HandleFunc("/readyz", s.handleReady).Methods(http.MethodGet)
	r.HandleFunc(distributionPath(v2.RouteNameBlob), s.handleBlob).Methods(http.MethodGet, http.MethodHead)
	r.HandleFunc(distributionPath(v2.RouteNameManifest), s.handleManifestPut).Methods(http.MethodPut)
	r.HandleFunc("/v2/{name:"+reference.NameRegexp.String()+"}/referrers/{digest:"+digest.DigestRegexp.String()+"}", s.handleReferrers).Methods(http.MethodGet, http.MethodHead)
	r.NotFoundHandler = s.app
	r.MethodNotAllowedHandler = s.app
	return s.metrics.instrument(s.refuseWritesWhileReadOnly(r))
}

// refuseWritesWhileReadOnly answers writes with 503 while a marker is in
// force or a cache flush is pending. Reads, and the chunk index's batch
// lookup (a POST that writes nothing), pass.
func (s *Server) refuseWritesWhileReadOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			next.ServeHTTP(w, r)
			return
		}
		if !strings.HasPrefix(r.URL.Path, "/v2/") || r.URL.Path == "/v2/_cryo/chunks" {
			next.ServeHTTP(w, r)
			return
		}
		why := s.maint.WritesRefused()
		if why == "" {
			next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Retry-After", "30")
		writeRegistryError(w, http.StatusServiceUnavailable, "UNAVAILABLE", why)
	})
}

// distributionPath is the path pattern of distribution's route name.
func distributionPath(name string) string {
	for _, d := range v2.APIDescriptor.RouteDescriptors {
		if d.Name == name {
			return d.Path
		}
	}
	panic("distribution has no route " + name)
}

// handleBlob serves a blob GET or HEAD from filesystem storage itself
// (serveBlobFile), filling a mirror first if needed, or hands it to
// distribution.
func (s *Server) handleBlob(w http.ResponseWriter, r *http.Request) {
	vars := mux.Vars(r)
	repo, ref := vars["name"], vars["digest"]
	if s.serveBlobFile(w, r, repo, ref) {
		return
	}
	// A mirror's blob not fetched yet: fetch it once, then serve it like
	// any other.
	if s.mirrorOf != "" && r.Method == http.MethodGet && s.fillMirror(r, repo, ref) && s.serveBlobFile(w, r, repo, ref) {
		return
	}
	s.app.ServeHTTP(w, r)
}

// handleReady answers 200 when the storage backend answers, 503 otherwise.
func (s *Server) handleReady(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	_, err := s.driver.Stat(ctx, "/")
	if err != nil && !extstore.IsNotFound(err) {
		http.Error(w, fmt.Sprintf("storage %s unreachable: %v", s.driver.Name(), err), http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// authorize checks that the request's credentials may pull from repo (or
// take the actions given instead, or reach the registry at all if repo is
// ""), with the access controller
// distribution uses. On refusal it answers 401 with the controller's
// challenge, as distribution does, or, for any other refusal, 403 DENIED
// (where distribution answers a bare 400), and returns false.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request, repo string, actions ...string) bool {
	if s.access == nil {
		return true
	}
	var access []auth.Access
	if repo != "" {
		if len(actions) == 0 {
			actions = []string{"pull"}
		}
		for _, a := range actions {
			access = append(access, auth.Access{Resource: auth.Resource{Type: "repository", Name: repo}, Action: a})
		}
	}
	_, err := s.access.Authorized(r, access...)
	if err == nil {
		return true
	}
	if ch, ok := err.(auth.Challenge); ok {
		ch.SetHeaders(r, w)
		_ = errcode.ServeJSON(w, errcode.ErrorCodeUnauthorized.WithDetail(access))
		return false
	}
	s.log.Warn("authorize extension request", "path", r.URL.Path, "err", err)
	_ = errcode.ServeJSON(w, errcode.ErrorCodeDenied)
	return false
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
