package puller

import (
	"fmt"

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
