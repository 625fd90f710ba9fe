package testenv

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
)

// ImageDir writes a synthetic image dir (synth.ImageDir) under a temp dir.
func ImageDir(t testing.TB, kind synth.Kind, size int64, seed uint64) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, kind, size, seed); err != nil {
		t.Fatal(err)
	}
	return dir
}

// SameImage fails the test unless image dirs a and b hold the same
// checkpoint.img, pages_meta.img and pages.img.
func SameImage(t testing.TB, a, b string) {
	t.Helper()
	for _, name := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		x, err1 := os.ReadFile(filepath.Join(a, name))
		y, err2 := os.ReadFile(filepath.Join(b, name))
		if err1 != nil || err2 != nil || !bytes.Equal(x, y) {
			t.Fatalf("%s differs between %s and %s (%v, %v)", name, a, b, err1, err2)
		}
	}
}

// StartRedis starts Debian's redis-server on a free loopback port, without
// persistence, and returns its host:port. It is stopped when the test ends.
func StartRedis(t testing.TB) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		SkipOrFatal(t, "testenv: no redis-server (scripts/install-test-deps.sh installs Debian's)")
	}
	addr := FreeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	p := startProcess(t, "redis", bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
	t.Cleanup(p.Stop)
	waitTCP(t, addr, 20*time.Second, p)
	return addr
}

// SeaweedFS is a `weed server -s3` process: master, volume server, filer
// and S3 gateway in one, on loopback, with one bucket and one access key.
type SeaweedFS struct {
	// S3 is the S3 endpoint URL (http://127.0.0.1:port).
	S3                           string
	Bucket, AccessKey, SecretKey string
	bin                          string
	args                         []string
	master                       string
	proc                         *process
}

// StartSeaweedFS starts bin/weed with its data under a temp dir, creates the
// bucket, and waits until the S3 gateway answers. It is stopped when the
// test ends.
func StartSeaweedFS(t testing.TB) *SeaweedFS {
	t.Helper()
	bin := Tool(t, "weed")
	dir := t.TempDir()
	w := &SeaweedFS{Bucket: "cryo", AccessKey: "cryo-test-access", SecretKey: "cryo-test-secret", bin: bin}
	s3cfg := filepath.Join(dir, "s3.json")
	identities := fmt.Sprintf(`{"identities":[{"name":"cryo","credentials":[{"accessKey":%q,"secretKey":%q}],"actions":["Admin","Read","Write","List","Tagging"]}]}`, w.AccessKey, w.SecretKey)
	if err := os.WriteFile(s3cfg, []byte(identities), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	// weed also listens on each port + 10000 for gRPC unless told
	// otherwise: give every listener its own free port.
	port := func() string { _, p, _ := net.SplitHostPort(FreeAddr(t)); return p }
	mp, mgp, s3p := port(), port(), port()
	w.master = "127.0.0.1:" + mp
	w.S3 = "http://127.0.0.1:" + s3p
	w.args = []string{"server", "-dir=" + filepath.Join(dir, "data"), "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
		"-master.port=" + mp, "-master.port.grpc=" + mgp, "-master.volumeSizeLimitMB=64",
		"-volume.port=" + port(), "-volume.port.grpc=" + port(), "-volume.max=400",
		"-filer.port=" + port(), "-filer.port.grpc=" + port(),
		"-s3", "-s3.port=" + s3p, "-s3.port.grpc=" + port(), "-s3.config=" + s3cfg,
		"-s3.port.iceberg=0", "-s3.port.lance=0"}
	w.Start(t)
	t.Cleanup(w.Stop)
	// weed names a server with a non-default gRPC port as host:port.grpcport.
	out, err := runWithInput(w.bin, "s3.bucket.create -name "+w.Bucket+"\n", "shell", "-master="+w.master+"."+mgp)
	if err != nil || !strings.Contains(out, "created bucket") {
		t.Fatalf("create bucket %s: %v\n%s\nweed log:\n%s", w.Bucket, err, out, w.proc.Log())
	}
	return w
}

// Start (re)starts the weed process on its ports and data dir and waits
// until the S3 gateway answers.
func (w *SeaweedFS) Start(t testing.TB) {
	t.Helper()
	w.proc = startProcess(t, "weed", w.bin, w.args...)
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := http.Get(w.S3 + "/")
		if err == nil {
			resp.Body.Close()
			// The gateway answers before the filer has volumes to write to;
			// the master's status says when a volume server has joined.
			if st, err := http.Get("http://" + w.master + "/dir/status"); err == nil {
				var b bytes.Buffer
				b.ReadFrom(st.Body)
				st.Body.Close()
				if strings.Contains(b.String(), `"Url"`) {
					return
				}
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatalf("SeaweedFS did not come up; log:\n%s", w.proc.Log())
}

// Stop kills the weed process (SIGKILL), as a crash or a network partition
// from the registry's point of view would.
func (w *SeaweedFS) Stop() {
	if w.proc != nil {
		w.proc.Stop()
	}
}

// Env returns the environment entries that give a distribution S3 driver
// the access key (REGISTRY_STORAGE_S3_*), to keep it out of config files.
func (w *SeaweedFS) Env() []string {
	return []string{"REGISTRY_STORAGE_S3_ACCESSKEY=" + w.AccessKey, "REGISTRY_STORAGE_S3_SECRETKEY=" + w.SecretKey}
}

// process is a child process in its own process group, logging to a file.
type process struct {
	cmd *exec.Cmd
	log *os.File
}

func startProcess(t testing.TB, name, bin string, args ...string) *process {
	t.Helper()
	log, err := os.CreateTemp("", name+"-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	return &process{cmd: cmd, log: log}
}

func (p *process) Stop() {
	if p.cmd == nil || p.cmd.Process == nil {
		return
	}
	syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	p.cmd.Wait()
	p.cmd = nil
	p.log.Close()
	os.Remove(p.log.Name())
}

func (p *process) Log() string {
	data, _ := os.ReadFile(p.log.Name())
	if len(data) > 8<<10 {
		data = data[len(data)-8<<10:]
	}
	return string(data)
}

func waitTCP(t testing.TB, addr string, limit time.Duration, p *process) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("nothing listens on %s; log:\n%s", addr, p.Log())
}

func runWithInput(bin, input string, args ...string) (string, error) {
	cmd := exec.Command(bin, args...)
	cmd.Stdin = strings.NewReader(input)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// Mount starts `cryo mount REF DIR extra...` (root and /dev/fuse needed:
// the test skips, or fails with CI=true, without them), waits until it
// prints "ready", and returns the process and a stop function that ends it
// with SIGTERM (unmounting) and waits; the test's cleanup calls stop too.
func Mount(t testing.TB, cryo, ref, dir string, extra ...string) (*exec.Cmd, func()) {
	t.Helper()
	NeedFUSE(t, "cryo mount")
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, cryo, append([]string{"mount", ref, dir}, extra...)...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 20 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); cmd.Wait() }) }
	ready := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "ready") {
				ready <- nil
				io.Copy(io.Discard, stdout)
				return
			}
		}
		ready <- fmt.Errorf("cryo mount %s ended before ready", ref)
	}()
	select {
	case err := <-ready:
		if err != nil {
			stop()
			t.Fatalf("%v:\n%s", err, stderr.String())
		}
	case <-time.After(2 * time.Minute):
		stop()
		t.Fatalf("cryo mount %s: no ready after 2m:\n%s", ref, stderr.String())
	}
	t.Cleanup(stop)
	return cmd, stop
}
