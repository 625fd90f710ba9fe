package main

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// noCoreDumps makes the process non-dumpable: no core dump of it is
// written, and only root can ptrace it or read its memory through /proc.
// A puller holds snapshot memory (small files, chunks in flight), which is
// a sandbox's memory: keys, tokens, user data. Processes it starts (runsc)
// are dumpable again after exec.
func noCoreDumps() error {
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("make the process non-dumpable: %w", err)
	}
	return nil
}
