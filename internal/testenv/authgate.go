package testenv

import (
	"encoding/base64"
	"net/http"
	"sync"
)

// AuthGate is an http.Handler in front of a registry that demands one
// basic credential (once Require is called) and records every
// Authorization header it receives: tests use it to check which
// credentials reach which registry.
type AuthGate struct {
	next http.Handler

	mu   sync.Mutex
	want string
	seen []string
	reqs int
}

// NewAuthGate returns a gate that lets every request through to next until
// Require is called.
func NewAuthGate(next http.Handler) *AuthGate { return &AuthGate{next: next} }

// Require makes the gate answer 401 to requests without user:pass.
func (g *AuthGate) Require(user, pass string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.want = BasicAuth(user, pass)
}

// Seen returns the Authorization headers received so far (empty ones
// left out).
func (g *AuthGate) Seen() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.seen...)
}

// Requests counts the requests received so far.
func (g *AuthGate) Requests() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reqs
}

// ServeHTTP records the request's credentials and refuses it (401 with a
// basic challenge) unless they are the required ones.
func (g *AuthGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	got := r.Header.Get("Authorization")
	g.mu.Lock()
	g.reqs++
	if got != "" {
		g.seen = append(g.seen, got)
	}
	want := g.want
	g.mu.Unlock()
	if want != "" && got != want {
		w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	g.next.ServeHTTP(w, r)
}

// BasicAuth is the Authorization header value of basic credentials.
func BasicAuth(user, pass string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+pass))
}
