// Command pullerbench measures the node puller against the eager paths, in
// one run, on loopback: a real `cryo registry serve` process holds a
// synthetic snapshot (random memory) pushed both with cryo and with oras;
// for each rep, with an empty node cache, it mounts the snapshot with the
// puller (FUSE) and records the time until the mount is ready, the latency
// of random 256 KiB reads on the cold cache (p50/p99, the reads a restoring
// sandbox makes for pages it faults on), and the time until every chunk is
// local; then, in the same rep, `cryo pull` and `oras pull` of the same
// snapshot into a fresh dir. Needs root and /dev/fuse. Output is Markdown.
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/progress"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
)

func main() {
	size := flag.Int64("size", 1<<30, "size of pages.img in bytes")
	reps := flag.Int("reps", 3, "repetitions")
	reads := flag.Int("reads", 64, "random 256 KiB reads per rep, on the cold cache")
	bin := flag.String("bin", "bin", "directory holding cryo and oras")
	flag.Parse()
	if err := run(*size, *reps, *reads, *bin); err != nil {
		fmt.Fprintln(os.Stderr, "pullerbench:", err)
		os.Exit(1)
	}
}

func run(size int64, reps, reads int, bin string) error {
	if os.Geteuid() != 0 || !puller.FUSEAvailable() {
		return fmt.Errorf("needs root and /dev/fuse")
	}
	cryo, _ := filepath.Abs(filepath.Join(bin, "cryo"))
	oras, _ := filepath.Abs(filepath.Join(bin, "oras"))
	work, err := os.MkdirTemp("/var/tmp", "pullerbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	addr, err := benchutil.FreeAddr()
	if err != nil {
		return err
	}
	reg := exec.Command(cryo, "registry", "serve", "--root", filepath.Join(work, "registry"), "--addr", addr, "--metrics-addr", "")
	reg.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := reg.Start(); err != nil {
		return err
	}
	defer syscall.Kill(-reg.Process.Pid, syscall.SIGKILL)
	for i := 0; ; i++ {
		if resp, err := http.Get("http://" + addr + "/v2/"); err == nil {
			resp.Body.Close()
			break
		}
		if i > 200 {
			return fmt.Errorf("registry did not start")
		}
		time.Sleep(50 * time.Millisecond)
	}
	img := filepath.Join(work, "img")
	if err := synth.ImageDir(img, synth.Random, size, 1); err != nil {
		return err
	}
	if out, err := exec.Command(cryo, "push", img, addr+"/app:v1").CombinedOutput(); err != nil {
		return fmt.Errorf("cryo push: %v\n%s", err, out)
	}
	c := exec.Command(oras, "push", "--plain-http", addr+"/oras:v1", "checkpoint.img", "pages_meta.img", "pages.img")
	c.Dir = img
	if out, err := c.CombinedOutput(); err != nil {
		return fmt.Errorf("oras push: %v\n%s", err, out)
	}
	ctx := context.Background()
	repo, tag, err := transfer.Repository(addr+"/app:v1", transfer.ClientOptions{})
	if err != nil {
		return err
	}
	desc, err := repo.Resolve(ctx, tag)
	if err != nil {
		return err
	}
	src := puller.Source{Index: desc, Endpoints: []fetch.Endpoint{{Name: "primary", Store: repo}}}
	var ready, local, loaded, cpull, opull []float64
	var lat []float64
	for r := range reps {
		cacheDir := filepath.Join(work, fmt.Sprintf("cache-%d", r))
		p, err := puller.New(puller.Options{CacheDir: cacheDir})
		if err != nil {
			return err
		}
		if err := benchutil.DropCaches(); err != nil {
			return err
		}
		m, err := p.Mount(ctx, src, filepath.Join(work, fmt.Sprintf("mnt-%d", r)))
		if err != nil {
			return err
		}
		ready = append(ready, m.Progress().ReadySeconds)
		f, err := os.Open(filepath.Join(m.Dir(), "pages.img"))
		if err != nil {
			return err
		}
		rng := rand.New(rand.NewPCG(uint64(r), 2))
		buf := make([]byte, 256<<10)
		for range reads {
			off := rng.Int64N(size/4096-64) * 4096
			t := time.Now()
			if _, err := f.ReadAt(buf, off); err != nil {
				return err
			}
			lat = append(lat, time.Since(t).Seconds())
		}
		f.Close()
		<-m.Loaded()
		if err := m.Err(); err != nil {
			return err
		}
		loaded = append(loaded, m.Progress().LoadedSeconds)
		local = append(local, m.Progress().LocalSeconds)
		m.Unmount()
		p.Close()
		os.RemoveAll(cacheDir)

		out := filepath.Join(work, "out")
		if err := benchutil.DropCaches(); err != nil {
			return err
		}
		t := time.Now()
		if o, err := exec.Command(cryo, "pull", addr+"/app:v1", out).CombinedOutput(); err != nil {
			return fmt.Errorf("cryo pull: %v\n%s", err, o)
		}
		cpull = append(cpull, time.Since(t).Seconds())
		os.RemoveAll(out)
		os.MkdirAll(out, 0o755)
		if err := benchutil.DropCaches(); err != nil {
			return err
		}
		t = time.Now()
		if o, err := exec.Command(oras, "pull", "--plain-http", "-o", out, addr+"/oras:v1").CombinedOutput(); err != nil {
			return fmt.Errorf("oras pull: %v\n%s", err, o)
		}
		opull = append(opull, time.Since(t).Seconds())
		os.RemoveAll(out)
		fmt.Fprintf(os.Stderr, "rep %d: ready %.1f ms, loaded %.2f s, cryo pull %.2f s, oras pull %.2f s\n", r, ready[r]*1000, loaded[r], cpull[r], opull[r])
	}
	fmt.Printf("`go run ./bench/pullerbench -size %d -reps %d -reads %d` — GOMAXPROCS=%d, %s, %s\n\n", size, reps, reads, runtime.GOMAXPROCS(0), runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Printf("### Node puller, %s random pages.img, registry on loopback, cold node cache, %d reps\n\n", progress.Bytes(size), reps)
	fmt.Println("| measure | median | min–max |")
	fmt.Println("|---|--:|--:|")
	fmt.Printf("| mount ready (ms) | %.1f | %s |\n", 1000*benchutil.Median(ready), benchutil.Range(scale(ready, 1000), "%.1f"))
	fmt.Printf("| random 256 KiB read, cold cache, p50 (ms) | %.2f | |\n", 1000*benchutil.Percentile(lat, 0.5))
	fmt.Printf("| random 256 KiB read, cold cache, p99 (ms) | %.2f | |\n", 1000*benchutil.Percentile(lat, 0.99))
	fmt.Printf("| every chunk local (s) | %.2f | %s |\n", benchutil.Median(local), benchutil.Range(local, "%.2f"))
	fmt.Printf("| mount fully loaded, materialized dir written (s) | %.2f | %s |\n", benchutil.Median(loaded), benchutil.Range(loaded, "%.2f"))
	fmt.Printf("| cryo pull (s) | %.2f | %s |\n", benchutil.Median(cpull), benchutil.Range(cpull, "%.2f"))
	fmt.Printf("| oras pull (s) | %.2f | %s |\n", benchutil.Median(opull), benchutil.Range(opull, "%.2f"))
	fmt.Printf("| every chunk local / cryo pull | %.2f | |\n", benchutil.Median(local)/benchutil.Median(cpull))
	fmt.Printf("| fully loaded / cryo pull | %.2f | |\n", benchutil.Median(loaded)/benchutil.Median(cpull))
	fmt.Printf("| fully loaded / oras pull | %.2f | |\n", benchutil.Median(loaded)/benchutil.Median(opull))
	fmt.Println("\nThe page cache is dropped before each measurement. The fully loaded time includes writing the materialized image dir that later restores use.")
	return nil
}

// scale returns v with every value multiplied by k.
func scale(v []float64, k float64) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = x * k
	}
	return out
}
