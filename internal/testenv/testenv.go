// Package testenv finds the tools cryo's tests run for real (bin/cryo,
// bin/oras, bin/registry, ...) and starts real registries for them. A test
// whose tool is missing skips with the reason on a laptop and fails when
// CI=true: CI must never skip silently.
package testenv

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// ModulePath is cryo's Go module path.
const ModulePath = "github.com/cryo-oci/cryo"

// SkipOrFatal skips the test with the reason, or fails it when CI=true.
func SkipOrFatal(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("CI=true, so not skipping: "+format, args...)
	}
	t.Skipf(format, args...)
}

// NeedFUSE skips the test (fails it when CI=true) unless it runs as root
// and can open /dev/fuse for reading and writing, as a FUSE mount does: the
// device can exist and still be unusable (a container without the device
// allowed, a node without the module loaded). what names what needs it.
func NeedFUSE(t testing.TB, what string) {
	t.Helper()
	if os.Geteuid() != 0 {
		SkipOrFatal(t, "%s needs root (FUSE mounts)", what)
	}
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		SkipOrFatal(t, "%s needs a usable /dev/fuse: %v", what, err)
		return
	}
	f.Close()
}

// RepoRoot returns the nearest directory at or above the working directory
// whose go.mod declares module ModulePath.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding repo root: %w", err)
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && ModulePathOf(data) == ModulePath {
			return dir, nil
		}
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", fmt.Errorf("finding repo root: %w", err)
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("finding repo root: no go.mod of module %s above the working directory", ModulePath)
		}
		dir = parent
	}
}

// ModulePathOf returns the module path a go.mod declares, or "".
func ModulePathOf(gomod []byte) string {
	for _, line := range strings.Split(string(gomod), "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module")
		if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '\t') {
			continue
		}
		rest, _, _ = strings.Cut(rest, "//")
		return strings.Trim(strings.TrimSpace(rest), `"`+"`")
	}
	return ""
}

// Tool returns the path of bin/<name> under the repo root (make test builds
// and installs them; `make build` for cryo, scripts/install-test-deps.sh for
// the others), skipping or failing the test if it is missing.
func Tool(t testing.TB, name string) string {
	t.Helper()
	root, err := RepoRoot()
	if err != nil {
		SkipOrFatal(t, "testenv: %v", err)
	}
	p := filepath.Join(root, "bin", name)
	if fi, err := os.Stat(p); err != nil || fi.Mode()&0o111 == 0 {
		SkipOrFatal(t, "testenv: no %s (run `make build` and scripts/install-test-deps.sh)", p)
	}
	return p
}

// FreeAddr returns a free loopback TCP address.
func FreeAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Registry is a `cryo registry serve` process (or another registry binary).
type Registry struct {
	// Addr is host:port; Root the storage root of the embedded default.
	Addr, Root string
	// MetricsAddr serves /metrics.
	MetricsAddr string
	bin         string
	args        []string
	cmd         *exec.Cmd
	log         *os.File
}

// StartRegistry starts `bin/cryo registry serve` on a free port with
// filesystem storage under root (a temp dir if ""), plus extra args, and
// waits until it answers. It is stopped when the test ends.
func StartRegistry(t testing.TB, root string, extra ...string) *Registry {
	t.Helper()
	if root == "" {
		root = t.TempDir()
	}
	r := &Registry{Addr: FreeAddr(t), MetricsAddr: FreeAddr(t), Root: root, bin: Tool(t, "cryo")}
	r.args = append([]string{"registry", "serve", "--root", root}, extra...)
	r.Start(t)
	t.Cleanup(r.Stop)
	return r
}

// StartCommand starts an arbitrary registry command listening on addr and
// waits until it answers on /v2/. It is stopped when the test ends.
func StartCommand(t testing.TB, addr string, bin string, args ...string) *Registry {
	t.Helper()
	r := &Registry{Addr: addr, bin: bin, args: args}
	r.start(t, false)
	t.Cleanup(r.Stop)
	return r
}

// Start (re)starts the registry process on its address.
func (r *Registry) Start(t testing.TB) { r.start(t, true) }

func (r *Registry) start(t testing.TB, cryo bool) {
	t.Helper()
	args := r.args
	if cryo {
		args = append(append([]string{}, args...), "--addr", r.Addr, "--metrics-addr", r.MetricsAddr)
	}
	log, err := os.CreateTemp("", "registry-*.log")
	if err != nil {
		t.Fatal(err)
	}
	r.log = log
	r.cmd = exec.Command(r.bin, args...)
	r.cmd.Stdout, r.cmd.Stderr = log, log
	r.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := r.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", r.bin, err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("registry %s did not answer on %s; log:\n%s", r.bin, r.Addr, r.Log())
}

// PID is the registry process's id (0 when it is not running).
func (r *Registry) PID() int {
	if r.cmd == nil || r.cmd.Process == nil {
		return 0
	}
	return r.cmd.Process.Pid
}

// Stop kills the registry process (as a crash would: SIGKILL).
func (r *Registry) Stop() {
	if r.cmd == nil || r.cmd.Process == nil {
		return
	}
	syscall.Kill(-r.cmd.Process.Pid, syscall.SIGKILL)
	r.cmd.Wait()
	r.cmd = nil
	if r.log != nil {
		r.log.Close()
		os.Remove(r.log.Name())
	}
}

// Log returns what the registry printed so far.
func (r *Registry) Log() string {
	if r.log == nil {
		return ""
	}
	data, _ := os.ReadFile(r.log.Name())
	var b strings.Builder
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for sc.Scan() {
		b.WriteString(sc.Text() + "\n")
	}
	return b.String()
}

// Run runs a command and returns its combined output, failing the test
// with that output if it fails.
func Run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
