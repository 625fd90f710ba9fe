// Package transfer moves snapshots between image dirs and registries: push
// (pack on the fly, upload only what the registry lacks), pull (verified,
// parallel, resumable), copy between registries, and login. It speaks the
// OCI distribution API through oras-go, so it works with any OCI registry;
// cryo's registry extensions (the chunk index) are used when present.
package transfer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"oras.land/oras-go/v2/registry"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/errcode"
)

// DefaultTag is the tag used when a reference names none.
const DefaultTag = "latest"

// DefaultResponseHeaderTimeout is how long a request waits for a
// registry's response headers once it is sent, unless ClientOptions says
// otherwise: a registry that accepts a connection and then hangs fails the
// request (which callers retry or fail over) instead of hanging it forever.
const DefaultResponseHeaderTimeout = 60 * time.Second

// ClientOptions say how to reach registries.
type ClientOptions struct {
	// PlainHTTP forces HTTP (true) or HTTPS (false). Unset, localhost and
	// loopback registries use HTTP, as Docker does, and others HTTPS.
	PlainHTTP *bool
	// Username and Password, if set, are the credentials of the registry
	// CredentialHost, used there instead of Docker's credential store.
	// They are never sent to another registry (a mirror, say): every
	// other registry gets its credentials from Docker's credential store.
	Username, Password string
	// CredentialHost is the registry (host[:port]) Username and Password
	// are for. Repository sets it to the registry its reference names
	// when it is empty; NewClient refuses credentials without it.
	CredentialHost string
	// MaxConns bounds the idle connections kept per registry (default 64),
	// so that parallel transfers reuse keep-alive connections.
	MaxConns int
	// CAFile is a PEM file of CA certificates to trust besides the
	// system's, for registries with a private CA or a self-signed
	// certificate.
	CAFile string
	// Insecure skips TLS certificate verification (testing only).
	Insecure bool
	// ResponseHeaderTimeout bounds the wait for a response's headers
	// after a request is sent (default DefaultResponseHeaderTimeout).
	ResponseHeaderTimeout time.Duration
}

// Client reaches registries. It builds one authenticated HTTP client per
// registry host on first use, over one shared transport (keep-alive
// connections, TLS settings, retries), and shares it between every
// repository it opens on that host, so tokens and connections are reused
// and Docker's credential store is read once (again only when its config
// file changes, as a mounted Kubernetes secret does when it is rotated). A
// Client is safe for
// concurrent use.
type Client struct {
	opts ClientOptions
	http *http.Client

	mu    sync.Mutex
	hosts map[string]*auth.Client

	storeMu   sync.Mutex
	store     *credentials.DynamicStore
	storeStat os.FileInfo // of the config file store was read from; nil: none
}

// NewClient returns a Client that reaches registries as opts says.
func NewClient(opts ClientOptions) (*Client, error) {
	if (opts.Username != "" || opts.Password != "") && opts.CredentialHost == "" {
		return nil, errors.New("transfer: a username or password needs the registry it is for (ClientOptions.CredentialHost)")
	}
	tr, err := newTransport(opts)
	if err != nil {
		return nil, err
	}
	return &Client{opts: opts, http: &http.Client{Transport: newRetryTransport(tr)}, hosts: map[string]*auth.Client{}}, nil
}

// Repository opens the repository named by ref
// ("host[:port]/name[:tag|@digest]") and returns it with the tag or digest
// ref names (DefaultTag if none). Repositories on one host share that
// host's authenticated client.
func (c *Client) Repository(ref string) (*remote.Repository, string, error) {
	parsed, err := ParseReference(ref)
	if err != nil {
		return nil, "", err
	}
	repo, err := remote.NewRepository(parsed.String())
	if err != nil {
		return nil, "", fmt.Errorf("reference %q: %w", ref, err)
	}
	repo.PlainHTTP = c.plainHTTP(parsed.Registry)
	repo.Client = c.authClient(parsed.Registry)
	repo.SkipReferrersGC = true
	return repo, parsed.Reference, nil
}

// Registry returns the registry at host ("host[:port]").
func (c *Client) Registry(host string) (*remote.Registry, error) {
	reg, err := remote.NewRegistry(host)
	if err != nil {
		return nil, fmt.Errorf("registry %q: %w", host, err)
	}
	reg.PlainHTTP = c.plainHTTP(reg.Reference.Registry)
	reg.Client = c.authClient(reg.Reference.Registry)
	return reg, nil
}

func (c *Client) plainHTTP(host string) bool {
	if c.opts.PlainHTTP != nil {
		return *c.opts.PlainHTTP
	}
	return isLocal(host)
}

// authClient returns the authenticated client of host, built on first use.
func (c *Client) authClient(host string) *auth.Client {
	c.mu.Lock()
	defer c.mu.Unlock()
	if ac := c.hosts[host]; ac != nil {
		return ac
	}
	ac := &auth.Client{
		Client:     c.http,
		Cache:      auth.NewCache(),
		Header:     http.Header{"User-Agent": {"cryo"}},
		Credential: c.credential,
	}
	c.hosts[host] = ac
	return ac
}

// credential returns the credential for the registry hostport: the
// explicit one for CredentialHost only, else what Docker's credential
// store holds for hostport.
func (c *Client) credential(ctx context.Context, hostport string) (auth.Credential, error) {
	if (c.opts.Username != "" || c.opts.Password != "") && sameRegistry(hostport, c.opts.CredentialHost) {
		return auth.Credential{Username: c.opts.Username, Password: c.opts.Password}, nil
	}
	store, err := c.dockerStore()
	if err != nil {
		return auth.EmptyCredential, err
	}
	return credentials.Credential(store)(ctx, hostport)
}

// dockerStore returns Docker's credential store, read on first need and
// read again when its config file has changed since.
func (c *Client) dockerStore() (credentials.Store, error) {
	c.storeMu.Lock()
	defer c.storeMu.Unlock()
	if c.store != nil {
		fi, err := os.Stat(c.store.ConfigPath())
		if unchanged(c.storeStat, fi, err) {
			return c.store, nil
		}
	}
	store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{})
	if err != nil {
		return nil, fmt.Errorf("read Docker credentials: %w", err)
	}
	c.store = store
	c.storeStat, _ = os.Stat(store.ConfigPath())
	return store, nil
}

// unchanged reports whether a file that was as before (nil: absent) is
// still so, given what stat says of it now.
func unchanged(before, now os.FileInfo, err error) bool {
	if err != nil {
		return before == nil
	}
	return before != nil && now.ModTime().Equal(before.ModTime()) && now.Size() == before.Size()
}

// sameRegistry reports whether two registry names are one registry
// (docker.io is served as registry-1.docker.io).
func sameRegistry(a, b string) bool {
	norm := func(h string) string { return registry.Reference{Registry: h}.Host() }
	return norm(a) == norm(b)
}

// ParseReference parses "host[:port]/name[:tag|@digest]", giving it
// DefaultTag if it names neither a tag nor a digest.
func ParseReference(ref string) (registry.Reference, error) {
	parsed, err := registry.ParseReference(ref)
	if err != nil {
		return registry.Reference{}, fmt.Errorf("reference %q: %w", ref, err)
	}
	if parsed.Reference == "" {
		parsed.Reference = DefaultTag
	}
	return parsed, nil
}

// Repository opens the repository named by ref ("host[:port]/name[:tag|@digest]")
// with a client of its own, and returns it with the tag or digest ref names
// (DefaultTag if none). opts' credentials go to ref's registry unless
// opts.CredentialHost names another. To open several repositories, share
// a Client instead.
func Repository(ref string, opts ClientOptions) (*remote.Repository, string, error) {
	if opts.CredentialHost == "" {
		parsed, err := ParseReference(ref)
		if err != nil {
			return nil, "", err
		}
		opts.CredentialHost = parsed.Registry
	}
	c, err := NewClient(opts)
	if err != nil {
		return nil, "", err
	}
	return c.Repository(ref)
}

// BaseURL is the scheme and host of repo's registry.
func BaseURL(repo *remote.Repository) string {
	scheme := "https"
	if repo.PlainHTTP {
		scheme = "http"
	}
	return scheme + "://" + repo.Reference.Host()
}

// newTransport is the HTTP transport every registry of a Client shares.
func newTransport(opts ClientOptions) (*http.Transport, error) {
	maxConns := opts.MaxConns
	if maxConns <= 0 {
		maxConns = 64
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 4 * maxConns
	tr.MaxIdleConnsPerHost = maxConns
	tr.IdleConnTimeout = 90 * time.Second
	tr.ResponseHeaderTimeout = opts.ResponseHeaderTimeout
	if tr.ResponseHeaderTimeout <= 0 {
		tr.ResponseHeaderTimeout = DefaultResponseHeaderTimeout
	}
	tr.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	if opts.CAFile != "" || opts.Insecure {
		cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: opts.Insecure}
		if opts.CAFile != "" {
			pem, err := os.ReadFile(opts.CAFile)
			if err != nil {
				return nil, fmt.Errorf("CA file: %w", err)
			}
			pool, err := x509.SystemCertPool()
			if err != nil {
				pool = x509.NewCertPool()
			}
			if !pool.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("CA file %s holds no PEM certificate", opts.CAFile)
			}
			cfg.RootCAs = pool
		}
		tr.TLSClientConfig = cfg
	}
	return tr, nil
}

// isLocal reports whether host names this machine.
func isLocal(host string) bool {
	h := host
	if hh, _, err := net.SplitHostPort(host); err == nil {
		h = hh
	}
	h = strings.Trim(h, "[]")
	if h == "localhost" {
		return true
	}
	ip := net.ParseIP(h)
	return ip != nil && ip.IsLoopback()
}

// Login checks the credentials against the registry at host, reached as
// opts says (plain HTTP, CA file, insecure), and stores them in Docker's
// credential store (or its credential helper). opts' own credentials are
// not used.
func Login(ctx context.Context, host, username, password string, opts ClientOptions) error {
	opts.Username, opts.Password, opts.CredentialHost = "", "", ""
	c, err := NewClient(opts)
	if err != nil {
		return err
	}
	reg, err := c.Registry(host)
	if err != nil {
		return err
	}
	store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{AllowPlaintextPut: true})
	if err != nil {
		return fmt.Errorf("read Docker credentials: %w", err)
	}
	if err := credentials.Login(ctx, store, reg, auth.Credential{Username: username, Password: password}); err != nil {
		return fmt.Errorf("login to %s: %w", host, err)
	}
	return nil
}

// explain adds a hint to errors that mean the registry cannot be reached,
// that it wants credentials, or that it failed on its side (a registry whose object store is down
// answers 500 to everything; its /readyz says why).
func explain(err error, repo *remote.Repository) error {
	if err == nil {
		return nil
	}
	var resp *errcode.ErrorResponse
	isResp := errors.As(err, &resp)
	var netErr *net.OpError
	switch {
	case errors.As(err, &netErr) && netErr.Op == "dial":
		// The address dialed, not repo's: a copy's source may be the one
		// down.
		addr := repo.Reference.Registry
		if netErr.Addr != nil {
			addr = netErr.Addr.String()
		}
		return fmt.Errorf("%w\ncannot reach the registry at %s: is it running, and are its address and scheme (--plain-http) right?", err, addr)
	case errors.Is(err, auth.ErrBasicCredentialNotFound) || (isResp && resp.StatusCode == http.StatusUnauthorized):
		return fmt.Errorf("%w\nunauthorized: %s needs credentials: run `cryo login %s`, or pass -u with --password-stdin or --password-file", err, repo.Reference.Registry, repo.Reference.Registry)
	case isResp && (resp.StatusCode == http.StatusInternalServerError || resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusServiceUnavailable):
		return fmt.Errorf("%w\nthe registry %s failed on its side (HTTP %d): if its storage is unreachable, its /readyz endpoint says so; read-only mode during gc answers 503 too", err, repo.Reference.Registry, resp.StatusCode)
	}
	return err
}
