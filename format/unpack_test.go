package format

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
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
