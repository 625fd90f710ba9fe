package restore

import (
	"bufio"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
)

var (
	sizesFlag = flag.String("sizes", "256,1024", "app memory sizes in MiB")
	repsFlag  = flag.Int("reps", 3, "repetitions on loopback")
	shapedRep = flag.Int("shaped-reps", 1, "repetitions on each shaped link")
	linksFlag = flag.String("links", "loopback,1gbit-5ms,100mbit-25ms", "links: loopback and/or shaped NAME-RTT with NAME 1gbit or 100mbit")
	chartFlag = flag.String("chart", "", "write a PNG bar chart of the loopback results here")
	formatFl  = flag.String("format", "v2", "snapshot formats cryo pushes, comma-separated (v1, v2): the cold cryo paths run once for each, side by side")
	regRoot   = flag.String("registry-root", "", "the registry's storage root (default: a temp dir); on tmpfs (/dev/shm/...) the registry, remote in real use, does not share the node's disk")
)

// The six ways back to a running app.
const (
	localCold = "local dir, cold page cache"
	localWarm = "local dir, warm page cache"
	naive     = "oras pull + runsc restore"
	cryoGofer = "cryo restore --backend gofer, cold node cache"
	cryoCold  = "cryo restore --backend fuse, cold node cache"
	cryoWarm  = "cryo restore, warm node cache (materialized)"
)

// paths are the paths measured (BenchmarkRestore sets them from the
// formats): a cold cryo path of a format other than the first carries
// its name after formatSep.
var paths = pathsFromEnv([]string{"v1"})

// formatSep ends a path's name before its format.
const formatSep = ", format "

// pathFormat splits a path into its kind (one of the consts above) and the
// format cryo restores (first, if the path names none).
func pathFormat(path, first string) (string, string) {
	if i := strings.Index(path, formatSep); i >= 0 {
		return path[:i], path[i+len(formatSep):]
	}
	return path, first
}

// loadedLine is what cryo restore prints when runsc wait --restore returns.
var loadedLine = regexp.MustCompile(`cryo: all pages loaded after ([0-9.]+) s`)

// sample is one restore: seconds until the app runs again and until every
// page is loaded, registry blob bytes, and for cryo the cryo process's
// peak RSS and block-device writes, in bytes.
type sample struct {
	running, loaded, wire, rss, writes float64
	// stored (s) is when the restore command exited: for cryo, once the
	// snapshot is materialized on the node (committed and fsynced) for
	// later restores; for the naive path, once runsc wait --restore
	// returned, oras pull's files having been on disk since before.
	stored float64
	// requests and regCPU (s) are the registry's, while the path ran.
	requests, regCPU float64
}

// BenchmarkRestore measures, for each app size and link, the time from the
// restore command's start until the app's next output line, and until all
// its memory is loaded, for the five paths, reps interleaved, and prints a
// Markdown table with the ratios the targets are stated in.
func BenchmarkRestore(b *testing.B) {
	runsc := gvisortest.Runsc(b)
	cryo, oras := testenv.Tool(b, "cryo"), testenv.Tool(b, "oras")
	reg, sizes, links := setup(b)
	formats := strings.Split(*formatFl, ",")
	paths = pathsFromEnv(formats)
	results := map[string][]sample{} // size|link|path
	for _, mib := range sizes {
		app := gvisortest.StartApp(b, runsc, gvisortest.AppOptions{MemoryMiB: mib, Interval: 5 * time.Millisecond})
		app.NextCount(b)
		img := app.Checkpoint(b)
		tag := fmt.Sprintf("m%d", mib)
		pushBoth(b, cryo, oras, img, reg.Addr, tag, "--format", formats[0])
		for _, f := range formats[1:] {
			testenv.Run(b, cryo, "push", "--format", f, img, reg.Addr+"/cryo:"+tag+"-"+f)
		}
		for _, link := range links {
			addr := reg.Addr
			reps := *repsFlag
			if link.BitsPerSecond > 0 || link.RTT > 0 {
				p, err := testenv.StartProxy(reg.Addr, link)
				if err != nil {
					b.Fatal(err)
				}
				defer p.Close()
				addr = p.Addr()
				reps = *shapedRep
			}
			for r := range reps {
				// Removed after each rep (its paths share the caches): a
				// 2 GiB app's copies over many reps fill the disk.
				work, err := os.MkdirTemp("", "cryo-bench-restore-")
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { os.RemoveAll(work) })
				cache := filepath.Join(work, "cache")
				for _, path := range paths {
					var cmd *exec.Cmd
					kind, format := pathFormat(path, formats[0])
					ref, caches := addr+"/cryo:"+tag, work
					if format != formats[0] {
						ref += "-" + format
						caches = filepath.Join(work, format)
					}
					switch kind {
					case localCold:
						if err := benchutil.DropCaches(); err != nil {
							b.Fatal(err)
						}
						cmd = shell(app, runscRestore(app, img)+" && "+runscWait(app))
					case localWarm:
						warm(img)
						cmd = shell(app, runscRestore(app, img)+" && "+runscWait(app))
					case naive:
						if err := benchutil.DropCaches(); err != nil {
							b.Fatal(err)
						}
						out := filepath.Join(work, "oras-out")
						cmd = shell(app, fmt.Sprintf("mkdir -p %s && %s pull --plain-http -o %s %s/oras:%s >/dev/null && ", out, oras, out, addr, tag)+
							runscRestore(app, out)+" && "+runscWait(app))
					case cryoGofer, cryoCold, cryoWarm:
						if kind != cryoWarm {
							if err := benchutil.DropCaches(); err != nil {
								b.Fatal(err)
							}
						} else {
							warm(filepath.Join(cache, "images"))
						}
						args := []string{"restore", "--cache", filepath.Join(caches, "cache"), "--runsc", runsc}
						switch kind {
						case cryoGofer:
							// A cache of its own: cold, as the FUSE path's.
							args = []string{"restore", "--cache", filepath.Join(caches, "cache-gofer"), "--runsc", runsc, "--backend", "gofer"}
							if prof := os.Getenv("CRYO_BENCH_GOFER_CPUPROFILE"); prof != "" {
								args = append(args, "--cpuprofile", prof)
							}
							if log := os.Getenv("CRYO_BENCH_READ_LOG"); log != "" {
								args = append(args, "--read-log", log+".gofer")
							}
							args = append(args, strings.Fields(os.Getenv("CRYO_BENCH_GOFER_FLAGS"))...)
						case cryoCold:
							args = append(args, "--backend", "fuse")
							if prof := os.Getenv("CRYO_BENCH_FUSE_CPUPROFILE"); prof != "" {
								args = append(args, "--cpuprofile", fmt.Sprintf("%s.%s.%d.%d", prof, format, mib, r))
							}
							if log := os.Getenv("CRYO_BENCH_READ_LOG"); log != "" {
								args = append(args, "--read-log", fmt.Sprintf("%s.%s.%d.%d", log, format, mib, r))
							}
						}
						for _, f := range app.Flags() {
							args = append(args, "--runsc-flag="+f)
						}
						cmd = exec.Command(cryo, append(args, ref, "--bundle="+app.BundleDir(), app.ID())...)
					}
					before, reqBefore, cpuBefore := blobBytes(b, reg.MetricsAddr), registryRequests(b, reg.MetricsAddr), benchutil.CPUTime(reg.PID())
					rc := app.StartRestoreWith(b, cmd)
					app.WaitLine(b, `^count [0-9]+$`, 30*time.Minute)
					running := time.Since(rc.Start).Seconds()
					if err := rc.Wait(30 * time.Minute); err != nil {
						stdout, stderr := rc.Output()
						b.Fatalf("%s: %v\n%s%s", path, err, stdout, stderr)
					}
					s := sample{running: running, loaded: rc.Duration().Seconds(), stored: rc.Duration().Seconds(), wire: blobBytes(b, reg.MetricsAddr) - before,
						requests: registryRequests(b, reg.MetricsAddr) - reqBefore, regCPU: (benchutil.CPUTime(reg.PID()) - cpuBefore).Seconds()}
					if ru, ok := rc.Cmd.ProcessState.SysUsage().(*syscall.Rusage); ok && strings.HasPrefix(path, "cryo") {
						s.rss, s.writes = float64(ru.Maxrss)*1024, float64(ru.Oublock)*512
					}
					if strings.HasPrefix(path, "cryo") {
						// cryo restore goes on to write the materialized
						// dir after the sandbox has all its pages; "fully
						// loaded" is when runsc wait --restore returned.
						_, stderr := rc.Output()
						if m := loadedLine.FindStringSubmatch(stderr); m != nil {
							s.loaded, _ = strconv.ParseFloat(m[1], 64)
						}
					}
					if os.Getenv("CRYO_BENCH_VERBOSE") != "" {
						_, stderr := rc.Output()
						fmt.Fprint(os.Stderr, stderr)
					}
					key := fmt.Sprintf("%d|%s|%s", mib, link.Name, path)
					results[key] = append(results[key], s)
					fmt.Fprintf(os.Stderr, "%d MiB %s rep %d %-32s running %.3fs loaded %.3fs stored %.3fs wire %.0f MiB in %.0f requests, registry CPU %.2fs\n", mib, link.Name, r, path, s.running, s.loaded, s.stored, s.wire/(1<<20), s.requests, s.regCPU)
				}
				if err := os.RemoveAll(work); err != nil {
					b.Fatal(err)
				}
			}
		}
		if h := app.Hash(b); h != app.StartHash() {
			b.Fatalf("memory hash after the last restore %s, before checkpoint %s", h, app.StartHash())
		}
	}
	report(sizes, links, results)
	if *chartFlag != "" {
		if err := writeChart(*chartFlag, sizes, results); err != nil {
			b.Fatal(err)
		}
	}
}

// setup starts the registry the benchmark pushes to (its storage under
// -registry-root if set, removed at the end) and parses -sizes and
// -links.
func setup(b *testing.B) (*testenv.Registry, []int, []testenv.Link) {
	root := *regRoot
	if root != "" {
		var err error
		if root, err = os.MkdirTemp(root, "cryo-bench-registry-"); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { os.RemoveAll(root) })
	}
	reg := testenv.StartRegistry(b, root)
	var sizes []int
	for _, s := range strings.Split(*sizesFlag, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			b.Fatalf("-sizes: %v", err)
		}
		sizes = append(sizes, n)
	}
	return reg, sizes, parseLinks(b, *linksFlag)
}

// pushBoth pushes the image dir img as addr/cryo:tag (cryo push with
// cryoFlags) and as addr/oras:tag (oras push of its three files).
func pushBoth(b *testing.B, cryo, oras, img, addr, tag string, cryoFlags ...string) {
	testenv.Run(b, cryo, append(append([]string{"push"}, cryoFlags...), img, addr+"/cryo:"+tag)...)
	c := exec.Command(oras, "push", "--plain-http", addr+"/oras:"+tag, "checkpoint.img", "pages_meta.img", "pages.img")
	c.Dir = img
	if out, err := c.CombinedOutput(); err != nil {
		b.Fatalf("oras push: %v\n%s", err, out)
	}
}

func parseLinks(b *testing.B, s string) []testenv.Link {
	var out []testenv.Link
	for _, name := range strings.Split(s, ",") {
		switch name = strings.TrimSpace(name); name {
		case "loopback":
			out = append(out, testenv.Link{Name: name})
		case "1gbit-5ms":
			out = append(out, testenv.Link{Name: name, BitsPerSecond: 1e9, RTT: 5 * time.Millisecond})
		case "100mbit-25ms":
			out = append(out, testenv.Link{Name: name, BitsPerSecond: 1e8, RTT: 25 * time.Millisecond})
		default:
			b.Fatalf("unknown link %q", name)
		}
	}
	return out
}

func runscRestore(app *gvisortest.App, img string) string {
	return fmt.Sprintf("%s %s restore --detach --background --bundle=%s --image-path=%s %s",
		app.Runsc(), strings.Join(app.Flags(), " "), app.BundleDir(), img, app.ID())
}

func runscWait(app *gvisortest.App) string {
	return fmt.Sprintf("%s %s wait --restore %s >/dev/null", app.Runsc(), strings.Join(app.Flags(), " "), app.ID())
}

func shell(app *gvisortest.App, script string) *exec.Cmd {
	return exec.Command("/bin/sh", "-c", script)
}

// warm reads every file under dir into the page cache.
func warm(dir string) {
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if f, err := os.Open(p); err == nil {
				bufio.NewReaderSize(f, 1<<20).WriteTo(devNull{})
				f.Close()
			}
		}
		return nil
	})
}

type devNull struct{}

func (devNull) Write(p []byte) (int, error) { return len(p), nil }

func blobBytes(b *testing.B, metricsAddr string) float64 {
	return registryMetric(b, metricsAddr, `cryo_registry_response_bytes_total{kind="blob"}`)
}

// registryRequests is the registry's count of blob requests served.
func registryRequests(b *testing.B, metricsAddr string) float64 {
	return registryMetric(b, metricsAddr, `cryo_registry_requests_total{kind="blob"}`)
}

// registryMetric reads one sample of the registry's metrics (0 if absent).
func registryMetric(b *testing.B, metricsAddr, sample string) float64 {
	resp, err := http.Get("http://" + metricsAddr + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, sample+" ") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			return v
		}
	}
	return 0
}

// med is the median of f over s.
func med(s []sample, f func(sample) float64) float64 { return benchutil.Median(values(s, f)) }

// values returns f of every sample.
func values(s []sample, f func(sample) float64) []float64 {
	v := make([]float64, len(s))
	for i, x := range s {
		v[i] = f(x)
	}
	return v
}

func cell(s []sample, f func(sample) float64) string {
	if len(s) == 0 {
		return "-"
	}
	return benchutil.Spread(values(s, f), "%.2f")
}

func running(s sample) float64 { return s.running }
func loaded(s sample) float64  { return s.loaded }
func stored(s sample) float64  { return s.stored }

func report(sizes []int, links []testenv.Link, res map[string][]sample) {
	fmt.Printf("\n`go test ./bench/restore -run '^$' -bench Restore -benchtime 1x -sizes %s -reps %d -shaped-reps %d -links %s -registry-root '%s'` — GOMAXPROCS=%d, %s, %s\n\n",
		*sizesFlag, *repsFlag, *shapedRep, *linksFlag, *regRoot, runtime.GOMAXPROCS(0), runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Println("| app memory | link | path | app running again (s) | fully loaded (s) | bytes from the registry | blob requests | registry CPU (s) | cryo's peak RSS | cryo's disk writes per restored byte |")
	fmt.Println("|--:|---|---|--:|--:|--:|--:|--:|--:|--:|")
	for _, mib := range sizes {
		for _, l := range links {
			for _, p := range paths {
				s := res[fmt.Sprintf("%d|%s|%s", mib, l.Name, p)]
				if len(s) == 0 {
					continue
				}
				rss, writes := "", ""
				if strings.HasPrefix(p, "cryo") {
					rss = fmt.Sprintf("%.0f MiB", med(s, func(x sample) float64 { return x.rss })/(1<<20))
					writes = fmt.Sprintf("%.2f", med(s, func(x sample) float64 { return x.writes })/float64(int64(mib)<<20))
				}
				fmt.Printf("| %d MiB | %s | %s | %s | %s | %.0f MiB | %.0f | %.2f | %s | %s |\n", mib, l.Name, p, cell(s, running), cell(s, loaded), med(s, func(x sample) float64 { return x.wire })/(1<<20),
					med(s, func(x sample) float64 { return x.requests }), med(s, func(x sample) float64 { return x.regCPU }), rss, writes)
			}
		}
	}
	fmt.Println("\n| app memory | link | format | gofer cold / local cold (target ≤ 1.2) | gofer loaded / naive loaded (target ≤ 1.0) | gofer stored on the node / naive loaded | fuse cold / local cold (target ≤ 1.5) | fuse loaded / naive loaded | naive / gofer cold | cryo warm / local warm (target ≤ 1.2) |")
	fmt.Println("|--:|---|---|--:|--:|--:|--:|--:|--:|--:|")
	formats := strings.Split(*formatFl, ",")
	for _, mib := range sizes {
		for _, l := range links {
			get := func(p string, f func(sample) float64) float64 {
				s := res[fmt.Sprintf("%d|%s|%s", mib, l.Name, p)]
				if len(s) == 0 {
					return 0
				}
				return med(s, f)
			}
			for i, format := range formats {
				gofer, fuse := cryoGofer, cryoCold
				if i > 0 {
					gofer, fuse = gofer+formatSep+format, fuse+formatSep+format
				}
				fmt.Printf("| %d MiB | %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", mib, l.Name, format,
					get(gofer, running)/get(localCold, running), get(gofer, loaded)/get(naive, loaded), get(gofer, stored)/get(naive, loaded),
					get(fuse, running)/get(localCold, running), get(fuse, loaded)/get(naive, loaded),
					get(naive, running)/get(gofer, running), get(cryoWarm, running)/get(localWarm, running))
			}
		}
	}
	fmt.Println("\nApp running again: from the start of the restore command (for the naive path, of `oras pull`) until the app's next output line (it prints every 5 ms). Fully loaded: until `runsc wait --restore` returns (as cryo restore reports it; cryo restore then writes the materialized dir for later restores before it exits). Stored on the node: until cryo restore exits, the snapshot materialized (committed and fsynced) on the node. Peak RSS and disk writes are the cryo restore process's (getrusage: ru_maxrss, ru_oublock), materializing included; the gofer process's own memory is not in them. Shaped links go through a proxy with a bandwidth shared by all connections and the given round-trip time. Local paths and local disk reads need no registry bytes.")
}

// pathsFromEnv returns the paths to measure: all, or with
// CRYO_BENCH_ONLY=SUBSTRING[,SUBSTRING...] those whose name contains one
// of them (e.g. "gofer,oras,cold page" for the paths issue 15 compares). For
// investigations, CRYO_BENCH_GOFER_CPUPROFILE=FILE profiles the gofer
// path's cryo restore, CRYO_BENCH_FUSE_CPUPROFILE=PREFIX the FUSE path's
// (to PREFIX.<format>.<MiB>.<rep>), CRYO_BENCH_GOFER_FLAGS adds flags to it (e.g.
// "--workers 4"), and CRYO_BENCH_READ_LOG=FILE logs every read of the FUSE
// path to FILE.<format>.<MiB>.<rep> and of the gofer path to FILE.gofer.
func pathsFromEnv(formats []string) []string {
	all := []string{localCold, localWarm, naive, cryoGofer, cryoCold, cryoWarm}
	for _, f := range formats[1:] {
		all = append(all, cryoGofer+formatSep+f, cryoCold+formatSep+f)
	}
	if os.Getenv("CRYO_BENCH_ONLY") == "" {
		return all
	}
	var out []string
	for _, p := range all {
		for _, want := range strings.Split(os.Getenv("CRYO_BENCH_ONLY"), ",") {
			if want != "" && strings.Contains(p, want) {
				out = append(out, p)
				break
			}
		}
	}
	return out
}
