package puller_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/puller/profile"
)

// TestProfileRecordPushReplay records the working set of an app with a
// hot set in one cold restore (cryo restore --record-profile), attaches it
// to the snapshot (cryo profile push), lists it (cryo profile list), and
// restores on an empty node cache again: that restore finds the profile
// by itself (--profile auto), says so, and the app goes on with its
// memory unchanged.
func TestProfileRecordPushReplay(t *testing.T) {
	e := newRestoreEnv(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 128, HotSet: gvisortest.HotRegions, Interval: 20 * time.Millisecond})
	app.NextCount(t)
	hash := app.StartHash()
	img := app.Checkpoint(t)
	last := app.LastCount()
	ref := e.reg.Addr + "/app:hot"
	dgst := e.push(t, img, ref)

	recorded := filepath.Join(t.TempDir(), "app.profile")
	e.flags = []string{"--record-profile", recorded}
	_, out := e.restoreThroughCryo(t, app, ref, last, hash)
	if strings.Contains(out, "profile: sha256:") {
		t.Errorf("the first restore used a profile, but none was published:\n%s", out)
	}
	data, err := os.ReadFile(recorded)
	if err != nil {
		t.Fatalf("no profile recorded: %v", err)
	}
	p, err := profile.Parse(data)
	if err != nil {
		t.Fatalf("recorded profile: %v", err)
	}
	pages, _ := os.Stat(filepath.Join(img, "pages.img"))
	t.Logf("recorded %d ranges, %d bytes of a %d-byte pages.img", len(p.Ranges), p.Bytes(), pages.Size())
	if p.Subject.String() != dgst {
		t.Errorf("recorded profile's subject %s, want %s", p.Subject, dgst)
	}
	if len(p.Ranges) == 0 || p.Bytes() >= pages.Size() {
		t.Errorf("recorded %d ranges of %d bytes: want the hot set's windows, not nothing or everything", len(p.Ranges), p.Bytes())
	}
	if fi, err := os.Stat(recorded); err == nil && fi.Mode().Perm() != 0o600 {
		t.Errorf("profile file mode %v, want 0600", fi.Mode().Perm())
	}

	ctx := context.Background()
	pushed, err := e.command(ctx, "profile", "push", ref, recorded).CombinedOutput()
	if err != nil {
		t.Fatalf("cryo profile push: %v\n%s", err, pushed)
	}
	m := regexp.MustCompile(`pushed profile (sha256:[0-9a-f]{64})`).FindSubmatch(pushed)
	if m == nil {
		t.Fatalf("cryo profile push printed no digest:\n%s", pushed)
	}
	listed, err := e.command(ctx, "profile", "list", "--json", ref).Output()
	if err != nil {
		t.Fatalf("cryo profile list: %v", err)
	}
	var entries []struct {
		Digest string `json:"digest"`
		Ranges int    `json:"ranges"`
	}
	if err := json.Unmarshal(listed, &entries); err != nil || len(entries) != 1 || entries[0].Digest != string(m[1]) || entries[0].Ranges != len(p.Ranges) {
		t.Fatalf("cryo profile list: %s (%v), want the one profile pushed, %s with %d ranges", listed, err, m[1], len(p.Ranges))
	}

	// A node that has never seen the snapshot.
	e.cacheDir = t.TempDir()
	e.flags = nil
	_, out = e.restoreThroughCryo(t, app, ref, last, hash)
	if want := fmt.Sprintf("profile: %s (%d ranges, ", m[1], len(p.Ranges)); !strings.Contains(out, want) {
		t.Errorf("the restore on an empty node cache did not say it used the profile (want %q):\n%s", want, out)
	}
}
