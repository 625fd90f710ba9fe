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
	"time"

	"oras.land/oras-go/v2/registry"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/errcode"
)

// DefaultTag is the tag used when a reference names none.
const DefaultTag = "latest"

// ClientOptions say how to reach a registry.
type ClientOptions struct {
	// PlainHTTP forces HTTP (true) or HTTPS (false). Unset, localhost and
	// loopback registries use HTTP, as Docker does, and others HTTPS.
	PlainHTTP *bool
	// Username and Password, if set, are used instead of Docker's
	// credential store.
	Username, Password string
	// MaxConns bounds the idle connections kept per registry (default 64),
	// so that parallel transfers reuse keep-alive connections.
	MaxConns int
	// CAFile is a PEM file of CA certificates to trust besides the
	// system's, for registries with a private CA or a self-signed
	// certificate.
	CAFile string
	// Insecure skips TLS certificate verification (testing only).
	Insecure bool
}

// Repository opens the repository named by ref ("host[:port]/name[:tag|@digest]")
// and returns it with the tag or digest ref names (DefaultTag if none).
func Repository(ref string, opts ClientOptions) (*remote.Repository, string, error) {
	parsed, err := registry.ParseReference(ref)
	if err != nil {
		return nil, "", fmt.Errorf("reference %q: %w", ref, err)
	}
	reference := parsed.Reference
	if reference == "" {
		reference = DefaultTag
		parsed.Reference = DefaultTag
	}
	repo, err := remote.NewRepository(parsed.String())
	if err != nil {
		return nil, "", fmt.Errorf("reference %q: %w", ref, err)
	}
	repo.PlainHTTP = isLocal(parsed.Registry)
	if opts.PlainHTTP != nil {
		repo.PlainHTTP = *opts.PlainHTTP
	}
	client, err := newClient(opts)
	if err != nil {
		return nil, "", err
	}
	repo.Client = client
	repo.SkipReferrersGC = true
	return repo, reference, nil
}

// BaseURL is the scheme and host of repo's registry.
func BaseURL(repo *remote.Repository) string {
	scheme := "https"
	if repo.PlainHTTP {
		scheme = "http"
	}
	return scheme + "://" + repo.Reference.Host()
}

func newClient(opts ClientOptions) (*auth.Client, error) {
	maxConns := opts.MaxConns
	if maxConns <= 0 {
		maxConns = 64
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConns = 4 * maxConns
	tr.MaxIdleConnsPerHost = maxConns
	tr.IdleConnTimeout = 90 * time.Second
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
	c := &auth.Client{
		Client: &http.Client{Transport: newRetryTransport(tr)},
		Cache:  auth.NewCache(),
		Header: http.Header{"User-Agent": {"cryo"}},
	}
	if opts.Username != "" || opts.Password != "" {
		cred := auth.Credential{Username: opts.Username, Password: opts.Password}
		c.Credential = func(context.Context, string) (auth.Credential, error) { return cred, nil }
		return c, nil
	}
	store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{})
	if err != nil {
		return nil, fmt.Errorf("read Docker credentials: %w", err)
	}
	c.Credential = credentials.Credential(store)
	return c, nil
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
	reg, err := remote.NewRegistry(host)
	if err != nil {
		return fmt.Errorf("registry %q: %w", host, err)
	}
	reg.PlainHTTP = isLocal(host)
	if opts.PlainHTTP != nil {
		reg.PlainHTTP = *opts.PlainHTTP
	}
	opts.Username, opts.Password = username, password
	if reg.Client, err = newClient(opts); err != nil {
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

// explain adds a hint to errors that mean the registry wants credentials,
// or that it failed on its side (a registry whose object store is down
// answers 500 to everything; its /readyz says why).
func explain(err error, repo *remote.Repository) error {
	if err == nil {
		return nil
	}
	var resp *errcode.ErrorResponse
	isResp := errors.As(err, &resp)
	switch {
	case errors.Is(err, auth.ErrBasicCredentialNotFound) || (isResp && resp.StatusCode == http.StatusUnauthorized):
		return fmt.Errorf("%w\nunauthorized: %s needs credentials: run `cryo login %s` or pass -u and -p", err, repo.Reference.Registry, repo.Reference.Registry)
	case isResp && (resp.StatusCode == http.StatusInternalServerError || resp.StatusCode == http.StatusBadGateway || resp.StatusCode == http.StatusServiceUnavailable):
		return fmt.Errorf("%w\nthe registry %s failed on its side (HTTP %d): if its storage is unreachable, its /readyz endpoint says so; read-only mode during gc answers 503 too", err, repo.Reference.Registry, resp.StatusCode)
	}
	return err
}
