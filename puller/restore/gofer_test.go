package restore_test

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/restore"
)

// TestRestoreThroughGofer restores a checkpointed app through cryo's
// checkpoint gofer (no FUSE): the app goes on with its memory hash
// unchanged, the image dir runsc got held gcs_opts.json and nothing else,
// no FUSE mount was made, and the snapshot is materialized afterwards.
func TestRestoreThroughGofer(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	img := app.Checkpoint(t)
	last := app.LastCount()
	ref := e.reg.Addr + "/app:gofer"
	d := e.push(t, img, ref)

	var log fetchLog
	src := resolve(t, ref, &log)
	p, err := puller.New(puller.Options{CacheDir: e.cacheDir})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var events []restore.Event
	opts := options(e, app, &events)
	opts.Backend = restore.BackendGofer
	opts.GoferDir = goferDir
	opts.GoferLog = filepath.Join(t.TempDir(), "gofer.log")
	var dirFiles []string
	opts.Progress = func(ev restore.Event) {
		events = append(events, ev)
		if ev.Step == restore.Ready {
			ents, _ := os.ReadDir(ev.Dir)
			for _, de := range ents {
				dirFiles = append(dirFiles, de.Name())
			}
			if mps := mountsUnder(t, e.cacheDir); len(mps) != 0 {
				t.Errorf("gofer restore mounted %v", mps)
			}
		}
	}
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	res := e.restoreApp(t, p, src, opts, app, last)
	goferLog, _ := os.ReadFile(opts.GoferLog)
	t.Logf("gofer log:\n%s", goferLog)
	if res.Mode != "gofer" {
		t.Errorf("mode %q, want gofer", res.Mode)
	}
	if !slices.Equal(dirFiles, []string{"gcs_opts.json"}) {
		t.Errorf("image dir held %v, want only gcs_opts.json", dirFiles)
	}
	if !strings.Contains(string(goferLog), "pages.img") {
		t.Errorf("the gofer's log does not show it served pages.img: runsc did not use it")
	}
	if _, ok := p.Materialized(d); !ok || res.MaterializeErr != nil {
		t.Errorf("not materialized after the restore: %v", res.MaterializeErr)
	}
	t.Logf("ready %v, restored %v, pages loaded %v, materialized %v", res.Ready, res.Restored, res.PagesLoaded, res.Materialized)
}
