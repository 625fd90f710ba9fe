package gvisortest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format/statefile"
)

// Flags returns the global runsc flags every runsc command of the app uses:
// --root=<state dir>, --platform=systrap, --network=none, --ignore-cgroups
// and AppOptions.RunscFlags. A tool that runs runsc for the app (cryo
// restore --runsc-flag=...) must pass all of them.
func (a *App) Flags() []string { return append([]string(nil), a.flags...) }

// StateDir returns the app's runsc root (--root).
func (a *App) StateDir() string { return a.stateDir }

// Runsc returns the runsc binary the app runs with.
func (a *App) Runsc() string { return a.runsc }

// GoesOn fails t unless the restored app goes on from its checkpoint:
// its next count is last+1 (it did not start again) and its buffer's hash
// is the one it printed at start (no page is wrong).
func (a *App) GoesOn(t testing.TB, last int) {
	t.Helper()
	if n := a.NextCount(t); n != last+1 {
		t.Errorf("restored app counts %d, want %d (it should go on from the checkpoint, not restart)", n, last+1)
	}
	if h := a.Hash(t); h != a.startHash {
		t.Errorf("memory hash after restore %s, at start %s", h, a.startHash)
	}
}

// RestoreCmd is a command started by StartRestoreWith in place of
// `runsc restore`.
type RestoreCmd struct {
	// Cmd is the running command.
	Cmd *exec.Cmd
	// Start is when it was started.
	Start time.Time
	// End is when it exited (zero until then).
	End time.Time

	app     *App
	outPath string
	errPath string
	done    chan struct{}
	err     error
}

// StartRestoreWith starts cmd in place of `runsc restore` (e.g. a `cryo
// restore ... <a.ID()>` that runs runsc restore itself, with a.Flags() and
// --bundle=<a.BundleDir()>) with the same set-up as Restore: the app's
// container is deleted first if it exists, and cmd's stdout and stderr go
// to new files, which the restored sandbox inherits and where the app's
// line reading continues. cmd's own messages land in those files too:
// RestoreCmd.Output returns them.
//
// It returns without waiting for cmd. Until cmd exits, WaitLine (NextCount,
// Hash) fails at once if cmd exits with an error. A cmd still running when
// the test ends is killed (SIGKILL to its process group).
func (a *App) StartRestoreWith(t testing.TB, cmd *exec.Cmd) *RestoreCmd {
	t.Helper()
	if err := a.delete(); err != nil {
		t.Fatalf("gvisortest: before restore: %v", err)
	}
	a.runs++
	outPath := filepath.Join(a.dir, fmt.Sprintf("out-%d.log", a.runs))
	errPath := filepath.Join(a.dir, fmt.Sprintf("err-%d.log", a.runs))
	stdout, err := os.OpenFile(outPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatalf("gvisortest: creating output file: %v", err)
	}
	defer stdout.Close()
	stderr, err := os.OpenFile(errPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatalf("gvisortest: creating output file: %v", err)
	}
	defer stderr.Close()
	a.outPath, a.errPath, a.outOff, a.partial = outPath, errPath, 0, nil

	cmd.Stdout, cmd.Stderr = stdout, stderr
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	rc := &RestoreCmd{Cmd: cmd, app: a, outPath: outPath, errPath: errPath, done: make(chan struct{})}
	// The container may exist even if the command fails half-way: let
	// cleanup try to delete it.
	a.running = true
	rc.Start = time.Now()
	if err := cmd.Start(); err != nil {
		t.Fatalf("gvisortest: starting %s: %v", cmd, err)
	}
	a.restoring = rc
	go func() {
		err := cmd.Wait()
		rc.End = time.Now()
		if err != nil {
			rc.err = fmt.Errorf("%s: %w", strings.Join(cmd.Args, " "), err)
		}
		close(rc.done)
	}()
	t.Cleanup(func() {
		select {
		case <-rc.done:
			return
		default:
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-rc.done
	})
	return rc
}

// Done is closed when the command has exited.
func (r *RestoreCmd) Done() <-chan struct{} { return r.done }

// Wait waits up to timeout for the command to exit and returns its error
// (nil if it exited with status 0). After timeout it kills the command's
// process group and returns an error.
func (r *RestoreCmd) Wait(timeout time.Duration) error {
	select {
	case <-r.done:
		return r.err
	case <-time.After(timeout):
	}
	_ = syscall.Kill(-r.Cmd.Process.Pid, syscall.SIGKILL)
	<-r.done
	return fmt.Errorf("%s: still running after %v, killed", strings.Join(r.Cmd.Args, " "), timeout)
}

// Duration is how long the command ran (so far, if it still runs).
func (r *RestoreCmd) Duration() time.Duration {
	select {
	case <-r.done:
		return r.End.Sub(r.Start)
	default:
		return time.Since(r.Start)
	}
}

// Output returns what was written to the command's stdout and stderr so
// far, NUL bytes dropped. It includes the restored app's own output, which
// goes to the same files.
func (r *RestoreCmd) Output() (stdout, stderr string) {
	read := func(p string) string {
		data, err := os.ReadFile(p)
		if err != nil {
			return fmt.Sprintf("(%v)", err)
		}
		return string(bytes.ReplaceAll(data, []byte{0}, nil))
	}
	return read(r.outPath), read(r.errPath)
}

// ReadMetadata returns the JSON metadata of a checkpoint.img header (see
// format/statefile).
func ReadMetadata(checkpointImg string) (map[string]string, error) {
	f, err := os.Open(checkpointImg)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	md, err := statefile.ReadMetadata(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", checkpointImg, err)
	}
	return md, nil
}

// CopyImageWithMetadata copies the image dir src to the new dir dst,
// rewriting the metadata of dst's checkpoint.img header: set's keys are set
// (an empty value deletes the key); the rest of the file is kept byte for
// byte. Other files are hard-linked when possible, copied otherwise. E.g.
// set = {"runsc_version": "other"} makes a checkpoint that runsc refuses to
// restore.
func CopyImageWithMetadata(src, dst string, set map[string]string) error {
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	entries, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if !e.Type().IsRegular() {
			return fmt.Errorf("%s: %s is not a regular file", src, e.Name())
		}
		s, d := filepath.Join(src, e.Name()), filepath.Join(dst, e.Name())
		if e.Name() == CheckpointFile {
			if err := rewriteHeader(s, d, set); err != nil {
				return fmt.Errorf("%s: %w", s, err)
			}
			continue
		}
		if err := os.Link(s, d); err == nil {
			continue
		}
		if err := copyFile(s, d); err != nil {
			return err
		}
	}
	return nil
}

func rewriteHeader(src, dst string, set map[string]string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	md, err := statefile.ReadMetadata(in)
	if err != nil {
		return err
	}
	for k, v := range set {
		if v == "" {
			delete(md, k)
		} else {
			md[k] = v
		}
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := out.Write(statefile.Header(md)); err != nil {
		out.Close()
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// SetAnnotations replaces the annotations of the app's bundle, for the
// sandboxes started from it next (a restore): e.g. to drop the
// dev.gvisor.internal.checkpoint.path of a checkpoint session that ended.
func (a *App) SetAnnotations(t testing.TB, annotations map[string]string) {
	t.Helper()
	path := filepath.Join(a.bundleDir, "config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	var config map[string]any
	if err := json.Unmarshal(data, &config); err != nil {
		t.Fatalf("gvisortest: %s: %v", path, err)
	}
	config["annotations"] = annotations
	if data, err = json.MarshalIndent(config, "", "  "); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
}
