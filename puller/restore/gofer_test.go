package restore_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/restore"
	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/opencontainers/go-digest"
)

// checkpointedApp starts an app of mib MiB, checkpoints it and pushes
// the image as tag of repository app: it returns the app, its last count
// before the checkpoint, the reference and the snapshot's digest.
func (e *env) checkpointedApp(t *testing.T, mib int, tag string) (*gvisortest.App, int, string, digest.Digest) {
	t.Helper()
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: mib})
	app.NextCount(t)
	img := app.Checkpoint(t)
	ref := e.reg.Addr + "/app:" + tag
	return app, app.LastCount(), ref, e.push(t, img, ref)
}

// newPuller returns a puller on the env's node cache, closed when the
// test ends.
func (e *env) newPuller(t *testing.T) *puller.Puller {
	t.Helper()
	p, err := puller.New(puller.Options{CacheDir: e.cacheDir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// goferOptions are Restore's options for app through the gofer in dir.
func goferOptions(e *env, app *gvisortest.App, dir string, events *[]restore.Event) restore.Options {
	opts := options(e, app, events)
	opts.Backend, opts.GoferDir = restore.BackendGofer, dir
	return opts
}

// TestRestoreThroughGofer restores a checkpointed app through cryo's
// checkpoint gofer (no FUSE): the app goes on with its memory hash
// unchanged, the image dir runsc got held gcs_opts.json and nothing else,
// no FUSE mount was made, and the snapshot is materialized afterwards.
func TestRestoreThroughGofer(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, ref, d := e.checkpointedApp(t, 32, "gofer")

	var log fetchLog
	src := resolve(t, ref, &log)
	p := e.newPuller(t)
	var events []restore.Event
	opts := goferOptions(e, app, goferDir, &events)
	opts.GoferLog = filepath.Join(t.TempDir(), "gofer.log")
	var dirFiles []string
	opts.Progress = func(ev restore.Event) {
		events = append(events, ev)
		if ev.Step == restore.Ready {
			ents, _ := os.ReadDir(ev.Dir)
			for _, de := range ents {
				dirFiles = append(dirFiles, de.Name())
			}
			if mps := mountsUnder(t, e.cacheDir); len(mps) != 0 {
				t.Errorf("gofer restore mounted %v", mps)
			}
		}
	}
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res := e.restoreApp(t, p, src, opts, app, last)
	goferLog, _ := os.ReadFile(opts.GoferLog)
	t.Logf("gofer log:\n%s", goferLog)
	if res.Mode != "gofer" {
		t.Errorf("mode %q, want gofer", res.Mode)
	}
	if !slices.Equal(dirFiles, []string{"gcs_opts.json"}) {
		t.Errorf("image dir held %v, want only gcs_opts.json", dirFiles)
	}
	if !strings.Contains(string(goferLog), "pages.img") {
		t.Errorf("the gofer's log does not show it served pages.img: runsc did not use it")
	}
	if _, ok := p.Materialized(d); !ok || res.MaterializeErr != nil {
		t.Errorf("not materialized after the restore: %v", res.MaterializeErr)
	}
	t.Logf("ready %v, restored %v, pages loaded %v, materialized %v", res.Ready, res.Restored, res.PagesLoaded, res.Materialized)
}

// TestRestoreThroughGoferFromAfar restores through the gofer from a
// registry 30 ms away (a delaying proxy): the gofer is told the round
// trip and offers the sentry reads of pages.img of 256 KiB, 32 at a
// time, and the app goes on with its memory hash unchanged.
func TestRestoreThroughGoferFromAfar(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, ref, _ := e.checkpointedApp(t, 32, "far")
	far, err := testenv.StartProxy(e.reg.Addr, testenv.Link{Name: "far", RTT: 30 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(far.Close)
	var log fetchLog
	src := resolve(t, strings.Replace(ref, e.reg.Addr, far.Addr(), 1), &log)
	p := e.newPuller(t)
	var events []restore.Event
	opts := goferOptions(e, app, goferDir, &events)
	opts.GoferLog = filepath.Join(t.TempDir(), "gofer.log")
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res := e.restoreApp(t, p, src, opts, app, last)
	goferLog, _ := os.ReadFile(opts.GoferLog)
	t.Logf("ready %v, restored %v, pages loaded %v, materialized %v", res.Ready, res.Restored, res.PagesLoaded, res.Materialized)
	if res.Mode != "gofer" {
		t.Errorf("mode %q, want gofer", res.Mode)
	}
	for _, want := range []string{`"pages.img max read"=262144 parallel=32`, `path=pages.img`, `"max read"=262144 parallel=32`} {
		if !strings.Contains(string(goferLog), want) {
			t.Errorf("the gofer's log has no %s: it did not read pages.img in 256 KiB pieces, 32 at a time, from a registry 30 ms away\n%s", want, goferLog)
		}
	}
}

// TestGoferRestoreFailsOverCorruptChunk restores through the gofer from
// two registries holding the same snapshot, the first (tried first)
// serving a corrupt copy of one pages.img chunk: the chunk fails
// verification, is fetched from the second, and the app goes on with its
// memory hash unchanged: no wrong page reached it.
func TestGoferRestoreFailsOverCorruptChunk(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	second := testenv.StartRegistry(t, "")
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	img := app.Checkpoint(t)
	last := app.LastCount()
	ref := e.reg.Addr + "/app:corrupt"
	if d, d2 := e.push(t, img, ref), e.push(t, img, second.Addr+"/app:corrupt"); d2 != d {
		t.Fatalf("same image pushed as %s and %s", d, d2)
	}

	var log fetchLog
	src := resolve(t, ref, &log)
	src.Endpoints = append(src.Endpoints, resolve(t, second.Addr+"/app:corrupt", &log).Endpoints...)
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, src.Endpoints[0].Store, src.Index)
	if err != nil {
		t.Fatal(err)
	}
	pt, err := format.LoadPart(ctx, src.Endpoints[0].Store, snap.File("pages.img"), 0)
	if err != nil {
		t.Fatal(err)
	}
	var bad format.Chunk
	for _, c := range pt.Table.Chunks {
		if c.Encoding != format.EncodingZero {
			bad = c
		}
	}
	if bad.Blob == "" {
		t.Fatal("pages.img has no stored chunk")
	}
	blob := filepath.Join(e.reg.Root, distlayout.BlobDataPath(bad.Blob))
	data, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	data[len(data)/2] ^= 0xff
	if err := os.WriteFile(blob, data, 0o644); err != nil {
		t.Fatal(err)
	}

	var events []restore.Event
	opts := goferOptions(e, app, goferDir, &events)
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res := e.restoreApp(t, e.newPuller(t), src, opts, app, last)
	if res.Mode != "gofer" {
		t.Errorf("mode %q, want gofer", res.Mode)
	}
	// The corrupt copy was read, found bad, and the chunk read again from
	// the second registry.
	from := log.endpointsOf(bad.Blob)
	if from[src.Endpoints[0].Name] == 0 || from[src.Endpoints[1].Name] == 0 {
		t.Errorf("the corrupt chunk's blob %s was fetched %v times by endpoint, want from both %s and %s", bad.Blob, from, src.Endpoints[0].Name, src.Endpoints[1].Name)
	}
}

// TestGoferRestoreSurvivesRegistryRestart kills the registry in the middle
// of the load (as the third fetch after the gofer image dir is ready
// starts, with fetches done before it and fetches left after it) and
// starts it again a second later: the sandbox's reads wait instead of
// failing, and the app goes on with its memory hash unchanged.
func TestGoferRestoreSurvivesRegistryRestart(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, ref, _ := e.checkpointedApp(t, 32, "restart")
	var log fetchLog
	src := resolve(t, ref, &log)
	p := e.newPuller(t)
	var events []restore.Event
	opts := goferOptions(e, app, goferDir, &events)
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	restarted := make(chan struct{})
	var ready atomic.Int64 // fetches before Ready, plus one once it came
	var killedAt atomic.Int64
	log.mu.Lock()
	log.onFetch = func(n int) {
		if r := ready.Load(); r > 0 && int64(n) == r-1+3 && killedAt.CompareAndSwap(0, int64(n)) {
			e.reg.Stop()
			time.AfterFunc(time.Second, func() {
				defer close(restarted)
				e.reg.Start(t)
			})
		}
	}
	log.mu.Unlock()
	opts.Progress = func(ev restore.Event) {
		events = append(events, ev)
		if ev.Step == restore.Ready {
			ready.Store(int64(len(log.digests())) + 1)
		}
	}
	res := e.restoreApp(t, p, src, opts, app, last)
	if killedAt.Load() == 0 {
		t.Fatalf("fewer than 3 fetches after the image dir was ready (%d in all, %d before): the registry was never killed", len(log.digests()), ready.Load()-1)
	}
	<-restarted
	if res.Mode != "gofer" {
		t.Errorf("mode %q, want gofer", res.Mode)
	}
	if n := int64(len(log.digests())); n <= killedAt.Load() {
		t.Errorf("nothing fetched after the registry was killed at fetch %d: the load did not span the outage", killedAt.Load())
	}
	t.Logf("registry killed at fetch %d (%d before the image dir was ready, %d in all); restored %v, pages loaded %v", killedAt.Load(), ready.Load()-1, len(log.digests()), res.Restored, res.PagesLoaded)
}

// TestRestoreRefusesGoferOfOtherRelease gives Restore a gofer dir whose
// checkpointgofer is of another gVisor release than runsc. Asked for the
// gofer, Restore refuses with a *gofer.BinaryError naming both releases, having
// mounted nothing and run no runsc restore (also when the caller started
// the check, Options.GoferCheck); with the default backend
// (auto) it restores through FUSE instead.
func TestRestoreRefusesGoferOfOtherRelease(t *testing.T) {
	e := newEnv(t)
	app, last, ref, _ := e.checkpointedApp(t, 16, "other-gofer")
	const other = "release-20990101.0"
	goferDir := t.TempDir()
	fake := "#!/bin/sh\necho 'cryo checkpointgofer, gVisor release " + other + "'\n"
	if err := os.WriteFile(filepath.Join(goferDir, gofer.Binary), []byte(fake), 0o755); err != nil {
		t.Fatal(err)
	}
	p := e.newPuller(t)

	wrapper, calls := gvisortest.NoRestoreRunsc(t, e.runsc)
	var events []restore.Event
	opts := options(e, app, &events)
	opts.Runsc, opts.Backend, opts.GoferDir = wrapper, restore.BackendGofer, goferDir
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	_, err := restore.Restore(ctx, p, resolve(t, ref, &fetchLog{}), opts)
	var ge *gofer.BinaryError
	if !errors.As(err, &ge) {
		t.Fatalf("Restore with a gofer of release %s: %v, want a *gofer.BinaryError", other, err)
	}
	local := gvisortest.RunscVersion(t, e.runsc)
	for _, v := range []string{other, local} {
		if !strings.Contains(err.Error(), v) {
			t.Errorf("error %q does not name release %q", err, v)
		}
	}
	if len(events) != 0 {
		t.Errorf("refused restore reported steps %v", steps(events))
	}
	if called, _ := os.ReadFile(calls); strings.Contains(string(called), "restore") {
		t.Errorf("runsc restore ran: %s", called)
	}
	// A check the caller started early (Options.GoferCheck) is the one
	// Restore goes by. (The dir is left out only to tell the two checks
	// apart: Restore's own of no dir would not name the other release.)
	events = nil
	opts.GoferDir, opts.GoferCheck = "", gofer.StartCheck(ctx, goferDir)
	if _, err := restore.Restore(ctx, p, resolve(t, ref, &fetchLog{}), opts); !errors.As(err, &ge) || !strings.Contains(err.Error(), other) {
		t.Errorf("Restore with the caller's check of a gofer of release %s: %v, want a *gofer.BinaryError naming it", other, err)
	}
	if len(events) != 0 {
		t.Errorf("restore refused by the caller's check reported steps %v", steps(events))
	}
	if called, _ := os.ReadFile(calls); strings.Contains(string(called), "restore") {
		t.Errorf("runsc restore ran: %s", called)
	}

	events = nil
	opts = options(e, app, &events)
	opts.Backend, opts.GoferDir = restore.BackendAuto, goferDir
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res := e.restoreApp(t, p, resolve(t, ref, &fetchLog{}), opts, app, last)
	if res.Mode != "fuse" {
		t.Errorf("auto with a gofer of another release: mode %q, want fuse", res.Mode)
	}
}

// TestStandaloneGoferRestoreAsksPeers restores through a standalone gofer
// whose config names a peer (a `cryo puller serve --peer-listen` of the
// pool, its token in a file): the gofer asks the peer for the chunks (the
// peer, which owns them, fetches them upstream once), and the app goes on
// with its memory hash unchanged.
func TestStandaloneGoferRestoreAsksPeers(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, ref, d := e.checkpointedApp(t, 32, "standalone-peers")

	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte("a pool token of the test's own\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	peerAddr, metricsAddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	pd := t.TempDir()
	daemon := exec.Command(e.cryo, "puller", "serve", "--socket", filepath.Join(pd, "puller.sock"), "--cache", filepath.Join(pd, "cache"),
		"--mounts", filepath.Join(pd, "mnt"), "--profile", "none", "--peer-listen", peerAddr, "--peer-token-file", tokenFile, "--metrics-addr", metricsAddr)
	daemonLog := filepath.Join(pd, "log")
	lf, err := os.Create(daemonLog)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	daemon.Stdout, daemon.Stderr = lf, lf
	if err := daemon.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { daemon.Process.Kill(); daemon.Wait() })
	served := func() float64 {
		resp, err := http.Get("http://" + metricsAddr + "/metrics")
		if err != nil {
			return -1
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		for _, line := range strings.Split(string(data), "\n") {
			if v, ok := strings.CutPrefix(line, "cryo_puller_peer_served_bytes_total "); ok {
				f, _ := strconv.ParseFloat(v, 64)
				return f
			}
		}
		return 0
	}
	for deadline := time.Now().Add(30 * time.Second); served() < 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			logged, _ := os.ReadFile(daemonLog)
			t.Fatalf("the peer daemon never served its metrics:\n%s", logged)
		}
	}

	dir := filepath.Join(t.TempDir(), "img")
	logFile := filepath.Join(t.TempDir(), "gofer.log")
	cfg := gofer.Config{MediaType: gofer.MediaType, Reference: ref, Index: d, Log: logFile, CacheDir: t.TempDir(), Peers: []string{peerAddr}, PeerTokenFile: tokenFile}
	if err := gofer.WriteImageDir(dir, cfg); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(e.runsc, append(app.Flags(), "restore", "--detach", "--background", "--bundle="+app.BundleDir(), "--image-path="+dir, app.ID())...)
	cmd.Env = append(os.Environ(), "GVISOR_SIDECAR_BINARIES_DIR="+goferDir)
	if err := app.StartRestoreWith(t, cmd).Wait(restoreTimeout); err != nil {
		logged, _ := os.ReadFile(logFile)
		t.Fatalf("runsc restore: %v\ngofer log:\n%s", err, logged)
	}
	app.GoesOn(t, last)
	app.WaitRestored(t)
	n := served()
	t.Logf("the peer served %.0f bytes", n)
	if n < 16<<20 {
		logged, _ := os.ReadFile(logFile)
		dlog, _ := os.ReadFile(daemonLog)
		t.Errorf("the peer served %.0f bytes to the standalone gofer, want most of the 32 MiB snapshot\ngofer log:\n%s\npeer log:\n%s", n, logged, dlog)
	}
}

// TestStandaloneGoferRestore restores with plain runsc restore from an
// image dir whose gcs_opts.json names no cryo process, only the snapshot
// (reference and index digest): the gofer resolves and fetches it itself,
// with the node's credentials, and the app goes on with its memory hash
// unchanged. The gofer fetches the config's index by digest, whatever the
// tag names now: a config naming a snapshot the registry lacks fails the
// restore, naming it.
func TestStandaloneGoferRestore(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, ref, d := e.checkpointedApp(t, 32, "standalone")

	run := func(index digest.Digest) (*gvisortest.RestoreCmd, string) {
		dir := filepath.Join(t.TempDir(), "img")
		logFile := filepath.Join(t.TempDir(), "gofer.log")
		if err := gofer.WriteImageDir(dir, gofer.Config{MediaType: gofer.MediaType, Reference: ref, Index: index, Log: logFile, CacheDir: t.TempDir()}); err != nil {
			t.Fatal(err)
		}
		args := append(app.Flags(), "restore", "--detach", "--background", "--bundle="+app.BundleDir(), "--image-path="+dir, app.ID())
		cmd := exec.Command(e.runsc, args...)
		cmd.Env = append(os.Environ(), "GVISOR_SIDECAR_BINARIES_DIR="+goferDir)
		return app.StartRestoreWith(t, cmd), logFile
	}
	rc, logFile := run(d)
	if err := rc.Wait(restoreTimeout); err != nil {
		logged, _ := os.ReadFile(logFile)
		t.Fatalf("runsc restore: %v\ngofer log:\n%s", err, logged)
	}
	app.GoesOn(t, last)
	app.WaitRestored(t)
	if logged, _ := os.ReadFile(logFile); !strings.Contains(string(logged), "standalone") {
		t.Errorf("the gofer did not serve standalone:\n%s", logged)
	}

	other := digest.FromString("another snapshot")
	rc, logFile = run(other)
	if err := rc.Wait(restoreTimeout); err == nil {
		t.Error("runsc restore of a config naming a snapshot the registry lacks succeeded")
	}
	if logged, _ := os.ReadFile(logFile); !strings.Contains(string(logged), other.String()) {
		t.Errorf("the gofer's log does not name the snapshot it could not get:\n%s", logged)
	}
}
