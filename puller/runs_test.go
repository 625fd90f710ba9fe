package puller

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/fetch"
)

// TestMountRunsWhenTold: a MountFiles mount made with
// FilesOptions.RunsWhenTold (cryo restore's, through the gofer) does not
// count its sandbox as running at a page fault of pages.img (runsc's own,
// while it loads the kernel), only once SandboxStarted says runsc restore
// returned; a mount made without it counts the first fault.
func TestMountRunsWhenTold(t *testing.T) {
	r := startReg(t)
	_, s := pushV2(t, r, "app", synth.Random, 4<<20, 11)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, told := range []bool{true, false} {
		p := newPuller(t, Options{})
		m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{MaterializeAfter: make(chan struct{}), RunsWhenTold: told})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.ReadAt(ctx, format.PagesFile, make([]byte, 4096), 1<<20, fetch.Fault); err != nil {
			t.Fatal(err)
		}
		if got := m.l.sched.Running(); got == told {
			t.Errorf("RunsWhenTold %v: running after a page fault: %v, want %v", told, got, !told)
		}
		m.SandboxStarted()
		if !m.l.sched.Running() {
			t.Errorf("RunsWhenTold %v: not running after SandboxStarted", told)
		}
		if err := m.Unmount(); err != nil {
			t.Fatal(err)
		}
	}
}
