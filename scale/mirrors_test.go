package scale

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
)

var blobGet = regexp.MustCompile(`^/v2/.+/blobs/(sha256:[a-f0-9]{64})$`)

// countingLink is a reverse proxy to the primary that counts the blob GETs
// crossing it, per digest: the link between one region and the primary.
type countingLink struct {
	srv    *httptest.Server
	mu     sync.Mutex
	counts map[string]int
}

func newCountingLink(t *testing.T, primary string) *countingLink {
	t.Helper()
	target, _ := url.Parse("http://" + primary)
	proxy := httputil.NewSingleHostReverseProxy(target)
	l := &countingLink{counts: map[string]int{}}
	l.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if m := blobGet.FindStringSubmatch(r.URL.Path); m != nil && r.Method == http.MethodGet {
			l.mu.Lock()
			l.counts[m[1]]++
			l.mu.Unlock()
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(l.srv.Close)
	return l
}

func (l *countingLink) host() string { return strings.TrimPrefix(l.srv.URL, "http://") }

// snapshot returns a copy of the per-digest counts.
func (l *countingLink) snapshot() map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := make(map[string]int, len(l.counts))
	for k, v := range l.counts {
		c[k] = v
	}
	return c
}

// checkOnce fails the test for every blob fetched more than once.
func checkOnce(t *testing.T, name string, counts map[string]int) {
	t.Helper()
	var twice []string
	for d, n := range counts {
		if n > 1 {
			twice = append(twice, d[:19]+"…×"+string(rune('0'+min(n, 9))))
		}
	}
	sort.Strings(twice)
	if len(twice) > 0 {
		t.Errorf("%s: %d blobs crossed the link more than once: %v", name, len(twice), twice)
	}
}

// node restores the snapshot on a fresh node: a FUSE mount with its own
// cache and the given mirror list, pages.img read in full and compared.
func node(t *testing.T, cryo, ref, want string, mirrors ...string) {
	t.Helper()
	var args []string
	for _, m := range mirrors {
		args = append(args, "--mirror", m)
	}
	dir, stop := mount(t, cryo, ref, args...)
	defer stop()
	got, err := os.ReadFile(filepath.Join(dir, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	wantBytes, _ := os.ReadFile(filepath.Join(want, "pages.img"))
	if !bytes.Equal(got, wantBytes) {
		t.Fatalf("node with mirrors %v: pages.img differs from the source", mirrors)
	}
}

// TestRegionalMirrors runs a primary and two pull-through mirrors, each
// behind its own counted link to the primary, and nodes whose pullers list
// the near mirror first: nodes pull through the near mirror; the primary
// serves each chunk at most once per mirror, even to nodes restoring at the
// same moment; a mirror that is down fails over to the next; a mirror
// serving a corrupt chunk is caught by digest and skipped.
func TestRegionalMirrors(t *testing.T) {
	cryo := testenv.Tool(t, "cryo")
	primary := testenv.StartRegistry(t, "")
	direct := newCountingLink(t, primary.Addr) // nodes to the primary itself
	link1 := newCountingLink(t, primary.Addr)  // region 1's mirror to the primary
	link2 := newCountingLink(t, primary.Addr)  // region 2's mirror to the primary
	m1 := testenv.StartRegistry(t, "", "--mirror-of", "http://"+link1.host())
	m2 := testenv.StartRegistry(t, "", "--mirror-of", "http://"+link2.host())

	img := testenv.ImageDir(t, synth.Random, 48<<20, 7)
	pushed := push(t, cryo, img, primary.Addr+"/app:v1")
	ref := direct.host() + "/app:v1"
	blobBytes := func(r *testenv.Registry) float64 {
		return metric(t, "http://"+r.MetricsAddr+"/metrics", "cryo_registry_response_bytes_total", `kind="blob"`)
	}

	t.Run("nodes pull through the near mirror, the primary serves each chunk once", func(t *testing.T) {
		// Two nodes restoring at the same moment (parallel subtests: the
		// group returns when both have).
		t.Run("at once", func(t *testing.T) {
			for i := range 2 {
				t.Run(fmt.Sprintf("node %d", i), func(t *testing.T) {
					t.Parallel()
					node(t, cryo, ref, img, m1.Addr, m2.Addr)
				})
			}
		})
		node(t, cryo, ref, img, m1.Addr, m2.Addr) // a third node, later
		if got := blobBytes(m1); got < float64(pushed.Stats.StoredBytes) {
			t.Errorf("near mirror served %.0f blob bytes; want at least the snapshot's %d", got, pushed.Stats.StoredBytes)
		}
		if got := blobBytes(m2); got != 0 {
			t.Errorf("far mirror served %.0f blob bytes; want 0", got)
		}
		if d := direct.snapshot(); len(d) != 0 {
			t.Errorf("nodes fetched %d blobs from the primary directly; want 0", len(d))
		}
		c := link1.snapshot()
		if len(c) == 0 {
			t.Fatal("nothing crossed region 1's link: the mirror did not pull through")
		}
		checkOnce(t, "region 1", c)
		t.Logf("region 1: %d blobs crossed the link to the primary for 3 nodes", len(c))
	})

	t.Run("a mirror that is down fails over to the next", func(t *testing.T) {
		m1.Stop()
		node(t, cryo, ref, img, m1.Addr, m2.Addr)
		node(t, cryo, ref, img, m1.Addr, m2.Addr)
		if got := blobBytes(m2); got < float64(pushed.Stats.StoredBytes) {
			t.Errorf("next mirror served %.0f blob bytes; want at least %d", got, pushed.Stats.StoredBytes)
		}
		c := link2.snapshot()
		if len(c) == 0 {
			t.Fatal("nothing crossed region 2's link")
		}
		checkOnce(t, "region 2", c)
		if d := direct.snapshot(); len(d) != 0 {
			t.Errorf("nodes fetched %d blobs from the primary directly; want 0", len(d))
		}
	})

	t.Run("a mirror serving a corrupt chunk is skipped", func(t *testing.T) {
		// Flip bytes in the largest blob the mirror stores (a chunk).
		var biggest string
		var size int64
		filepath.Walk(m2.Root, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode().IsRegular() && fi.Name() == "data" && fi.Size() > size {
				biggest, size = p, fi.Size()
			}
			return nil
		})
		if biggest == "" {
			t.Fatal("mirror 2 stores no blobs")
		}
		data, err := os.ReadFile(biggest)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < len(data); i += 4096 {
			data[i] ^= 0xff
		}
		if err := os.WriteFile(biggest, data, 0o644); err != nil {
			t.Fatal(err)
		}
		corrupt := "sha256:" + filepath.Base(filepath.Dir(biggest))
		node(t, cryo, ref, img, m2.Addr)
		d := direct.snapshot()
		if d[corrupt] != 1 || len(d) != 1 {
			t.Errorf("direct fetches from the primary: %v; want exactly the corrupt chunk %s once", d, corrupt)
		}
	})
}
