package puller

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"golang.org/x/sys/unix"
)

func TestParseMountInfo(t *testing.T) {
	line := `312 29 0:64 / /run/cryo/mounts/with\040space rw,nosuid,nodev,relatime shared:170 - fuse.cryo cryo:0123456789ab rw,user_id=0,group_id=0,allow_other`
	point, fstype, ok := parseMountInfo(line)
	if !ok || point != "/run/cryo/mounts/with space" || fstype != "fuse.cryo" {
		t.Fatalf("parseMountInfo: %q %q %v", point, fstype, ok)
	}
	if _, _, ok := parseMountInfo("garbage"); ok {
		t.Fatal("parsed a line without a separator")
	}
}

// TestCleanStaleMounts kills a `cryo mount` process, as an OOM kill would
// kill the puller, and checks that its dead FUSE mount is detached while a
// mount of another kind under the same dir is left alone.
func TestCleanStaleMounts(t *testing.T) {
	testenv.NeedFUSE(t, "cryo mount")
	cryo := testenv.Tool(t, "cryo")
	reg := testenv.StartRegistry(t, "")
	img := testenv.ImageDir(t, synth.HalfZero, 8<<20, 1)
	testenv.Run(t, cryo, "push", img, reg.Addr+"/app:v1")

	mounts := t.TempDir()
	keep := filepath.Join(mounts, "keep")
	if err := os.Mkdir(keep, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", keep, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(keep, unix.MNT_DETACH)

	dir := filepath.Join(mounts, "stale")
	cmd, _ := testenv.Mount(t, cryo, reg.Addr+"/app:v1", dir, "--cache", t.TempDir())
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	if _, err := os.Stat(filepath.Join(dir, "pages.img")); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("stat in the killed puller's mount: %v; want ENOTCONN (a dead mount)", err)
	}

	n, err := CleanStaleMounts(mounts)
	if err != nil || n != 1 {
		t.Fatalf("CleanStaleMounts: %d, %v; want 1 mount detached", n, err)
	}
	if _, err := os.Lstat(dir); !os.IsNotExist(err) {
		t.Errorf("stale mount point still there: %v", err)
	}
	var keepStat, parentStat unix.Stat_t
	unix.Stat(keep, &keepStat)
	unix.Stat(mounts, &parentStat)
	if keepStat.Dev == parentStat.Dev {
		t.Error("the tmpfs mount under the same dir was detached too")
	}
}
