package restore_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/gvisortest"
	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/restore"
	"github.com/cryo-oci/cryo/transfer"
)

// TestCheckpointIntoRegistryThenRestore checkpoints a running app with
// checkpoint.Checkpoint, straight into the registry through cryo's gofer,
// then restores that snapshot on an empty node cache through the gofer:
// the app goes on from the checkpoint with its memory hash unchanged.
func TestCheckpointIntoRegistryThenRestore(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 32})
	app.NextCount(t)
	ref := e.reg.Addr + "/app:ckpt"
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), restoreTimeout)
	defer cancel()
	goferLog := filepath.Join(t.TempDir(), "gofer.log")
	res, err := checkpoint.Checkpoint(ctx, checkpoint.Options{
		Runsc: e.runsc, RunscFlags: app.Flags(), ContainerID: app.ID(),
		GoferDir: goferDir, GoferLog: goferLog, Repo: repo, Tag: tag,
	})
	logged, _ := os.ReadFile(goferLog)
	if err != nil {
		t.Fatalf("checkpoint: %v\ngofer log:\n%s", err, logged)
	}
	if !strings.Contains(string(logged), "path=pages.img upload=references") {
		t.Errorf("the gofer did not pass pages.img's bytes by reference:\n%s", logged)
	}
	app.AfterCheckpoint(t)
	last := app.LastCount()
	t.Logf("checkpoint: %+v; files %v; runsc returned after %v, tagged after %v", res.Stats, res.Files, res.Checkpointed, res.Pushed)
	for _, f := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		if res.Files[f] <= 0 {
			t.Errorf("checkpoint wrote %s of %d bytes", f, res.Files[f])
		}
	}
	if res.Files["pages.img"] < 32<<20 {
		t.Errorf("pages.img of %d bytes for a 32 MiB app", res.Files["pages.img"])
	}

	src := resolve(t, ref, &fetchLog{})
	if src.Index.Digest != res.Descriptor.Digest {
		t.Fatalf("%s resolves to %s, checkpoint pushed %s", ref, src.Index.Digest, res.Descriptor.Digest)
	}
	var events []restore.Event
	opts := goferOptions(e, app, goferDir, &events)
	opts.Stdout, opts.Stderr = containerOutput(t, app)
	if r := e.restoreApp(t, e.newPuller(t), src, opts, app, last); r.Mode != "gofer" {
		t.Errorf("restore mode %q, want gofer", r.Mode)
	}
}

// TestKilledCheckpointLeavesNoTag kills `cryo checkpoint` while the
// sentry writes pages.img (seen in the gofer's log): the tag must not
// exist in the registry.
func TestKilledCheckpointLeavesNoTag(t *testing.T) {
	e := newEnv(t)
	goferDir := gvisortest.GoferDir(t)
	app := gvisortest.StartApp(t, e.runsc, gvisortest.AppOptions{MemoryMiB: 256})
	app.NextCount(t)
	ref := e.reg.Addr + "/app:killed"
	goferLog := filepath.Join(t.TempDir(), "gofer.log")
	args := []string{"checkpoint", "--runsc", e.runsc, "--gofer-dir", goferDir, "--gofer-log", goferLog}
	for _, f := range app.Flags() {
		args = append(args, "--runsc-flag="+f)
	}
	cmd := exec.Command(e.cryo, append(args, app.ID(), ref)...)
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+os.Getenv("DOCKER_CONFIG"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(restoreTimeout)
	for {
		logged, _ := os.ReadFile(goferLog)
		if strings.Contains(string(logged), "open for writing") && strings.Contains(string(logged), "pages.img") {
			break
		}
		if time.Now().After(deadline) {
			cmd.Process.Kill()
			t.Fatalf("the gofer never opened pages.img for writing; its log:\n%s", logged)
		}
		time.Sleep(5 * time.Millisecond)
	}
	cmd.Process.Kill() // cryo checkpoint alone: runsc and the gofer lose it
	cmd.Wait()
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if d, err := repo.Resolve(context.Background(), tag); err == nil {
		t.Fatalf("a killed checkpoint left tag %s pointing at %s", ref, d.Digest)
	}
}
