package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
	"golang.org/x/sys/unix"
)

// testDaemon is a daemon over a real unix socket, mounting from a real
// registry that holds one snapshot, host/app:v1.
type testDaemon struct {
	d      *Daemon
	p      *puller.Puller
	img    string // the snapshot's image dir
	ref    string
	host   string // the registry's
	gate   *testenv.TagGate
	sock   string
	mounts string
	client *http.Client
}

func newTestDaemon(t *testing.T, opts Options) *testDaemon {
	t.Helper()
	testenv.NeedFUSE(t, "the daemon's mounts")
	logrus.SetLevel(logrus.ErrorLevel)
	ctx := context.Background()
	cfg, _ := registry.DefaultConfig(t.TempDir(), "127.0.0.1:0")
	srv, err := registry.New(ctx, cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	gate := testenv.NewTagGate(srv.Handler())
	hs := httptest.NewServer(gate)
	t.Cleanup(hs.Close)
	t.Cleanup(gate.Release)
	host := strings.TrimPrefix(hs.URL, "http://")
	img := filepath.Join(t.TempDir(), "img")
	synth.ImageDir(img, synth.HalfZero, 8<<20, 1)
	repo, tag, _ := transfer.Repository(host+"/app:v1", transfer.ClientOptions{})
	if _, err := transfer.Push(ctx, img, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	p, err := puller.New(puller.Options{CacheDir: t.TempDir(), FetchMetrics: fetch.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	client, err := transfer.NewClient(transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	resolve := func(ctx context.Context, ref, _ string) (puller.Source, error) {
		return puller.Resolve(ctx, ref, puller.ResolveOptions{Client: client})
	}
	if opts.MountsDir == "" {
		opts.MountsDir = filepath.Join(t.TempDir(), "mounts")
	}
	if opts.Checkpoint == nil {
		opts.Checkpoint = func(ctx context.Context, req CheckpointRequest) (*checkpoint.Triggered, error) {
			repo, tag, err := client.Repository(req.Ref)
			if err != nil {
				return nil, fmt.Errorf("%w: %w", ErrInvalidRequest, err)
			}
			return checkpoint.NewTriggered(ctx, checkpoint.TriggeredOptions{Repo: repo, Tag: tag, Filesystem: req.Filesystem, Deferred: req.Adopted, Push: transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}}})
		}
	}
	opts.Logger, opts.Registerer, opts.Gatherer = slog.Default(), reg, reg
	if opts.Socket == "" {
		opts.Socket = filepath.Join(t.TempDir(), "puller.sock")
	}
	sock := opts.Socket
	d, err := New(p, resolve, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	ln, err := Listen(sock, -1)
	if err != nil {
		t.Fatal(err)
	}
	hsrv := &http.Server{Handler: d.Handler()}
	go hsrv.Serve(ln)
	t.Cleanup(func() { hsrv.Close() })
	return &testDaemon{d: d, p: p, img: img, ref: host + "/app:v1", host: host, gate: gate, sock: sock, mounts: opts.MountsDir,
		client: &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}}
}

// do sends a request and returns the status and body.
func (td *testDaemon) do(t *testing.T, method, path, body string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://puller"+path, strings.NewReader(body))
	resp, err := td.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, data
}

// call sends a request and fails the test unless it gets want.
func (td *testDaemon) call(t *testing.T, method, path, body string, want int) []byte {
	t.Helper()
	code, data := td.do(t, method, path, body)
	if code != want {
		t.Fatalf("%s %s: %d %s, want %d", method, path, code, data, want)
	}
	return data
}

func (td *testDaemon) mount(t *testing.T) Mount {
	t.Helper()
	var m Mount
	json.Unmarshal(td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`"}`, http.StatusCreated), &m)
	return m
}

// TestAPI drives the daemon over a real unix socket: mount a snapshot from
// a real registry, list it, wait until loaded, read its bytes, check the
// metrics, unmount. The node cache, the mounts dir and each mount dir are
// 0700.
func TestAPI(t *testing.T) {
	td := newTestDaemon(t, Options{})
	img := td.img
	call := func(method, path, body string, want int) []byte {
		t.Helper()
		return td.call(t, method, path, body, want)
	}
	for _, dir := range []string{td.p.Cache().Root(), td.mounts} {
		if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: %v %v, want 0700", dir, fi.Mode(), err)
		}
	}
	call("POST", "/v1/mounts", `{"ref": "nope"}`, http.StatusBadGateway)
	var m Mount
	json.Unmarshal(call("POST", "/v1/mounts", `{"ref": "`+td.ref+`"}`, http.StatusCreated), &m)
	if m.ID == "" || m.Dir == "" || m.Mode != "fuse" {
		t.Fatalf("mount: %+v", m)
	}
	var list []Mount
	json.Unmarshal(call("GET", "/v1/mounts", "", http.StatusOK), &list)
	if len(list) != 1 || list[0].ID != m.ID {
		t.Fatalf("list: %+v", list)
	}
	json.Unmarshal(call("POST", "/v1/mounts/"+m.ID+"/wait", "", http.StatusOK), &m)
	if !m.Loaded || m.LocalBytes != m.TotalBytes || m.Err != "" {
		t.Fatalf("after wait: %+v", m)
	}
	got, _ := os.ReadFile(filepath.Join(m.Dir, "pages.img"))
	want, _ := os.ReadFile(filepath.Join(img, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs")
	}
	metrics := string(call("GET", "/metrics", "", http.StatusOK))
	for _, name := range []string{"cryo_puller_fetched_bytes_total", "cryo_puller_time_to_ready_seconds", "cryo_puller_time_to_loaded_seconds", "cryo_puller_cache_bytes"} {
		if !strings.Contains(metrics, name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	call("DELETE", "/v1/mounts/"+m.ID, "", http.StatusNoContent)
	call("GET", "/v1/mounts/"+m.ID, "", http.StatusNotFound)
	if _, err := os.Stat(m.Dir); !os.IsNotExist(err) {
		t.Errorf("mount dir %s left after unmount: %v", m.Dir, err)
	}

	// The TCP (metrics) handler serves metrics and health, never the mount API.
	mh := td.d.MetricsHandler()
	for _, tc := range []struct {
		method, path string
		want         int
	}{{"GET", "/metrics", 200}, {"GET", "/healthz", 200}, {"POST", "/v1/mounts", 404}, {"GET", "/v1/mounts", 404}} {
		rec := httptest.NewRecorder()
		mh.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, strings.NewReader(`{"ref":"x/y:z"}`)))
		if rec.Code != tc.want {
			t.Errorf("metrics handler %s %s: %d, want %d", tc.method, tc.path, rec.Code, tc.want)
		}
	}
}

// TestMaxMounts: mounts over --max-mounts are refused with 503 and a clear
// error; unmounting one makes room again.
func TestMaxMounts(t *testing.T) {
	td := newTestDaemon(t, Options{MaxMounts: 2})
	a := td.mount(t)
	td.mount(t)
	code, body := td.do(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`"}`)
	if code != http.StatusServiceUnavailable || !strings.Contains(string(body), "--max-mounts 2") {
		t.Fatalf("third mount with --max-mounts 2: %d %s, want 503 naming the limit", code, body)
	}
	td.call(t, "DELETE", "/v1/mounts/"+a.ID, "", http.StatusNoContent)
	td.mount(t)
}

// TestConcurrentDeletes: of several concurrent DELETEs of one mount,
// exactly one unmounts it (204) and the others find no mount (404), so its
// chunks are unpinned once; another mount of the same snapshot still
// serves its bytes.
func TestConcurrentDeletes(t *testing.T) {
	td := newTestDaemon(t, Options{})
	a, b := td.mount(t), td.mount(t)
	const n = 8
	codes := make(chan int, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			code, _ := td.do(t, "DELETE", "/v1/mounts/"+a.ID, "")
			codes <- code
		}()
	}
	close(start)
	wg.Wait()
	close(codes)
	count := map[int]int{}
	for c := range codes {
		count[c]++
	}
	if count[http.StatusNoContent] != 1 || count[http.StatusNotFound] != n-1 {
		t.Fatalf("%d concurrent DELETEs of one mount: %v, want one 204 and %d 404", n, count, n-1)
	}
	td.call(t, "POST", "/v1/mounts/"+b.ID+"/wait", "", http.StatusOK)
	got, _ := os.ReadFile(filepath.Join(b.Dir, "pages.img"))
	want, _ := os.ReadFile(filepath.Join(td.img, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("the other mount's pages.img differs")
	}
}

// dialEnv, when set, makes the test binary a client: it dials the socket
// it names, asks GET /healthz and exits 0 on 200, 3 otherwise.
const dialEnv = "CRYO_DAEMON_TEST_DIAL"

func TestMain(m *testing.M) {
	if sock := os.Getenv(dialEnv); sock != "" {
		c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
		resp, err := c.Get("http://puller/healthz")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(3)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			fmt.Fprintln(os.Stderr, resp.Status)
			os.Exit(3)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestSocketModes: the API socket is 0600 even under umask 0, and user
// nobody (a real other uid, via setpriv) cannot connect; with a socket
// group it is 0660 and that group's members connect, others still not. A
// stale socket is replaced; another kind of file is not.
func TestSocketModes(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.SkipOrFatal(t, "needs root to run a client as another user")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		testenv.SkipOrFatal(t, "no setpriv: %v", err)
	}
	// A copy of this test binary that user nobody can run, as the client.
	dir := t.TempDir()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	client := filepath.Join(dir, "client")
	if err := os.WriteFile(client, data, 0o755); err != nil {
		t.Fatal(err)
	}
	for d := dir; d != os.TempDir() && d != "/"; d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	dial := func(sock, gid string) error {
		cmd := exec.Command(setpriv, "--reuid=nobody", "--regid="+gid, "--clear-groups", client)
		cmd.Env = append(os.Environ(), dialEnv+"="+sock)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	}
	serve := func(t *testing.T, gid int) string {
		t.Helper()
		sock := filepath.Join(dir, "run", "puller.sock")
		old := unix.Umask(0)
		ln, err := Listen(sock, gid)
		unix.Umask(old)
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		if err := os.Chmod(filepath.Dir(sock), 0o755); err != nil {
			t.Fatal(err)
		}
		return sock
	}
	checkMode := func(t *testing.T, sock string, perm os.FileMode, gid int) {
		t.Helper()
		fi, err := os.Stat(sock)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Type() != os.ModeSocket || fi.Mode().Perm() != perm {
			t.Errorf("socket mode %v, want socket %v", fi.Mode(), perm)
		}
		if gid >= 0 && int(fi.Sys().(*syscall.Stat_t).Gid) != gid {
			t.Errorf("socket group %d, want %d", fi.Sys().(*syscall.Stat_t).Gid, gid)
		}
	}

	t.Run("root only", func(t *testing.T) {
		sock := serve(t, -1)
		checkMode(t, sock, 0o600, -1)
		if err := dial(sock, "nogroup"); err == nil {
			t.Error("user nobody connected to the API socket")
		}
	})
	t.Run("socket group", func(t *testing.T) {
		gid, err := LookupGroup("nogroup")
		if err != nil {
			testenv.SkipOrFatal(t, "no group nogroup: %v", err)
		}
		sock := serve(t, gid) // replaces the stale socket of the subtest before
		checkMode(t, sock, 0o660, gid)
		if err := dial(sock, "nogroup"); err != nil {
			t.Errorf("a member of the socket group could not connect: %v", err)
		}
		if err := dial(sock, "1"); err == nil {
			t.Error("user nobody outside the socket group connected")
		}
	})
	t.Run("not a socket", func(t *testing.T) {
		f := filepath.Join(dir, "file")
		os.WriteFile(f, []byte("keep"), 0o644)
		if _, err := Listen(f, -1); err == nil {
			t.Fatal("Listen replaced a regular file")
		}
		if data, _ := os.ReadFile(f); string(data) != "keep" {
			t.Fatal("Listen removed a regular file")
		}
	})
}

// TestGoferMount asks the daemon for a gofer mount: its dir holds
// gcs_opts.json alone (0600), naming the daemon's socket, the mount and
// the snapshot, and the file API serves the snapshot's bytes to a
// gofer.Client of that config, at either priority, and in place once the
// mount is loaded; a client expecting another snapshot is refused, and so
// are ranges past the file.
func TestGoferMount(t *testing.T) {
	td := newTestDaemon(t, Options{})
	var m Mount
	json.Unmarshal(td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`", "backend": "gofer"}`, http.StatusCreated), &m)
	if m.Mode != "gofer" {
		t.Fatalf("mount: %+v", m)
	}
	ents, _ := os.ReadDir(m.Dir)
	if len(ents) != 1 || ents[0].Name() != gofer.ConfigFile {
		t.Fatalf("gofer mount dir holds %v, want %s alone", ents, gofer.ConfigFile)
	}
	if fi, _ := ents[0].Info(); fi.Mode().Perm() != 0o600 {
		t.Errorf("%s is %v, want 0600", gofer.ConfigFile, fi.Mode())
	}
	f, err := os.Open(filepath.Join(m.Dir, gofer.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := gofer.ReadConfig(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Socket != td.sock || cfg.Mount != m.ID || cfg.Index != m.Digest || cfg.Reference != td.ref {
		t.Fatalf("config %+v for mount %+v", cfg, m)
	}
	ctx := context.Background()
	c := gofer.NewClient(cfg.Socket, cfg.Mount, cfg.Index, 5*time.Second)
	defer c.Close()
	want, _ := os.ReadFile(filepath.Join(td.img, "pages.img"))
	size, err := c.Size(ctx, "pages.img")
	if err != nil || size != int64(len(want)) {
		t.Fatalf("size %d, %v; want %d", size, err, len(want))
	}
	got := make([]byte, len(want))
	// The first half as faults, 3 MiB at a time, the rest as reads.
	for off := 0; off < len(got); off += 3 << 20 {
		prio := fetch.Fault
		if off >= len(got)/2 {
			prio = fetch.Read
		}
		end := min(off+3<<20, len(got))
		if err := c.ReadAt(ctx, "pages.img", [][]byte{got[off:end]}, int64(off), prio); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img through the file API differs")
	}
	// Once the mount is loaded (its snapshot materialized), a client that
	// may read the node store gets every byte in place, right.
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		var now Mount
		json.Unmarshal(td.call(t, "GET", "/v1/mounts/"+m.ID, "", http.StatusOK), &now)
		if now.LoadedSeconds > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("mount not loaded after a minute: %+v", now)
		}
	}
	pc := gofer.NewClient(cfg.Socket, cfg.Mount, cfg.Index, 5*time.Second)
	pc.InPlace = true
	defer pc.Close()
	placed := make([]byte, len(want))
	if err := pc.ReadAt(ctx, "pages.img", [][]byte{placed}, 0, fetch.Read); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(placed, want) || pc.PlacedBytes() != int64(len(want)) {
		t.Fatalf("pages.img read in place: same bytes %v, %d of %d bytes in place", bytes.Equal(placed, want), pc.PlacedBytes(), len(want))
	}
	if _, err := c.Size(ctx, "nope.img"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("size of a missing file: %v, want ErrNotExist", err)
	}
	if err := c.ReadAt(ctx, "pages.img", [][]byte{make([]byte, 10)}, int64(len(want)), fetch.Read); err == nil {
		t.Error("read past the end: no error")
	}
	other := gofer.NewClient(cfg.Socket, cfg.Mount, digest.FromString("another snapshot"), time.Second)
	defer other.Close()
	if _, err := other.Size(ctx, "pages.img"); !errors.Is(err, gofer.ErrOtherSnapshot) {
		t.Errorf("client of another snapshot: %v, want a refusal", err)
	}
	// The faults are the working set the mount recorded; the reads are
	// the sweep's.
	rec, err := profile.Parse(td.call(t, "GET", "/v1/mounts/"+m.ID+"/profile", "", http.StatusOK))
	if err != nil {
		t.Fatalf("the mount's profile: %v", err)
	}
	if rec.Subject != m.Digest || rec.Bytes() != 6<<20 || rec.Ranges[0].Offset != 0 {
		t.Errorf("recorded %+v, want the 6 MiB read as faults", rec)
	}
	td.call(t, "DELETE", "/v1/mounts/"+m.ID, "", http.StatusNoContent)
	if _, err := os.Stat(m.Dir); !os.IsNotExist(err) {
		t.Errorf("gofer mount dir %s left after unmount: %v", m.Dir, err)
	}
	td.call(t, "GET", "/v1/mounts/"+m.ID+"/profile", "", http.StatusNotFound)
	td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`", "backend": "nfs"}`, http.StatusBadRequest)
	td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`", "profile": "/etc/shadow"}`, http.StatusBadRequest)
}

// TestGoferMountAwaitsTheSandbox: a daemon's gofer mount is made for a
// sandbox manager to restore from next, so its background load fetches
// the start of pages.img only until a sandbox reads it (as cryo
// restore's does); the read releases the rest.
func TestGoferMountAwaitsTheSandbox(t *testing.T) {
	td := newTestDaemon(t, Options{})
	ctx := context.Background()
	img := filepath.Join(t.TempDir(), "big")
	synth.ImageDir(img, synth.Random, 64<<20, 2)
	ref := strings.Replace(td.ref, "/app:v1", "/big:v1", 1)
	repo, tag, _ := transfer.Repository(ref, transfer.ClientOptions{})
	if _, err := transfer.Push(ctx, img, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatal(err)
	}
	var m Mount
	json.Unmarshal(td.call(t, "POST", "/v1/mounts", `{"ref": "`+ref+`", "backend": "gofer"}`, http.StatusCreated), &m)
	pages, _ := os.Stat(filepath.Join(img, "pages.img"))
	small := m.TotalBytes - pages.Size()
	// Unheld, a loopback registry's 64 MiB is local well within this.
	time.Sleep(500 * time.Millisecond)
	json.Unmarshal(td.call(t, "GET", "/v1/mounts/"+m.ID, "", http.StatusOK), &m)
	if m.LocalBytes > small+32<<20 {
		t.Fatalf("%d of %d bytes local before a sandbox read pages.img, want at most the small files and the first 32 MiB", m.LocalBytes, m.TotalBytes)
	}
	c := gofer.NewClient(td.sock, m.ID, m.Digest, 5*time.Second)
	defer c.Close()
	if err := c.ReadAt(ctx, "pages.img", [][]byte{make([]byte, 4096)}, 0, fetch.Read); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for !m.Loaded {
		if time.Now().After(deadline) {
			t.Fatalf("not loaded a minute after the sandbox's read: %+v", m)
		}
		time.Sleep(20 * time.Millisecond)
		json.Unmarshal(td.call(t, "GET", "/v1/mounts/"+m.ID, "", http.StatusOK), &m)
	}
}

// TestRecordProfileMount: a gofer or FUSE mount asked to record a profile
// to keep ("recordProfile") holds its sweep at the default rate and says
// so; one not asked holds nothing. (A materialized mount holds nothing
// either: puller's TestRecordingHoldsTheSweep.)
func TestRecordProfileMount(t *testing.T) {
	td := newTestDaemon(t, Options{})
	var m Mount
	json.Unmarshal(td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`", "backend": "gofer", "recordProfile": true}`, http.StatusCreated), &m)
	json.Unmarshal(td.call(t, "GET", "/v1/mounts/"+m.ID, "", http.StatusOK), &m)
	if m.RecordSweepRate != puller.DefaultRecordSweepRate {
		t.Errorf("recording gofer mount: recordSweepRate %v, want %v", m.RecordSweepRate, puller.DefaultRecordSweepRate)
	}
	var plain Mount
	json.Unmarshal(td.call(t, "POST", "/v1/mounts", `{"ref": "`+td.ref+`", "backend": "gofer"}`, http.StatusCreated), &plain)
	if plain.RecordSweepRate != 0 {
		t.Errorf("gofer mount not asked to record: recordSweepRate %v, want 0", plain.RecordSweepRate)
	}
	// Each FUSE mount on a node of its own: a node that has loaded the
	// snapshot once serves it materialized, with no sweep to hold.
	for _, c := range []struct {
		body string
		want float64
	}{
		{`{"ref": "REF", "recordProfile": true}`, puller.DefaultRecordSweepRate},
		{`{"ref": "REF"}`, 0},
	} {
		node := newTestDaemon(t, Options{})
		var fm Mount
		json.Unmarshal(node.call(t, "POST", "/v1/mounts", strings.ReplaceAll(c.body, "REF", node.ref), http.StatusCreated), &fm)
		json.Unmarshal(node.call(t, "GET", "/v1/mounts/"+fm.ID, "", http.StatusOK), &fm)
		if fm.Mode != "fuse" || fm.RecordSweepRate != c.want {
			t.Errorf("FUSE mount %s: mode %q, recordSweepRate %v, want fuse, %v", c.body, fm.Mode, fm.RecordSweepRate, c.want)
		}
	}
}
