package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/sirupsen/logrus"
)

// TestAPI drives the daemon over a real unix socket: mount a snapshot from
// a real registry, list it, wait until loaded, read its bytes, check the
// metrics, unmount.
func TestAPI(t *testing.T) {
	if os.Geteuid() != 0 || !puller.FUSEAvailable() {
		testenv.SkipOrFatal(t, "needs root and /dev/fuse")
	}
	logrus.SetLevel(logrus.ErrorLevel)
	ctx := context.Background()
	cfg, _ := registry.DefaultConfig(t.TempDir(), "127.0.0.1:0")
	srv, err := registry.New(ctx, cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	defer hs.Close()
	host := strings.TrimPrefix(hs.URL, "http://")
	img := filepath.Join(t.TempDir(), "img")
	synth.ImageDir(img, synth.HalfZero, 8<<20, 1)
	repo, tag, _ := transfer.Repository(host+"/app:v1", transfer.ClientOptions{})
	if _, err := transfer.Push(ctx, img, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewRegistry()
	p, err := puller.New(puller.Options{CacheDir: t.TempDir(), FetchMetrics: fetch.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	resolve := func(ctx context.Context, ref string) (puller.Source, error) {
		r, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
		if err != nil {
			return puller.Source{}, err
		}
		desc, err := r.Resolve(ctx, tag)
		return puller.Source{Index: desc, Endpoints: []fetch.Endpoint{{Name: r.Reference.Registry, Store: r}}}, err
	}
	d := New(p, resolve, t.TempDir(), slog.Default(), reg, reg)
	defer d.Close()
	sock := filepath.Join(t.TempDir(), "puller.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go http.Serve(ln, d.Handler())
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	call := func(method, path, body string, want int) []byte {
		t.Helper()
		req, _ := http.NewRequest(method, "http://puller"+path, strings.NewReader(body))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != want {
			t.Fatalf("%s %s: %s %s", method, path, resp.Status, data)
		}
		return data
	}
	call("POST", "/v1/mounts", `{"ref": "nope"}`, http.StatusBadGateway)
	var m Mount
	json.Unmarshal(call("POST", "/v1/mounts", `{"ref": "`+host+`/app:v1"}`, http.StatusCreated), &m)
	if m.ID == "" || m.Dir == "" || m.Mode != "fuse" {
		t.Fatalf("mount: %+v", m)
	}
	var list []Mount
	json.Unmarshal(call("GET", "/v1/mounts", "", http.StatusOK), &list)
	if len(list) != 1 || list[0].ID != m.ID {
		t.Fatalf("list: %+v", list)
	}
	json.Unmarshal(call("POST", "/v1/mounts/"+m.ID+"/wait", "", http.StatusOK), &m)
	if !m.Loaded || m.LocalBytes != m.TotalBytes || m.Err != "" {
		t.Fatalf("after wait: %+v", m)
	}
	got, _ := os.ReadFile(filepath.Join(m.Dir, "pages.img"))
	want, _ := os.ReadFile(filepath.Join(img, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs")
	}
	metrics := string(call("GET", "/metrics", "", http.StatusOK))
	for _, name := range []string{"cryo_puller_fetched_bytes_total", "cryo_puller_time_to_ready_seconds", "cryo_puller_time_to_loaded_seconds", "cryo_puller_cache_bytes"} {
		if !strings.Contains(metrics, name) {
			t.Errorf("metrics lack %s", name)
		}
	}
	call("DELETE", "/v1/mounts/"+m.ID, "", http.StatusNoContent)
	call("GET", "/v1/mounts/"+m.ID, "", http.StatusNotFound)

	// The TCP (metrics) handler serves metrics and health, never the mount API.
	mh := d.MetricsHandler()
	for _, tc := range []struct {
		method, path string
		want         int
	}{{"GET", "/metrics", 200}, {"GET", "/healthz", 200}, {"POST", "/v1/mounts", 404}, {"GET", "/v1/mounts", 404}} {
		rec := httptest.NewRecorder()
		mh.ServeHTTP(rec, httptest.NewRequest(tc.method, tc.path, strings.NewReader(`{"ref":"x/y:z"}`)))
		if rec.Code != tc.want {
			t.Errorf("metrics handler %s %s: %d, want %d", tc.method, tc.path, rec.Code, tc.want)
		}
	}
}
