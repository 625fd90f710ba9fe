package gvisortest

import (
	"os"
	"path/filepath"
	"testing"
)

// NoRestoreRunsc writes a runsc wrapper that logs each call's arguments
// to a file, passes every call to runsc except `restore`, which it refuses
// (exit 99): tests use it to check that a refused snapshot never reaches
// runsc restore. It returns the wrapper's path and the log file's.
func NoRestoreRunsc(t testing.TB, runsc string) (wrapper, calls string) {
	t.Helper()
	dir := t.TempDir()
	calls = filepath.Join(dir, "calls")
	wrapper = filepath.Join(dir, "runsc")
	script := "#!/bin/sh\n" +
		"echo \"$*\" >> '" + calls + "'\n" +
		"for a in \"$@\"; do\n" +
		"  if [ \"$a\" = restore ]; then echo 'wrapper: restore must not be called' >&2; exit 99; fi\n" +
		"done\n" +
		"exec '" + runsc + "' \"$@\"\n"
	if err := os.WriteFile(wrapper, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return wrapper, calls
}
