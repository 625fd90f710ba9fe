package atomicfile

import (
	"bytes"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestWriteSurvivesCrash writes a file with Write and cuts the power right
// after it returns: the file is there, whole, after the filesystem comes
// back. (Without the flushes, ext4 holds the data and the link in memory
// for seconds, and the crash loses both.)
func TestWriteSurvivesCrash(t *testing.T) {
	mnt, crash := testenv.CrashableFS(t, 64<<20)
	dir := filepath.Join(mnt, "chunks")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	unix.Sync() // the setup is not under test
	data := make([]byte, 1<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	target := filepath.Join(dir, "chunk")
	if err := Write(dir, target, data, 0o400); err != nil {
		t.Fatal(err)
	}
	crash()
	got, err := os.ReadFile(target)
	if err != nil {
		t.Fatalf("after a crash right after Write returned: %v", err)
	}
	if !bytes.Equal(got, data) {
		t.Fatalf("after a crash right after Write returned: %d bytes, not the %d written", len(got), len(data))
	}
}

// TestWriteExisting: a target that appears meanwhile (the same content,
// written by another writer) is success, and no temporary file is left.
func TestWriteExisting(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "x")
	for range 2 {
		if err := Write(dir, target, []byte("same"), 0o400); err != nil {
			t.Fatal(err)
		}
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 1 {
		t.Fatalf("dir holds %d entries, want 1", len(ents))
	}
	fi, err := os.Stat(target)
	if err != nil || fi.Mode().Perm() != 0o400 {
		t.Fatalf("target: %v %v", fi.Mode(), err)
	}
	if err := Write(filepath.Join(dir, "missing"), filepath.Join(dir, "missing", "y"), nil, 0o400); err == nil {
		t.Fatal("Write into a missing dir succeeded")
	}
}

// TestReplace: Replace puts new bytes and mode in place of an existing
// file and leaves no temporary file behind.
func TestReplace(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := Replace(path, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(path)
	fi, _ := os.Stat(path)
	if string(data) != "new" || fi.Mode().Perm() != 0o600 {
		t.Errorf("after Replace: %q, %v; want \"new\", 0600", data, fi.Mode().Perm())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Errorf("dir holds %d entries, want the file alone", len(ents))
	}
}
