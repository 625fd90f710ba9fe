package puller

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
)

// The file API finds in-place answers by a type assertion: a Place whose
// signature drifted from gofer.Placer would turn them off unseen.
var _ gofer.Placer = (*Mount)(nil)

// TestMountPlacesVerifiedRanges: a gofer mount says where pages.img lies
// in place once its chunks are in and its sandbox has faulted (before,
// the restore's loader reads through the file API): in the node store's
// assembly of the
// snapshot while it loads (the file holds the source's bytes), in the
// materialized dir once it is committed, for the mount and for a later
// mount of the snapshot; never for a small
// file served from memory; and a range answered in place counts as read
// (a page fault's is in the working set recorded).
func TestMountPlacesVerifiedRanges(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 8<<20, 7)
	want, err := os.ReadFile(filepath.Join(src, format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	size := int64(len(want))
	ctx := context.Background()
	p := newPuller(t, Options{})
	hold := make(chan struct{})
	m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{MaterializeAfter: hold, AwaitSandbox: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	if _, ok := m.Place(ctx, "checkpoint.img", 0, 100, fetch.Fault); ok {
		t.Error("checkpoint.img, held in memory, answered in place")
	}
	if _, ok := m.Place(ctx, "no such file", 0, 100, fetch.Fault); ok {
		t.Error("a file the snapshot lacks answered in place")
	}
	if _, ok := m.Place(ctx, format.PagesFile, size-10, 20, fetch.Fault); ok {
		t.Error("a range past pages.img's end answered in place")
	}
	// Before the sandbox's first page fault nothing is answered in place,
	// even once every chunk is stored.
	settle(t, p.cache, snapshotChunksOf(t, s, format.PagesFile))
	if _, ok := m.Place(ctx, format.PagesFile, 0, 4096, fetch.Read); ok {
		t.Error("a range answered in place before the sandbox's first page fault")
	}
	if err := m.ReadAt(ctx, format.PagesFile, make([]byte, 4096), 1<<20, fetch.Fault); err != nil {
		t.Fatal(err)
	}
	// Wait for the background load to write every chunk in place.
	var in cache.InPlace
	for deadline := time.Now().Add(time.Minute); ; {
		var ok bool
		if in, ok = m.Place(ctx, format.PagesFile, 0, size, fetch.Read); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("pages.img never in place")
		}
		time.Sleep(10 * time.Millisecond)
	}
	got, err := os.ReadFile(in.Path)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the file in place (%s) is not pages.img: %v", in.Path, err)
	}
	if !strings.HasPrefix(in.Path, p.opts.CacheDir+string(filepath.Separator)) {
		t.Errorf("in place at %s, outside the node store %s", in.Path, p.opts.CacheDir)
	}
	const faultAt, faultLen = 3 << 20, 64 << 10
	if _, ok := m.Place(ctx, format.PagesFile, faultAt, faultLen, fetch.Fault); !ok {
		t.Fatal("a range of a file in place answered not in place")
	}
	if !recorded(m, faultAt, faultLen) {
		t.Errorf("a page fault answered in place is not in the working set: %+v", m.Profile().Ranges)
	}
	close(hold)
	waitLoaded(t, m)
	img, ok := p.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("not materialized")
	}
	matPages := filepath.Join(img, format.PagesFile)
	// The assembly is committed: the mount's sandbox (a daemon's) may
	// still be loading, from the materialized dir now.
	if in, ok := m.Place(ctx, format.PagesFile, 4096, 8192, fetch.Read); !ok || in.Path != matPages {
		t.Errorf("the mount, once its snapshot is materialized: in place %v at %s, want %s", ok, in.Path, matPages)
	}

	m2, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt2"), FilesOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Unmount() })
	in2, ok := m2.Place(ctx, format.PagesFile, 4096, 8192, fetch.Read)
	if !ok || in2.Path != matPages {
		t.Fatalf("a mount of the materialized snapshot: in place %v at %s, want %s", ok, in2.Path, matPages)
	}
	if got, err := os.ReadFile(in2.Path); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("the materialized pages.img differs: %v", err)
	}
	// The dir's file replaced (as a commit replaces a dir found damaged):
	// the answer names the new file, not the inode it replaced.
	tmp := matPages + ".new"
	if err := os.WriteFile(tmp, want, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, matPages); err != nil {
		t.Fatal(err)
	}
	if in3, ok := m2.Place(ctx, format.PagesFile, 4096, 8192, fetch.Read); !ok || in3.Ino == in2.Ino {
		t.Errorf("after the materialized file was replaced: in place %v, inode %d, the old one was %d", ok, in3.Ino, in2.Ino)
	}
}

// recorded reports whether m's working set holds pages.img's [off, off+n).
func recorded(m *Mount, off, n int64) bool {
	for _, r := range m.Profile().Ranges {
		if r.Path == format.PagesFile && r.Offset <= off && off+n <= r.Offset+r.Length {
			return true
		}
	}
	return false
}
