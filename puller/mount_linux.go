package puller

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/puller/imagefs"
	"golang.org/x/sys/unix"
)

// bindMount makes dir show src (a materialized image dir), read-only.
func bindMount(src, dir string) error {
	if err := unix.Mount(src, dir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", src, dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		unix.Unmount(dir, 0)
		return fmt.Errorf("make %s read-only: %w", dir, err)
	}
	return nil
}

// unmount detaches dir lazily.
func unmount(dir string) error {
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
		return fmt.Errorf("unmount %s: %w", dir, err)
	}
	return nil
}

// CleanStaleMounts detaches the image filesystems a previous puller process
// left under dir and removes their mount points. A puller that is killed
// (OOM, SIGKILL, a node agent restart) cannot unmount its FUSE mounts; they
// stay behind as dead mount points ("transport endpoint is not connected")
// that nothing can use. Only such dead mounts are detached: live ones (of
// another puller sharing the dir) and bind mounts of materialized dirs,
// which work without a puller, stay. It returns how many it detached.
func CleanStaleMounts(dir string) (int, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return 0, fmt.Errorf("read mount table: %w", err)
	}
	prefix := filepath.Clean(dir) + "/"
	n := 0
	var errs []error
	for _, line := range strings.Split(string(data), "\n") {
		point, fstype, ok := parseMountInfo(line)
		if !ok || fstype != "fuse."+imagefs.FSType || !strings.HasPrefix(point, prefix) || !deadMount(point) {
			continue
		}
		if err := unix.Unmount(point, unix.MNT_DETACH); err != nil && err != unix.EINVAL {
			errs = append(errs, fmt.Errorf("detach stale mount %s: %w", point, err))
			continue
		}
		os.Remove(point)
		n++
	}
	return n, errors.Join(errs...)
}

// MountPointsUnder returns the mount points below dir (of any filesystem),
// from the mount table: what a walk of dir must not open (a FUSE server
// that hangs would hang it).
func MountPointsUnder(dir string) (map[string]bool, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	// The table holds absolute paths, symlinks resolved; the points are
	// returned under dir as given.
	real, err := filepath.Abs(dir)
	if err == nil {
		real, err = filepath.EvalSymlinks(real)
	}
	if err != nil {
		return nil, fmt.Errorf("mount points under %s: %w", dir, err)
	}
	prefix := real + "/"
	points := map[string]bool{}
	for _, line := range strings.Split(string(data), "\n") {
		if point, _, ok := parseMountInfo(line); ok && strings.HasPrefix(point, prefix) {
			points[filepath.Join(dir, strings.TrimPrefix(point, prefix))] = true
		}
	}
	return points, nil
}

// deadMount reports whether the FUSE mount at point has lost its server:
// a stat that must ask the server (AT_STATX_FORCE_SYNC: the root's
// attributes may be cached for an hour) answers ENOTCONN at once. A live
// mount (another puller's, sharing the dir) answers, or takes longer than
// a second, and is left alone.
func deadMount(point string) bool {
	res := make(chan error, 1)
	go func() {
		var st unix.Statx_t
		res <- unix.Statx(unix.AT_FDCWD, point, unix.AT_STATX_FORCE_SYNC, unix.STATX_BASIC_STATS, &st)
	}()
	select {
	case err := <-res:
		return err == unix.ENOTCONN
	case <-time.After(time.Second):
		return false
	}
}

// parseMountInfo returns the mount point and filesystem type of one line
// of /proc/self/mountinfo (proc(5)): the fifth field, octal-escaped, and
// the first field after the " - " separator.
func parseMountInfo(line string) (point, fstype string, ok bool) {
	before, after, found := strings.Cut(line, " - ")
	if !found {
		return "", "", false
	}
	f := strings.Fields(before)
	g := strings.Fields(after)
	if len(f) < 5 || len(g) < 1 {
		return "", "", false
	}
	return unescapeOctal(f[4]), g[0], true
}

// unescapeOctal undoes the kernel's \NNN escapes of spaces, tabs,
// newlines and backslashes in mount table fields.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
