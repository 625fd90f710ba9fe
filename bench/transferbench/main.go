// Command transferbench compares cryo's transfer path with the naive one on
// loopback, in one run: a real `cryo registry serve` process, a synthetic
// 1 GiB checkpoint image dir (random and text-like memory), and for each
// kind `cryo push` vs `oras push` of the same three files, then `cryo pull`
// vs `oras pull`, reps interleaved. It reports wall time, bytes on the wire
// (from the registry's own request/response byte counters), and the ratios
// cryo/oras. Finally it pushes a second snapshot that shares about 90% of
// its chunks with the first and reports what that push uploads. Output is
// Markdown for docs/benchmarks.md; progress goes to stderr.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/progress"
	"github.com/cryo-oci/cryo/internal/synth"
)

func main() {
	size := flag.Int64("size", 1<<30, "size of pages.img in bytes")
	reps := flag.Int("reps", 3, "repetitions of each measurement (median and spread are reported)")
	kinds := flag.String("kinds", "random,text", "kinds of synthetic memory")
	bin := flag.String("bin", "bin", "directory holding cryo and oras")
	flag.Parse()
	if err := run(*size, *reps, strings.Split(*kinds, ","), *bin); err != nil {
		fmt.Fprintln(os.Stderr, "transferbench:", err)
		os.Exit(1)
	}
}

type sample struct{ seconds, wire float64 }

func run(size int64, reps int, kinds []string, bin string) error {
	cryo, err := filepath.Abs(filepath.Join(bin, "cryo"))
	if err != nil {
		return err
	}
	oras, _ := filepath.Abs(filepath.Join(bin, "oras"))
	for _, p := range []string{cryo, oras} {
		if _, err := os.Stat(p); err != nil {
			return fmt.Errorf("%s missing: run make build and scripts/install-test-deps.sh", p)
		}
	}
	work, err := os.MkdirTemp("/var/tmp", "transferbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	addr, err := benchutil.FreeAddr()
	if err != nil {
		return err
	}
	maddr, err := benchutil.FreeAddr()
	if err != nil {
		return err
	}
	reg := exec.Command(cryo, "registry", "serve", "--root", filepath.Join(work, "registry"), "--addr", addr, "--metrics-addr", maddr)
	reg.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := reg.Start(); err != nil {
		return err
	}
	defer syscall.Kill(-reg.Process.Pid, syscall.SIGKILL)
	if err := waitHTTP("http://" + addr + "/v2/"); err != nil {
		return err
	}
	fmt.Printf("`go run ./bench/transferbench -size %d -reps %d -kinds %s` — GOMAXPROCS=%d, %s, %s\n\n", size, reps, strings.Join(kinds, ","), runtime.GOMAXPROCS(0), runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Printf("### Push and pull on loopback, %s pages.img, %d reps\n\n", progress.Bytes(size), reps)
	fmt.Println("| kind | op | cryo s | oras s | cryo/oras time | cryo wire | oras wire | cryo/oras bytes |")
	fmt.Println("|---|---|--:|--:|--:|--:|--:|--:|")
	var firstDir string
	for i, kind := range kinds {
		img := filepath.Join(work, "img-"+kind)
		if err := synth.ImageDir(img, synth.Kind(kind), size, uint64(i+1)); err != nil {
			return err
		}
		if firstDir == "" {
			firstDir = img
		}
		pushC, pushO, pullC, pullO := []sample{}, []sample{}, []sample{}, []sample{}
		for r := range reps {
			tag := fmt.Sprintf("%s-%d", kind, r)
			// Chunk blobs are global in the registry, so a repeated push
			// would find them all present: pushes are measured once per
			// kind, pulls on every rep.
			if r == 0 {
				s, err := measure(maddr, "request", func() error {
					return runCmd(cryo, "push", img, addr+"/cryo-"+kind+":"+tag)
				})
				if err != nil {
					return err
				}
				pushC = append(pushC, s)
				s, err = measure(maddr, "request", func() error {
					c := exec.Command(oras, "push", "--plain-http", addr+"/oras-"+kind+":"+tag, "checkpoint.img", "pages_meta.img", "pages.img")
					c.Dir = img
					return runExec(c)
				})
				if err != nil {
					return err
				}
				pushO = append(pushO, s)
			}
			out := filepath.Join(work, "out")
			s, err := measure(maddr, "response", func() error {
				return runCmd(cryo, "pull", addr+"/cryo-"+kind+":"+kind+"-0", out)
			})
			if err != nil {
				return err
			}
			pullC = append(pullC, s)
			os.RemoveAll(out)
			os.MkdirAll(out, 0o755)
			s, err = measure(maddr, "response", func() error {
				return runCmd(oras, "pull", "--plain-http", "-o", out, addr+"/oras-"+kind+":"+kind+"-0")
			})
			if err != nil {
				return err
			}
			pullO = append(pullO, s)
			os.RemoveAll(out)
			fmt.Fprintf(os.Stderr, "%s rep %d: pull cryo %.2fs oras %.2fs\n", kind, r, pullC[len(pullC)-1].seconds, pullO[len(pullO)-1].seconds)
		}
		row(kind, "push", pushC, pushO)
		row(kind, "pull", pullC, pullO)
	}

	// A second snapshot sharing ~90% of its chunks with the first.
	pages := size / synth.PageSize
	second := filepath.Join(work, "img-second")
	if err := os.MkdirAll(second, 0o755); err != nil {
		return err
	}
	for _, f := range []string{"checkpoint.img", "pages_meta.img"} {
		data, _ := os.ReadFile(filepath.Join(firstDir, f))
		os.WriteFile(filepath.Join(second, f), data, 0o644)
	}
	src, _ := os.Open(filepath.Join(firstDir, "pages.img"))
	dst, _ := os.Create(filepath.Join(second, "pages.img"))
	bw := bufio.NewWriterSize(dst, 1<<20)
	edits := synth.MutationPlan(pages, 16, 0.02, 9)
	unchanged, err := synth.Mutate(bw, bufio.NewReaderSize(src, 1<<20), pages, edits, synth.Kind(kinds[0]), 9)
	bw.Flush()
	src.Close()
	dst.Close()
	if err != nil {
		return err
	}
	var res struct {
		Stats struct {
			LogicalBytes  int64 `json:"logicalBytes"`
			UploadedBytes int64 `json:"uploadedBytes"`
		} `json:"stats"`
		Seconds float64 `json:"seconds"`
	}
	var outJSON []byte
	s, err := measure(maddr, "request", func() error {
		var err error
		outJSON, err = exec.Command(cryo, "push", "--json", second, addr+"/cryo-"+kinds[0]+":second").Output()
		return err
	})
	if err != nil {
		return err
	}
	json.Unmarshal(outJSON, &res)
	fmt.Printf("\n### Second snapshot (%s, %d edits, %.1f%% of pages unchanged)\n\n", kinds[0], len(edits), 100*float64(unchanged)/float64(size))
	fmt.Println("| push | time s | uploaded | uploaded / logical | bytes on the wire |")
	fmt.Println("|---|--:|--:|--:|--:|")
	fmt.Printf("| cryo push of the second snapshot | %.2f | %s | %.1f%% | %s |\n", s.seconds, progress.Bytes(res.Stats.UploadedBytes), 100*float64(res.Stats.UploadedBytes)/float64(res.Stats.LogicalBytes), progress.Bytes(int64(s.wire)))
	fmt.Println("\nWall time of the command; bytes on the wire are HTTP body bytes the registry received (push) or sent (pull), from its cryo_registry_request/response_bytes_total counters. Pushes run once per kind (a repeat would find every blob present); pulls are repeated, cryo and oras alternating, into a fresh dir each time.")
	return nil
}

func row(kind, op string, c, o []sample) {
	mc, mo := benchutil.Median(values(c, seconds)), benchutil.Median(values(o, seconds))
	wc, wo := benchutil.Median(values(c, wire)), benchutil.Median(values(o, wire))
	fmt.Printf("| %s | %s | %s | %s | %.2f | %s | %s | %.2f |\n", kind, op, benchutil.Spread(values(c, seconds), "%.2f"), benchutil.Spread(values(o, seconds), "%.2f"), mc/mo, progress.Bytes(int64(wc)), progress.Bytes(int64(wo)), wc/wo)
}

// values returns f of every sample.
func values(s []sample, f func(sample) float64) []float64 {
	v := make([]float64, len(s))
	for i, x := range s {
		v[i] = f(x)
	}
	return v
}

func seconds(s sample) float64 { return s.seconds }
func wire(s sample) float64    { return s.wire }

// measure runs fn and returns its wall time and the registry's body bytes
// of the given direction ("request" or "response") during it.
func measure(maddr, dir string, fn func() error) (sample, error) {
	before, err := counter(maddr, dir)
	if err != nil {
		return sample{}, err
	}
	start := time.Now()
	if err := fn(); err != nil {
		return sample{}, err
	}
	d := time.Since(start).Seconds()
	after, err := counter(maddr, dir)
	return sample{seconds: d, wire: after - before}, err
}

func counter(maddr, dir string) (float64, error) {
	resp, err := http.Get("http://" + maddr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var total float64
	sc := bufio.NewScanner(resp.Body)
	prefix := "cryo_registry_" + dir + "_bytes_total{"
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, prefix) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			total += v
		}
	}
	return total, sc.Err()
}

func runCmd(name string, args ...string) error { return runExec(exec.Command(name, args...)) }

func runExec(c *exec.Cmd) error {
	out, err := c.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %v\n%s", strings.Join(c.Args, " "), err, out)
	}
	return nil
}

func waitHTTP(url string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("registry did not start")
}
