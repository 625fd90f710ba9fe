package puller_test

import (
	"regexp"
	"testing"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/internal/testenv"
)

// TestRestoreThroughMirror restores a real checkpoint from a regional
// mirror: a `cryo registry serve --mirror-of` pull-through cache of the
// registry it was pushed to. The app continues with its memory intact, and
// the mirror, not the client, fetched from the primary. It runs `cryo
// restore` with its defaults, which take cryo's checkpoint gofer (bin/cryo
// has one beside it, of runsc's release), so it also shows the gofer path
// reading through mirrors.
func TestRestoreThroughMirror(t *testing.T) {
	gvisortest.GoferDir(t)
	e := newRestoreEnv(t)
	mirror := testenv.StartRegistry(t, "", "--mirror-of", "http://"+e.reg.Addr)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	hash := app.StartHash()
	img := app.Checkpoint(t)
	last := app.LastCount()
	e.push(t, img, e.reg.Addr+"/app:v1")

	primaryBefore := e.blobBytes(t)
	_, out := e.restoreThroughCryo(t, app, mirror.Addr+"/app:v1", last, hash)
	if !regexp.MustCompile(`(?m)\bmode gofer\b`).MatchString(out) {
		t.Errorf("restore through the mirror with the defaults did not use the checkpoint gofer (want \"mode gofer\"):\n%s", out)
	}
	if e.blobBytes(t) <= primaryBefore {
		t.Error("the primary served no blob: the mirror did not pull through")
	}
}
