package main

import (
	"bytes"
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/sirupsen/logrus"
	"github.com/spf13/cobra"
)

// authRegistry is an in-process cryo registry behind a testenv.AuthGate:
// it demands basic credentials (once Require is called) and records the
// Authorization headers it receives.
type authRegistry struct {
	*testenv.AuthGate
	host string
}

func startAuthRegistry(t *testing.T) *authRegistry {
	t.Helper()
	logrus.SetLevel(logrus.ErrorLevel)
	cfg, err := registry.DefaultConfig(t.TempDir(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := registry.New(context.Background(), cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	gate := testenv.NewAuthGate(srv.Handler())
	hs := httptest.NewServer(gate)
	t.Cleanup(func() { hs.Close(); srv.Close() })
	return &authRegistry{AuthGate: gate, host: strings.TrimPrefix(hs.URL, "http://")}
}

// runCryo runs the cryo command line in-process with stdin and returns
// stdout, stderr and the error.
func runCryo(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetIn(strings.NewReader(stdin))
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.ExecuteContext(context.Background())
	return out.String(), errOut.String(), err
}

const cliPasswordWarning = "WARNING! Using --password via the CLI is insecure."

// TestPasswordFlags: -p works and warns; --password-stdin and
// --password-file work without a warning; two ways at once are refused.
// No output holds the password.
func TestPasswordFlags(t *testing.T) {
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	reg := startAuthRegistry(t)
	reg.Require("alice", "s3cret")
	img := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(img, synth.Text, 1<<20, 1); err != nil {
		t.Fatal(err)
	}
	ref := reg.host + "/app:v1"
	pwFile := filepath.Join(t.TempDir(), "pw")
	os.WriteFile(pwFile, []byte("s3cret\n"), 0o600)

	if _, stderr, err := runCryo(t, "", "push", img, ref); err == nil {
		t.Fatalf("push without credentials succeeded: %s", stderr)
	}
	stdout, stderr, err := runCryo(t, "", "push", "-u", "alice", "-p", "s3cret", img, ref)
	if err != nil {
		t.Fatalf("push -u -p: %v\n%s", err, stderr)
	}
	if !strings.Contains(stderr, cliPasswordWarning+" Use --password-stdin.") {
		t.Errorf("push -p printed no warning:\n%s", stderr)
	}
	if strings.Contains(stdout+stderr, "s3cret") {
		t.Errorf("output holds the password:\n%s\n%s", stdout, stderr)
	}
	_, stderr, err = runCryo(t, "s3cret\n", "pull", "-u", "alice", "--password-stdin", ref, filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatalf("pull --password-stdin: %v\n%s", err, stderr)
	}
	if strings.Contains(stderr, "WARNING") {
		t.Errorf("--password-stdin warned:\n%s", stderr)
	}
	_, stderr, err = runCryo(t, "", "inspect", "-u", "alice", "--password-file", pwFile, ref)
	if err != nil {
		t.Fatalf("inspect --password-file: %v\n%s", err, stderr)
	}
	if _, _, err := runCryo(t, "s3cret\n", "verify", "-u", "alice", "-p", "s3cret", "--password-stdin", ref); err == nil || !strings.Contains(err.Error(), "one way") {
		t.Errorf("-p with --password-stdin: %v, want refused", err)
	}
	_, stderr, _ = runCryo(t, "", "login", reg.host, "-u", "alice", "-p", "wrong")
	if !strings.Contains(stderr, cliPasswordWarning) {
		t.Errorf("login -p printed no warning:\n%s", stderr)
	}
	if strings.Contains(stderr, "wrong") {
		t.Errorf("login's output holds the password:\n%s", stderr)
	}
}

// TestPasswordFlagsOffered: every command that takes -p takes
// --password-file, and --password-stdin except cryo restore, whose stdin
// is the container's; cryo puller serve takes no credentials at all.
func TestPasswordFlagsOffered(t *testing.T) {
	var walk func(c *cobra.Command)
	seen := 0
	walk = func(c *cobra.Command) {
		for _, sub := range c.Commands() {
			walk(sub)
		}
		fl := c.Flags()
		path := c.CommandPath()
		switch path {
		case "cryo puller serve":
			for _, name := range []string{"username", "password", "password-stdin", "password-file"} {
				if fl.Lookup(name) != nil {
					t.Errorf("%s takes --%s", path, name)
				}
			}
			return
		case "cryo restore":
			if fl.Lookup("password-stdin") != nil {
				t.Errorf("%s takes --password-stdin, but its stdin is the container's", path)
			}
			if fl.Lookup("password-file") == nil {
				t.Errorf("%s lacks --password-file", path)
			}
		}
		if fl.Lookup("password") == nil {
			return
		}
		seen++
		if fl.Lookup("password-file") == nil {
			t.Errorf("%s takes -p but not --password-file", path)
		}
		if path != "cryo restore" && fl.Lookup("password-stdin") == nil {
			t.Errorf("%s takes -p but not --password-stdin", path)
		}
	}
	walk(newRootCmd())
	if seen < 8 {
		t.Errorf("only %d commands take -p", seen)
	}
}

// TestRestorePasswordWarningNamesFile: cryo restore's -p warning points to
// --password-file, the way it offers.
func TestRestorePasswordWarningNamesFile(t *testing.T) {
	_, stderr, _ := runCryo(t, "", "restore", "--cache", t.TempDir(), "--runsc", "/nonexistent", "-u", "a", "-p", "b", "bad::ref", "id")
	if !strings.Contains(stderr, cliPasswordWarning+" Use --password-file.") {
		t.Errorf("restore -p: warning does not name --password-file:\n%s", stderr)
	}
}

// TestPullerFlagsTagAtPrimary: the resolver every puller command uses
// (mount, restore, puller serve) asks the reference's registry what a tag
// means, not a mirror that holds another snapshot under it, and sends -u/-p
// credentials to that registry only.
func TestPullerFlagsTagAtPrimary(t *testing.T) {
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	primary, mirror := startAuthRegistry(t), startAuthRegistry(t)
	push := func(ref string, seed uint64) string {
		img := filepath.Join(t.TempDir(), "img")
		if err := synth.ImageDir(img, synth.Text, 1<<20, seed); err != nil {
			t.Fatal(err)
		}
		repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
		if err != nil {
			t.Fatal(err)
		}
		res, err := transfer.Push(context.Background(), img, repo, tag, transfer.PushOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return res.Descriptor.Digest.String()
	}
	want := push(primary.host+"/app:v1", 1)
	other := push(mirror.host+"/app:v1", 2)
	flags := func(args ...string) *pullerFlags {
		var pf pullerFlags
		cmd := &cobra.Command{Use: "test"}
		pf.register(cmd, withCredentials)
		if err := cmd.Flags().Parse(args); err != nil {
			t.Fatal(err)
		}
		return &pf
	}
	ctx := context.Background()

	// The mirror would answer the tag with its own snapshot.
	src, err := flags("--mirror", mirror.host).source(ctx, primary.host+"/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	if got := src.Index.Digest.String(); got != want {
		t.Fatalf("resolved %s, want the primary's %s (the mirror's tag says %s)", got, want, other)
	}

	// Both registries want credentials; the mirror's are not in the store.
	primary.Require("alice", "s3cret")
	mirror.Require("bob", "other")
	src, err = flags("--mirror", mirror.host, "-u", "alice", "--password-file", writeFile(t, "s3cret")).source(ctx, primary.host+"/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	// Read the index through the endpoints: the mirror is asked first.
	before := mirror.Requests()
	if _, err := format.LoadSnapshot(ctx, puller.Failover(src.Endpoints), src.Index); err != nil {
		t.Fatal(err)
	}
	if mirror.Requests() == before {
		t.Fatal("the mirror was never asked: the test tested nothing")
	}
	for _, h := range mirror.Seen() {
		if h == testenv.BasicAuth("alice", "s3cret") {
			t.Fatal("the mirror received the primary's credentials")
		}
	}
}

func writeFile(t *testing.T, s string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}
