// Package pause benchmarks a sandbox's pause: the time from "checkpoint
// it" until the snapshot is pullable from the registry, for `cryo
// checkpoint` (checkpoint and push in one, through cryo's gofer, nothing of
// the memory on local disk) against what users do without it, `runsc
// checkpoint` to a local image dir and then `cryo push`, for a first and a
// second checkpoint of one running app (10% of its memory rewritten in
// between). Each way pushes to a registry of its own, so that neither
// dedupes against the other's uploads.
//
//	go test ./bench/pause -run '^$' -bench Pause -benchtime 1x -sizes 256,1024
package pause

import (
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
)

var sizesFlag = flag.String("sizes", "256,1024", "app memory sizes in MiB")

type pause struct {
	toDisk, push, cryo    float64 // seconds
	naiveBytes, cryoBytes int64   // uploaded
	logical               int64
}

func BenchmarkPause(b *testing.B) {
	runsc := gvisortest.Runsc(b)
	cryo := testenv.Tool(b, "cryo")
	goferDir := gvisortest.GoferDir(b)
	regNaive, regCryo := testenv.StartRegistry(b, ""), testenv.StartRegistry(b, "")
	b.Setenv("DOCKER_CONFIG", b.TempDir())
	type row struct {
		mib  int
		n    int
		p    pause
		hash float64
	}
	var rows []row
	for _, s := range strings.Split(*sizesFlag, ",") {
		mib, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			b.Fatal(err)
		}
		app := gvisortest.StartApp(b, runsc, gvisortest.AppOptions{MemoryMiB: mib})
		app.NextCount(b)
		for n := 1; n <= 2; n++ {
			if n == 2 {
				app.Rewrite(b)
			}
			var p pause
			img := filepath.Join(b.TempDir(), "img")
			t0 := time.Now()
			run(b, runsc, append(app.Flags(), "checkpoint", "--leave-running", "--image-path="+img, app.ID())...)
			p.toDisk = time.Since(t0).Seconds()
			t0 = time.Now()
			var res struct {
				Stats struct {
					LogicalBytes  int64 `json:"logicalBytes"`
					UploadedBytes int64 `json:"uploadedBytes"`
				} `json:"stats"`
			}
			decode(b, run(b, cryo, "push", "--json", img, fmt.Sprintf("%s/app:%d", regNaive.Addr, n)), &res)
			p.push = time.Since(t0).Seconds()
			p.naiveBytes, p.logical = res.Stats.UploadedBytes, res.Stats.LogicalBytes
			pages, err := os.ReadFile(filepath.Join(img, "pages.img"))
			if err != nil {
				b.Fatal(err)
			}
			os.RemoveAll(img)

			args := []string{"checkpoint", "--json", "--leave-running", "--runsc", runsc, "--gofer-dir", goferDir}
			if prof := os.Getenv("CRYO_BENCH_CPUPROFILE"); prof != "" {
				// For investigations: profile each cryo checkpoint.
				args = append(args, "--cpuprofile", fmt.Sprintf("%s.%d-%d", prof, mib, n))
			}
			for _, f := range app.Flags() {
				args = append(args, "--runsc-flag="+f)
			}
			t0 = time.Now()
			decode(b, run(b, cryo, append(args, app.ID(), fmt.Sprintf("%s/app:%d", regCryo.Addr, n))...), &res)
			p.cryo = time.Since(t0).Seconds()
			p.cryoBytes = res.Stats.UploadedBytes

			// The floor on this machine: one core hashing every byte.
			t0 = time.Now()
			sha256.Sum256(pages)
			rows = append(rows, row{mib, n, p, time.Since(t0).Seconds()})
			fmt.Fprintf(os.Stderr, "%d MiB checkpoint %d: runsc to disk %.2fs + cryo push %.2fs (%d B up); cryo checkpoint %.2fs (%d B up)\n", mib, n, p.toDisk, p.push, p.naiveBytes, p.cryo, p.cryoBytes)
		}
	}
	fmt.Printf("\n`go test ./bench/pause -run '^$' -bench Pause -benchtime 1x -sizes %s`: GOMAXPROCS=%d, %s, %s; loopback registries (cryo registry serve), one per way\n\n",
		*sizesFlag, runtime.GOMAXPROCS(0), runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Println("| app memory | checkpoint | runsc checkpoint to disk | + cryo push | = pullable after | cryo checkpoint | cryo / (to disk + push) | cryo / to disk alone (target ≤ 1.5 for the second at 1 GiB) | uploaded: push / cryo checkpoint | sha256 of pages.img, one core |")
	fmt.Println("|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	for _, r := range rows {
		p := r.p
		fmt.Printf("| %d MiB | %s | %.2f s | %.2f s | %.2f s | %.2f s | %.2f | %.2f | %.1f / %.1f MiB | %.2f s |\n", r.mib, map[int]string{1: "first", 2: "second (10% rewritten)"}[r.n],
			p.toDisk, p.push, p.toDisk+p.push, p.cryo, p.cryo/(p.toDisk+p.push), p.cryo/p.toDisk, float64(p.naiveBytes)/(1<<20), float64(p.cryoBytes)/(1<<20), r.hash)
	}
}

func run(b *testing.B, bin string, args ...string) []byte {
	b.Helper()
	cmd := exec.Command(bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		b.Fatalf("%s %s: %v\n%s", bin, strings.Join(args, " "), err, stderr.String())
	}
	return out
}

func decode(b *testing.B, data []byte, v any) {
	b.Helper()
	if err := json.Unmarshal(data, v); err != nil {
		b.Fatalf("%v: %s", err, data)
	}
}
