package restore_test

import (
	"encoding/base64"
	"encoding/json"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/gofer"
)

// TestStandaloneGoferUsesNodeCredentials: a standalone gofer (no daemon
// socket in gcs_opts.json, which never carries credentials) restores from
// a registry that demands them, with those of the node's Docker
// credential store (DOCKER_CONFIG: runsc hands its environment to the
// sidecar). Without them in the store the restore fails, the gofer's log
// saying so, and the registry saw no credentials; with them it goes on, memory hash unchanged.
func TestStandaloneGoferUsesNodeCredentials(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app, last, _, d := e.checkpointedApp(t, 16, "auth")
	backend, err := url.Parse("http://" + e.reg.Addr)
	if err != nil {
		t.Fatal(err)
	}
	gate := testenv.NewAuthGate(httputil.NewSingleHostReverseProxy(backend))
	gate.Require("alice", "s3cret")
	hs := httptest.NewServer(gate)
	t.Cleanup(hs.Close)
	host := strings.TrimPrefix(hs.URL, "http://")
	ref := host + "/app:auth"

	run := func() (*gvisortest.RestoreCmd, string) {
		dir := filepath.Join(t.TempDir(), "img")
		logFile := filepath.Join(t.TempDir(), "gofer.log")
		if err := gofer.WriteImageDir(dir, gofer.Config{MediaType: gofer.MediaType, Reference: ref, Index: d, Log: logFile, CacheDir: t.TempDir()}); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(e.runsc, append(app.Flags(), "restore", "--detach", "--background", "--bundle="+app.BundleDir(), "--image-path="+dir, app.ID())...)
		cmd.Env = append(os.Environ(), "GVISOR_SIDECAR_BINARIES_DIR="+goferDir)
		return app.StartRestoreWith(t, cmd), logFile
	}

	rc, logFile := run()
	if err := rc.Wait(restoreTimeout); err == nil {
		t.Fatal("a standalone gofer restored from a registry demanding credentials with none in the store")
	}
	if logged, _ := os.ReadFile(logFile); !strings.Contains(string(logged), "credential not found") || !strings.Contains(string(logged), host) {
		t.Errorf("the gofer's log does not say it found no credentials for %s:\n%s", host, logged)
	}
	if seen := gate.Seen(); len(seen) != 0 {
		t.Fatalf("the registry saw credentials %q with none in the store", seen)
	}

	auth := base64.StdEncoding.EncodeToString([]byte("alice:s3cret"))
	data, err := json.Marshal(map[string]any{"auths": map[string]any{host: map[string]string{"auth": auth}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(os.Getenv("DOCKER_CONFIG"), "config.json"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	rc, logFile = run()
	if err := rc.Wait(restoreTimeout); err != nil {
		logged, _ := os.ReadFile(logFile)
		t.Fatalf("runsc restore with the node's credentials: %v\ngofer log:\n%s", err, logged)
	}
	app.GoesOn(t, last)
	app.WaitRestored(t)
	if !slices.Contains(gate.Seen(), testenv.BasicAuth("alice", "s3cret")) {
		t.Errorf("the registry never saw the store's credentials (%d requests)", gate.Requests())
	}
}
