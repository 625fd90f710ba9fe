package restore

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/profile"
)

var hotSetsFlag = flag.String("hotsets", "regions,scattered", "BenchmarkProfile's hot sets: regions (5% of memory in 4 contiguous regions) and/or scattered (5% spread over every 32 MiB window)")

// The ways back to a first answer that BenchmarkProfile compares.
const (
	profLocal     = "local dir, cold page cache"
	profNaive     = "oras pull + runsc restore"
	profNone      = "cryo restore, cold, no profile"
	profWith      = "cryo restore, cold, with profile"
	profWithAlt   = "cryo restore, cold, with profile, alt"
	profRecording = "cryo restore, cold, recording"
)

// profSample is one restore: seconds until the app's first answer, and
// the bytes that crossed the link (from the registry) until then.
type profSample struct{ answer, bytes float64 }

// BenchmarkProfile measures, for an app that reads a hot set of its
// memory on every request (gvisortest.HotRegions or HotScattered, 5% of
// its memory), the time from the restore command's start until its first
// answer after the restore, on a cold node cache: from a local dir (cold
// page cache), `oras pull` + restore, cryo without a profile, and cryo
// with the profile recorded in one restore of the same snapshot on the
// same link just before (the working set: the ranges the sandbox waited
// on). It prints a Markdown table and the targets of issue 13.
//
// For investigations, besides CRYO_BENCH_ONLY, CRYO_BENCH_VERBOSE and
// CRYO_BENCH_READ_LOG (below), CRYO_BENCH_RUNSC_FLAGS adds global flags to
// every runsc the app runs with, on every path: "--debug
// --debug-log=/tmp/d/%COMMAND%-%TIMESTAMP%.log" logs runsc's restore
// timeline (its "Timer for Restore" lines) beside the reads of cryo's;
// CRYO_BENCH_CRYO_ALT, the path of another cryo binary beside
// bin/cryo-gofer (it finds the gofer beside itself), replays the profile
// with it too, before or after each replay of bin/cryo's in turn (its first
// answers on stderr, as "with profile, alt"; not in the table), for
// builds alternated on the same app: the recording is bin/cryo's.
func BenchmarkProfile(b *testing.B) {
	runsc := gvisortest.Runsc(b)
	gvisortest.GoferDir(b)
	cryo, oras := testenv.Tool(b, "cryo"), testenv.Tool(b, "oras")
	reg, sizes, links := setup(b)
	hotSets := strings.Split(*hotSetsFlag, ",")
	res := map[string][]profSample{} // hot|size|link|path
	ws := map[string]int64{}         // hot|size|link: the working set recorded
	for _, hot := range hotSets {
		for _, mib := range sizes {
			app := gvisortest.StartApp(b, runsc, gvisortest.AppOptions{MemoryMiB: mib, Interval: 5 * time.Millisecond, HotSet: gvisortest.HotSet(hot), RunscFlags: strings.Fields(os.Getenv("CRYO_BENCH_RUNSC_FLAGS"))})
			app.NextCount(b)
			img := app.Checkpoint(b)
			tag := fmt.Sprintf("%s-m%d", hot, mib)
			pushBoth(b, cryo, oras, img, reg.Addr, tag)
			for _, link := range links {
				addr := reg.Addr
				reps := *repsFlag
				var proxy *testenv.Proxy
				if link.BitsPerSecond > 0 || link.RTT > 0 {
					p, err := testenv.StartProxy(reg.Addr, link)
					if err != nil {
						b.Fatal(err)
					}
					defer p.Close()
					proxy, addr, reps = p, p.Addr(), *shapedRep
				}
				moved := func() float64 {
					if proxy != nil {
						return float64(proxy.Delivered())
					}
					return blobBytes(b, reg.MetricsAddr)
				}
				key := fmt.Sprintf("%s|%d|%s", hot, mib, link.Name)
				recorded := filepath.Join(b.TempDir(), "profile.json")
				restore := func(path string) profSample {
					// Removed after each restore: a 2 GiB app's copies add up.
					work, err := os.MkdirTemp("", "cryo-bench-profile-")
					if err != nil {
						b.Fatal(err)
					}
					defer os.RemoveAll(work)
					if err := benchutil.DropCaches(); err != nil {
						b.Fatal(err)
					}
					var cmd *exec.Cmd
					switch path {
					case profLocal:
						cmd = shell(app, runscRestore(app, img)+" && "+runscWait(app))
					case profNaive:
						out := filepath.Join(work, "oras-out")
						cmd = shell(app, fmt.Sprintf("mkdir -p %s && %s pull --plain-http -o %s %s/oras:%s >/dev/null && ", out, oras, out, addr, tag)+
							runscRestore(app, out)+" && "+runscWait(app))
					default:
						args := []string{"restore", "--cache", filepath.Join(work, "cache"), "--runsc", runsc}
						switch path {
						case profRecording:
							args = append(args, "--profile", "none", "--record-profile", recorded)
							if log := os.Getenv("CRYO_BENCH_READ_LOG"); log != "" {
								args = append(args, "--read-log", log+".recording")
							}
						case profNone:
							args = append(args, "--profile", "none")
							if log := os.Getenv("CRYO_BENCH_READ_LOG"); log != "" {
								args = append(args, "--read-log", log)
							}
						case profWith, profWithAlt:
							args = append(args, "--profile", recorded)
							if log := os.Getenv("CRYO_BENCH_READ_LOG"); log != "" {
								suffix := ".profile"
								if path == profWithAlt {
									suffix = ".alt"
								}
								args = append(args, "--read-log", log+suffix)
							}
						}
						for _, f := range app.Flags() {
							args = append(args, "--runsc-flag="+f)
						}
						bin := cryo
						if path == profWithAlt {
							var err error
							if bin, err = filepath.Abs(os.Getenv("CRYO_BENCH_CRYO_ALT")); err != nil {
								b.Fatal(err)
							}
						}
						cmd = exec.Command(bin, append(args, addr+"/cryo:"+tag, "--bundle="+app.BundleDir(), app.ID())...)
					}
					before := moved()
					rc := app.StartRestoreWith(b, cmd)
					app.WaitLine(b, `^count [0-9]+$`, 30*time.Minute)
					s := profSample{answer: time.Since(rc.Start).Seconds(), bytes: moved() - before}
					if err := rc.Wait(30 * time.Minute); err != nil {
						stdout, stderr := rc.Output()
						b.Fatalf("%s: %v\n%s%s", path, err, stdout, stderr)
					}
					if os.Getenv("CRYO_BENCH_VERBOSE") != "" {
						_, stderr := rc.Output()
						fmt.Fprint(os.Stderr, stderr)
					}
					if path == profWith || path == profWithAlt {
						if _, stderr := rc.Output(); !strings.Contains(stderr, "profile: sha256:") {
							b.Fatalf("%s: cryo restore did not say it used the profile:\n%s", path, stderr)
						}
					}
					fmt.Fprintf(os.Stderr, "%s %d MiB %s %-34s first answer %.3fs, %.1f MiB moved before it\n", hot, mib, link.Name, path, s.answer, s.bytes/(1<<20))
					return s
				}
				restore(profRecording)
				data, err := os.ReadFile(recorded)
				if err != nil {
					b.Fatal(err)
				}
				p, err := profile.Parse(data)
				if err != nil {
					b.Fatal(err)
				}
				ws[key] = p.Bytes()
				fmt.Fprintf(os.Stderr, "%s %d MiB %s: profile of %d ranges, %.1f MiB\n", hot, mib, link.Name, len(p.Ranges), float64(p.Bytes())/(1<<20))
				for rep := range reps {
					paths := []string{profLocal, profNaive, profNone, profWith}
					if os.Getenv("CRYO_BENCH_CRYO_ALT") != "" {
						paths = append(paths, profWithAlt)
						if rep%2 == 1 {
							paths[3], paths[4] = profWithAlt, profWith
						}
					}
					for _, path := range paths {
						if only := os.Getenv("CRYO_BENCH_ONLY"); only != "" && !strings.Contains(path, only) {
							continue
						}
						res[key+"|"+path] = append(res[key+"|"+path], restore(path))
					}
				}
			}
			if h := app.Hash(b); h != app.StartHash() {
				b.Fatalf("memory hash after the last restore %s, before checkpoint %s", h, app.StartHash())
			}
		}
	}
	reportProfile(hotSets, sizes, links, res, ws)
}

func reportProfile(hotSets []string, sizes []int, links []testenv.Link, res map[string][]profSample, ws map[string]int64) {
	fmt.Printf("\n`go test ./bench/restore -run '^$' -bench Profile -benchtime 1x -hotsets %s -sizes %s -reps %d -shaped-reps %d -links %s -registry-root '%s'` — GOMAXPROCS=%d, %s, %s\n\n",
		*hotSetsFlag, *sizesFlag, *repsFlag, *shapedRep, *linksFlag, *regRoot, runtime.GOMAXPROCS(0), runtime.Version(), time.Now().UTC().Format("2006-01-02 15:04 UTC"))
	fmt.Println("| hot set | app memory | link | working set | local cold (s) | oras pull + restore (s) | cryo, no profile (s) | cryo, profile (s) | profile / local (target ≤ 1.2 or +0.1 s) | shaped target (s) | moved before the answer, no profile / profile (MiB) | moved / working set (target ≤ 1.3) |")
	fmt.Println("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	answer := func(s profSample) float64 { return s.answer }
	for _, hot := range hotSets {
		for _, mib := range sizes {
			for _, l := range links {
				key := fmt.Sprintf("%s|%d|%s", hot, mib, l.Name)
				get := func(path string) []profSample { return res[key+"|"+path] }
				m := func(path string) float64 {
					s := get(path)
					if len(s) == 0 {
						return 0
					}
					v := make([]float64, len(s))
					for i, x := range s {
						v[i] = answer(x)
					}
					return benchutil.Median(v)
				}
				bytesOf := func(path string) float64 {
					s := get(path)
					v := make([]float64, len(s))
					for i, x := range s {
						v[i] = x.bytes
					}
					return benchutil.Median(v)
				}
				local, with := m(profLocal), m(profWith)
				target := "-"
				if l.BitsPerSecond > 0 {
					limit := local + 1.3*float64(ws[key])*8/float64(l.BitsPerSecond) + 4*l.RTT.Seconds()
					target = fmt.Sprintf("%.2f", limit)
				}
				spread := func(path string) string {
					s := get(path)
					v := make([]float64, len(s))
					for i, x := range s {
						v[i] = answer(x)
					}
					return benchutil.Spread(v, "%.2f")
				}
				fmt.Printf("| %s | %d MiB | %s | %.1f MiB | %s | %s | %s | %s | %.2f (%+.2f s) | %s | %.1f / %.1f | %.2f |\n", hot, mib, l.Name, float64(ws[key])/(1<<20),
					spread(profLocal), spread(profNaive), spread(profNone), spread(profWith), with/local, with-local, target,
					bytesOf(profNone)/(1<<20), bytesOf(profWith)/(1<<20), bytesOf(profWith)/float64(max(ws[key], 1)))
			}
		}
	}
	fmt.Println("\nFirst answer: from the start of the restore command (for the naive path, of `oras pull`) until the app's first output after the restore; the app reads its hot set (one byte of each of its pages) before every output line. Working set: the bytes of the profile recorded in a cold cryo restore of the same snapshot on the same link (the ranges the sandbox waited on). Moved: bytes from the registry across the link until the first answer. Shaped target: local cold + 1.3 x working set / link rate + 4 round trips. Every cryo restore is on an empty node cache, through the checkpoint gofer (the default backend).")
}
