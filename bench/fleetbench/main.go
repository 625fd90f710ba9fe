// Command fleetbench mounts one new snapshot on a fleet of node pullers at
// once and compares sharing chunks between them (--peers) with every node
// fetching from the registry on its own, in the same run (make
// bench-fleet).
//
// Every puller is a real `cryo puller serve` in a network namespace of its
// own, joined to the others and to the registry (a real `cryo registry
// serve`, in its own namespace) by veth pairs on a bridge; the registry's
// link is shaped with the kernel's tbf (-rate), so that its egress, as on
// a real cluster, bounds how fast a fleet loads. All namespaces are made by
// the benchmark and removed at the end; no traffic leaves them.
//
// For each fleet (-fleets: N pullers x snapshot MiB), a new snapshot is
// pushed, then mounted (FUSE, through each node's daemon API) on one node
// alone, on all N without peers, and on all N with peers, each time on
// cold node caches. While each node loads, it reads 4 KiB at random places
// of pages.img every -fault-every (what a page fault costs). Printed, as
// Markdown: the registry's egress (bytes its link sent, against the bytes
// the snapshot takes in the registry), the time until every node is fully
// loaded, the time to ready, the random reads' p50/p99 latency, and the
// bytes that went between peers. -chart writes a PNG of the load times.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/internal/barchart"
	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/synth"
)

type fleet struct {
	n    int
	size int64
}

func (f fleet) String() string { return fmt.Sprintf("%d x %s", f.n, mib(f.size)) }

func mib(n int64) string {
	if n >= 1<<30 && n%(1<<30) == 0 {
		return fmt.Sprintf("%d GiB", n>>30)
	}
	return fmt.Sprintf("%d MiB", n>>20)
}

type config struct {
	cryo       string
	fleets     []fleet
	rate       string
	format     string
	faultEvery time.Duration
	chart      string
	modes      []string
	timeout    time.Duration
	keep       bool
}

// The runs of each fleet.
const (
	modeAlone = "alone"
	modeNo    = "no peers"
	modePeers = "peers"
)

func main() {
	var cfg config
	fleets := flag.String("fleets", "4x1024,16x512,32x256", "fleets to run: N x snapshot MiB, comma-separated")
	modes := flag.String("modes", "alone,nopeers,peers", "runs of each fleet: alone (one node), nopeers (N nodes on the registry), peers (N nodes sharing chunks)")
	flag.StringVar(&cfg.cryo, "cryo", "bin/cryo", "the cryo binary")
	flag.StringVar(&cfg.rate, "rate", "200mbit", "the registry link's rate (tbf)")
	flag.StringVar(&cfg.format, "format", "v1", "snapshot format (cryo push --format)")
	flag.DurationVar(&cfg.faultEvery, "fault-every", 100*time.Millisecond, "how often each node reads 4 KiB at a random place of pages.img while it loads")
	flag.StringVar(&cfg.chart, "chart", "", "write a PNG chart of the load times here")
	flag.DurationVar(&cfg.timeout, "timeout", 20*time.Minute, "bound of each run")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the work dir (the pullers' logs; not their caches)")
	flag.Parse()
	for _, f := range strings.Split(*fleets, ",") {
		a, b, ok := strings.Cut(strings.TrimSpace(f), "x")
		n, err1 := strconv.Atoi(a)
		m, err2 := strconv.ParseInt(b, 10, 64)
		if !ok || err1 != nil || err2 != nil || n < 1 || n > 500 || m < 1 {
			fatal(fmt.Errorf("-fleets %q: want N x MiB, e.g. 4x1024", f))
		}
		cfg.fleets = append(cfg.fleets, fleet{n, m << 20})
	}
	for _, m := range strings.Split(*modes, ",") {
		switch m {
		case "alone":
			cfg.modes = append(cfg.modes, modeAlone)
		case "nopeers":
			cfg.modes = append(cfg.modes, modeNo)
		case "peers":
			cfg.modes = append(cfg.modes, modePeers)
		default:
			fatal(fmt.Errorf("-modes: unknown %q", m))
		}
	}
	if err := runAll(cfg); err != nil {
		fatal(err)
	}
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "fleetbench:", err)
	os.Exit(1)
}

// result is one run: one fleet, one mode.
type result struct {
	fleet     fleet
	mode      string
	stored    int64
	egress    int64 // bytes the registry's link sent
	blobs     int64 // blob bytes the registry served
	allLoaded time.Duration
	loaded    []float64 // seconds, per node
	ready     []float64 // seconds, per node
	faults    []float64 // milliseconds
	fromPeers float64
	// peerErrors counts the pullers' failed peer requests by kind
	// (cryo_puller_peer_errors_total): why chunks went upstream.
	peerErrors map[string]float64
	// cpu is the CPU time the pullers used, busy that time over the
	// run's wall time on every core of the machine.
	cpu  time.Duration
	busy float64
}

func runAll(cfg config) error {
	if os.Geteuid() != 0 {
		return errors.New("needs root: it makes network namespaces and FUSE mounts")
	}
	for _, tool := range []string{"ip", "tc", "nsenter"} {
		if _, err := exec.LookPath(tool); err != nil {
			return fmt.Errorf("needs %s (iproute2, util-linux): %w", tool, err)
		}
	}
	cryo, err := filepath.Abs(cfg.cryo)
	if err != nil {
		return err
	}
	cfg.cryo = cryo
	if _, err := os.Stat(cryo); err != nil {
		return fmt.Errorf("no cryo binary (make build): %w", err)
	}
	work, err := os.MkdirTemp("", "fleetbench-")
	if err != nil {
		return err
	}
	if cfg.keep {
		fmt.Fprintln(os.Stderr, "fleetbench: work dir", work)
	} else {
		defer os.RemoveAll(work)
	}
	maxN := 1
	for _, f := range cfg.fleets {
		maxN = max(maxN, f.n)
	}
	prefix := "cfb-"
	removeStale(prefix)
	nw, err := newNetwork(prefix, maxN, cfg.rate)
	if err != nil {
		return err
	}
	defer nw.close()
	token := filepath.Join(work, "token")
	secret := make([]byte, 32)
	rand.Read(secret)
	if err := os.WriteFile(token, []byte(base64.StdEncoding.EncodeToString(secret)), 0o600); err != nil {
		return err
	}
	regRoot := filepath.Join(work, "registry")
	reg, err := start(filepath.Join(work, "registry.log"), "cryo registry listening", nw.registryNS(), cryo, "registry", "serve", "--addr", registryIP+":5000", "--metrics-addr", registryIP+":5001", "--root", regRoot)
	if err != nil {
		return err
	}
	defer reg.stop()

	var results []result
	for fi, f := range cfg.fleets {
		img := filepath.Join(work, "image")
		if err := synth.ImageDir(img, synth.HalfZero, f.size, uint64(100+fi)); err != nil {
			return err
		}
		ref := fmt.Sprintf("%s:5000/fleet%d:v1", registryIP, fi)
		before := blobBytes(regRoot)
		push := exec.Command("ip", "netns", "exec", nw.nodeNS(0), cryo, "push", "--plain-http", "--format", cfg.format, img, ref)
		if out, err := push.CombinedOutput(); err != nil {
			return fmt.Errorf("push: %v: %s", err, out)
		}
		os.RemoveAll(img)
		stored := blobBytes(regRoot) - before
		fmt.Fprintf(os.Stderr, "fleetbench: %s: pushed %s, %s stored\n", f, ref, mib(stored))
		for _, mode := range cfg.modes {
			n := f.n
			if mode == modeAlone {
				n = 1
			}
			ctx, cancel := context.WithTimeout(context.Background(), cfg.timeout)
			r, err := runFleet(ctx, cfg, nw, filepath.Join(work, fmt.Sprintf("run-%d-%s", fi, strings.ReplaceAll(mode, " ", ""))), token, ref, n, f.size, mode == modePeers)
			cancel()
			if err != nil {
				return fmt.Errorf("%s, %s: %w", f, mode, err)
			}
			r.fleet, r.mode, r.stored = f, mode, stored
			fmt.Fprintf(os.Stderr, "fleetbench: %s, %s: all loaded in %.1f s, registry served %.2fx stored\n", f, mode, r.allLoaded.Seconds(), float64(r.blobs)/float64(stored))
			results = append(results, r)
		}
	}
	report(cfg, results)
	if cfg.chart != "" {
		return writeChart(cfg, results)
	}
	return nil
}

// blobBytes sums the blob files of a filesystem registry's storage.
func blobBytes(root string) int64 {
	var n int64
	filepath.Walk(filepath.Join(root, "docker", "registry", "v2", "blobs"), func(_ string, info os.FileInfo, err error) error {
		if err == nil && info.Mode().IsRegular() {
			n += info.Size()
		}
		return nil
	})
	return n
}

// process is a cryo process running in a namespace.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// start runs args in network namespace ns (nsenter, which execs them:
// the pid is theirs; unlike ip netns exec, it keeps the mount namespace,
// so the FUSE mounts a puller makes are seen here) with stderr to log,
// and waits up to 30 s for a line of its stdout to start with ready.
func start(log, ready, ns string, args ...string) (*process, error) {
	lf, err := os.Create(log)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("nsenter", append([]string{"--net=/run/netns/" + ns, "--"}, args...)...)
	cmd.Stderr = lf
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	up := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(out)
		once := sync.Once{}
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), ready) {
				once.Do(func() { close(up) })
			}
		}
	}()
	go func() {
		cmd.Wait()
		lf.Close()
		close(p.done)
	}()
	select {
	case <-up:
		return p, nil
	case <-p.done:
		b, _ := os.ReadFile(log)
		return nil, fmt.Errorf("%s exited: %s", strings.Join(args, " "), tail(b))
	case <-time.After(30 * time.Second):
		p.stop()
		return nil, fmt.Errorf("%s not up after 30 s", strings.Join(args, " "))
	}
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// stop sends SIGTERM, and SIGKILL after 10 s.
func (p *process) stop() {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// daemon is one node's puller and its API client.
type daemon struct {
	proc   *process
	client *http.Client
	dir    string
}

func (d *daemon) do(ctx context.Context, method, path string, body any, out any) error {
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://puller"+path, rd)
	if err != nil {
		return err
	}
	resp, err := d.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		return fmt.Errorf("%s %s: %s: %s", method, path, resp.Status, strings.TrimSpace(string(data)))
	}
	if out != nil {
		return json.Unmarshal(data, out)
	}
	return nil
}

// mountInfo is what the daemon API says of a mount.
type mountInfo struct {
	ID           string  `json:"id"`
	Dir          string  `json:"dir"`
	ReadySeconds float64 `json:"readySeconds"`
	Loaded       bool    `json:"loaded"`
	Err          string  `json:"error"`
}

// startDaemons starts n pullers, node i in its namespace, with cold
// caches under dir; with peers, each serves and asks the others.
func startDaemons(cfg config, nw *network, dir, token string, n int, peers bool) ([]*daemon, error) {
	var list []string
	for i := range n {
		list = append(list, nodeIP(i)+":7070")
	}
	ds := make([]*daemon, 0, n)
	for i := range n {
		nd := filepath.Join(dir, fmt.Sprintf("n%d", i))
		if err := os.MkdirAll(nd, 0o700); err != nil {
			return ds, err
		}
		sock := filepath.Join(nd, "puller.sock")
		args := []string{cfg.cryo, "puller", "serve", "--plain-http", "--socket", sock, "--cache", filepath.Join(nd, "cache"), "--mounts", filepath.Join(nd, "mnt"), "--profile", "none"}
		if i == 1 && os.Getenv("CRYO_FLEET_CPUPROFILE") != "" {
			// One puller's CPU profile, to see where a fleet's time goes.
			args = append(args, "--cpuprofile", os.Getenv("CRYO_FLEET_CPUPROFILE"))
		}
		if peers {
			args = append(args, "--peer-listen", nodeIP(i)+":7070", "--peers", strings.Join(list, ","), "--peer-token-file", token)
		}
		p, err := start(filepath.Join(nd, "puller.log"), "cryo puller listening", nw.nodeNS(i), args...)
		if err != nil {
			return ds, err
		}
		client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
		ds = append(ds, &daemon{proc: p, client: client, dir: nd})
	}
	return ds, nil
}

// runFleet mounts ref on n fresh pullers at once and waits until every
// one has loaded it.
func runFleet(ctx context.Context, cfg config, nw *network, dir, token, ref string, n int, size int64, peers bool) (result, error) {
	var r result
	os.RemoveAll(dir)
	defer func() {
		// The caches go; with -keep, the logs stay.
		if !cfg.keep {
			os.RemoveAll(dir)
			return
		}
		for i := range n {
			os.RemoveAll(filepath.Join(dir, fmt.Sprintf("n%d", i), "cache"))
		}
	}()
	ds, err := startDaemons(cfg, nw, dir, token, n, peers)
	defer func() {
		for _, d := range ds {
			d.proc.stop()
		}
	}()
	if err != nil {
		return r, err
	}
	sent0, err := nw.registrySent()
	if err != nil {
		return r, err
	}
	blobs0, err := nw.registryBlobBytes()
	if err != nil {
		return r, fmt.Errorf("registry metrics: %w", err)
	}
	start := time.Now()
	var mu sync.Mutex
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var m mountInfo
			if err := d.do(ctx, http.MethodPost, "/v1/mounts", map[string]string{"ref": ref, "profile": "none"}, &m); err != nil {
				errs[i] = err
				return
			}
			ready := time.Since(start).Seconds()
			stop := make(chan struct{})
			faults := make(chan []float64, 1)
			go func() { faults <- randomReads(filepath.Join(m.Dir, "pages.img"), size, cfg.faultEvery, stop) }()
			var w mountInfo
			err := d.do(ctx, http.MethodPost, "/v1/mounts/"+m.ID+"/wait", nil, &w)
			loaded := time.Since(start)
			close(stop)
			fs := <-faults
			if err == nil && w.Err != "" {
				err = errors.New(w.Err)
			}
			if err != nil {
				errs[i] = fmt.Errorf("node %d: %w", i, err)
				return
			}
			mu.Lock()
			r.ready = append(r.ready, ready)
			r.loaded = append(r.loaded, loaded.Seconds())
			r.allLoaded = max(r.allLoaded, loaded)
			r.faults = append(r.faults, fs...)
			mu.Unlock()
			d.do(context.Background(), http.MethodDelete, "/v1/mounts/"+m.ID, nil, nil)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return r, err
	}
	sent1, err := nw.registrySent()
	if err != nil {
		return r, err
	}
	r.egress = sent1 - sent0
	blobs1, err := nw.registryBlobBytes()
	if err != nil {
		return r, fmt.Errorf("registry metrics: %w", err)
	}
	r.blobs = blobs1 - blobs0
	wall := time.Since(start)
	for _, d := range ds {
		r.fromPeers += scrape(d, "cryo_puller_peer_received_bytes_total")
		for _, kind := range []string{"unreachable", "timeout", "refused", "busy", "corrupt", "short", "local", "other"} {
			if v := scrape(d, `cryo_puller_peer_errors_total{kind="`+kind+`"}`); v > 0 {
				if r.peerErrors == nil {
					r.peerErrors = map[string]float64{}
				}
				r.peerErrors[kind] += v
			}
		}
		r.cpu += benchutil.CPUTime(d.proc.cmd.Process.Pid)
	}
	r.busy = r.cpu.Seconds() / (wall.Seconds() * float64(runtime.NumCPU()))
	return r, nil
}

// randomReads reads 4 KiB at a random page of path every interval until
// stop, and returns each read's latency in milliseconds.
func randomReads(path string, size int64, every time.Duration, stop <-chan struct{}) []float64 {
	f, err := os.Open(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fleetbench: random reads:", err)
		return nil
	}
	defer f.Close()
	var out []float64
	buf := make([]byte, 4096)
	t := time.NewTicker(every)
	defer t.Stop()
	for i := 0; i < 100000; i++ {
		if i > 0 {
			select {
			case <-stop:
				return out
			case <-t.C:
			}
		}
		off := mrand.Int64N(size/4096) * 4096
		start := time.Now()
		if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, io.EOF) {
			fmt.Fprintln(os.Stderr, "fleetbench: random read:", err)
			continue
		}
		out = append(out, float64(time.Since(start).Microseconds())/1000)
	}
	return out
}

// scrape sums metric name in the daemon's /metrics.
func scrape(d *daemon, name string) float64 {
	v, _ := sumMetric(d.client, "http://puller/metrics", name)
	return v
}

// sumMetric sums the samples of series at url's Prometheus text: a
// metric name (every label set) or a name with its labels (that set).
func sumMetric(c *http.Client, url, series string) (float64, error) {
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, series+" ") || (!strings.Contains(series, "{") && strings.HasPrefix(line, series+"{")) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			sum += v
		}
	}
	return sum, sc.Err()
}

func report(cfg config, rs []result) {
	fmt.Printf("\nRegistry link: tbf %s on its egress; snapshots: synthetic, half zero pages, format %s; one FUSE mount per node through its daemon, cold node caches.\n\n", cfg.rate, cfg.format)
	fmt.Println("| fleet | run | registry link sent | blob bytes served | x stored | every node loaded (s) | loaded p50 (s) | ready max (s) | 4 KiB random reads: n, p50 / p99 (ms) | from peers | pullers' CPU (s), machine busy |")
	fmt.Println("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	for _, r := range rs {
		fmt.Printf("| %s | %s | %s | %s | %.2f | %.1f | %.1f | %.2f | %d, %.1f / %.1f | %s | %.0f, %.0f%% |\n", r.fleet, r.mode, mib(r.egress), mib(r.blobs), float64(r.blobs)/float64(r.stored),
			r.allLoaded.Seconds(), benchutil.Median(r.loaded), maxOf(r.ready), len(r.faults), benchutil.Percentile(r.faults, 0.5), benchutil.Percentile(r.faults, 0.99), mib(int64(r.fromPeers)), r.cpu.Seconds(), 100*r.busy)
	}
	fmt.Println()
	for _, r := range rs {
		if len(r.peerErrors) == 0 {
			continue
		}
		kinds := make([]string, 0, len(r.peerErrors))
		for k := range r.peerErrors {
			kinds = append(kinds, k)
		}
		sort.Strings(kinds)
		var parts []string
		for _, k := range kinds {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, r.peerErrors[k]))
		}
		fmt.Printf("- %s, %s: peer requests that failed: %s\n", r.fleet, r.mode, strings.Join(parts, ", "))
	}
	byFleet := map[fleet]map[string]result{}
	for _, r := range rs {
		if byFleet[r.fleet] == nil {
			byFleet[r.fleet] = map[string]result{}
		}
		byFleet[r.fleet][r.mode] = r
	}
	for _, f := range cfg.fleets {
		m := byFleet[f]
		p, ok := m[modePeers]
		if !ok {
			continue
		}
		line := fmt.Sprintf("%s: with peers, the registry served %.2fx the stored size in blobs (target <= 1.1; its link sent %.2fx, headers included)", f, float64(p.blobs)/float64(p.stored), float64(p.egress)/float64(p.stored))
		if a, ok := m[modeAlone]; ok {
			line += fmt.Sprintf("; every node loaded in %.2fx one node's time alone (target <= 1.5)", p.allLoaded.Seconds()/a.allLoaded.Seconds())
		}
		if np, ok := m[modeNo]; ok {
			line += fmt.Sprintf("; random read p99 %.1f ms vs %.1f ms without peers; %.1fx faster than without", benchutil.Percentile(p.faults, 0.99), benchutil.Percentile(np.faults, 0.99), np.allLoaded.Seconds()/p.allLoaded.Seconds())
		}
		fmt.Println("- " + line)
	}
}

func maxOf(v []float64) float64 {
	_, hi := benchutil.MinMax(v)
	return hi
}

func writeChart(cfg config, rs []result) error {
	c := barchart.Chart{Title: fmt.Sprintf("Time until every node has loaded a new snapshot (s), registry link %s", cfg.rate), Format: "%.0f"}
	idx := map[string]int{}
	for _, m := range cfg.modes {
		idx[m] = len(c.Series)
		c.Series = append(c.Series, m)
	}
	for _, f := range cfg.fleets {
		c.Groups = append(c.Groups, f.String())
		row := make([]float64, len(c.Series))
		for _, r := range rs {
			if r.fleet == f {
				row[idx[r.mode]] = r.allLoaded.Seconds()
			}
		}
		c.Values = append(c.Values, row)
	}
	return barchart.WritePNG(cfg.chart, c)
}
