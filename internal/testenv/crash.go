package testenv

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// CrashableFS mounts a fresh ext4 filesystem of size bytes on a loop device
// and returns its mount point and a crash function, for tests of what
// survives a power loss: crash cuts the filesystem off from its disk
// (EXT4_IOC_SHUTDOWN without flushing the journal, as xfstests' godown
// does: whatever is not on disk yet is lost), then mounts it again at the
// same place. Only what was flushed (fsync, fdatasync, sync) survives. It
// needs root, a loop device and e2fsprogs; without them the test skips, or
// fails with CI=true.
func CrashableFS(t testing.TB, size int64) (mnt string, crash func()) {
	t.Helper()
	if os.Geteuid() != 0 {
		SkipOrFatal(t, "testenv: a loop-device filesystem needs root")
	}
	for _, tool := range []string{"mkfs.ext4", "losetup", "mount", "umount"} {
		if _, err := exec.LookPath(tool); err != nil {
			SkipOrFatal(t, "testenv: no %s", tool)
		}
	}
	img := filepath.Join(t.TempDir(), "disk.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, size); err != nil {
		t.Fatal(err)
	}
	run := func(name string, args ...string) {
		t.Helper()
		if out, err := exec.Command(name, args...).CombinedOutput(); err != nil {
			t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	run("mkfs.ext4", "-q", img)
	attach := func() string {
		t.Helper()
		out, err := exec.Command("losetup", "-f", "--show", img).CombinedOutput()
		if err != nil {
			SkipOrFatal(t, "testenv: no loop device: %v %s", err, out)
		}
		loop := strings.TrimSpace(string(out))
		t.Cleanup(func() { exec.Command("losetup", "-d", loop).Run() })
		return loop
	}
	loop := attach()
	mnt = t.TempDir()
	run("mount", loop, mnt)
	// Registered after the loop device's cleanup, so it runs before it.
	t.Cleanup(func() { exec.Command("umount", "-l", mnt).Run() })
	crash = func() {
		t.Helper()
		f, err := os.Open(mnt)
		if err != nil {
			t.Fatal(err)
		}
		// EXT4_IOC_SHUTDOWN, _IOR('X', 125, __u32); EXT4_GOING_FLAGS_NOLOGFLUSH.
		const ext4IOCShutdown, noLogFlush = 0x8004587d, 2
		err = unix.IoctlSetPointerInt(int(f.Fd()), ext4IOCShutdown, noLogFlush)
		f.Close()
		if err != nil {
			t.Fatalf("testenv: EXT4_IOC_SHUTDOWN: %v", err)
		}
		run("umount", mnt)
		// Mounted again from a new loop device: a mount namespace made
		// meanwhile (runsc makes them, in tests running in parallel) keeps
		// a copy of the old mount, so the old device's shut-down
		// filesystem lives on and mounting that device again would get
		// it back, failing every call with EIO. A new device gets a fresh
		// mount of what reached the disk.
		exec.Command("losetup", "-d", loop).Run()
		loop = attach()
		run("mount", loop, mnt)
	}
	return mnt, crash
}
