package gofer

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
)

// heldFiles is a file whose reads wait until release is closed, counting
// how many wait at once.
type heldFiles struct {
	release      chan struct{}
	now, highest atomic.Int64
}

func (h *heldFiles) FileSize(path string) (int64, bool) { return 1 << 20, path == "pages.img" }

func (h *heldFiles) ReadAt(ctx context.Context, path string, p []byte, off int64, prio fetch.Priority) error {
	n := h.now.Add(1)
	for {
		m := h.highest.Load()
		if n <= m || h.highest.CompareAndSwap(m, n) {
			break
		}
	}
	<-h.release
	h.now.Add(-1)
	return nil
}

// TestRequestsPerMountBounded: of more GETs of one mount than
// MaxRequestsPerMount at once, only that many are served at a time; the
// rest wait for a turn (they do not fail) and are all served; another
// mount's requests are not held back by them.
func TestRequestsPerMountBounded(t *testing.T) {
	held := &heldFiles{release: make(chan struct{})}
	other := &heldFiles{release: make(chan struct{})}
	close(other.release)
	mux := http.NewServeMux()
	RegisterFiles(mux, func(id string) (Files, digest.Digest, bool) {
		if id == "other" {
			return other, testIndex, true
		}
		return held, testIndex, id == "m"
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	get := func(id string) int {
		req, _ := http.NewRequest("GET", srv.URL+"/v1/mounts/"+id+"/files/pages.img", nil)
		req.Header.Set("Range", "bytes=0-4095")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Error(err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	const n = MaxRequestsPerMount + 8
	var wg sync.WaitGroup
	codes := make(chan int, n)
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); codes <- get("m") }()
	}
	deadline := time.Now().Add(30 * time.Second)
	for held.now.Load() < MaxRequestsPerMount && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	// The others had every chance to get in too.
	time.Sleep(100 * time.Millisecond)
	if got := held.highest.Load(); got != MaxRequestsPerMount {
		t.Errorf("%d reads of one mount served at once, want %d", got, MaxRequestsPerMount)
	}
	if code := get("other"); code != http.StatusPartialContent {
		t.Errorf("another mount's read while the first is at its bound: %d", code)
	}
	close(held.release)
	wg.Wait()
	close(codes)
	for code := range codes {
		if code != http.StatusPartialContent {
			t.Errorf("a read that waited for its turn got %d", code)
		}
	}
}

// TestTurnsStayOneSet has a request look a mount up while all its turns
// are held, then waits until every held turn is given back and as many
// new requests have taken one before it lets the request go on: the new
// requests must have taken turns of the same set the waiting request
// looked up (it then waits for one of them), not of a second set made
// after the first seemed unused, which would let twice
// MaxRequestsPerMount reads of one mount run at once.
func TestTurnsStayOneSet(t *testing.T) {
	tu := &turns{byMount: map[string]*mountTurns{}}
	ctx := context.Background()
	held := make([]*mountTurns, MaxRequestsPerMount)
	for i := range held {
		held[i] = tu.take(ctx, "m")
	}
	looked, goOn := make(chan *mountTurns), make(chan struct{})
	tu.lookedUp = func(m *mountTurns) { looked <- m; <-goOn }
	waiter := make(chan *mountTurns)
	go func() { waiter <- tu.take(ctx, "m") }()
	seen := <-looked
	tu.lookedUp = nil
	for _, m := range held {
		tu.give("m", m)
	}
	for i := range held {
		held[i] = tu.take(ctx, "m")
	}
	close(goOn)
	if held[0] != seen {
		t.Errorf("after a mount's turns were all given back while a request waited, %d new requests took turns of a second set: with the waiting request's, %d reads of the mount at once",
			MaxRequestsPerMount, MaxRequestsPerMount+1)
	}
	tu.give("m", held[0])
	got := <-waiter
	for _, m := range append(held[1:], got) {
		tu.give("m", m)
	}
	if len(tu.byMount) != 0 {
		t.Errorf("%d mounts keep turns after all were given back", len(tu.byMount))
	}
}
