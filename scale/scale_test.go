package scale

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
)

// pushResult is the part of `cryo push --json` the tests read.
type pushResult struct {
	Stats struct {
		LogicalBytes  int64 `json:"logicalBytes"`
		StoredBytes   int64 `json:"storedBytes"`
		UploadedBytes int64 `json:"uploadedBytes"`
		ComposedBytes int64 `json:"composedBytes"`
	} `json:"stats"`
	ChunkIndexHits int `json:"chunkIndexHits"`
}

// push runs `cryo push --json [FLAGS] DIR REF` and returns what it
// uploaded.
func push(t *testing.T, cryo, dir, ref string, flags ...string) pushResult {
	t.Helper()
	out, err := exec.Command(cryo, append(append([]string{"push", "--json"}, flags...), dir, ref)...).Output()
	if err != nil {
		t.Fatalf("cryo push %s: %v\n%s", ref, err, stderrOf(err))
	}
	var r pushResult
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("cryo push --json: %v\n%s", err, out)
	}
	return r
}

// pull runs `cryo pull REF` into a new temp dir and returns it.
func pull(t *testing.T, cryo, ref string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "pulled")
	testenv.Run(t, cryo, "pull", ref, dir)
	return dir
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok {
		return string(ee.Stderr)
	}
	return ""
}

// editedCopy copies image dir src and overwrites n bytes of pages.img at
// off: a later snapshot of the same app that shares most chunks.
func editedCopy(t *testing.T, src string, off, n int64, seed uint64) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "img")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == "pages.img" {
			p, _ := synth.NewPages(synth.Random, seed)
			p.Fill(data[off:off+n], off/synth.PageSize)
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// manifestStatus answers the HTTP status of HEAD /v2/<repo>/manifests/<ref>.
func manifestStatus(t *testing.T, host, repo, ref string) int {
	t.Helper()
	req, _ := http.NewRequest(http.MethodHead, "http://"+host+"/v2/"+repo+"/manifests/"+ref, nil)
	req.Header.Set("Accept", "application/vnd.oci.image.index.v1+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// deleteSnapshot deletes the index a tag points at (distribution deletes
// manifests by digest).
func deleteSnapshot(t *testing.T, host, repo, tag string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodHead, "http://"+host+"/v2/"+repo+"/manifests/"+tag, nil)
	req.Header.Set("Accept", "application/vnd.oci.image.index.v1+json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	d := resp.Header.Get("Docker-Content-Digest")
	if resp.StatusCode != http.StatusOK || d == "" {
		t.Fatalf("resolve %s/%s:%s: %d", host, repo, tag, resp.StatusCode)
	}
	req, _ = http.NewRequest(http.MethodDelete, "http://"+host+"/v2/"+repo+"/manifests/"+d, nil)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("delete %s@%s: %d", repo, d, resp.StatusCode)
	}
}

// metric reads the sum of a Prometheus counter's series whose labels
// contain match (all series if "") from a /metrics URL.
func metric(t *testing.T, url, name, match string) float64 {
	t.Helper()
	return metricVia(t, http.DefaultClient, url, name, match)
}

// metricVia is metric through client (a daemon's unix socket).
func metricVia(t *testing.T, client *http.Client, url, name, match string) float64 {
	t.Helper()
	resp, err := client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sum := 0.0
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name) || (len(line) > len(name) && line[len(name)] != '{' && line[len(name)] != ' ') {
			continue
		}
		if match != "" && !strings.Contains(line, match) {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// httpStatus polls GET url until it answers want or limit passes, and
// returns the last status and body.
func httpStatus(url string, want int, limit time.Duration) (int, string) {
	return poll(http.MethodGet, url, want, limit)
}

// uploadStatus polls POST /v2/probe/blobs/uploads/ (starting an upload: a
// write) until it answers want.
func uploadStatus(host string, want int, limit time.Duration) (int, string) {
	return poll(http.MethodPost, "http://"+host+"/v2/probe/blobs/uploads/", want, limit)
}

func poll(method, url string, want int, limit time.Duration) (int, string) {
	deadline := time.Now().Add(limit)
	for {
		code, body := 0, ""
		req, _ := http.NewRequest(method, url, nil)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			code, body = resp.StatusCode, string(b)
		} else {
			body = err.Error()
		}
		if code == want || time.Now().After(deadline) {
			return code, body
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// mount runs `cryo mount REF DIR` with a fresh node cache in the
// background, waits for "ready", and returns the dir and a stop function.
func mount(t *testing.T, cryo, ref string, extra ...string) (string, func()) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "mnt")
	_, stop := testenv.Mount(t, cryo, ref, dir, append([]string{"--cache", filepath.Join(t.TempDir(), "cache")}, extra...)...)
	return dir, stop
}
