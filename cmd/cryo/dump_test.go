package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// mainArgsEnv, when set, makes the test binary run the cryo command line
// it holds (a JSON array) and print "dumpable=N", the process's
// PR_GET_DUMPABLE after the command.
const mainArgsEnv = "CRYO_TEST_MAIN_ARGS"

func TestMain(m *testing.M) {
	if js := os.Getenv(mainArgsEnv); js != "" {
		var args []string
		if err := json.Unmarshal([]byte(js), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		root := newRootCmd()
		root.SetArgs(args)
		err := root.Execute()
		d, perr := unix.PrctlRetInt(unix.PR_GET_DUMPABLE, 0, 0, 0, 0)
		if perr != nil {
			fmt.Fprintln(os.Stderr, perr)
			os.Exit(2)
		}
		fmt.Printf("dumpable=%d\n", d)
		fmt.Fprintln(os.Stderr, "command:", err)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestPullerCommandsAreNotDumpable runs each command that holds snapshot
// memory (mount, restore, puller serve) in a test binary process, up to an
// early error, and checks that it made the process non-dumpable (no core
// dump, no ptrace or /proc/PID/mem by other users); a command that holds
// none (inspect) leaves it dumpable.
func TestPullerCommandsAreNotDumpable(t *testing.T) {
	cache := t.TempDir()
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"mount", "--cache", cache, "bad::ref", filepath.Join(t.TempDir(), "m")}, "dumpable=0"},
		{[]string{"restore", "--cache", cache, "--runsc", "/nonexistent", "bad::ref", "id"}, "dumpable=0"},
		{[]string{"puller", "serve", "--cache", cache, "--socket", "/dev/null/puller.sock"}, "dumpable=0"},
		{[]string{"inspect", "bad::ref"}, "dumpable=1"},
	}
	for _, tc := range cases {
		js, _ := json.Marshal(tc.args)
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), mainArgsEnv+"="+string(js))
		var stderr strings.Builder
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("cryo %v: %v\n%s", tc.args, err, stderr.String())
		}
		if got := strings.TrimSpace(string(out)); got != tc.want {
			t.Errorf("cryo %s: %s, want %s (%s)", strings.Join(tc.args, " "), got, tc.want, strings.TrimSpace(stderr.String()))
		}
	}
}
