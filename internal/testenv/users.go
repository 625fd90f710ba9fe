package testenv

import (
	"os"
	"os/exec"
	"testing"
)

// AsNobody runs name with args as user nobody (uid 65534, group nogroup, no
// supplementary groups) through util-linux's setpriv, and returns its
// combined output and error: a real other uid, for tests that snapshot
// memory, sockets or caches are the puller's alone. It needs root and
// setpriv; without them the test skips, or fails with CI=true.
func AsNobody(t testing.TB, name string, args ...string) (string, error) {
	t.Helper()
	if os.Geteuid() != 0 {
		SkipOrFatal(t, "testenv: running as another user needs root")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		SkipOrFatal(t, "testenv: no setpriv (util-linux) to run as another user")
	}
	argv := append([]string{"--reuid=nobody", "--regid=nogroup", "--clear-groups", name}, args...)
	out, err := exec.Command(setpriv, argv...).CombinedOutput()
	return string(out), err
}
