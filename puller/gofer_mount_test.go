package puller_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/puller/gofer"
)

// TestMountThroughGofer: `cryo mount --backend gofer` makes an image dir of
// gcs_opts.json alone and no FUSE mount, prints the environment that
// points runsc at cryo's gofer, and a runsc restore run by the caller with
// it continues the app with its memory unchanged; at SIGTERM the mount
// ends cleanly and the dir is gone.
func TestMountThroughGofer(t *testing.T) {
	e := newRestoreEnv(t)
	gvisortest.GoferDir(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	hash := app.StartHash()
	img := app.Checkpoint(t)
	last := app.LastCount()
	ref := e.reg.Addr + "/app:gofermount"
	e.push(t, img, ref)

	dir := filepath.Join(t.TempDir(), "img")
	env, mount := e.startMount(t, true, dir, "--runsc", e.runsc, "--cache", e.cacheDir, ref)
	if !strings.HasPrefix(env, "GVISOR_SIDECAR_BINARIES_DIR=") {
		t.Fatalf("cryo mount --backend gofer printed no env line (got %q):\n%s", env, mount.stderr.String())
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 || ents[0].Name() != gofer.ConfigFile {
		t.Errorf("image dir holds %v, want %s alone", ents, gofer.ConfigFile)
	}
	if mps := mountsUnder(t, filepath.Dir(dir)); len(mps) != 0 {
		t.Errorf("gofer mount made FUSE mounts %v", mps)
	}
	restore := app.Command("restore", "--detach", "--background", "--bundle="+app.BundleDir(), "--image-path="+dir, app.ID())
	restore.Env = append(os.Environ(), env)
	rc := app.StartRestoreWith(t, restore)
	if n := app.NextCount(t); n != last+1 {
		t.Errorf("restored app counts %d, want %d", n, last+1)
	}
	if h := app.Hash(t); h != hash {
		t.Errorf("memory hash after restore %s, at start %s", h, hash)
	}
	if err := rc.Wait(time.Minute); err != nil {
		t.Fatal(err)
	}
	if out, err := app.Command("wait", "--restore", app.ID()).CombinedOutput(); err != nil {
		t.Fatalf("runsc wait --restore: %v\n%s", err, out)
	}
	mount.stop(t)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("image dir %s left after the mount ended: %v", dir, err)
	}
}
