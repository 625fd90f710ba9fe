package puller_test

import (
	"bufio"
	"context"
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
