package puller_test

import (
	"bufio"
	"context"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
)

// startMount starts `cryo mount ARGS...` and waits for its ready line. It
// returns the environment its "env:" line gives runsc (empty for a FUSE
// mount) and the running command, killed when the test ends.
func (e *restoreEnv) startMount(t *testing.T, args ...string) (env string, mount *exec.Cmd, stderr *strings.Builder) {
	t.Helper()
	mount = e.command(context.Background(), append([]string{"mount"}, args...)...)
	stdout, err := mount.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr = &strings.Builder{}
	mount.Stderr = stderr
	if err := mount.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if mount.ProcessState == nil {
			mount.Process.Kill()
			mount.Wait()
		}
	})
	// The env line, if any, follows the ready line.
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	ready := false
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				t.Fatalf("cryo mount %q ended before it was ready:\n%s", args, stderr.String())
			}
			if v, ok := strings.CutPrefix(line, "env: "); ok {
				return v, mount, stderr
			}
			if strings.HasPrefix(line, "ready: ") {
				ready = true
				if !strings.Contains(line, "gofer") {
					go func() {
						for range lines {
						}
					}()
					return "", mount, stderr
				}
			}
		case <-timeout:
			t.Fatalf("cryo mount %q: not ready (ready line seen: %v) after 2 minutes:\n%s", args, ready, stderr.String())
		}
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
		logged, _ := filepath.Glob(goferLog)
		t.Fatalf("cryo checkpoint --filesystem: %v\n%s\ngofer log %v", err, out, logged)
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
		name string
		args []string
	}{
		{"gofer", []string{"--backend", "gofer", "--runsc", e.runsc}},
		{"fuse", []string{"--backend", "fuse"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "img")
			env, mount, stderr := e.startMount(t, append(tc.args, "--cache", t.TempDir(), ref, dir)...)
			var extra []string
			if env != "" {
				extra = []string{env}
			}
			got := app.RunFromFS(t, dir, extra, "/bin/sh", "-c", "sha256sum /cryo-data /cryo-note")
			if got != want {
				t.Errorf("the new sandbox reads\n%s\nthe checkpointed one wrote\n%s\ncryo mount:\n%s", got, want, stderr.String())
			}
			mount.Process.Signal(syscall.SIGTERM)
			if err := mount.Wait(); err != nil {
				t.Errorf("cryo mount after SIGTERM: %v\n%s", err, stderr.String())
			}
		})
	}

	restore := e.command(ctx, "restore", "--runsc", e.runsc, ref, "--bundle="+app.BundleDir(), "other")
	out, err = restore.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "is a filesystem checkpoint") {
		t.Errorf("cryo restore of a filesystem checkpoint: %v\n%s", err, out)
	}
}
