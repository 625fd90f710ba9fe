package gofer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
)

var testIndex = digest.FromString("snapshot")

func TestConfigRoundTripAndRefusals(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "img")
	good := Config{MediaType: MediaType, Reference: "r/app:v1", Index: testIndex, Socket: "/run/cryo/puller.sock", Mount: "m1"}
	if err := WriteImageDir(dir, good); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(filepath.Join(dir, ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	got, err := ReadConfig(f)
	if err != nil || !reflect.DeepEqual(got, good) {
		t.Fatalf("read back %+v, %v; wrote %+v", got, err, good)
	}
	if err := WriteImageDir(dir, good); err == nil {
		t.Error("WriteImageDir over an existing config: no error")
	}
	standalone := Config{MediaType: MediaType, Reference: "r/app:v1", Index: testIndex, Peers: []string{"10.0.0.2:7070", "dns:pullers:7070"}, PeerTokenFile: "/etc/cryo/token"}
	sdir := filepath.Join(t.TempDir(), "img")
	if err := WriteImageDir(sdir, standalone); err != nil {
		t.Fatal(err)
	}
	if data, err := os.ReadFile(filepath.Join(sdir, ConfigFile)); err != nil {
		t.Fatal(err)
	} else if got, err := ReadConfig(bytes.NewReader(data)); err != nil || !reflect.DeepEqual(got, standalone) {
		t.Fatalf("read back %+v, %v; wrote %+v", got, err, standalone)
	}
	valid := `"mediaType":"` + MediaType + `","index":"` + testIndex.String() + `"`
	for name, body := range map[string]string{
		"gVisor's own":      `{"bucket":"b","prefix":"p"}`,
		"unknown key":       `{` + valid + `,"reference":"r","sockett":"/s"}`,
		"key of other case": `{` + valid + `,"Reference":"r"}`,
		"key twice":         `{` + valid + `,"reference":"r","reference":"s"}`,
		"bad index":         `{"mediaType":"` + MediaType + `","index":"sha256:1","reference":"r"}`,
		"socket alone":      `{` + valid + `,"socket":"/s"}`,
		"nothing to read":   `{` + valid + `}`,
		"relative socket":   `{` + valid + `,"socket":"s.sock","mount":"m"}`,
		"two objects":       `{` + valid + `,"reference":"r"}{}`,
		"oversized":         `{` + valid + `,"reference":"` + strings.Repeat("r", MaxConfigSize) + `"}`,
		"peers, no token":   `{` + valid + `,"reference":"r","peers":["p:7070"]}`,
		"peers of a socket": `{` + valid + `,"socket":"/s","mount":"m","peers":["p:7070"],"peerTokenFile":"/t"}`,
		"token, no peers":   `{` + valid + `,"reference":"r","peerTokenFile":"/t"}`,
		"relative token":    `{` + valid + `,"reference":"r","peers":["p:7070"],"peerTokenFile":"t"}`,
	} {
		if _, err := ReadConfig(strings.NewReader(body)); err == nil {
			t.Errorf("%s: %s accepted", name, body[:min(len(body), 80)])
		}
	}
}

func TestParseRange(t *testing.T) {
	for _, tc := range []struct {
		h          string
		start, end int64
		ok         bool
	}{
		{"bytes=0-9", 0, 10, true},
		{"bytes=90-200", 90, 100, true},                 // clipped at the end
		{"bytes=90-9223372036854775807", 90, 100, true}, // last+1 overflows
		{"bytes=0-9223372036854775807", 0, 100, true},
		{"bytes=100-200", 0, 0, false}, // past the end
		{"bytes=5-4", 0, 0, false},
		{"bytes=-5", 0, 0, false},
		{"bytes=0-", 0, 0, false},
		{"items=0-1", 0, 0, false},
		{"", 0, 0, false},
	} {
		start, end, err := parseRange(tc.h, 100)
		if (err == nil) != tc.ok || (tc.ok && (start != tc.start || end != tc.end)) {
			t.Errorf("%q: [%d, %d) %v; want [%d, %d) ok=%v", tc.h, start, end, err, tc.start, tc.end, tc.ok)
		}
	}
	if _, _, err := parseRange(fmt.Sprintf("bytes=0-%d", MaxRange), 1<<40); err == nil {
		t.Error("a range over MaxRange accepted")
	}
}

// TestClientResumesCutResponses serves a file whose first GET is cut off
// halfway (the connection dropped) and whose second answers 502: the
// client keeps the bytes it got, asks for the rest, and returns the whole
// range right.
func TestClientResumesCutResponses(t *testing.T) {
	data := bytes.Repeat([]byte("0123456789abcdef"), 1<<16) // 1 MiB
	var mu sync.Mutex
	var ranges []string
	h := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(SnapshotHeader, testIndex.String())
		if r.Method == http.MethodHead {
			w.Header().Set("Content-Length", fmt.Sprint(len(data)))
			return
		}
		mu.Lock()
		ranges = append(ranges, r.Header.Get("Range"))
		n := len(ranges)
		mu.Unlock()
		start, end, err := parseRange(r.Header.Get("Range"), int64(len(data)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusRequestedRangeNotSatisfiable)
			return
		}
		switch n {
		case 1: // half the bytes, then the connection goes
			w.Header().Set("Content-Length", fmt.Sprint(end-start))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(data[start : start+(end-start)/2])
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
		case 2:
			http.Error(w, "fetch failed", http.StatusBadGateway)
		default:
			w.Header().Set("Content-Length", fmt.Sprint(end-start))
			w.WriteHeader(http.StatusPartialContent)
			w.Write(data[start:end])
		}
	}
	sock := filepath.Join(t.TempDir(), "s")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(h)}
	go srv.Serve(ln)
	defer srv.Close()
	c := NewClient(sock, "m", testIndex, 30*time.Second)
	defer c.Close()
	// Into three buffers, as gVisor's vectored reads ask.
	got := make([]byte, len(data)-4096)
	dsts := [][]byte{got[:1000], got[1000 : 300<<10], got[300<<10:]}
	if err := c.ReadAt(context.Background(), "pages.img", dsts, 4096, fetch.Fault); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[4096:]) {
		t.Fatal("bytes differ")
	}
	half := 4096 + (len(data)-4096)/2
	want := []string{fmt.Sprintf("bytes=4096-%d", len(data)-1), fmt.Sprintf("bytes=%d-%d", half, len(data)-1), fmt.Sprintf("bytes=%d-%d", half, len(data)-1)}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(ranges) != fmt.Sprint(want) {
		t.Errorf("ranges asked %v, want %v (resume after the bytes already read)", ranges, want)
	}
}

func TestInstall(t *testing.T) {
	src := filepath.Join(t.TempDir(), "checkpointgofer")
	if err := os.WriteFile(src, []byte("#!/bin/sh\necho v2\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "run", "gofer")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, Binary), []byte("old"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := Install(src, dir); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, Binary))
	if err != nil || string(got) != "#!/bin/sh\necho v2\n" {
		t.Fatalf("installed %q, %v", got, err)
	}
	if fi, _ := os.Stat(filepath.Join(dir, Binary)); fi.Mode().Perm() != 0o755 {
		t.Errorf("installed with mode %v, want 0755", fi.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("dir holds %v after the install, want the gofer alone", ents)
	}
	if err := Install(src, filepath.Join(t.TempDir(), "gvisor-bin")); err == nil || !strings.Contains(err.Error(), "gVisor's own") {
		t.Errorf("install into a gvisor-bin dir: %v, want a refusal", err)
	}
}

// TestSidecarDir gives runsc a sidecar dir beside a fake runsc whose
// gvisor-bin/ holds gVisor's own gofer and sentry: the dir made links
// cryo's gofer and runsc's sentry, never gVisor's gofer.
func TestSidecarDir(t *testing.T) {
	root := t.TempDir()
	runsc := filepath.Join(root, "bin", "runsc")
	for _, f := range []string{runsc, filepath.Join(root, "bin", "gvisor-bin", "gvisor_sentry"), filepath.Join(root, "bin", "gvisor-bin", Binary), filepath.Join(root, "cryo-gofer", Binary)} {
		if err := os.MkdirAll(filepath.Dir(f), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(f, []byte(f), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	dir, err := SidecarDir(filepath.Join(root, "sidecars"), filepath.Join(root, "cryo-gofer"), runsc)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{Binary: filepath.Join(root, "cryo-gofer", Binary), "gvisor_sentry": filepath.Join(root, "bin", "gvisor-bin", "gvisor_sentry")} {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || string(got) != want {
			t.Errorf("%s in the sidecar dir: %q, %v; want the file %s", name, got, err, want)
		}
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 2 {
		t.Errorf("sidecar dir holds %v, want 2 links", ents)
	}
}

// TestStartCheck runs the look at a gofer ahead of runsc's release, as a
// restore does: a gofer of that release passes; another release, a dir
// without a gofer and a binary that is not cryo's gofer are refused with
// a *BinaryError that says which; asking twice gives the same answer.
func TestStartCheck(t *testing.T) {
	ctx := context.Background()
	gofer := func(t *testing.T, script string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, Binary), []byte("#!/bin/sh\n"+script+"\n"), 0o700); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	good := gofer(t, `echo "cryo checkpointgofer, gVisor release release-1"`)
	check := StartCheck(ctx, good)
	for i := range 2 {
		if err := check("release-1"); err != nil {
			t.Fatalf("call %d: a gofer of runsc's release: %v", i, err)
		}
	}
	var be *BinaryError
	if err := StartCheck(ctx, good)("release-2"); !errors.As(err, &be) || be.Release != "release-1" || be.Runsc != "release-2" {
		t.Errorf("a gofer of another release: %v, want a *BinaryError naming both", err)
	}
	if err := StartCheck(ctx, t.TempDir())("release-1"); !errors.As(err, &be) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("no gofer in the dir: %v, want a *BinaryError wrapping ErrNotExist", err)
	}
	if err := StartCheck(ctx, gofer(t, `echo "runsc version release-1"`))("release-1"); !errors.As(err, &be) || !strings.Contains(err.Error(), "not cryo's checkpoint gofer") {
		t.Errorf("another binary: %v, want it named not cryo's gofer", err)
	}
	if err := StartCheck(ctx, "")("release-1"); !errors.As(err, &be) {
		t.Errorf("no gofer dir: %v, want a *BinaryError", err)
	}
}
