package main

import (
	"strings"
	"testing"
)

// TestRecordSweepRateWarnsAlone: --record-sweep-rate without a recording
// says it does nothing; with --record-profile, or not given, it says
// nothing. (The restores fail on a bad reference after the flags are read.)
func TestRecordSweepRateWarnsAlone(t *testing.T) {
	const warning = "--record-sweep-rate does nothing without"
	for _, tc := range []struct {
		args []string
		warn bool
	}{
		{[]string{"restore", "--record-sweep-rate", "1000"}, true},
		{[]string{"mount", "--record-sweep-rate", "1000"}, true},
		{[]string{"restore", "--record-sweep-rate", "1000", "--record-profile", "/nonexistent/p"}, false},
		{[]string{"restore"}, false},
	} {
		args := append(tc.args, "--cache", t.TempDir(), "bad::ref")
		if tc.args[0] == "restore" {
			args = append(args, "id")
		} else {
			args = append(args, t.TempDir())
		}
		_, stderr, _ := runCryo(t, "", args...)
		if got := strings.Contains(stderr, warning); got != tc.warn {
			t.Errorf("cryo %s: warned %v, want %v:\n%s", strings.Join(tc.args, " "), got, tc.warn, stderr)
		}
	}
}
