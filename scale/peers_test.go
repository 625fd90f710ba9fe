package scale

import (
	"bytes"
	"context"
	"encoding/json"
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
	"github.com/cryo-oci/cryo/internal/testenv"
)

// pullerd is a `cryo puller serve` process and a client of its API socket.
type pullerd struct {
	cmd     *exec.Cmd
	client  *http.Client
	logFile string
}

// log returns what the daemon printed so far.
func (d *pullerd) log() string {
	b, _ := os.ReadFile(d.logFile)
	return string(b)
}

// startPullerd starts `cryo puller serve` with a fresh cache and extra
// flags, and waits until its socket answers.
func startPullerd(t *testing.T, cryo string, extra ...string) *pullerd {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "puller.sock")
	args := append([]string{"puller", "serve", "--socket", sock, "--cache", filepath.Join(dir, "cache"), "--mounts", filepath.Join(dir, "mnt"), "--profile", "none"}, extra...)
	cmd := exec.Command(cryo, args...)
	logFile := filepath.Join(dir, "puller.log")
	lf, err := os.Create(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	d := &pullerd{cmd: cmd, logFile: logFile, client: &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
			<-done
		}
	})
	for deadline := time.Now().Add(20 * time.Second); ; {
		if resp, err := d.client.Get("http://puller/v1/mounts"); err == nil {
			resp.Body.Close()
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("cryo %s: no answer on its socket; log:\n%s", strings.Join(args, " "), d.log())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// mountAndWait mounts ref through the daemon, waits until it is loaded,
// and returns its dir.
func (d *pullerd) mountAndWait(ref string) (string, error) {
	post := func(path string, body any, out any) error {
		b, _ := json.Marshal(body)
		resp, err := d.client.Post("http://puller"+path, "application/json", bytes.NewReader(b))
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		if resp.StatusCode/100 != 2 {
			return fmt.Errorf("POST %s: %s: %s", path, resp.Status, data)
		}
		return json.Unmarshal(data, out)
	}
	var m struct {
		ID    string `json:"id"`
		Dir   string `json:"dir"`
		Error string `json:"error"`
	}
	if err := post("/v1/mounts", map[string]string{"ref": ref}, &m); err != nil {
		return "", err
	}
	if err := post("/v1/mounts/"+m.ID+"/wait", nil, &m); err != nil {
		return "", err
	}
	if m.Error != "" {
		return "", fmt.Errorf("mount %s: %s", m.ID, m.Error)
	}
	return m.Dir, nil
}

// metric sums a counter of the daemon's /metrics.
func (d *pullerd) metric(t *testing.T, name string) float64 {
	return metricVia(t, d.client, "http://puller/metrics", name, "")
}

// TestPeerDaemons runs 4 `cryo puller serve` processes on loopback that
// know each other as peers, and mounts one new snapshot on all of them at
// once (FUSE, through their API): each serves the snapshot's bytes, the
// registry serves its blobs about once in all (at most 1.25 times what
// it stores), not once per node, and the chunks went between the
// daemons. A fifth daemon with another pool token is refused by every
// one of them and still mounts the snapshot, from the registry.
func TestPeerDaemons(t *testing.T) {
	testenv.NeedFUSE(t, "the daemons' mounts")
	cryo := testenv.Tool(t, "cryo")
	reg := testenv.StartRegistry(t, "")
	img := testenv.ImageDir(t, synth.HalfZero, 48<<20, 11)
	pushed := push(t, cryo, img, reg.Addr+"/app:v1")
	ref := reg.Addr + "/app:v1"
	tokens := t.TempDir()
	token := filepath.Join(tokens, "pool")
	other := filepath.Join(tokens, "other")
	os.WriteFile(token, []byte("the-pool-token-0123456789\n"), 0o600)
	os.WriteFile(other, []byte("another-pool-token-0123456789\n"), 0o600)
	addrs := make([]string, 4)
	for i := range addrs {
		addrs[i] = testenv.FreeAddr(t)
	}
	var ds []*pullerd
	for _, a := range addrs {
		ds = append(ds, startPullerd(t, cryo, "--peer-listen", a, "--peers", strings.Join(addrs, ","), "--peer-token-file", token))
	}
	blobs := func() float64 {
		return metric(t, "http://"+reg.MetricsAddr+"/metrics", "cryo_registry_response_bytes_total", `kind="blob"`)
	}
	before := blobs()
	var wg sync.WaitGroup
	errs := make([]error, len(ds))
	dirs := make([]string, len(ds))
	for i, d := range ds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dirs[i], errs[i] = d.mountAndWait(ref)
		}()
	}
	wg.Wait()
	for i := range ds {
		if errs[i] != nil {
			t.Fatalf("daemon %d: %v\n%s", i, errs[i], ds[i].log())
		}
		testenv.SameImage(t, dirs[i], img)
	}
	served := blobs() - before
	stored := float64(pushed.Stats.StoredBytes)
	t.Logf("stored %.0f bytes; the registry served %.0f (%.2fx) to 4 daemons", stored, served, served/stored)
	if served > 1.25*stored {
		t.Fatalf("the registry served %.0f blob bytes to 4 daemons for %.0f stored (%.2fx): chunks were not shared", served, stored, served/stored)
	}
	var fromPeers float64
	for _, d := range ds {
		fromPeers += d.metric(t, "cryo_puller_peer_received_bytes_total")
	}
	if fromPeers == 0 {
		t.Fatal("no chunk went between the daemons")
	}

	stranger := startPullerd(t, cryo, "--peers", strings.Join(addrs, ","), "--peer-token-file", other)
	before = blobs()
	dir, err := stranger.mountAndWait(ref)
	if err != nil {
		t.Fatalf("the daemon with another token: %v\n%s", err, stranger.log())
	}
	testenv.SameImage(t, dir, img)
	if got := stranger.metric(t, "cryo_puller_peer_received_bytes_total"); got != 0 {
		t.Fatalf("the daemon with another token received %.0f bytes from the pool", got)
	}
	if got := blobs() - before; got < stored {
		t.Fatalf("the daemon with another token took %.0f blob bytes from the registry, less than the snapshot's %.0f: where did the rest come from?", got, stored)
	}
	var refused float64
	for _, d := range ds {
		refused += d.metric(t, "cryo_puller_peer_refused_requests_total")
	}
	if refused == 0 {
		t.Fatal("no daemon refused the other token")
	}
}
