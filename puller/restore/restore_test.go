package restore_test

// In-process tests of Restore with real parts: a runsc app is checkpointed,
// pushed with bin/cryo to a real `cryo registry serve`, resolved with
// puller.Resolve and restored by restore.Restore, called here, through a
// real FUSE mount and then from the node cache's materialized copy. They
// need root, bin/runsc, bin/cryo and /dev/fuse: without them they skip with
// the reason, except under CI=true, where they fail. The same restores
// through the `cryo restore` command are tested in package puller.

import (
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/restore"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sys/unix"
	"oras.land/oras-go/v2/content"
)

// restoreTimeout bounds one Restore of the test apps (mount, runsc
// restore, every page loaded, materialized, unmount).
const restoreTimeout = time.Minute

// env is what the tests share: tools, a registry, a node cache, and a
// DOCKER_CONFIG of the test's own so that no credentials of the machine
// are read.
type env struct {
	runsc, cryo string
	reg         *testenv.Registry
	cacheDir    string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	runsc := gvisortest.Runsc(t)
	if !puller.FUSEAvailable() {
		testenv.SkipOrFatal(t, "no usable /dev/fuse: Restore would pull eagerly instead of mounting")
	}
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	e := &env{runsc: runsc, cryo: testenv.Tool(t, "cryo"), cacheDir: t.TempDir()}
	// Registered after TempDir's removal, so it runs before it: a failed
	// test may leave a FUSE mount behind.
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

// push pushes an image dir with bin/cryo and returns the snapshot's digest.
func (e *env) push(t *testing.T, img, ref string) digest.Digest {
	t.Helper()
	out := testenv.Run(t, e.cryo, "push", img, ref)
	m := regexp.MustCompile(`(?m)^\s*digest\s+(sha256:[0-9a-f]{64})\s*$`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("cryo push printed no digest:\n%s", out)
	}
	return digest.Digest(m[1])
}

// resolve resolves ref and returns its source with every endpoint's
// fetches recorded in log.
func resolve(t *testing.T, ref string, log *fetchLog) puller.Source {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for i, ep := range src.Endpoints {
		src.Endpoints[i] = fetch.Endpoint{Name: ep.Name, Store: loggingFetcher{Fetcher: ep.Store, log: log, endpoint: ep.Name}}
	}
	return src
}

// fetchLog records the digests fetched from a source's endpoints, whole
// or by range.
type fetchLog struct {
	mu      sync.Mutex
	fetched []digest.Digest
	// from holds, for each fetch in fetched, the endpoint it went to.
	from []string
	// onFetch, if set, is called (outside mu) with the count of fetches
	// so far as each fetch starts, before it reaches the registry.
	onFetch func(n int)
}

func (l *fetchLog) digests() []digest.Digest {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.fetched)
}

// endpointsOf returns how many fetches of d went to each endpoint.
func (l *fetchLog) endpointsOf(d digest.Digest) map[string]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := map[string]int{}
	for i, got := range l.fetched {
		if got == d {
			n[l.from[i]]++
		}
	}
	return n
}

func (l *fetchLog) add(endpoint string, d digest.Digest) {
	l.mu.Lock()
	l.fetched = append(l.fetched, d)
	l.from = append(l.from, endpoint)
	n, hook := len(l.fetched), l.onFetch
	l.mu.Unlock()
	if hook != nil {
		hook(n)
	}
}

// loggingFetcher logs every fetch of its endpoint's blobs, and passes
// range reads on as range reads (format.OpenRange), as the endpoint it
// wraps serves them.
type loggingFetcher struct {
	content.Fetcher
	log      *fetchLog
	endpoint string
}

func (f loggingFetcher) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	f.log.add(f.endpoint, desc.Digest)
	return f.Fetcher.Fetch(ctx, desc)
}

// FetchRange implements format.RangeFetcher.
func (f loggingFetcher) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	f.log.add(f.endpoint, desc.Digest)
	return format.OpenRange(ctx, f.Fetcher, desc, off, n)
}

// containerOutput makes new output files for the app's next restore, where
// its line reading goes on, and returns them open for writing, to be the
// restored container's stdout and stderr. (gvisortest sets the files up
// for a restore command it starts: it starts one that does nothing.)
func containerOutput(t *testing.T, app *gvisortest.App) (stdout, stderr *os.File) {
	t.Helper()
	rc := app.StartRestoreWith(t, exec.Command("true"))
	if err := rc.Wait(restoreTimeout); err != nil {
		t.Fatal(err)
	}
	open := func(w io.Writer) *os.File {
		f, err := os.OpenFile(w.(*os.File).Name(), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { f.Close() })
		return f
	}
	return open(rc.Cmd.Stdout), open(rc.Cmd.Stderr)
}

// options are Restore's options for app, recording the steps in events.
func options(e *env, app *gvisortest.App, events *[]restore.Event) restore.Options {
	return restore.Options{
		Runsc:        e.runsc,
		RunscFlags:   app.Flags(),
		ContainerID:  app.ID(),
		RestoreFlags: []string{"--bundle=" + app.BundleDir()},
		Progress:     func(ev restore.Event) { *events = append(*events, ev) },
	}
}

// restoreApp runs Restore and checks that the app goes on from the
// checkpoint (next count last+1, memory hash unchanged).
func (e *env) restoreApp(t *testing.T, p *puller.Puller, src puller.Source, opts restore.Options, app *gvisortest.App, last int) *restore.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	type result struct {
		res *restore.Result
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := restore.Restore(ctx, p, src, opts)
		done <- result{res, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-time.After(restoreTimeout + 10*time.Second):
		t.Fatalf("Restore did not return within %v", restoreTimeout)
	}
	if r.err != nil {
		t.Fatalf("Restore: %v", r.err)
	}
	app.GoesOn(t, last)
	if mps := mountsUnder(t, e.cacheDir); len(mps) != 0 {
		t.Errorf("Restore returned and left mounts: %v", mps)
	}
	return r.res
}

// steps returns the steps of events.
func steps(events []restore.Event) []restore.Step {
	var s []restore.Step
	for _, e := range events {
		s = append(s, e.Step)
	}
	return s
}

// lockedBuffer is an io.Writer (not a file) safe for concurrent use.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

// TestRestoreFromRegistryThenMaterialized restores a checkpointed app with
// Restore twice on one node cache: first through a FUSE mount, fetching
// from the registry, and with a stderr that is not a file (which the
// container keeps: Restore must not wait for it to close); then, with a new
// puller on the same cache, from the materialized copy the first restore
// left, fetching nothing but the snapshot's index. Each time the app must
// go on from the checkpoint with its memory intact, the steps come in
// order, and nothing stays mounted or pinned.
func TestRestoreFromRegistryThenMaterialized(t *testing.T) {
	e := newEnv(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	img := app.Checkpoint(t)
	last := app.LastCount()
	ref := e.reg.Addr + "/app:v1"
	d := e.push(t, img, ref)

	// 1. Nothing local: through FUSE, from the registry.
	var log1 fetchLog
	src := resolve(t, ref, &log1)
	if src.Index.Digest != d {
		t.Fatalf("resolved %s, pushed %s", src.Index.Digest, d)
	}
	p1, err := puller.New(puller.Options{CacheDir: e.cacheDir})
	if err != nil {
		t.Fatal(err)
	}
	var events []restore.Event
	opts := options(e, app, &events)
	var stderr lockedBuffer
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	opts.Stderr = &stderr
	res := e.restoreApp(t, p1, src, opts, app, last)
	mountDir := filepath.Join(e.cacheDir, "mounts", app.ID())
	if res.Mode != "fuse" || res.Dir != mountDir {
		t.Errorf("first restore: mode %q, dir %s; want fuse, %s", res.Mode, res.Dir, mountDir)
	}
	want := []restore.Step{restore.Ready, restore.Restored, restore.PagesLoaded, restore.Materialized, restore.Unmounted}
	if got := steps(events); !slices.Equal(got, want) {
		t.Errorf("first restore: steps %v, want %v", got, want)
	}
	for _, ev := range events {
		if ev.Err != nil || ev.Snapshot != d {
			t.Errorf("first restore: %v step: snapshot %s, error %v", ev.Step, ev.Snapshot, ev.Err)
		}
	}
	matDir, ok := p1.Materialized(d)
	if !ok || res.MaterializedDir != matDir || res.MaterializeErr != nil || res.Materialized == 0 {
		t.Errorf("first restore: materialized %q (%v); result says %q after %v, error %v", matDir, ok, res.MaterializedDir, res.Materialized, res.MaterializeErr)
	}
	if _, err := os.Stat(mountDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("mount dir %s after the restore: %v, want it removed", mountDir, err)
	}
	if n := len(log1.digests()); n < 3 {
		t.Errorf("first restore fetched %d objects from the registry", n)
	}
	if st := p1.Cache().Stats(); st.Pinned != 0 {
		t.Errorf("first restore left %d pins in the node cache", st.Pinned)
	}
	t.Logf("first restore: runsc restore's stderr: %q", stderr.String())
	t.Logf("first restore: %d fetches; ready %v, restored %v, pages loaded %v, materialized %v",
		len(log1.digests()), res.Ready, res.Restored, res.PagesLoaded, res.Materialized)

	// 2. Same snapshot, same node cache, a new puller (as a new cryo
	// restore process): from the materialized dir, only the index read.
	var log2 fetchLog
	src = resolve(t, ref, &log2)
	p2, err := puller.New(puller.Options{CacheDir: e.cacheDir})
	if err != nil {
		t.Fatal(err)
	}
	events = nil
	opts = options(e, app, &events)
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res = e.restoreApp(t, p2, src, opts, app, last)
	if res.Mode != "materialized" || res.Dir != matDir {
		t.Errorf("second restore: mode %q, dir %s; want materialized, %s", res.Mode, res.Dir, matDir)
	}
	want = []restore.Step{restore.Ready, restore.Restored, restore.PagesLoaded}
	if got := steps(events); !slices.Equal(got, want) {
		t.Errorf("second restore: steps %v, want %v", got, want)
	}
	if got := log2.digests(); !slices.Equal(got, []digest.Digest{d}) {
		t.Errorf("second restore fetched %v, want only the index %s", got, d)
	}
	if st := p2.Cache().Stats(); st.Pinned != 0 {
		t.Errorf("second restore left %d pins in the node cache", st.Pinned)
	}
}

// TestRestoreRefusesOtherRunscVersion restores a checkpoint whose header
// says another runsc_version: Restore must refuse it with a VersionError
// naming both versions, having read the snapshot's index and nothing else
// (no chunk, no table), mounted nothing and never run runsc restore.
func TestRestoreRefusesOtherRunscVersion(t *testing.T) {
	e := newEnv(t)
	local := gvisortest.RunscVersion(t, e.runsc)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 16})
	app.NextCount(t)
	img := app.Checkpoint(t)
	const other = "release-20990101.0"
	otherImg := filepath.Join(t.TempDir(), "img")
	if err := gvisortest.CopyImageWithMetadata(img, otherImg, map[string]string{"runsc_version": other}); err != nil {
		t.Fatal(err)
	}
	ref := e.reg.Addr + "/other:v1"
	d := e.push(t, otherImg, ref)

	// A runsc that logs its arguments, answers --version with the real
	// runsc, and refuses to restore.
	wrapper, calls := gvisortest.NoRestoreRunsc(t, e.runsc)

	var log fetchLog
	src := resolve(t, ref, &log)
	p, err := puller.New(puller.Options{CacheDir: e.cacheDir})
	if err != nil {
		t.Fatal(err)
	}
	var events []restore.Event
	opts := options(e, app, &events)
	opts.Runsc = wrapper
	opts.Name = ref
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	res, err := restore.Restore(ctx, p, src, opts)
	var ve *restore.VersionError
	if !errors.As(err, &ve) {
		t.Fatalf("Restore of a checkpoint by runsc %q with runsc %q: %v, %v; want a VersionError", other, local, res, err)
	}
	if ve.Checkpointed != other || ve.Local != local || ve.Snapshot != ref {
		t.Errorf("VersionError %+v, want checkpointed %q, local %q, snapshot %q", ve, other, local, ref)
	}
	for _, v := range []string{other, local, ref} {
		if !strings.Contains(err.Error(), v) {
			t.Errorf("error %q does not name %q", err, v)
		}
	}
	if got := log.digests(); !slices.Equal(got, []digest.Digest{d}) {
		t.Errorf("refused restore fetched %v, want only the index %s", got, d)
	}
	if len(events) != 0 {
		t.Errorf("refused restore reported steps %v", steps(events))
	}
	called, err := os.ReadFile(calls)
	if err != nil {
		t.Fatalf("the runsc wrapper was never called (not even --version): %v", err)
	}
	if strings.TrimSpace(string(called)) != "--version" {
		t.Errorf("runsc wrapper calls:\n%s\nwant only --version", called)
	}
	if _, err := os.Stat(filepath.Join(e.cacheDir, "mounts")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("refused restore made a mount dir: %v", err)
	}
	if st := p.Cache().Stats(); st.Chunks != 0 || st.Images != 0 || st.Pinned != 0 {
		t.Errorf("refused restore left cache stats %+v", st)
	}
}

// mountsUnder returns the mount points at or under dir, deepest first.
func mountsUnder(t testing.TB, dir string) []string {
	t.Helper()
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var mps []string
	for _, line := range strings.Split(string(data), "\n") {
		// The fifth field is the mount point (octal escapes, which the
		// test's temp dirs do not need).
		if f := strings.Fields(line); len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			mps = append(mps, f[4])
		}
	}
	slices.Reverse(mps)
	return mps
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
