package format

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cryo-oci/cryo/internal/testenv"
)

// TestUnpackRefusesUnsafePartial plants, before an unpack, a partial dir
// (PartialDir of the target) that the unpack did not create and that would
// let someone else read or steer what it writes, and checks that Unpack
// refuses to reuse it, writes nothing through it and leaves no target.
func TestUnpackRefusesUnsafePartial(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{})
	const nobody = 65534
	cases := map[string]struct {
		root  bool // needs root (chown)
		plant func(t *testing.T, partial, elsewhere string)
	}{
		"partial dir is a symlink": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Symlink(elsewhere, partial))
		}},
		"partial dir writable by others": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.Chmod(partial, 0o777))
		}},
		"partial dir writable by group": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.Chmod(partial, 0o770))
		}},
		"symlinked dir inside": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.Symlink(elsewhere, filepath.Join(partial, "fs")))
		}},
		"symlinked file inside": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.WriteFile(filepath.Join(elsewhere, "pages.img"), nil, 0o600))
			must(t, os.Symlink(filepath.Join(elsewhere, "pages.img"), filepath.Join(partial, "pages.img")))
		}},
		"writable dir inside": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.MkdirAll(filepath.Join(partial, "fs"), 0o700))
			must(t, os.Chmod(filepath.Join(partial, "fs"), 0o777))
		}},
		"fifo inside": {plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			mkfifo(t, filepath.Join(partial, "pages.img"))
		}},
		"partial dir of another user": {root: true, plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.Chown(partial, nobody, nobody))
		}},
		"file of another user inside": {root: true, plant: func(t *testing.T, partial, elsewhere string) {
			must(t, os.Mkdir(partial, 0o700))
			must(t, os.WriteFile(filepath.Join(partial, "pages.img"), []byte("x"), 0o666))
			must(t, os.Chown(filepath.Join(partial, "pages.img"), nobody, nobody))
		}},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			if tc.root && os.Getuid() != 0 {
				testenv.SkipOrFatal(t, "chown to another user needs root")
			}
			out := filepath.Join(t.TempDir(), "out")
			elsewhere := t.TempDir()
			tc.plant(t, PartialDir(out), elsewhere)
			_, _, err := Unpack(ctx, store, desc, out, UnpackOptions{})
			if !errors.Is(err, ErrUnsafePartial) {
				t.Fatalf("got %v, want ErrUnsafePartial", err)
			}
			t.Log(err)
			if _, err := os.Lstat(out); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("a refused unpack left %s: %v", out, err)
			}
			filepath.WalkDir(elsewhere, func(p string, d fs.DirEntry, err error) error {
				if info, _ := d.Info(); err == nil && info.Mode().IsRegular() && info.Size() > 0 {
					t.Errorf("the unpack wrote %s outside its partial dir", p)
				}
				return err
			})
		})
	}
}

// TestUnpackResumesFromOwnPartial checks that a partial dir this user left
// (mode 0700, its own files and dirs) is still reused.
func TestUnpackResumesFromOwnPartial(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{})
	out := filepath.Join(t.TempDir(), "out")
	partial := PartialDir(out)
	must(t, os.MkdirAll(filepath.Join(partial, "fs", "sub"), 0o755))
	data, err := os.ReadFile(filepath.Join(src, "pages.img"))
	must(t, err)
	must(t, os.WriteFile(filepath.Join(partial, "pages.img"), data, 0o600))
	_, st, err := Unpack(ctx, store, desc, out, UnpackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	if st.ChunksReused == 0 {
		t.Fatalf("reused no chunk of the partial dir: %+v", st)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// lyingSource hands back, for the chunk at offset lieAt, other bytes of the
// same length as if they were verified: a source with a bug.
type lyingSource struct {
	ChunkSource
	lieAt int64
}

func (s lyingSource) Chunk(ctx context.Context, c Chunk, buf []byte) ([]byte, error) {
	data, err := s.ChunkSource.Chunk(ctx, c, buf)
	if err != nil || c.Offset != s.lieAt {
		return data, err
	}
	out := append([]byte(nil), data...)
	out[len(out)/2] ^= 0xff
	return out, nil
}

// loadForUnpack packs the test image dir and returns what UnpackFrom takes.
func loadForUnpack(t *testing.T) (src string, snap *Snapshot, chunks [][]Chunk, r *Reader) {
	t.Helper()
	ctx := context.Background()
	src = makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{})
	snap, err := LoadSnapshot(ctx, store, desc)
	must(t, err)
	chunks, err = LoadChunks(ctx, store, snap)
	must(t, err)
	r, err = NewReader(store)
	must(t, err)
	t.Cleanup(r.Close)
	return src, snap, chunks, r
}

// TestUnpackFromChecksWholeFiles gives UnpackFrom a chunk source that
// returns one wrong chunk as verified: the whole-file sha256 catches it,
// nothing is committed (the commit hook is never called) and no target
// appears.
func TestUnpackFromChecksWholeFiles(t *testing.T) {
	_, snap, chunks, r := loadForUnpack(t)
	var lieAt int64 = -1
	for i, f := range snap.Files {
		for _, c := range chunks[i] {
			if f.Path == PagesFile && c.Encoding != EncodingZero && lieAt < 0 {
				lieAt = c.Offset
			}
		}
	}
	out := filepath.Join(t.TempDir(), "out")
	committed := false
	_, err := UnpackFrom(context.Background(), snap, chunks, lyingSource{r, lieAt}, out, UnpackOptions{
		Commit: func(string) error { committed = true; return nil },
	})
	if !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("got %v, want ErrDigestMismatch", err)
	}
	t.Log(err)
	if committed {
		t.Error("a file that failed its sha256 was committed")
	}
	if _, err := os.Lstat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a failed unpack left %s: %v", out, err)
	}
}

// TestUnpackFromPrivateStaging writes with the options the puller's node
// cache uses: its own staging dir (holding a file of no snapshot, as an
// interrupted write of another one would leave), private modes and its own
// commit. The commit hook gets the staging dir holding exactly the
// snapshot's files, 0600 in dirs of 0700 whatever the snapshot's modes,
// with zero chunks left as holes; the committed dir has the right bytes.
func TestUnpackFromPrivateStaging(t *testing.T) {
	src, snap, chunks, r := loadForUnpack(t)
	staging := filepath.Join(t.TempDir(), "staging")
	must(t, os.Mkdir(staging, 0o700))
	must(t, os.WriteFile(filepath.Join(staging, "stale.img"), []byte("x"), 0o600))
	out := filepath.Join(t.TempDir(), "out")
	commit := func(staging string) error {
		files := 0
		err := filepath.WalkDir(staging, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			info, err := d.Info()
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(staging, p)
			switch {
			case d.IsDir() && info.Mode().Perm() != 0o700:
				t.Errorf("dir %s has mode %v, want 0700", rel, info.Mode().Perm())
			case !d.IsDir() && info.Mode().Perm() != 0o600:
				t.Errorf("file %s has mode %v, want 0600", rel, info.Mode().Perm())
			case !d.IsDir() && snap.File(filepath.ToSlash(rel)) == nil:
				t.Errorf("staging dir holds %s, no file of the snapshot", rel)
			case !d.IsDir():
				files++
			}
			return nil
		})
		if files != len(snap.Files) {
			t.Errorf("staging dir holds %d files, snapshot has %d", files, len(snap.Files))
		}
		if err != nil {
			return err
		}
		return os.Rename(staging, out)
	}
	st, err := UnpackFrom(context.Background(), snap, chunks, r, out, UnpackOptions{Private: true, Staging: staging, Commit: commit})
	must(t, err)
	if st.Files != len(snap.Files) || st.ChunksFetched == 0 {
		t.Errorf("stats %+v", st)
	}
	for _, f := range snap.Files {
		got, err := os.ReadFile(filepath.Join(out, filepath.FromSlash(f.Path)))
		must(t, err)
		want, _ := os.ReadFile(filepath.Join(src, filepath.FromSlash(f.Path)))
		if !bytes.Equal(got, want) {
			t.Errorf("%s differs", f.Path)
		}
	}
	// pages.img starts with 1 MiB of zeros and holds 512 KiB more.
	info, err := os.Stat(filepath.Join(out, PagesFile))
	must(t, err)
	if used := info.Sys().(*syscall.Stat_t).Blocks * 512; used > info.Size()-(1<<20) {
		t.Errorf("pages.img uses %d bytes of disk for %d bytes with 1.5 MiB of zeros: zero chunks were written, not left as holes", used, info.Size())
	}
}
