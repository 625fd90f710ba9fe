// Package anchors benchmarks where the chunk index keeps the anchors of
// format v2 snapshots, in the object store or in redis, for pushes of
// memory another repository holds (docs/benchmarks.md, "Anchors in
// redis"). The registry reaches SeaweedFS through a proxy that counts
// its requests and delays each by -latency, as an object store across a
// network would: on loopback SeaweedFS answers in a millisecond, S3 in
// 20-50 ms.
//
//	go test ./bench/anchors -run '^$' -bench Anchors -benchtime 1x [-size 1024] [-latency 20ms]
package anchors

import (
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
)

var (
	sizeMiB = flag.Int64("size", 1024, "pages.img size of the snapshot, MiB")
	latency = flag.Duration("latency", 20*time.Millisecond, "delay added to each request of the registry to the object store")
	rewrite = flag.Float64("rewrite", 0.1, "share of the pages the second snapshot rewrites")
)

// delayProxy forwards to an object store, counting requests and
// delaying each.
type delayProxy struct {
	url      string
	requests atomic.Int64
	mu       sync.Mutex
	kinds    map[string]int64 // by method and kind of path
}

// kindOf names what an S3 request of the registry touches.
func kindOf(r *http.Request) string {
	p := r.URL.Path
	method := r.Method
	if prefix := r.URL.Query().Get("prefix"); prefix != "" && method == http.MethodGet {
		p, method = "/"+prefix, "LIST"
	}
	if r.Method == http.MethodPost && r.URL.Query().Has("delete") {
		method = "DELETE"
	}
	kind := "other"
	switch {
	case strings.Contains(p, "/cryo/v1/"):
		kind = "chunk index"
	case strings.Contains(p, "/_uploads/"):
		kind = "uploads"
	case strings.Contains(p, "/_layers/") || strings.Contains(p, "/_manifests/"):
		kind = "links"
	case strings.Contains(p, "/blobs/"):
		kind = "blob data"
	}
	return method + " " + kind
}

// take returns the requests counted by kind since the last take.
func (p *delayProxy) take() map[string]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := p.kinds
	p.kinds = map[string]int64{}
	return k
}

func newDelayProxy(b *testing.B, target string, delay time.Duration) *delayProxy {
	u, err := url.Parse(target)
	if err != nil {
		b.Fatal(err)
	}
	p := &delayProxy{kinds: map[string]int64{}}
	rp := httputil.NewSingleHostReverseProxy(u)
	addr := testenv.FreeAddr(b)
	srv := &http.Server{Addr: addr, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.requests.Add(1)
		p.mu.Lock()
		p.kinds[kindOf(r)]++
		p.mu.Unlock()
		time.Sleep(delay)
		rp.ServeHTTP(w, r)
	})}
	go srv.ListenAndServe()
	b.Cleanup(func() { srv.Close() })
	p.url = "http://" + addr
	return p
}

// config writes a registry configuration on the store behind proxy, under
// root, with the redis blob descriptor cache (as the chart's replicas).
func config(b *testing.B, store, redis, root string) string {
	cfg := fmt.Sprintf(`version: "0.1"
log: {level: error, accesslog: {disabled: true}}
http: {addr: ":5000", secret: bench}
redis: {addrs: [%q]}
storage:
  cache: {blobdescriptor: redis}
  delete: {enabled: true}
  redirect: {disable: true}
  maintenance: {uploadpurging: {enabled: false}}
  s3: {bucket: cryo, region: us-east-1, regionendpoint: %q, forcepathstyle: true, secure: false, rootdirectory: %q}
`, redis, store, root)
	path := filepath.Join(b.TempDir(), "registry.yml")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		b.Fatal(err)
	}
	return path
}

// pushStats is the part of `cryo push --json` the benchmark reports.
type pushStats struct {
	Stats struct {
		StoredBytes   int64 `json:"storedBytes"`
		UploadedBytes int64 `json:"uploadedBytes"`
		ComposedBytes int64 `json:"composedBytes"`
	} `json:"stats"`
}

func BenchmarkAnchors(b *testing.B) {
	cryo := testenv.Tool(b, "cryo")
	weed := testenv.StartSeaweedFS(b)
	for _, kv := range weed.Env() {
		k, v, _ := strings.Cut(kv, "=")
		b.Setenv(k, v)
	}
	proxy := newDelayProxy(b, weed.S3, *latency)
	dir := b.TempDir()
	img, img2 := filepath.Join(dir, "img"), filepath.Join(dir, "img2")
	if err := synth.ImageDir(img, synth.Text, *sizeMiB<<20, 1); err != nil {
		b.Fatal(err)
	}
	mk := exec.Command("go", "run", "./bench/mkimage", "-from", img, "-rewrite", fmt.Sprint(*rewrite), "-indels", "16", "-kind", "text", "-seed", "2", img2)
	root, _ := testenv.RepoRoot()
	mk.Dir = root
	if out, err := mk.CombinedOutput(); err != nil {
		b.Fatalf("mkimage: %v\n%s", err, out)
	}
	var rows, breakdown []string
	for i := 0; i < b.N; i++ {
		for _, anchors := range []string{"storage", "redis"} {
			// A redis of its own: the blob descriptor cache of one run
			// must not answer for blobs of another's root.
			redis := testenv.StartRedis(b)
			cfg := config(b, proxy.url, redis, fmt.Sprintf("/bench-%d-%s", i, anchors))
			addr := testenv.FreeAddr(b)
			reg := testenv.StartCommand(b, addr, cryo, "registry", "serve", "--config", cfg, "--addr", addr, "--metrics-addr", "", "--chunk-index-anchors", anchors)
			for _, step := range []struct{ what, dir, repo string }{
				{"first push", img, "a"},
				{"the same memory, another repository", img, "b"},
				{fmt.Sprintf("%.0f%% rewritten, another repository", *rewrite*100), img2, "c"},
			} {
				before := proxy.requests.Load()
				proxy.take()
				start := time.Now()
				cmd := exec.Command(cryo, "push", "--json", step.dir, addr+"/"+step.repo+":v1")
				var stderr strings.Builder
				cmd.Stderr = &stderr
				out, err := cmd.Output()
				wall := time.Since(start)
				if err != nil {
					b.Fatalf("cryo push %s: %v\n%s%s\nregistry:\n%s", step.repo, err, out, stderr.String(), reg.Log())
				}
				var s pushStats
				if err := json.Unmarshal(out, &s); err != nil {
					b.Fatalf("cryo push --json: %v\n%s", err, out)
				}
				rows = append(rows, fmt.Sprintf("| %s | %s | %.2f | %d | %.1f MiB | %.1f MiB |", anchors, step.what, wall.Seconds(),
					proxy.requests.Load()-before, float64(s.Stats.UploadedBytes)/(1<<20), float64(s.Stats.ComposedBytes)/(1<<20)))
				kinds := proxy.take()
				names := make([]string, 0, len(kinds))
				for k := range kinds {
					names = append(names, k)
				}
				sort.Slice(names, func(i, j int) bool { return kinds[names[i]] > kinds[names[j]] })
				var parts []string
				for _, k := range names {
					parts = append(parts, fmt.Sprintf("%s %d", k, kinds[k]))
				}
				breakdown = append(breakdown, fmt.Sprintf("- %s, %s: %s", anchors, step.what, strings.Join(parts, ", ")))
			}
			reg.Stop()
		}
	}
	fmt.Printf("\nv2 pushes to a registry on SeaweedFS behind %v per request, %d MiB pages.img (text-like):\n\n", *latency, *sizeMiB)
	fmt.Println("| anchors in | push | wall (s) | object store requests | uploaded | composed |")
	fmt.Println("|---|---|--:|--:|--:|--:|")
	for _, r := range rows {
		fmt.Println(r)
	}
	fmt.Println("\nObject store requests by method and what they touch:")
	fmt.Println()
	for _, b := range breakdown {
		fmt.Println(b)
	}
}
