package puller_test

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"golang.org/x/sys/unix"
)

// runningMount is a `cryo mount` started by startMount.
type runningMount struct {
	cmd    *exec.Cmd
	stderr *strings.Builder
	// exited is closed once cmd exited, with err its Wait's error.
	exited chan struct{}
	err    error
}

// startMount starts `cryo mount [--backend gofer] ARGS... DIR` (a FUSE
// mount unless gofer) and waits for its ready line. It returns the
// environment its "env:" line gives runsc (empty for a FUSE mount) and
// the mount. When the test ends a mount still running gets SIGTERM (a
// killed one cannot unmount), then SIGKILL after 30 s, and a FUSE mount
// left at dir is detached.
func (e *restoreEnv) startMount(t *testing.T, gofer bool, dir string, args ...string) (string, *runningMount) {
	t.Helper()
	if gofer {
		args = append([]string{"--backend", "gofer"}, args...)
	}
	m := &runningMount{cmd: e.command(context.Background(), append(append([]string{"mount"}, args...), dir)...), stderr: &strings.Builder{}, exited: make(chan struct{})}
	stdout, err := m.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	m.cmd.Stderr = m.stderr
	if err := m.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Every line is read to the end, so that the mount never blocks on
	// its stdout; the test waits only for the first it wants.
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case lines <- sc.Text():
			default:
			}
		}
		close(lines)
		m.err = m.cmd.Wait()
		close(m.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-m.exited:
		default:
			m.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-m.exited:
			case <-time.After(30 * time.Second):
				m.cmd.Process.Kill()
				<-m.exited
			}
		}
		if !gofer {
			unix.Unmount(dir, unix.MNT_DETACH) // nothing there if it ended cleanly
		}
	})
	want := "ready: "
	if gofer {
		want = "env: "
	}
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				<-m.exited
				t.Fatalf("cryo mount %q ended before it was ready (%v):\n%s", args, m.err, m.stderr.String())
			}
			if v, ok := strings.CutPrefix(line, want); ok {
				if gofer {
					return v, m
				}
				return "", m
			}
		case <-timeout:
			t.Fatalf("cryo mount %q: no %q line after 2 minutes:\n%s", args, want, m.stderr.String())
		}
	}
}

// stop ends the mount with SIGTERM and fails t unless it exits cleanly
// within 30 s.
func (m *runningMount) stop(t *testing.T) {
	t.Helper()
	m.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-m.exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("cryo mount still running 30 s after SIGTERM:\n%s", m.stderr.String())
	}
	if m.err != nil {
		t.Errorf("cryo mount after SIGTERM: %v\n%s", m.err, m.stderr.String())
	}
}

// TestFilesystemCheckpoint: `cryo checkpoint --filesystem` of a sandbox
// that wrote a file saves its overlay upper layer (runsc fscheckpoint)
// straight into the registry through cryo's gofer; a new sandbox
// created from that snapshot (runsc create --fs-restore-image-path) reads
// the same file, both through the gofer (`cryo mount --backend gofer`, an
// empty node cache) and through a FUSE mount; `cryo restore` refuses the
// snapshot, saying what it is.
func TestFilesystemCheckpoint(t *testing.T) {
	e := newRestoreEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{Overlay: true})
	// 24 MiB of random bytes, and one small file: the first in the
	// checkpoint's pages, both named in its multi-tar.
	want := app.Exec(t, "/bin/sh", "-c", "head -c 25165824 /dev/urandom > /cryo-data && echo hello > /cryo-note && sha256sum /cryo-data /cryo-note")
	if !regexp.MustCompile(`^[0-9a-f]{64}  /cryo-data\n[0-9a-f]{64}  /cryo-note\n$`).MatchString(want) {
		t.Fatalf("sha256sum in the sandbox printed %q", want)
	}
	ref := e.reg.Addr + "/app:fs"
	goferLog := filepath.Join(t.TempDir(), "gofer.log")
	args := []string{"checkpoint", "--filesystem", "--leave-running", "--runsc", e.runsc, "--gofer-dir", goferDir, "--gofer-log", goferLog}
	for _, f := range app.Flags() {
		args = append(args, "--runsc-flag="+f)
	}
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	out, err := e.command(ctx, append(args, app.ID(), ref)...).CombinedOutput()
	if err != nil {
		logged, _ := os.ReadFile(goferLog)
		t.Fatalf("cryo checkpoint --filesystem: %v\n%s\ngofer log:\n%s", err, out, logged)
	}
	if !strings.Contains(string(out), "runsc fscheckpoint returned") {
		t.Errorf("cryo checkpoint --filesystem printed:\n%s", out)
	}
	inspect, err := e.command(ctx, "inspect", ref).CombinedOutput()
	if err != nil {
		t.Fatalf("cryo inspect: %v\n%s", err, inspect)
	}
	for _, f := range []string{"fscheckpoint.pb", "multitar.img", "pages_meta.img", "pages.img"} {
		if !strings.Contains(string(inspect), f) {
			t.Errorf("the snapshot has no %s:\n%s", f, inspect)
		}
	}

	for _, tc := range []struct {
		name  string
		gofer bool
	}{{"gofer", true}, {"fuse", false}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "img")
			env, mount := e.startMount(t, tc.gofer, dir, "--runsc", e.runsc, "--cache", t.TempDir(), ref)
			var extra []string
			if env != "" {
				extra = []string{env}
			}
			got := app.RunFromFS(t, dir, extra, "/bin/sh", "-c", "sha256sum /cryo-data /cryo-note")
			if got != want {
				t.Errorf("the new sandbox reads\n%s\nthe checkpointed one wrote\n%s\ncryo mount:\n%s", got, want, mount.stderr.String())
			}
			mount.stop(t)
		})
	}

	ctx, cancel = context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	restore := e.command(ctx, "restore", "--runsc", e.runsc, ref, "--bundle="+app.BundleDir(), "other")
	out, err = restore.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "is a filesystem checkpoint") {
		t.Errorf("cryo restore of a filesystem checkpoint: %v\n%s", err, out)
	}
}

// pullerDaemon is a `cryo puller serve` of the test's own, and a client
// of its API socket.
type pullerDaemon struct {
	client *http.Client
	log    string
	args   []string
	cmd    *exec.Cmd
	e      *restoreEnv
}

// startDaemon starts `cryo puller serve` on an empty node cache and
// waits until its API answers. It is killed when the test ends.
func (e *restoreEnv) startDaemon(t *testing.T) *pullerDaemon {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "puller.sock")
	d := &pullerDaemon{e: e, log: filepath.Join(dir, "log"), client: &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}}
	d.args = []string{"puller", "serve", "--socket", sock, "--cache", filepath.Join(dir, "cache"), "--mounts", filepath.Join(dir, "mnt"), "--profile", "none"}
	d.start(t)
	t.Cleanup(func() { d.cmd.Process.Kill(); d.cmd.Wait() })
	return d
}

// start starts the daemon's process, its output appended to its log, and
// waits until its API answers.
func (d *pullerDaemon) start(t *testing.T) {
	t.Helper()
	lf, err := os.OpenFile(d.log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	d.cmd = d.e.command(context.Background(), d.args...)
	d.cmd.Stdout, d.cmd.Stderr = lf, lf
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := d.client.Get("http://puller/healthz"); err == nil {
			resp.Body.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("cryo puller serve never answered:\n%s", d.logged())
		}
	}
}

// restart stops the daemon as a node's service manager does (SIGTERM)
// and starts it again on the same socket, node cache and mounts dir.
func (d *pullerDaemon) restart(t *testing.T) {
	t.Helper()
	d.cmd.Process.Signal(syscall.SIGTERM)
	if err := d.cmd.Wait(); err != nil {
		t.Errorf("cryo puller serve after SIGTERM: %v\n%s", err, d.logged())
	}
	d.start(t)
}

func (d *pullerDaemon) logged() string {
	data, _ := os.ReadFile(d.log)
	return string(data)
}

// call sends a JSON request to the daemon, fails t unless it gets want
// and decodes the answer into out.
func (d *pullerDaemon) call(t *testing.T, method, path, body string, want int, out any) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://puller"+path, strings.NewReader(body))
	resp, err := d.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", method, path, err, d.logged())
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != want {
		t.Fatalf("%s %s: %d %s, want %d\n%s", method, path, resp.StatusCode, data, want, d.logged())
	}
	if out != nil {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: %v: %s", method, path, err, data)
		}
	}
}

// TestWorkloadTriggeredFilesystemCheckpoint: a sandbox created with
// gVisor's dev.gvisor.internal.fscheckpoint.path annotation naming a
// checkpoint dir the puller daemon handed out (POST /v1/checkpoints)
// saves its filesystem when its workload writes 1 to
// /proc/gvisor/fscheckpoint: through cryo's gofer, started by runsc with
// the sandbox, the files stream to the daemon, which pushes and tags the
// snapshot once all are in. A new sandbox created from a gofer mount of
// that tag reads the file the workload wrote.
func TestWorkloadTriggeredFilesystemCheckpoint(t *testing.T) {
	e := newRestoreEnv(t)
	goferDir := gvisortest.GoferDir(t)
	d := e.startDaemon(t)
	ref := e.reg.Addr + "/app:triggered"
	var cp struct {
		ID, Dir, State, Index, Error string
	}
	d.call(t, "POST", "/v1/checkpoints", `{"ref": "`+ref+`", "filesystem": true}`, http.StatusCreated, &cp)
	if cp.State != "waiting" {
		t.Fatalf("prepared: %+v", cp)
	}
	sidecars := "GVISOR_SIDECAR_BINARIES_DIR=" + goferDir
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{Overlay: true, Env: []string{sidecars}, Annotations: map[string]string{
		"dev.gvisor.internal.fscheckpoint.enable": "true",
		"dev.gvisor.internal.fscheckpoint.path":   cp.Dir,
		"dev.gvisor.internal.fscheckpoint.resume": "true",
	}})
	// The trigger's result is read on the fd it was written to: a read
	// waits for the end of the checkpoint after the fd's open (an fd
	// opened after the trigger waits for the next one).
	out := app.Exec(t, "/bin/sh", "-c", "head -c 16777216 /dev/urandom > /cryo-data && sha256sum /cryo-data && exec 3<>/proc/gvisor/fscheckpoint && echo 1 >&3 && cat <&3")
	want, result, _ := strings.Cut(strings.TrimSpace(out), "\n")
	if !regexp.MustCompile(`^[0-9a-f]{64}  /cryo-data$`).MatchString(want) || result != "resume" {
		t.Fatalf("the workload printed %q, want its file's hash, then resume\n%s", out, d.logged())
	}
	d.call(t, "POST", "/v1/checkpoints/"+cp.ID+"/wait", "", http.StatusOK, &cp)
	if cp.State != "pushed" || cp.Index == "" {
		t.Fatalf("after the workload's checkpoint: %+v\n%s", cp, d.logged())
	}
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	inspect, err := e.command(ctx, "inspect", ref).CombinedOutput()
	if err != nil || !strings.Contains(string(inspect), cp.Index) || !strings.Contains(string(inspect), "multitar.img") {
		t.Fatalf("cryo inspect %s (the checkpoint says %s): %v\n%s", ref, cp.Index, err, inspect)
	}

	var m struct{ Dir string }
	d.call(t, "POST", "/v1/mounts", `{"ref": "`+ref+`", "backend": "gofer"}`, http.StatusCreated, &m)
	got := app.RunFromFS(t, m.Dir, []string{sidecars}, "/bin/sh", "-c", "sha256sum /cryo-data")
	if got != want+"\n" {
		t.Errorf("the new sandbox reads %q, the workload wrote %q\n%s", got, want, d.logged())
	}
}

// TestWorkloadTriggeredCheckpoint: a sandbox created with gVisor's
// dev.gvisor.internal.checkpoint.path annotation naming a checkpoint dir
// the puller daemon handed out checkpoints itself when its workload writes
// 1 to /proc/gvisor/checkpoint, and goes on (resume); the daemon,
// restarted between the sandbox's start and the trigger, pushes and tags
// the snapshot; a restore from a gofer mount of that tag, on the
// daemon's empty node cache, goes on from the checkpoint with the app's
// memory unchanged.
func TestWorkloadTriggeredCheckpoint(t *testing.T) {
	e := newRestoreEnv(t)
	goferDir := gvisortest.GoferDir(t)
	d := e.startDaemon(t)
	ref := e.reg.Addr + "/app:triggered-sandbox"
	var cp struct {
		ID, Dir, State, Index, Error string
		Files                        map[string]int64
	}
	d.call(t, "POST", "/v1/checkpoints", `{"ref": "`+ref+`"}`, http.StatusCreated, &cp)
	sidecars := "GVISOR_SIDECAR_BINARIES_DIR=" + goferDir
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32, Env: []string{sidecars}, Annotations: map[string]string{
		"dev.gvisor.internal.checkpoint.enable":      "true",
		"dev.gvisor.internal.checkpoint.path":        cp.Dir,
		"dev.gvisor.internal.checkpoint.compression": "none",
		"dev.gvisor.internal.checkpoint.resume":      "true",
	}})
	// The daemon is restarted (upgraded, say) between the sandbox's
	// start and its checkpoint: the next one takes the session over.
	d.restart(t)
	before := app.NextCount(t)
	if out := app.Exec(t, "/bin/sh", "-c", "exec 3<>/proc/gvisor/checkpoint && echo 1 >&3 && cat <&3"); out != "resume\n" {
		t.Fatalf("the workload's checkpoint read %q, want resume\n%s", out, d.logged())
	}
	d.call(t, "POST", "/v1/checkpoints/"+cp.ID+"/wait", "", http.StatusOK, &cp)
	if cp.State != "pushed" || cp.Index == "" || cp.Files["pages.img"] < 32<<20 {
		t.Fatalf("after the workload's checkpoint: %+v\n%s", cp, d.logged())
	}
	if n := app.NextCount(t); n <= before {
		t.Errorf("the app counts %d after its checkpoint, %d before: it did not go on", n, before)
	}
	d.call(t, "DELETE", "/v1/checkpoints/"+cp.ID, "", http.StatusNoContent, nil)

	// The restored sandbox comes from the same bundle, without the
	// annotations of the session just deleted.
	app.SetAnnotations(t, nil)
	app.AfterCheckpoint(t)
	last := app.LastCount()
	var m struct{ Dir string }
	d.call(t, "POST", "/v1/mounts", `{"ref": "`+ref+`", "backend": "gofer"}`, http.StatusCreated, &m)
	restore := app.Command("restore", "--detach", "--background", "--bundle="+app.BundleDir(), "--image-path="+m.Dir, app.ID())
	restore.Env = append(os.Environ(), sidecars)
	rc := app.StartRestoreWith(t, restore)
	if n := app.NextCount(t); n <= before || n > last+1 {
		t.Errorf("restored app counts %d, want one after the checkpoint (%d before it, %d at the end)", n, before, last)
	}
	if h := app.Hash(t); h != app.StartHash() {
		t.Errorf("memory hash after restore %s, at start %s", h, app.StartHash())
	}
	if err := rc.Wait(time.Minute); err != nil {
		t.Fatal(err)
	}
}
