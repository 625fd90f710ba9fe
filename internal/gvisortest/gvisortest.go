// Package gvisortest runs a small Python app inside runsc (gVisor) so that
// tests can make real checkpoint images and restore them.
//
// The app allocates a buffer of a chosen size, prints the sha256 of the
// buffer once at start and again on SIGUSR1, and prints an incrementing
// counter about every 150 ms. Its output is made of lines that are easy to
// parse:
//
//	ready <buffer bytes> <python executable> <python version>
//	hash <sha256 hex of the buffer>
//	count <n>
//
// A test checkpoints the app, restores it (from the same image dir or from
// one that went through cryo) and asserts that the counter continues where
// it stopped and that the buffer's hash is unchanged:
//
//	runsc := gvisortest.Runsc(t)
//	app := gvisortest.StartApp(t, runsc, gvisortest.AppOptions{MemoryMiB: 64})
//	app.NextCount(t)
//	before := app.Hash(t)
//	img := app.Checkpoint(t)
//	last := app.LastCount()
//	app.Restore(t, img)
//	if n := app.NextCount(t); n != last+1 { ... }
//	if app.Hash(t) != before { ... }
//
// Everything an App creates (sandbox, state dir, the nsfs mount runsc leaves
// in it, output files, image dirs) is removed by t.Cleanup.
//
// runsc needs root. Runsc skips the test when runsc or root is missing,
// except when CI=true, where it fails it: tests must not skip silently in CI.
package gvisortest

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/cryo-oci/cryo/internal/testenv"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// ModulePath is the module whose go.mod marks the repository root, where
// bin/runsc is built by scripts/build-runsc.sh.
const ModulePath = "github.com/cryo-oci/cryo"

// Image file names written by runsc checkpoint with the default
// --compression=none.
const (
	// CheckpointFile holds the sentry's object graph after a statefile header.
	CheckpointFile = "checkpoint.img"
	// PagesMetaFile holds the memory-file metadata.
	PagesMetaFile = "pages_meta.img"
	// PagesFile holds the raw page contents.
	PagesFile = "pages.img"
)

// Timeouts used by the helpers that do not take one.
const (
	// DefaultTimeout bounds waits for the app's output lines.
	DefaultTimeout = 60 * time.Second
	// pollInterval is how often output files are polled for new lines.
	pollInterval = 5 * time.Millisecond
	// containerID is the container's name; each App has its own runsc root.
	containerID = "app"
)

// appScript is the sandboxed app. It writes each line with one os.write so
// that a checkpoint never cuts a line, and computes the hash in the main
// loop when SIGUSR1 set the flag.
const appScript = `
import hashlib, os, signal, sys, time
n = int(sys.argv[1]) << 20
if sys.argv[2] == "text":
    # Lowercase hex digits: 4 bits of entropy per byte, compresses ~2x.
    buf = bytearray(os.urandom(n // 2).hex(), "ascii")
else:
    buf = bytearray(os.urandom(n))
def out(s):
    os.write(1, (s + "\n").encode())
# The hot set: slices of buf whose pages the app reads before every count.
hot = []
page = 4096
if sys.argv[4] == "regions":
    # 5% of the buffer in 4 regions at random page-aligned places.
    # Random places, the same for every run of one size: benchmarks
    # compare restores of apps laid out alike.
    import random
    rnd = random.Random(n)
    size = (n // 20 // 4) // page * page
    for i in range(4):
        start = rnd.randrange(max(1, (n - size) // page)) * page
        hot.append((start, start + size, page))
elif sys.argv[4] == "scattered":
    # One page in every 20: 5% of the pages, in every part of the buffer.
    hot.append((0, n, 20 * page))
def touch():
    s = 0
    for a, b, step in hot:
        s += sum(buf[a:b:step])
    return s
want = [True]
rewrite = [False]
def on_usr1(signum, frame):
    want[0] = True
def on_usr2(signum, frame):
    rewrite[0] = True
signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
out("ready %d %s %s" % (len(buf), sys.executable, sys.version.split()[0]))
count = 0
while True:
    if rewrite[0]:
        # Every tenth MiB gets new random bytes: 10% of the memory changes,
        # in 1 MiB runs, as between two pauses of a real app.
        rewrite[0] = False
        for off in range(0, n - (1 << 20) + 1, 10 << 20):
            buf[off:off + (1 << 20)] = os.urandom(1 << 20)
        out("rewrote")
        want[0] = True
    if want[0]:
        want[0] = False
        out("hash " + hashlib.sha256(buf).hexdigest())
    touch()
    count += 1
    out("count %d" % count)
    time.sleep(float(sys.argv[3]))
`

func skipOrFatal(t testing.TB, format string, args ...any) {
	t.Helper()
	testenv.SkipOrFatal(t, format, args...)
}

// Runsc returns the path of the pinned runsc: $CRYO_RUNSC if set, else
// <repo root>/bin/runsc, where the repo root is the nearest directory above
// the working directory whose go.mod declares module ModulePath.
//
// If runsc is missing or the test does not run as root, Runsc skips the test
// with the reason (run scripts/install-test-deps.sh), except when CI=true,
// where it fails the test instead.
func Runsc(t testing.TB) string {
	t.Helper()
	path := os.Getenv("CRYO_RUNSC")
	if path == "" {
		root, err := RepoRoot()
		if err != nil {
			skipOrFatal(t, "gvisortest: no runsc: %v", err)
		}
		path = filepath.Join(root, "bin", "runsc")
	}
	if fi, err := os.Stat(path); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		skipOrFatal(t, "gvisortest: no runsc at %s (run scripts/install-test-deps.sh or set CRYO_RUNSC)", path)
	}
	if os.Geteuid() != 0 {
		skipOrFatal(t, "gvisortest: runsc needs root, running as uid %d", os.Geteuid())
	}
	return path
}

// RepoRoot returns the repo root (see testenv.RepoRoot).
func RepoRoot() (string, error) { return testenv.RepoRoot() }

// RunscVersion returns the version that runsc reports ("runsc version X"),
// which is also the runsc_version its checkpoints record and restore
// requires. bin/runsc built by scripts/build-runsc.sh reports the pinned
// gvisor.dev/gvisor module version.
func RunscVersion(t testing.TB, runsc string) string {
	t.Helper()
	out, err := exec.Command(runsc, "--version").CombinedOutput()
	if err != nil {
		t.Fatalf("gvisortest: %s --version: %v: %s", runsc, err, out)
	}
	v, err := parseVersion(out)
	if err != nil {
		t.Fatalf("gvisortest: %s --version: %v", runsc, err)
	}
	return v
}

// parseVersion extracts X from runsc's "runsc version X" line.
func parseVersion(out []byte) (string, error) {
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "runsc version "); ok && v != "" {
			return strings.TrimSpace(v), nil
		}
	}
	return "", fmt.Errorf("no %q line in %q", "runsc version", out)
}

// AppOptions configures StartApp.
type AppOptions struct {
	// MemoryMiB is the size of the app's buffer in MiB (default 16).
	MemoryMiB int
	// Interval is the time between the app's count lines (default 150 ms).
	// Restore benchmarks make it short: the time until the next line
	// includes what is left of the interval.
	Interval time.Duration
	// Text fills the buffer with text-like data (lowercase hex digits, which
	// compress about 2x) instead of random bytes (incompressible).
	Text bool
	// HotSet makes the app read a hot set of its buffer (one byte of each
	// of its pages) before every count line, as an app answering a
	// request reads its live objects: HotRegions (5% of the buffer in 4
	// contiguous regions at random places, the same for each size) or
	// HotScattered (5% of the
	// pages, one in every 20, spread over the whole buffer). Default:
	// none.
	HotSet HotSet
	// Python is the interpreter to run inside the sandbox. Default:
	// $CRYO_PYTHON, else /usr/bin/python3, else the real executable behind
	// the host's python3 (pyenv shims are resolved). The sandbox sees the
	// host's root file system read-only, so any host path works.
	Python string
	// RunscFlags are extra global runsc flags for every runsc command of the
	// app, e.g. "--debug", "--debug-log=/tmp/logs/".
	RunscFlags []string
	// Overlay makes the sandbox's root writable: the host's "/" under
	// gVisor's overlay, whose upper layer lives in a file of the app's
	// dir (--overlay2=root:dir=...), never on the host. runsc
	// fscheckpoint saves that upper layer (see RunFromFS).
	Overlay bool
	// Annotations go into the app's OCI spec, e.g. gVisor's
	// dev.gvisor.internal.fscheckpoint.* for checkpoints the workload
	// triggers.
	Annotations map[string]string
	// Env is added to the environment of the runsc commands that start
	// the app's sandbox (run and restore), e.g.
	// GVISOR_SIDECAR_BINARIES_DIR for a checkpoint gofer it starts with.
	Env []string
}

// HotSet is the part of its buffer an app reads on every request.
type HotSet string

// The hot sets.
const (
	HotNone      HotSet = ""
	HotRegions   HotSet = "regions"
	HotScattered HotSet = "scattered"
)

// App is a Python app running in a runsc sandbox. Its methods fail the test
// on error. An App is not safe for concurrent use.
type App struct {
	runsc     string
	flags     []string // global flags: --root etc.
	dir       string   // everything the app creates lives here
	stateDir  string
	bundleDir string
	startHash string
	python    string   // "path version" from the ready line
	writable  bool     // AppOptions.Overlay
	runEnv    []string // AppOptions.Env

	running  bool // the container exists in runsc's state
	runs     int  // run/restore count: names the output files
	images   int
	lastCnt  int
	outPath  string
	errPath  string
	outOff   int64
	partial  []byte
	cleaning bool
	// restoring is the command of the last StartRestoreWith: WaitLine
	// fails at once if it exited with an error.
	restoring *RestoreCmd
}

// StartApp starts the app in a new sandbox and waits for its first hash
// line. The sandbox runs with --root=<temp state dir> --platform=systrap
// --network=none --ignore-cgroups, from a bundle whose root is the host's
// "/" read-only. t.Cleanup deletes the sandbox and all files and mounts the
// app made.
func StartApp(t testing.TB, runsc string, opts AppOptions) *App {
	t.Helper()
	if opts.MemoryMiB == 0 {
		opts.MemoryMiB = 16
	}
	if opts.MemoryMiB < 0 {
		t.Fatalf("gvisortest: MemoryMiB %d < 0", opts.MemoryMiB)
	}
	python := opts.Python
	if python == "" {
		var err error
		if python, err = findPython(); err != nil {
			skipOrFatal(t, "gvisortest: %v", err)
		}
	}
	dir, err := os.MkdirTemp("", "gvisortest-")
	if err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	a := &App{
		runEnv:    opts.Env,
		runsc:     runsc,
		dir:       dir,
		stateDir:  filepath.Join(dir, "state"),
		bundleDir: filepath.Join(dir, "bundle"),
	}
	t.Cleanup(func() {
		if err := a.cleanup(); err != nil {
			t.Errorf("gvisortest: cleanup: %v", err)
		}
	})
	a.flags = []string{
		"--root=" + a.stateDir,
		"--platform=systrap",
		"--network=none",
		"--ignore-cgroups",
	}
	if opts.Overlay {
		overlay := filepath.Join(dir, "overlay")
		if err := os.Mkdir(overlay, 0o700); err != nil {
			t.Fatalf("gvisortest: %v", err)
		}
		a.flags = append(a.flags, "--overlay2=root:dir="+overlay)
		a.writable = true
	}
	a.flags = append(a.flags, opts.RunscFlags...)
	mode := "random"
	if opts.Text {
		mode = "text"
	}
	if opts.Interval <= 0 {
		opts.Interval = 150 * time.Millisecond
	}
	hot := string(opts.HotSet)
	if hot == "" {
		hot = "none"
	}
	args := []string{python, "-u", "-I", "-c", appScript, strconv.Itoa(opts.MemoryMiB), mode, strconv.FormatFloat(opts.Interval.Seconds(), 'f', 3, 64), hot}
	if err := writeBundle(a.bundleDir, args, a.writable, opts.Annotations); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	if err := os.Mkdir(a.stateDir, 0o700); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}

	if err := a.startRun("run", "--detach", "--bundle="+a.bundleDir, containerID); err != nil {
		t.Fatalf("gvisortest: starting app: %v", err)
	}
	timeout := max(DefaultTimeout, time.Duration(opts.MemoryMiB)*100*time.Millisecond)
	ready := a.WaitLine(t, `^ready `, timeout)
	a.python = strings.Join(strings.Fields(ready)[2:], " ")
	a.startHash = strings.TrimPrefix(a.WaitLine(t, `^hash [0-9a-f]{64}$`, timeout), "hash ")
	return a
}

// findPython picks the interpreter to run inside the sandbox.
func findPython() (string, error) {
	if p := os.Getenv("CRYO_PYTHON"); p != "" {
		return p, nil
	}
	if fi, err := os.Stat("/usr/bin/python3"); err == nil && fi.Mode()&0o111 != 0 {
		return "/usr/bin/python3", nil
	}
	host, err := exec.LookPath("python3")
	if err != nil {
		return "", fmt.Errorf("no python3 for the sandbox (install python3 or set CRYO_PYTHON): %w", err)
	}
	// A pyenv shim is a shell script that needs pyenv: ask for the real
	// executable.
	out, err := exec.Command(host, "-c", "import sys; print(sys.executable)").Output()
	if err != nil {
		return "", fmt.Errorf("resolving %s: %w", host, err)
	}
	p, err := filepath.EvalSymlinks(strings.TrimSpace(string(out)))
	if err != nil {
		return "", fmt.Errorf("resolving %s: %w", host, err)
	}
	return p, nil
}

// writeBundle writes an OCI bundle running args with the host's "/" as
// its root, read-only unless writable, with annotations (if any).
func writeBundle(dir string, args []string, writable bool, annotations map[string]string) error {
	caps := []string{"CAP_KILL"}
	config := map[string]any{
		"ociVersion": "1.0.0",
		"process": map[string]any{
			"user": map[string]any{"uid": 0, "gid": 0},
			"args": args,
			"env": []string{
				"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
				"HOME=/",
			},
			"cwd": "/",
			"capabilities": map[string]any{
				"bounding": caps, "effective": caps, "inheritable": caps, "permitted": caps,
			},
			"rlimits": []any{map[string]any{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}},
		},
		"root":        map[string]any{"path": "/", "readonly": !writable},
		"hostname":    "gvisortest",
		"annotations": annotations,
		"mounts": []any{
			map[string]any{"destination": "/proc", "type": "proc", "source": "proc"},
			map[string]any{"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
			map[string]any{"destination": "/sys", "type": "sysfs", "source": "sysfs",
				"options": []string{"nosuid", "noexec", "nodev", "ro"}},
		},
		"linux": map[string]any{
			"namespaces": []any{
				map[string]string{"type": "pid"},
				map[string]string{"type": "network"},
				map[string]string{"type": "ipc"},
				map[string]string{"type": "uts"},
				map[string]string{"type": "mount"},
			},
		},
	}
	data, err := json.MarshalIndent(config, "", "  ")
	if err != nil {
		return fmt.Errorf("writing bundle: %w", err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("writing bundle: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), data, 0o600); err != nil {
		return fmt.Errorf("writing bundle: %w", err)
	}
	return nil
}

// ID returns the app's container ID.
func (a *App) ID() string { return containerID }

// BundleDir returns the app's OCI bundle dir, for tests that run runsc
// restore themselves.
func (a *App) BundleDir() string { return a.bundleDir }

// Command returns a runsc command with the app's global flags (--root and
// the others) followed by args, e.g. a.Command("wait", "--restore", a.ID()).
func (a *App) Command(args ...string) *exec.Cmd {
	return exec.Command(a.runsc, append(append([]string(nil), a.flags...), args...)...)
}

// Python returns the interpreter the app runs and its version, as the app
// reported them, e.g. "/usr/bin/python3 3.11.2".
func (a *App) Python() string { return a.python }

// StartHash returns the buffer's sha256 (hex) that the app printed at start.
func (a *App) StartHash() string { return a.startHash }

// LastCount returns the last counter value read from the app's output. After
// Checkpoint (without --leave-running) it is the app's last count before the
// checkpoint, so a restored app's next count must be LastCount()+1.
func (a *App) LastCount() int { return a.lastCnt }

// runscOutput runs a runsc command with the app's global flags and returns its
// combined output.
func (a *App) runscOutput(args ...string) ([]byte, error) {
	cmd := a.Command(args...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("runsc %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return out, nil
}

// startRun runs "runsc run/restore --detach ..." with stdout and stderr
// going to new files, which the sandbox inherits.
func (a *App) startRun(args ...string) error {
	a.runs++
	outPath := filepath.Join(a.dir, fmt.Sprintf("out-%d.log", a.runs))
	errPath := filepath.Join(a.dir, fmt.Sprintf("err-%d.log", a.runs))
	stdout, err := os.OpenFile(outPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("creating output file: %w", err)
	}
	defer stdout.Close()
	stderr, err := os.OpenFile(errPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("creating output file: %w", err)
	}
	defer stderr.Close()
	a.outPath, a.errPath, a.outOff, a.partial = outPath, errPath, 0, nil
	a.restoring = nil

	cmd := a.Command(args...)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	if len(a.runEnv) > 0 {
		cmd.Env = append(os.Environ(), a.runEnv...)
	}
	// The container may exist even if the command fails half-way: let
	// cleanup try to delete it.
	a.running = true
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("runsc %s: %w: %s", strings.Join(args, " "), err, a.tail(errPath))
	}
	return nil
}

// tail returns the last lines of a file, for error messages.
func (a *App) tail(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	data = bytes.ReplaceAll(data, []byte{0}, nil)
	const max = 2000
	if len(data) > max {
		data = data[len(data)-max:]
	}
	return string(bytes.TrimSpace(data))
}

// Checkpoint checkpoints the app into a new image dir (checkpoint.img,
// pages_meta.img, pages.img) and returns its path; extraArgs go to runsc
// checkpoint (e.g. "--exclude-committed-zero-pages"). Unless extraArgs has
// --leave-running, the sandbox exits, its container is deleted and the
// app's remaining output is read, so LastCount is the app's last count.
// The image dir is removed with the app at the end of the test.
func (a *App) Checkpoint(t testing.TB, extraArgs ...string) string {
	t.Helper()
	a.images++
	img := filepath.Join(a.dir, fmt.Sprintf("image-%d", a.images))
	args := append(append([]string{"checkpoint", "--image-path=" + img}, extraArgs...), containerID)
	if _, err := a.runscOutput(args...); err != nil {
		t.Fatalf("gvisortest: checkpoint: %v", err)
	}
	if leaveRunning(extraArgs) {
		return img
	}
	a.AfterCheckpoint(t)
	return img
}

// AfterCheckpoint does what Checkpoint does after a checkpoint that did
// not leave the app running, for a checkpoint taken another way (cryo
// checkpoint): it deletes the container and reads the app's remaining
// output, so that LastCount is the app's last count.
func (a *App) AfterCheckpoint(t testing.TB) {
	t.Helper()
	if err := a.delete(); err != nil {
		t.Fatalf("gvisortest: after checkpoint: %v", err)
	}
	if err := a.readLines(func(string) bool { return false }); err != nil {
		t.Fatalf("gvisortest: after checkpoint: %v", err)
	}
}

// leaveRunning reports whether runsc checkpoint flags ask to leave the
// container running.
func leaveRunning(args []string) bool {
	on := false
	for _, a := range args {
		switch strings.TrimLeft(a, "-") {
		case "leave-running", "leave-running=true", "leave-running=1":
			on = true
		case "leave-running=false", "leave-running=0":
			on = false
		}
	}
	return on
}

// delete force-deletes the container and waits until none of its processes
// are left.
func (a *App) delete() error {
	if !a.running {
		return nil
	}
	out, err := a.runscOutput("delete", "--force", containerID)
	if err != nil && !bytes.Contains(out, []byte("does not exist")) {
		return err
	}
	a.running = false
	return a.waitNoProcesses(10 * time.Second)
}

// waitNoProcesses waits until no process runs with this app's runsc root
// (sandbox, gofer), killing any left after half the timeout.
func (a *App) waitNoProcesses(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	killed := false
	for {
		pids, err := processesWithArg("--root=" + a.stateDir)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		if !killed && time.Now().After(deadline.Add(-timeout/2)) {
			for _, pid := range pids {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
			killed = true
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("runsc processes %v still running after %v", pids, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// processesWithArg returns the PIDs of processes with arg in their command
// line.
func processesWithArg(arg string) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("listing processes: %w", err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue // exited meanwhile
		}
		for _, a := range bytes.Split(cmdline, []byte{0}) {
			if string(a) == arg {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids, nil
}

// Restore restores the app from imageDir with runsc restore --detach
// --background --bundle=<the app's bundle> --image-path=imageDir, plus
// extraArgs (runsc restore flags, e.g. "--direct"). If the app's container
// still exists (never checkpointed, or checkpointed with --leave-running),
// it is deleted first. The restored app's output goes to a new file; the
// app's line reading continues there.
func (a *App) Restore(t testing.TB, imageDir string, extraArgs ...string) {
	t.Helper()
	if err := a.delete(); err != nil {
		t.Fatalf("gvisortest: before restore: %v", err)
	}
	args := append([]string{"restore", "--detach", "--background",
		"--bundle=" + a.bundleDir, "--image-path=" + imageDir}, extraArgs...)
	if err := a.startRun(append(args, containerID)...); err != nil {
		t.Fatalf("gvisortest: restore: %v", err)
	}
}

// WaitRestored runs runsc wait --restore, which returns once all pages of a
// --background restore are loaded.
func (a *App) WaitRestored(t testing.TB) {
	t.Helper()
	if _, err := a.runscOutput("wait", "--restore", containerID); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
}

// Hash asks the app for the sha256 of its buffer (SIGUSR1 through runsc
// kill) and returns the hex digest it prints.
func (a *App) Hash(t testing.TB) string {
	t.Helper()
	if _, err := a.runscOutput("kill", containerID, "USR1"); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	return strings.TrimPrefix(a.WaitLine(t, `^hash [0-9a-f]{64}$`, DefaultTimeout), "hash ")
}

// Rewrite has the app write new random bytes over every tenth MiB of its
// buffer (SIGUSR2): 10% of its memory changes in 1 MiB runs. It waits for
// the app's new hash and makes it the one Hash is compared with
// (StartHash).
func (a *App) Rewrite(t testing.TB) {
	t.Helper()
	if _, err := a.runscOutput("kill", containerID, "USR2"); err != nil {
		t.Fatalf("gvisortest: %v", err)
	}
	a.WaitLine(t, `^rewrote$`, DefaultTimeout)
	a.startHash = strings.TrimPrefix(a.WaitLine(t, `^hash [0-9a-f]{64}$`, DefaultTimeout), "hash ")
}

// NextCount waits for the app's next counter line and returns its value.
func (a *App) NextCount(t testing.TB) int {
	t.Helper()
	line := a.WaitLine(t, `^count [0-9]+$`, DefaultTimeout)
	n, err := strconv.Atoi(strings.TrimPrefix(line, "count "))
	if err != nil {
		t.Fatalf("gvisortest: bad count line %q: %v", line, err)
	}
	return n
}

// WaitLine returns the app's next output line (without newline) that
// matches the regular expression pattern, skipping the lines before it. It
// fails the test after timeout. NUL bytes are dropped: a restored app keeps
// its stdout offset, so a new output file starts with a hole.
func (a *App) WaitLine(t testing.TB, pattern string, timeout time.Duration) string {
	t.Helper()
	re, err := regexp.Compile(pattern)
	if err != nil {
		t.Fatalf("gvisortest: WaitLine pattern: %v", err)
	}
	var found string
	deadline := time.Now().Add(timeout)
	for {
		err := a.readLines(func(line string) bool {
			if re.MatchString(line) {
				found = line
				return true
			}
			return false
		})
		if err != nil {
			t.Fatalf("gvisortest: reading app output: %v", err)
		}
		if found != "" {
			return found
		}
		if rc := a.restoring; rc != nil {
			select {
			case <-rc.done:
				if rc.err != nil {
					t.Fatalf("gvisortest: waiting for a line matching %q: %v\nstdout (%s):\n%s\nstderr (%s):\n%s",
						pattern, rc.err, a.outPath, a.tail(a.outPath), a.errPath, a.tail(a.errPath))
				}
			default:
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("gvisortest: no line matching %q within %v\nstdout (%s):\n%s\nstderr (%s):\n%s",
				pattern, timeout, a.outPath, a.tail(a.outPath), a.errPath, a.tail(a.errPath))
		}
		time.Sleep(pollInterval)
	}
}

// readLines reads the complete lines written since the last call and
// passes them to match until it returns true; lines after that one stay
// unread.
func (a *App) readLines(match func(string) bool) error {
	f, err := os.Open(a.outPath)
	if err != nil {
		return fmt.Errorf("reading output: %w", err)
	}
	defer f.Close()
	if _, err := f.Seek(a.outOff, io.SeekStart); err != nil {
		return fmt.Errorf("reading output: %w", err)
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return fmt.Errorf("reading output: %w", err)
	}
	buf := append(a.partial, bytes.ReplaceAll(data, []byte{0}, nil)...)
	a.outOff += int64(len(data))
	for {
		i := bytes.IndexByte(buf, '\n')
		if i < 0 {
			break
		}
		line := string(buf[:i])
		buf = buf[i+1:]
		if n, ok := strings.CutPrefix(line, "count "); ok {
			if v, err := strconv.Atoi(n); err == nil {
				a.lastCnt = v
			}
		}
		if match(line) {
			break
		}
	}
	a.partial = append([]byte(nil), buf...)
	return nil
}

// cleanup deletes the sandbox, unmounts what runsc left in the state dir and
// removes the app's files.
func (a *App) cleanup() error {
	if a.cleaning {
		return nil
	}
	a.cleaning = true
	var errs []error
	if a.running {
		if err := a.delete(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := a.waitNoProcesses(10 * time.Second); err != nil {
		errs = append(errs, err)
	}
	// runsc keeps the network namespace of --network=none bind-mounted at
	// <root>/null-netns; each run or restore may stack another mount.
	netns := filepath.Join(a.stateDir, "null-netns")
	for i := 0; i < 100; i++ {
		if err := syscall.Unmount(netns, 0); err != nil {
			if !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
				errs = append(errs, fmt.Errorf("unmounting %s: %w", netns, err))
			}
			break
		}
	}
	if err := os.RemoveAll(a.dir); err != nil {
		errs = append(errs, fmt.Errorf("removing %s: %w", a.dir, err))
	}
	return errors.Join(errs...)
}

// GoferDir returns the dir holding cryo's checkpoint gofer
// (bin/cryo-gofer, built by scripts/build-gofer.sh), for
// GVISOR_SIDECAR_BINARIES_DIR; it skips the test if there is none (fails
// under CI=true).
func GoferDir(t testing.TB) string {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		skipOrFatal(t, "gvisortest: no gofer: %v", err)
	}
	dir := filepath.Join(root, "bin", "cryo-gofer")
	if fi, err := os.Stat(filepath.Join(dir, "checkpointgofer")); err != nil || fi.Mode()&0o111 == 0 {
		skipOrFatal(t, "gvisortest: no checkpoint gofer in %s (run make gofer)", dir)
	}
	return dir
}
