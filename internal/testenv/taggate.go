package testenv

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"sync"
)

// tagManifest matches a manifest put by tag (not by digest).
var tagManifest = regexp.MustCompile(`^/v2/.+/manifests/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$`)

// TagGate is an http.Handler in front of a registry that, while held,
// passes a manifest PUT by tag on to the registry (which stores the tag)
// and holds its answer back until Release or until the request ends: a
// registry slow to answer once it took a tag. Tests use it to act while a
// tag is being pushed.
type TagGate struct {
	next http.Handler

	mu      sync.Mutex
	release chan struct{} // closed by Release; nil when not held
	seen    chan string
}

// NewTagGate returns a gate that lets every request through to next until
// Hold is called.
func NewTagGate(next http.Handler) *TagGate { return &TagGate{next: next} }

// Hold makes the gate hold the answers of tag PUTs until Release. The
// channel it returns receives the path of each one held, once the
// registry stored it.
func (g *TagGate) Hold() <-chan string {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.release, g.seen = make(chan struct{}), make(chan string, 16)
	return g.seen
}

// Release sends the held answers and stops holding.
func (g *TagGate) Release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.release != nil {
		close(g.release)
		g.release = nil
	}
}

// ServeHTTP passes the request on, holding a tag PUT's answer while held.
func (g *TagGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.mu.Lock()
	release, seen := g.release, g.seen
	g.mu.Unlock()
	if release == nil || r.Method != http.MethodPut || !tagManifest.MatchString(r.URL.Path) {
		g.next.ServeHTTP(w, r)
		return
	}
	rec := httptest.NewRecorder()
	g.next.ServeHTTP(rec, r)
	select {
	case seen <- r.URL.Path:
	default:
	}
	select {
	case <-release:
	case <-r.Context().Done():
		return
	}
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	w.Write(rec.Body.Bytes())
}
