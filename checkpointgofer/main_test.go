package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/runsc/version"
)

func TestCheckRelease(t *testing.T) {
	self := version.Version()
	for _, tc := range []struct {
		env string
		ok  bool
	}{
		{self, true},
		{"SKIP:" + self, true},
		{"TESTONLY_SKIP:" + self, true},
		// runsc's default policy passes SKIP:<its label>: a mismatch under
		// it must be refused too, not logged.
		{"SKIP:release-20990101.0", false},
		{"release-20990101.0", false},
		{"SKIP", false},
		{"", false},
	} {
		err := checkRelease(tc.env)
		if (err == nil) != tc.ok {
			t.Errorf("GVISOR_ENFORCE_RELEASE=%q: error %v, want ok=%v", tc.env, err, tc.ok)
		}
		if err != nil && strings.HasPrefix(tc.env, "release-") && !strings.Contains(err.Error(), tc.env) {
			t.Errorf("GVISOR_ENFORCE_RELEASE=%q: error %q does not name runsc's release", tc.env, err)
		}
	}
}

func TestParseArgs(t *testing.T) {
	f, err := parseArgs(strings.Fields("--root=/run/runsc --log-fd=7 --platform=systrap checkpointgofer -sock-fd=3 -gcs-opts-fd=4 -allow-checkpoint-reads"))
	if err != nil {
		t.Fatal(err)
	}
	if f.sockFD != 3 || f.optsFD != 4 || !f.checkpointReads || f.checkpointWrites || f.logFD != 7 {
		t.Errorf("parsed %+v", f)
	}
	for _, bad := range []string{"--root=/x", "checkpointgofer -sock-fd=3", "checkpointgofer -sock-fd=3 -gcs-opts-fd=4 -bogus"} {
		if _, err := parseArgs(strings.Fields(bad)); err == nil {
			t.Errorf("args %q: no error", bad)
		}
	}
}

// TestBinaryRefusesOtherRelease builds the gofer as make gofer does, with a
// release label, and starts it as runsc would, but with
// GVISOR_ENFORCE_RELEASE=SKIP:<another release> (runsc's default policy):
// it must exit non-zero without serving, naming both releases in the log
// file its config names.
func TestBinaryRefusesOtherRelease(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "checkpointgofer")
	build := exec.Command("go", "build", "-ldflags", "-X gvisor.dev/gvisor/runsc/version.version=release-20260101.0", "-o", bin, ".")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	if out, err := exec.Command(bin, "--version").Output(); err != nil || !strings.Contains(string(out), "gVisor release release-20260101.0") {
		t.Fatalf("--version: %q, %v", out, err)
	}
	dir := t.TempDir()
	logFile := filepath.Join(dir, "gofer.log")
	cfgPath := filepath.Join(dir, gofer.ConfigFile)
	cfg := `{"mediaType":"` + gofer.MediaType + `","reference":"r/app:v1","index":"sha256:` + strings.Repeat("a", 64) + `","socket":"/nonexistent.sock","mount":"m","log":"` + logFile + `"}`
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	cfgFile, err := os.Open(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	defer cfgFile.Close()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	sock := os.NewFile(uintptr(fds[1]), "sock")
	defer sock.Close()
	defer unix.Close(fds[0])
	cmd := exec.Command(bin, strings.Fields("--root=/run/runsc checkpointgofer -sock-fd=3 -gcs-opts-fd=4 -allow-checkpoint-reads")...)
	cmd.Args[0] = "runsc-checkpointgofer"
	cmd.ExtraFiles = []*os.File{sock, cfgFile}
	cmd.Env = append(os.Environ(), "GVISOR_ENFORCE_RELEASE=SKIP:release-20990101.0")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err == nil {
		t.Fatal("the gofer served a runsc of another release")
	}
	logged, _ := os.ReadFile(logFile)
	for _, rel := range []string{"release-20990101.0", "release-20260101.0"} {
		if !strings.Contains(string(logged), rel) {
			t.Errorf("the gofer's log does not name release %s:\n%s\nstderr: %s", rel, logged, stderr.String())
		}
	}
}

// multiFiles is a snapshot of named files of the given sizes, each all
// zeros.
type multiFiles map[string]int64

func (m multiFiles) FileSize(path string) (int64, bool) {
	n, ok := m[path]
	return n, ok
}

func (m multiFiles) ReadAt(_ context.Context, _ string, p []byte, _ int64, _ fetch.Priority) error {
	clear(p)
	return nil
}

// TestImageModes: runsc's one -allow flag picks the files the gofer
// serves or takes. A filesystem restore reads fscheckpoint.pb,
// multitar.img and the pages files, and a snapshot without them (a
// checkpoint's) is refused before serving, naming what is missing; a
// restore may not open a filesystem checkpoint's files, nor the other
// way round.
func TestImageModes(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		args string
		mode imageMode
	}{
		{"-allow-checkpoint-reads", restoreMode},
		{"-allow-checkpoint-writes", checkpointMode},
		{"-allow-fscheckpoint-reads", fsRestoreMode},
		{"-allow-fscheckpoint-writes", fsCheckpointMode},
	} {
		f, err := parseArgs(strings.Fields("checkpointgofer -sock-fd=3 -gcs-opts-fd=4 " + tc.args))
		if err != nil {
			t.Fatal(err)
		}
		if m, err := f.image(); err != nil || m != tc.mode {
			t.Errorf("%s: mode %v, %v; want %v", tc.args, m, err, tc.mode)
		}
	}
	for _, bad := range []string{"", "-allow-checkpoint-reads -allow-fscheckpoint-reads"} {
		f, err := parseArgs(strings.Fields("checkpointgofer -sock-fd=3 -gcs-opts-fd=4 " + bad))
		if err != nil {
			t.Fatal(err)
		}
		if m, err := f.image(); err == nil {
			t.Errorf("flags %q: mode %v, want an error", bad, m)
		}
	}

	ckpt := multiFiles{"checkpoint.img": 4096, "pages_meta.img": 100, "pages.img": 8192}
	fsckpt := multiFiles{"fscheckpoint.pb": 94, "multitar.img": 3072, "pages_meta.img": 88, "pages.img": 4096}
	if _, err := statFiles(ctx, gofer.Local(ckpt), fsRestoreMode); err == nil || !strings.Contains(err.Error(), "no fscheckpoint.pb") {
		t.Errorf("a filesystem restore of a checkpoint's snapshot: %v, want an error naming fscheckpoint.pb", err)
	}
	if _, err := statFiles(ctx, gofer.Local(fsckpt), restoreMode); err == nil || !strings.Contains(err.Error(), "no checkpoint.img") {
		t.Errorf("a restore of a filesystem checkpoint's snapshot: %v, want an error naming checkpoint.img", err)
	}
	noTar := multiFiles{"fscheckpoint.pb": 94, "pages_meta.img": 88, "pages.img": 4096}
	if _, err := statFiles(ctx, gofer.Local(noTar), fsRestoreMode); err == nil || !strings.Contains(err.Error(), "multitar.img") {
		t.Errorf("a filesystem restore without multitar.img: %v, want an error naming it", err)
	}
	sizes, err := statFiles(ctx, gofer.Local(fsckpt), fsRestoreMode)
	if err != nil {
		t.Fatal(err)
	}
	s := &server{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil)), src: gofer.Local(fsckpt),
		allowReads: true, image: fsRestoreMode, sizes: sizes, bufs: newBufPool()}
	for _, path := range []string{"fscheckpoint.pb", "multitar.img", "pages_meta.img", "pages.img"} {
		r, err := s.OpenRead(path)
		if err != nil {
			t.Errorf("filesystem restore: open %s: %v", path, err)
			continue
		}
		r.Close()
	}
	if _, err := s.OpenRead("checkpoint.img"); err == nil {
		t.Error("a filesystem restore opened checkpoint.img")
	}
	s.image = restoreMode
	if _, err := s.OpenRead("multitar.img"); err == nil {
		t.Error("a restore opened multitar.img")
	}
	for _, tc := range []struct {
		cfg   gofer.Config
		image imageMode
		ok    bool
	}{
		{gofer.Config{}, restoreMode, true},
		{gofer.Config{}, fsRestoreMode, true},
		{gofer.Config{Checkpoint: true}, checkpointMode, true},
		{gofer.Config{Checkpoint: true, Filesystem: true}, fsCheckpointMode, true},
		{gofer.Config{Checkpoint: true}, fsCheckpointMode, false},
		{gofer.Config{Checkpoint: true, Filesystem: true}, checkpointMode, false},
		{gofer.Config{Checkpoint: true}, restoreMode, false},
		{gofer.Config{}, checkpointMode, false},
	} {
		if err := checkMode(tc.cfg, tc.image); (err == nil) != tc.ok {
			t.Errorf("config checkpoint=%v filesystem=%v for a %s: %v", tc.cfg.Checkpoint, tc.cfg.Filesystem, tc.image, err)
		}
	}
	w := &server{ctx: ctx, log: s.log, image: checkpointMode, uploads: gofer.NewClient(filepath.Join(t.TempDir(), "none.sock"), "m", "", 0)}
	if _, err := w.OpenWrite("fscheckpoint.pb"); err == nil || !strings.Contains(err.Error(), "no file of a checkpoint image") {
		t.Errorf("a checkpoint opened fscheckpoint.pb for writing: %v", err)
	}
}
