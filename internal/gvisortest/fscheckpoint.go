package gvisortest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// Exec runs args in the app's container (runsc exec) and returns its
// stdout.
func (a *App) Exec(t testing.TB, args ...string) string {
	t.Helper()
	cmd := a.Command(append([]string{"exec", containerID}, args...)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("gvisortest: runsc exec %q: %v: %s", args, err, strings.TrimSpace(stderr.String()))
	}
	return string(out)
}

// RunFromFS runs args in a new container of the app's runsc root, created
// from the filesystem checkpoint at imageDir (runsc create
// --fs-restore-image-path, with env added to the environment of runsc
// create and start), waits for it to exit and returns its stdout. The
// container sees the host's "/" as the app does (AppOptions.Overlay must
// be set) with the checkpoint's upper layer restored over it. It is
// deleted before RunFromFS returns.
func (a *App) RunFromFS(t testing.TB, imageDir string, env []string, args ...string) string {
	t.Helper()
	if !a.writable {
		t.Fatal("gvisortest: RunFromFS needs AppOptions.Overlay")
	}
	a.runs++
	id := fmt.Sprintf("fsrestore-%d", a.runs)
	bundle := filepath.Join(a.dir, "bundle-"+id)
	if err := writeBundle(bundle, args, true, nil); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	outPath := filepath.Join(a.dir, id+".out")
	stdout, err := os.OpenFile(outPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	defer stdout.Close()
	defer func() {
		if out, err := a.Command("delete", "--force", id).CombinedOutput(); err != nil && !strings.Contains(string(out), "does not exist") {
			t.Errorf("gvisortest: runsc delete %s: %v: %s", id, err, out)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	// Every runsc command is bounded by DefaultTimeout: a sandbox that
	// never exits fails the test instead of hanging it.
	command := func(args ...string) *exec.Cmd {
		c := a.Command(args...)
		cmd := exec.CommandContext(ctx, c.Path, c.Args[1:]...)
		cmd.Env = append(os.Environ(), env...)
		return cmd
	}
	run := func(args ...string) {
		t.Helper()
		cmd := command(args...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("gvisortest: %s: %v: %s", strings.Join(cmd.Args, " "), err, strings.TrimSpace(string(out)))
		}
	}
	// The sandbox inherits runsc create's stdio: files, which a pipe's
	// reader would wait on until the sandbox exits.
	errPath := filepath.Join(a.dir, id+".err")
	stderr, err := os.OpenFile(errPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	defer stderr.Close()
	create := command("create", "--bundle="+bundle, "--fs-restore-image-path="+imageDir, id)
	create.Stdout, create.Stderr = stdout, stderr
	if err := create.Run(); err != nil {
		t.Fatalf("gvisortest: runsc create --fs-restore-image-path=%s: %v: %s", imageDir, err, a.tail(errPath))
	}
	run("start", id)
	run("wait", id)
	out, err := os.ReadFile(outPath)
	if err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	return string(out)
}
