package puller_test

// End-to-end restore tests: a real runsc app is checkpointed, pushed with
// bin/cryo to a real `cryo registry serve`, and restored by `bin/cryo
// restore` (a subprocess) through a real FUSE mount, then from the node
// cache's materialized copy. They need root, bin/runsc, bin/cryo and
// /dev/fuse: without them they skip with the reason, except under CI=true,
// where they fail. The restore sequence itself (package puller/restore) is
// tested in-process there; these check the command around it: its
// messages, where they go, and its exit status.

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"golang.org/x/sys/unix"
)

// restoreTimeout bounds a whole `cryo restore` (mount, runsc restore, every
// page loaded, unmount) of the test apps.
const restoreTimeout = time.Minute

// restoreEnv is what the restore tests share: tools, a registry, a node
// cache, and a DOCKER_CONFIG of the test's own so that no credentials of
// the machine are read.
type restoreEnv struct {
	runsc, cryo  string
	reg          *testenv.Registry
	cacheDir     string
	dockerConfig string
	// backend, if set, is cryo restore's --backend.
	backend string
	// flags are more cryo restore flags.
	flags []string
}

func newRestoreEnv(t *testing.T) *restoreEnv {
	t.Helper()
	runsc := gvisortest.Runsc(t)
	if !puller.FUSEAvailable() {
		testenv.SkipOrFatal(t, "no usable /dev/fuse: cryo restore would pull eagerly instead of mounting")
	}
	e := &restoreEnv{
		runsc:        runsc,
		cryo:         testenv.Tool(t, "cryo"),
		cacheDir:     t.TempDir(),
		dockerConfig: t.TempDir(),
	}
	// Registered after TempDir's removal, so it runs before it: a cryo
	// killed mid-restore leaves its FUSE mount behind.
	t.Cleanup(func() {
		for _, mp := range mountsUnder(t, e.cacheDir) {
			t.Errorf("mount left behind at %s: unmounting", mp)
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
				t.Errorf("unmount %s: %v", mp, err)
			}
		}
	})
	e.reg = testenv.StartRegistry(t, "")
	return e
}

// command returns bin/cryo with args and the test's DOCKER_CONFIG.
func (e *restoreEnv) command(ctx context.Context, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, e.cryo, args...)
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+e.dockerConfig)
	return cmd
}

// push pushes an image dir and returns the snapshot's digest.
func (e *restoreEnv) push(t *testing.T, img, ref string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	out, err := e.command(ctx, "push", img, ref).CombinedOutput()
	if err != nil {
		t.Fatalf("cryo push %s %s: %v\n%s", img, ref, err, out)
	}
	m := regexp.MustCompile(`(?m)^\s*digest\s+(sha256:[0-9a-f]{64})\s*$`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatalf("cryo push printed no digest:\n%s", out)
	}
	return m[1]
}

// restoreCommand is `cryo restore` of ref for app, with the app's global
// runsc flags and bundle, and runsc as given.
func (e *restoreEnv) restoreCommand(ctx context.Context, app *gvisortest.App, runsc, ref string) *exec.Cmd {
	args := []string{"restore", "--cache", e.cacheDir, "--runsc", runsc}
	if e.backend != "" {
		args = append(args, "--backend="+e.backend)
	}
	for _, f := range app.Flags() {
		args = append(args, "--runsc-flag="+f)
	}
	args = append(args, e.flags...)
	args = append(args, ref, "--bundle="+app.BundleDir(), app.ID())
	return e.command(ctx, args...)
}

// blobBytes returns the registry's cryo_registry_response_bytes_total
// {kind="blob"}: bytes of blob bodies it served.
func (e *restoreEnv) blobBytes(t *testing.T) float64 {
	t.Helper()
	resp, err := http.Get("http://" + e.reg.MetricsAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: %s", resp.Status)
	}
	const name = `cryo_registry_response_bytes_total{kind="blob"}`
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %v", sc.Text(), err)
			}
			return f
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return 0 // no blob served yet
}

// mountsUnder returns the mount points at or under dir, deepest first so
// that unmounting in order works.
func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var mps []string
	for _, line := range strings.Split(string(data), "\n") {
		mp, _, ok := puller.ParseMountInfo(line)
		if ok && (mp == dir || strings.HasPrefix(mp, dir+"/")) {
			mps = append(mps, mp)
		}
	}
	slices.Reverse(mps)
	return mps
}

// cacheContents returns the names under the node cache's materialized image
// dirs, and the number of files under the cache's chunk store (everything
// outside images/ and mounts/).
func cacheContents(t *testing.T, cacheDir string) (images []string, chunkFiles int) {
	t.Helper()
	entries, _ := os.ReadDir(filepath.Join(cacheDir, "images"))
	for _, e := range entries {
		images = append(images, e.Name())
	}
	err := filepath.WalkDir(cacheDir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (p == filepath.Join(cacheDir, "images") || p == filepath.Join(cacheDir, "mounts")) {
			return filepath.SkipDir
		}
		if d.Type().IsRegular() {
			chunkFiles++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return images, chunkFiles
}

// restoreThroughCryo restores app with `cryo restore` of ref and checks that
// the app goes on from the checkpoint (next count last+1, hash unchanged).
// It returns the time from starting cryo restore to the app's next output
// line, and cryo restore's own output lines.
func (e *restoreEnv) restoreThroughCryo(t *testing.T, app *gvisortest.App, ref string, last int, hash string) (time.Duration, string) {
	t.Helper()
	// No context: RestoreCmd.Wait and the test's cleanup kill it.
	rc := app.StartRestoreWith(t, e.restoreCommand(context.Background(), app, e.runsc, ref))
	next := app.NextCount(t)
	firstOutput := time.Since(rc.Start)
	if next != last+1 {
		t.Errorf("restored app counts %d, want %d (it should go on from the checkpoint, not restart)", next, last+1)
	}
	if h := app.Hash(t); h != hash {
		t.Errorf("memory hash after restore %s, at start %s", h, hash)
	}
	select {
	case <-rc.Done():
	case <-time.After(restoreTimeout):
		// Say who holds the snapshot's FUSE mount, and have cryo print its
		// goroutines (to its stderr) before it is killed.
		t.Errorf("cryo restore still running after %v; processes that see a cryo FUSE mount:\n%s", restoreTimeout, fuseMountHolders(t))
		rc.Cmd.Process.Signal(unix.SIGQUIT)
	}
	err := rc.Wait(5 * time.Second)
	stdout, stderr := rc.Output()
	own := cryoLines(stdout + stderr)
	if err != nil {
		t.Fatalf("cryo restore: %v\n%s", err, own)
	}
	if strings.Contains(stdout, "cryo:") {
		t.Errorf("cryo restore wrote its messages to stdout, which is the restored container's:\n%s", stdout)
	}
	t.Logf("cryo restore exited 0 after %v; next output %v after start:\n%s", rc.Duration().Round(time.Millisecond), firstOutput.Round(time.Millisecond), own)
	// The app must outlive cryo restore (which unmounts when all pages are
	// loaded).
	if n := app.NextCount(t); n <= next {
		t.Errorf("count %d after cryo restore exited, want > %d", n, next)
	}
	if mps := mountsUnder(t, e.cacheDir); len(mps) != 0 {
		t.Errorf("cryo restore exited and left mounts: %v", mps)
	}
	return firstOutput, own
}

// fuseMountHolders lists the processes whose mount namespace has a cryo
// FUSE mount, with the mount and any image files they hold open.
func fuseMountHolders(t *testing.T) string {
	var b strings.Builder
	pids, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range pids {
		mi, err := os.ReadFile(p + "/mountinfo")
		if err != nil || !strings.Contains(string(mi), "fuse.cryo") {
			continue
		}
		cmdline, _ := os.ReadFile(p + "/cmdline")
		fmt.Fprintf(&b, "%s %.100s\n", p, strings.ReplaceAll(string(cmdline), "\x00", " "))
		for _, line := range strings.Split(string(mi), "\n") {
			if strings.Contains(line, "fuse.cryo") {
				fmt.Fprintf(&b, "  mount: %s\n", line)
			}
		}
		fds, _ := filepath.Glob(p + "/fd/*")
		for _, fd := range fds {
			if l, err := os.Readlink(fd); err == nil && strings.HasSuffix(l, ".img") {
				fmt.Fprintf(&b, "  fd %s -> %s\n", filepath.Base(fd), l)
			}
		}
	}
	return b.String()
}

// appLine matches the test app's own output lines.
var appLine = regexp.MustCompile(`^(count \d+|hash [0-9a-f]{64}|ready .*)$`)

// cryoLines drops the app's lines (count, hash, ready) from the restore's
// output files, leaving cryo's and runsc's messages.
func cryoLines(out string) string {
	var b strings.Builder
	for _, line := range strings.Split(out, "\n") {
		if line == "" || appLine.MatchString(line) {
			continue
		}
		b.WriteString(line + "\n")
	}
	return b.String()
}

// TestRestoreThroughCryo checkpoints a 64 MiB app, pushes it and restores it
// twice with `cryo restore --backend fuse` on the same node cache: first
// through a FUSE mount, fetching from the registry, then from the materialized copy the
// first restore left, fetching nothing. Each time the app must go on from
// the checkpoint with its memory intact. A plain `runsc restore` from the
// local image dir gives the baseline time.
func TestRestoreThroughCryo(t *testing.T) {
	e := newRestoreEnv(t)
	e.backend = "fuse"
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 64})
	c1, c2 := app.NextCount(t), app.NextCount(t)
	if c2 != c1+1 {
		t.Fatalf("counts %d then %d, want consecutive", c1, c2)
	}
	hash := app.StartHash()
	img := app.Checkpoint(t)
	last := app.LastCount()
	if last < c2 {
		t.Fatalf("last count before checkpoint %d < %d", last, c2)
	}
	ref := e.reg.Addr + "/app:v1"
	dgst := e.push(t, img, ref)
	t.Logf("checkpoint at count %d pushed as %s", last, dgst)

	// 1. Nothing local: through FUSE, from the registry.
	blobs0 := e.blobBytes(t)
	first, out := e.restoreThroughCryo(t, app, ref, last, hash)
	if !regexp.MustCompile(`(?m)\bmode fuse\b`).MatchString(out) {
		t.Errorf("first cryo restore did not say it used a FUSE mount (want \"mode fuse\"):\n%s", out)
	}
	blobs1 := e.blobBytes(t)
	if blobs1 <= blobs0 {
		t.Errorf("first restore: registry served %.0f blob bytes, want > 0", blobs1-blobs0)
	}
	images, chunks1 := cacheContents(t, e.cacheDir)
	want := strings.TrimPrefix(dgst, "sha256:")
	if len(images) != 1 || images[0] != want {
		t.Errorf("after the first restore the cache holds materialized images %v, want [%s]", images, want)
	}
	t.Logf("first restore: registry served %.1f MiB of blobs; cache holds %d chunk files", (blobs1-blobs0)/(1<<20), chunks1)

	// 2. Same snapshot, same node: from the materialized dir, no fetch.
	second, out := e.restoreThroughCryo(t, app, ref, last, hash)
	if !regexp.MustCompile(`(?m)\bmode materialized\b`).MatchString(out) {
		t.Errorf("second cryo restore did not say it used the materialized dir (want \"mode materialized\"):\n%s", out)
	}
	if blobs2 := e.blobBytes(t); blobs2 != blobs1 {
		t.Errorf("second restore: registry served %.0f blob bytes, want 0", blobs2-blobs1)
	}
	if _, chunks2 := cacheContents(t, e.cacheDir); chunks2 != chunks1 {
		t.Errorf("second restore: cache went from %d to %d chunk files", chunks1, chunks2)
	}

	// Baseline: plain runsc restore from the local image dir (warm page
	// cache).
	start := time.Now()
	app.Restore(t, img)
	if n := app.NextCount(t); n != last+1 {
		t.Errorf("plain runsc restore: app counts %d, want %d", n, last+1)
	}
	plain := time.Since(start)
	if h := app.Hash(t); h != hash {
		t.Errorf("plain runsc restore: memory hash %s, at start %s", h, hash)
	}
	app.WaitRestored(t)
	t.Logf("start to the app's next output: cryo restore via FUSE %v, from the materialized dir %v, plain runsc restore %v",
		first.Round(time.Millisecond), second.Round(time.Millisecond), plain.Round(time.Millisecond))
}

// TestRestoreRefusesOtherRunscVersion pushes a checkpoint whose header says
// another runsc_version: cryo restore must refuse it, naming both versions,
// without ever calling runsc restore.
func TestRestoreRefusesOtherRunscVersion(t *testing.T) {
	e := newRestoreEnv(t)
	local := gvisortest.RunscVersion(t, e.runsc)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 16})
	app.NextCount(t)
	img := app.Checkpoint(t)
	md, err := gvisortest.ReadMetadata(filepath.Join(img, gvisortest.CheckpointFile))
	if err != nil {
		t.Fatal(err)
	}
	if md["runsc_version"] != local {
		t.Fatalf("checkpoint records runsc_version %q, runsc --version says %q", md["runsc_version"], local)
	}
	const other = "release-20990101.0"
	otherImg := filepath.Join(t.TempDir(), "img")
	if err := gvisortest.CopyImageWithMetadata(img, otherImg, map[string]string{"runsc_version": other}); err != nil {
		t.Fatal(err)
	}
	if md, err := gvisortest.ReadMetadata(filepath.Join(otherImg, gvisortest.CheckpointFile)); err != nil || md["runsc_version"] != other {
		t.Fatalf("rewritten header: %v, %v", md, err)
	}
	ref := e.reg.Addr + "/other:v1"
	e.push(t, otherImg, ref)

	// A runsc that logs its arguments, answers --version with the real
	// runsc, and refuses to restore.
	wrapper, calls := gvisortest.NoRestoreRunsc(t, e.runsc)

	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	out, err := e.restoreCommand(ctx, app, wrapper, ref).CombinedOutput()
	t.Logf("cryo restore: %v\n%s", err, out)
	if err == nil {
		t.Fatalf("cryo restore of a checkpoint by runsc %q with runsc %q exited 0", other, local)
	}
	if _, ok := err.(*exec.ExitError); !ok {
		t.Fatalf("cryo restore: %v", err)
	}
	for _, v := range []string{other, local} {
		if !strings.Contains(string(out), v) {
			t.Errorf("cryo restore's message does not name runsc version %q:\n%s", v, out)
		}
	}
	called, err := os.ReadFile(calls)
	if err != nil {
		t.Fatalf("the runsc wrapper was never called (not even --version): %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(called)), "\n") {
		for _, a := range strings.Fields(line) {
			if a == "restore" {
				t.Errorf("cryo restore ran runsc restore for a checkpoint of another runsc version: runsc %s", line)
			}
		}
	}
	t.Logf("runsc wrapper calls:\n%s", called)
	if mps := mountsUnder(t, e.cacheDir); len(mps) != 0 {
		t.Errorf("cryo restore refused and left mounts: %v", mps)
	}
}
