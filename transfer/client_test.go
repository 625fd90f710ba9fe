package transfer

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/testenv"
)

// basicRegistry answers /v2/ like a registry with basic auth, through a
// testenv.AuthGate that records every Authorization header it receives.
type basicRegistry struct {
	*testenv.AuthGate
	host string
}

func startBasicRegistry(t *testing.T, user, pass string) *basicRegistry {
	t.Helper()
	gate := testenv.NewAuthGate(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) { w.WriteHeader(http.StatusOK) }))
	gate.Require(user, pass)
	srv := httptest.NewServer(gate)
	t.Cleanup(srv.Close)
	return &basicRegistry{AuthGate: gate, host: strings.TrimPrefix(srv.URL, "http://")}
}

// dockerConfig points DOCKER_CONFIG at a new dir whose config.json holds
// the given host -> user:pass entries.
func dockerConfig(t *testing.T, auths map[string][2]string) {
	t.Helper()
	dir := t.TempDir()
	cfg := map[string]map[string]map[string]string{"auths": {}}
	for host, up := range auths {
		cfg["auths"][host] = map[string]string{"auth": base64.StdEncoding.EncodeToString([]byte(up[0] + ":" + up[1]))}
	}
	data, _ := json.Marshal(cfg)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_CONFIG", dir)
}

// TestCredentialsGoOnlyToTheirRegistry gives a client -u/-p style
// credentials for one registry and has it talk to another (a mirror) too:
// the mirror never receives them; it gets what Docker's credential store
// holds for it, and the primary gets the explicit ones.
func TestCredentialsGoOnlyToTheirRegistry(t *testing.T) {
	primary := startBasicRegistry(t, "alice", "s3cret")
	mirror := startBasicRegistry(t, "bob", "mirror-pw")
	dockerConfig(t, map[string][2]string{mirror.host: {"bob", "mirror-pw"}})
	ctx := context.Background()

	c, err := NewClient(ClientOptions{Username: "alice", Password: "s3cret", CredentialHost: primary.host})
	if err != nil {
		t.Fatal(err)
	}
	for _, host := range []string{primary.host, mirror.host} {
		reg, err := c.Registry(host)
		if err != nil {
			t.Fatal(err)
		}
		if err := reg.Ping(ctx); err != nil {
			t.Errorf("ping %s: %v", host, err)
		}
	}
	// A one-off repository with the same options, on the mirror.
	repo, _, err := Repository(mirror.host+"/app:v1", ClientOptions{Username: "alice", Password: "s3cret", CredentialHost: primary.host})
	if err != nil {
		t.Fatal(err)
	}
	repo.Resolve(ctx, "v1") // 404 after auth; only the headers matter

	for _, h := range mirror.Seen() {
		if h == testenv.BasicAuth("alice", "s3cret") {
			t.Errorf("the mirror received the primary's credentials")
		}
	}
	if !contains(mirror.Seen(), testenv.BasicAuth("bob", "mirror-pw")) {
		t.Errorf("the mirror never received its own credentials from the store: %q", mirror.Seen())
	}
	if !contains(primary.Seen(), testenv.BasicAuth("alice", "s3cret")) {
		t.Errorf("the primary never received the explicit credentials: %q", primary.Seen())
	}

	// Repository without CredentialHost: the credentials are for the
	// registry its reference names.
	repo, _, err = Repository(primary.host+"/app:v1", ClientOptions{Username: "alice", Password: "s3cret"})
	if err != nil {
		t.Fatal(err)
	}
	before := len(primary.Seen())
	repo.Resolve(ctx, "v1")
	if !contains(primary.Seen()[before:], testenv.BasicAuth("alice", "s3cret")) {
		t.Errorf("Repository did not send the credentials to its own registry")
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestRotatedCredentialsAreRead: a long-lived client (the puller daemon's)
// reads Docker's credential store again when its config file changes, as
// a mounted Kubernetes secret does when rotated.
func TestRotatedCredentialsAreRead(t *testing.T) {
	reg := startBasicRegistry(t, "bob", "first")
	dockerConfig(t, map[string][2]string{reg.host: {"bob", "first"}})
	c, err := NewClient(ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Registry(reg.host)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Ping(context.Background()); err != nil {
		t.Fatal(err)
	}
	reg.Require("bob", "second-password")
	cfg := filepath.Join(os.Getenv("DOCKER_CONFIG"), "config.json")
	data, _ := json.Marshal(map[string]any{"auths": map[string]any{reg.host: map[string]string{"auth": base64.StdEncoding.EncodeToString([]byte("bob:second-password"))}}})
	if err := os.WriteFile(cfg, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := r.Ping(context.Background()); err != nil {
		t.Fatalf("after the credential store changed: %v", err)
	}
}

func TestNewClientRefusesCredentialsWithoutRegistry(t *testing.T) {
	if _, err := NewClient(ClientOptions{Username: "alice", Password: "s3cret"}); err == nil {
		t.Fatal("NewClient took credentials without the registry they are for")
	}
}

// TestClientSharesOneAuthClientPerHost: repositories on one host share its
// authenticated client (token cache, credentials), another host has its own.
func TestClientSharesOneAuthClientPerHost(t *testing.T) {
	c, err := NewClient(ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	a, _, _ := c.Repository("reg.example:5000/app:v1")
	b, _, _ := c.Repository("reg.example:5000/other@sha256:" + strings.Repeat("a", 64))
	m, _, _ := c.Repository("mirror.example:5000/app:v1")
	if a.Client != b.Client {
		t.Error("two repositories on one host have different clients")
	}
	if a.Client == m.Client {
		t.Error("two hosts share one authenticated client")
	}
}

// TestResponseHeaderTimeout: a registry that accepts a request and never
// answers fails it (after the retries) instead of hanging it.
func TestResponseHeaderTimeout(t *testing.T) {
	stop := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stop:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(stop)
	c, err := NewClient(ClientOptions{ResponseHeaderTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	repo, _, err := c.Repository(strings.TrimPrefix(srv.URL, "http://") + "/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	// The test's own limit only keeps a hang from lasting forever.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	_, err = repo.Resolve(ctx, "v1")
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "timeout awaiting response headers") {
		t.Fatalf("resolve against a hanging registry: %v, want a response header timeout", err)
	}
}
