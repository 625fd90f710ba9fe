// Command loadbench loads cryo's registry with many node pullers at once and
// compares it, in the same run, with the naive path: the same snapshots
// pushed as plain single-blob OCI artifacts and pulled whole.
//
// Two scenarios: -pullers pullers fetch the same snapshot (-size bytes of
// memory), and -pullers pullers each fetch a different snapshot
// (-variant-size bytes) where every snapshot shares -shared of its chunks
// with the others (later snapshots of one app). Each runs against one
// registry and against two replicas sharing one storage root (half the
// pullers on each), every registry a real `cryo registry serve` process
// started fresh for the run.
//
// A cryo puller is puller.Load: the node puller's fetch scheduler (12
// workers, digest verification, zstd decoding) writing into its own node
// cache, capped at -cache-cap bytes. Like a mount, a load pins its
// snapshot's chunks while it runs: each cache holds its whole snapshot
// until its load ends, then LRU eviction brings it under the cap.
// A naive puller does what `oras pull` does: fetches its artifact's blobs
// with oras-go into files in its own dir, verifying their digests.
//
// Printed, as Markdown: aggregate throughput (snapshot bytes delivered per
// second across all pullers), p50/p99 time for a puller to finish, p50/p99
// chunk (blob) fetch latency, errors (must be 0: the command fails
// otherwise), bytes on the wire, and the registries' CPU seconds and peak
// RSS. -chart writes a PNG of the throughputs.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/barchart"
	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

func main() {
	var cfg config
	flag.IntVar(&cfg.pullers, "pullers", 32, "concurrent pullers")
	flag.Int64Var(&cfg.size, "size", 1<<30, "pages.img bytes of the snapshot every puller fetches")
	flag.Int64Var(&cfg.variantSize, "variant-size", 256<<20, "pages.img bytes of each of the distinct snapshots")
	flag.Float64Var(&cfg.shared, "shared", 0.8, "fraction of a distinct snapshot's memory shared with the others")
	flag.Int64Var(&cfg.cacheCap, "cache-cap", 256<<20, "node cache cap of each cryo puller, bytes")
	flag.StringVar(&cfg.kind, "kind", string(synth.Random), "memory of the synthetic snapshots: random (nothing compresses, no zero pages: cryo's worst case), halfzero or text")
	flag.StringVar(&cfg.bin, "bin", "bin", "directory holding cryo and oras")
	flag.StringVar(&cfg.chart, "chart", "", "write a PNG bar chart of the throughputs here")
	flag.Parse()
	if err := run(context.Background(), cfg); err != nil {
		fmt.Fprintln(os.Stderr, "loadbench:", err)
		os.Exit(1)
	}
}

type config struct {
	pullers                int
	size, variantSize      int64
	shared                 float64
	cacheCap               int64
	kind                   string
	bin, chart, cryo, oras string
	work, root             string
}

// result is one run: a scenario, a registry set-up and a path.
type result struct {
	scenario, setup, path string
	wall                  time.Duration
	logical, wire         int64
	pullerTimes, chunkLat []time.Duration
	errors                int64
	cpu                   time.Duration
	peakRSS               int64
}

func run(ctx context.Context, cfg config) error {
	cfg.cryo, _ = filepath.Abs(filepath.Join(cfg.bin, "cryo"))
	cfg.oras, _ = filepath.Abs(filepath.Join(cfg.bin, "oras"))
	work, err := os.MkdirTemp("/var/tmp", "loadbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	cfg.work, cfg.root = work, filepath.Join(work, "registry")

	// Fill the registry through one writer process, then serve it with
	// fresh processes per run.
	regs, err := startRegistries(cfg, 1)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "pushing the shared snapshot (%d MiB) and %d distinct ones (%d MiB, %.0f%% shared)\n", cfg.size>>20, cfg.pullers, cfg.variantSize>>20, cfg.shared*100)
	if err := pushSnapshot(cfg, regs[0].addr, "same", synth.Kind(cfg.kind), cfg.size, 1, nil); err != nil {
		stopAll(regs)
		return err
	}
	for i := range cfg.pullers {
		if err := pushSnapshot(cfg, regs[0].addr, fmt.Sprintf("v%02d", i), synth.Kind(cfg.kind), cfg.variantSize, 2, &variant{index: i, shared: cfg.shared}); err != nil {
			stopAll(regs)
			return err
		}
	}
	stopAll(regs)
	warm(cfg.root)

	var results []result
	for _, sc := range []string{"same snapshot", "distinct snapshots"} {
		for _, replicas := range []int{1, 2} {
			for _, path := range []string{"cryo", "naive"} {
				r, err := runOne(ctx, cfg, sc, replicas, path)
				if err != nil {
					return err
				}
				fmt.Fprintf(os.Stderr, "%s, %d registr%s, %s: %.2f GB/s, %d errors\n", sc, replicas, plural(replicas), path, gbps(r.logical, r.wall), r.errors)
				results = append(results, r)
			}
		}
	}
	report(cfg, results)
	if cfg.chart != "" {
		c := barchart.Chart{Title: fmt.Sprintf("Aggregate throughput of %d concurrent pullers (GB/s of snapshot delivered)", cfg.pullers), Series: []string{"cryo", "naive (single-blob artifact)"}}
		for i := 0; i+1 < len(results); i += 2 {
			c.Groups = append(c.Groups, strings.Fields(results[i].scenario)[0]+", "+strings.Replace(results[i].setup, "2 registries", "2 replicas", 1))
			c.Values = append(c.Values, []float64{gbps(results[i].logical, results[i].wall), gbps(results[i+1].logical, results[i+1].wall)})
		}
		if err := barchart.WritePNG(cfg.chart, c); err != nil {
			return err
		}
	}
	for _, r := range results {
		if r.errors > 0 {
			return fmt.Errorf("%s, %s, %s: %d errors", r.scenario, r.setup, r.path, r.errors)
		}
	}
	return nil
}

func plural(n int) string {
	if n == 1 {
		return "y"
	}
	return "ies"
}

// variant describes a distinct snapshot: the base memory with 1-shared of
// it rewritten in 10 page-aligned regions chosen by index.
type variant struct {
	index  int
	shared float64
}

// pushSnapshot writes an image dir, pushes it with cryo as <name>:v1 and
// with oras as naive-<name>:v1, and deletes the dir.
func pushSnapshot(cfg config, addr, name string, kind synth.Kind, size int64, seed uint64, v *variant) error {
	dir := filepath.Join(cfg.work, "img-"+name)
	if err := synth.ImageDir(dir, kind, size, seed); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if v != nil {
		if err := rewrite(filepath.Join(dir, "pages.img"), size, v); err != nil {
			return err
		}
	}
	if out, err := exec.Command(cfg.cryo, "push", dir, addr+"/"+name+":v1").CombinedOutput(); err != nil {
		return fmt.Errorf("cryo push %s: %v\n%s", name, err, out)
	}
	c := exec.Command(cfg.oras, "push", "--plain-http", addr+"/naive-"+name+":v1", "checkpoint.img", "pages_meta.img", "pages.img")
	c.Dir = dir
	if out, err := c.CombinedOutput(); err != nil {
		return fmt.Errorf("oras push %s: %v\n%s", name, err, out)
	}
	return nil
}

func rewrite(path string, size int64, v *variant) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	const regions = 10
	pages := size / synth.PageSize
	regionPages := int64(float64(pages) * (1 - v.shared) / regions)
	rng := rand.New(rand.NewPCG(uint64(v.index), 42))
	p, err := synth.NewPages(synth.Random, 1000+uint64(v.index))
	if err != nil {
		return err
	}
	buf := make([]byte, regionPages*synth.PageSize)
	for r := range regions {
		// One region per tenth of the file, at a random page inside it.
		slot := pages / regions
		first := int64(r)*slot + rng.Int64N(max(1, slot-regionPages))
		p.Fill(buf, first)
		if _, err := f.WriteAt(buf, first*synth.PageSize); err != nil {
			return err
		}
	}
	return nil
}

// warm reads every blob once so that no run starts with a colder page
// cache than the next.
func warm(root string) {
	filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			if f, err := os.Open(p); err == nil {
				io.Copy(io.Discard, f)
				f.Close()
			}
		}
		return nil
	})
}

// registry is a `cryo registry serve` process.
type registry struct {
	addr string
	cmd  *exec.Cmd
}

func startRegistries(cfg config, n int) ([]*registry, error) {
	var regs []*registry
	for range n {
		addr, err := benchutil.FreeAddr()
		if err != nil {
			stopAll(regs)
			return nil, err
		}
		cmd := exec.Command(cfg.cryo, "registry", "serve", "--root", cfg.root, "--addr", addr, "--metrics-addr", "")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			stopAll(regs)
			return nil, err
		}
		r := &registry{addr: addr, cmd: cmd}
		regs = append(regs, r)
		for i := 0; ; i++ {
			if resp, err := http.Get("http://" + addr + "/v2/"); err == nil {
				resp.Body.Close()
				break
			}
			if i > 200 {
				stopAll(regs)
				return nil, fmt.Errorf("registry on %s did not start", addr)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return regs, nil
}

func stopAll(regs []*registry) {
	for _, r := range regs {
		syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
		r.cmd.Wait()
	}
}

// cpuAndPeak reads a process's CPU time and peak RSS from /proc.
func cpuAndPeak(pid int) (time.Duration, int64) {
	cpu := benchutil.CPUTime(pid)
	var peak int64
	if f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid)); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if rest, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
				kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
				peak = kb << 10
			}
		}
		f.Close()
	}
	return cpu, peak
}

// stats collects fetch latencies, errors and wire bytes from many pullers.
type stats struct {
	mu     sync.Mutex
	lat    []time.Duration
	errors atomic.Int64
	wire   atomic.Int64
}

func (s *stats) latency(d time.Duration) {
	s.mu.Lock()
	s.lat = append(s.lat, d)
	s.mu.Unlock()
}

// timedFetcher records how long each blob takes, from request to the last
// byte, and counts failed fetches. Manifests, indexes and chunk tables pass
// untimed: the figures are those of the blobs that carry the snapshot.
type timedFetcher struct {
	content.Fetcher
	st *stats
}

func (f timedFetcher) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	switch desc.MediaType {
	case ocispec.MediaTypeImageIndex, ocispec.MediaTypeImageManifest, format.MediaTypeChunkTable:
		return f.Fetcher.Fetch(ctx, desc)
	}
	start := time.Now()
	rc, err := f.Fetcher.Fetch(ctx, desc)
	if err != nil {
		f.st.errors.Add(1)
		return nil, err
	}
	return &timedBody{ReadCloser: rc, start: start, st: f.st}, nil
}

type timedBody struct {
	io.ReadCloser
	start time.Time
	st    *stats
	n     int64
	once  sync.Once
}

func (b *timedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n += int64(n)
	return n, err
}

func (b *timedBody) Close() error {
	b.once.Do(func() {
		b.st.latency(time.Since(b.start))
		b.st.wire.Add(b.n)
	})
	return b.ReadCloser.Close()
}

func runOne(ctx context.Context, cfg config, scenario string, replicas int, path string) (result, error) {
	regs, err := startRegistries(cfg, replicas)
	if err != nil {
		return result{}, err
	}
	defer stopAll(regs)
	res := result{scenario: scenario, setup: fmt.Sprintf("%d registr%s", replicas, plural(replicas)), path: path}
	st := &stats{}
	times := make([]time.Duration, cfg.pullers)
	logical := make([]int64, cfg.pullers)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range cfg.pullers {
		name := "same"
		if scenario != "same snapshot" {
			name = fmt.Sprintf("v%02d", i)
		}
		if path == "naive" {
			name = "naive-" + name
		}
		ref := regs[i%replicas].addr + "/" + name + ":v1"
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			var n int64
			var err error
			if path == "cryo" {
				n, err = cryoPuller(ctx, ref, filepath.Join(cfg.work, fmt.Sprintf("cache-%02d", i)), cfg.cacheCap, st)
			} else {
				n, err = naivePuller(ctx, ref, filepath.Join(cfg.work, fmt.Sprintf("cache-%02d", i)), st)
			}
			if err != nil {
				st.errors.Add(1)
				fmt.Fprintf(os.Stderr, "puller %d (%s): %v\n", i, ref, err)
			}
			times[i], logical[i] = time.Since(t0), n
		}()
	}
	wg.Wait()
	res.wall = time.Since(start)
	for i := range cfg.pullers {
		res.logical += logical[i]
		os.RemoveAll(filepath.Join(cfg.work, fmt.Sprintf("cache-%02d", i)))
	}
	for _, r := range regs {
		cpu, peak := cpuAndPeak(r.cmd.Process.Pid)
		res.cpu += cpu
		res.peakRSS = max(res.peakRSS, peak)
	}
	res.pullerTimes, res.chunkLat, res.errors, res.wire = times, st.lat, st.errors.Load(), st.wire.Load()
	return res, nil
}

// cryoPuller loads a snapshot into its own node cache with puller.Load, as
// the node puller's background load does (its chunks written in place into
// the snapshot's materialized dir), and returns the snapshot's logical
// bytes.
func cryoPuller(ctx context.Context, ref, cacheDir string, capBytes int64, st *stats) (int64, error) {
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		return 0, err
	}
	desc, err := repo.Resolve(ctx, tag)
	if err != nil {
		return 0, fmt.Errorf("resolve: %w", err)
	}
	p, err := puller.New(puller.Options{CacheDir: cacheDir, CacheCap: capBytes, Deadline: time.Minute})
	if err != nil {
		return 0, err
	}
	defer p.Close()
	src := puller.Source{Index: desc, Endpoints: []fetch.Endpoint{{Name: "registry", Store: timedFetcher{Fetcher: repo, st: st}}}}
	snap, err := p.Load(ctx, src)
	if err != nil {
		return 0, err
	}
	return snap.LogicalSize(), nil
}

// naivePuller fetches every layer of a plain artifact into a file in dir,
// verified by digest, as oras pull does.
func naivePuller(ctx context.Context, ref, dir string, st *stats) (int64, error) {
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		return 0, err
	}
	desc, err := repo.Resolve(ctx, tag)
	if err != nil {
		return 0, fmt.Errorf("resolve: %w", err)
	}
	mdata, err := content.FetchAll(ctx, repo, desc)
	if err != nil {
		return 0, err
	}
	m, err := parseManifest(mdata)
	if err != nil {
		return 0, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return 0, err
	}
	var n int64
	for i, l := range m.Layers {
		if err := fetchVerified(ctx, repo, l, filepath.Join(dir, strconv.Itoa(i)), st); err != nil {
			return n, err
		}
		n += l.Size
	}
	return n, nil
}

func fetchVerified(ctx context.Context, repo *remote.Repository, d ocispec.Descriptor, path string, st *stats) error {
	rc, err := timedFetcher{Fetcher: repo, st: st}.Fetch(ctx, d)
	if err != nil {
		return err
	}
	defer rc.Close()
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	defer f.Close()
	vr := content.NewVerifyReader(rc, d)
	if _, err := io.Copy(f, vr); err != nil {
		return err
	}
	if err := vr.Verify(); err != nil {
		return err
	}
	return f.Close()
}

func gbps(n int64, d time.Duration) float64 { return float64(n) / d.Seconds() / 1e9 }

func pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[min(len(s)-1, int(p*float64(len(s))))]
}

func report(cfg config, results []result) {
	fmt.Printf("%d concurrent pullers; %s memory; same snapshot: %d MiB; distinct snapshots: %d MiB each, %.0f%% shared; loopback, %d CPUs shared by pullers and registries\n\n",
		cfg.pullers, cfg.kind, cfg.size>>20, cfg.variantSize>>20, cfg.shared*100, numCPU())
	fmt.Println("| scenario | registries | path | throughput (GB/s) | puller p50 / p99 (s) | blob fetch p50 / p99 (ms) | errors | bytes on the wire (GiB) | registry CPU (s) | registry CPU per GB delivered (s) | registry peak RSS (MiB) |")
	fmt.Println("|---|---|---|---|---|---|---|---|---|---|---|")
	for _, r := range results {
		fmt.Printf("| %s | %s | %s | %.2f | %.1f / %.1f | %.1f / %.1f | %d | %.2f | %.1f | %.2f | %d |\n",
			r.scenario, r.setup, r.path, gbps(r.logical, r.wall),
			pct(r.pullerTimes, 0.5).Seconds(), pct(r.pullerTimes, 0.99).Seconds(),
			float64(pct(r.chunkLat, 0.5).Microseconds())/1000, float64(pct(r.chunkLat, 0.99).Microseconds())/1000,
			r.errors, float64(r.wire)/(1<<30), r.cpu.Seconds(), r.cpu.Seconds()/(float64(r.logical)/1e9), r.peakRSS>>20)
	}
	fmt.Println()
	fmt.Println("| scenario | registries | cryo / naive throughput | cryo / naive bytes on the wire | cryo / naive registry CPU |")
	fmt.Println("|---|---|---|---|---|")
	for i := 0; i+1 < len(results); i += 2 {
		c, n := results[i], results[i+1]
		fmt.Printf("| %s | %s | %.2f | %.2f | %.2f |\n", c.scenario, c.setup,
			gbps(c.logical, c.wall)/gbps(n.logical, n.wall), float64(c.wire)/float64(n.wire), c.cpu.Seconds()/n.cpu.Seconds())
	}
}

func parseManifest(data []byte) (ocispec.Manifest, error) {
	var m ocispec.Manifest
	if err := json.Unmarshal(data, &m); err != nil {
		return m, fmt.Errorf("parse manifest: %w", err)
	}
	return m, nil
}

func numCPU() int { return runtime.NumCPU() }
