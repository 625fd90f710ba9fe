package format

// Tests that hold SPEC.md rules a second implementation found untested
// (issue 12, "SPEC.md, held to a second implementation"): each would fail
// if the code broke its rule.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/memory"
	"oras.land/oras-go/v2/errdef"
)

// pushDoc pushes the JSON of v to store (unless it has it) and returns its
// descriptor.
func pushDoc(t *testing.T, store content.Storage, mediaType string, v any) ocispec.Descriptor {
	t.Helper()
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	desc := content.NewDescriptorFromBytes(mediaType, data)
	if err := store.Push(context.Background(), desc, bytes.NewReader(data)); err != nil && !errors.Is(err, errdef.ErrAlreadyExists) {
		t.Fatal(err)
	}
	return desc
}

// rewriteManifest stores the manifest of part part of the file at path of
// snapshot desc, changed by edit, and an index that names it in place of
// the old one, and returns the new index's descriptor.
func rewriteManifest(t *testing.T, store content.Storage, desc ocispec.Descriptor, path string, part int, edit func(*ocispec.Manifest)) ocispec.Descriptor {
	t.Helper()
	ctx := context.Background()
	data, err := content.FetchAll(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(data, &idx); err != nil {
		t.Fatal(err)
	}
	n := 0
	for i, d := range idx.Manifests {
		if d.Annotations[AnnotationFilePath] != path {
			continue
		}
		if n++; n-1 != part {
			continue
		}
		mdata, err := content.FetchAll(ctx, store, d)
		if err != nil {
			t.Fatal(err)
		}
		var m ocispec.Manifest
		if err := json.Unmarshal(mdata, &m); err != nil {
			t.Fatal(err)
		}
		edit(&m)
		nd := pushDoc(t, store, ocispec.MediaTypeImageManifest, m)
		idx.Manifests[i].Digest, idx.Manifests[i].Size = nd.Digest, nd.Size
		return pushDoc(t, store, ocispec.MediaTypeImageIndex, idx)
	}
	t.Fatalf("no part %d of %s in the index", part, path)
	return ocispec.Descriptor{}
}

// loadPartOf loads the snapshot desc and part part of its file path.
func loadPartOf(t *testing.T, store content.Fetcher, desc ocispec.Descriptor, path string, part int) (*PartTable, error) {
	t.Helper()
	ctx := context.Background()
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	f := snap.File(path)
	if f == nil {
		t.Fatalf("no file %s", path)
	}
	return LoadPart(ctx, store, f, part)
}

func layerDigests(layers []ocispec.Descriptor) []digest.Digest {
	var out []digest.Digest
	for _, l := range layers {
		out = append(out, l.Digest)
	}
	return out
}

// TestLayerOrder holds SPEC.md section 3 (and 4, 15.2): writers list a
// part's layers in the order of first use by its chunks, each blob once;
// a v1 reader checks them as a set, a v2 reader in order. pages.img is
// the pages A B A C D in fixed 4 KiB chunks, each stored raw: in v1 a blob
// of its own, in v2 a pack of its own (PackSize 4096), so the layers are
// the sha256 of A, B, C, D, in that order, an order their digests do not
// sort in. Checked against these mutations: partLayers sorting its
// layers by digest (the writer's order fails); LoadPart's v2 order check
// removed (the reordered v2 manifest is accepted); LoadPart checking v1
// layers in order too (the reordered v1 manifest is refused).
func TestLayerOrder(t *testing.T) {
	pages := [][]byte{randBytes(101, 4096), randBytes(102, 4096), randBytes(103, 4096), randBytes(104, 4096)}
	a, b, c, d := pages[0], pages[1], pages[2], pages[3]
	data := bytes.Join([][]byte{a, b, a, c, d}, nil)
	var want []digest.Digest
	for _, p := range pages {
		want = append(want, digest.FromBytes(p))
	}
	if slices.IsSorted(want) {
		t.Fatal("the pages' digests sort in first-use order: pick other pages")
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, PagesFile), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		opts PackOptions
	}{
		{"v1", PackOptions{Chunking: chunker.FixedSize(4096)}},
		{"v2", PackOptions{Format: V2, Chunking: chunker.FixedSize(4096), PackSize: 4096}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := memory.New()
			desc, _, err := Pack(context.Background(), dir, store, tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			pt, err := loadPartOf(t, store, desc, PagesFile, 0)
			if err != nil {
				t.Fatal(err)
			}
			if got := layerDigests(pt.Manifest.Layers); !slices.Equal(got, want) {
				t.Fatalf("layers %v, want the blobs in order of first use %v", got, want)
			}
			if tc.opts.Format == V2 {
				if got := layerDigests(pt.Table.Packs); !slices.Equal(got, want) {
					t.Fatalf("table's packs %v, want %v", got, want)
				}
			}
			reversed := rewriteManifest(t, store, desc, PagesFile, 0, func(m *ocispec.Manifest) { slices.Reverse(m.Layers) })
			_, err = loadPartOf(t, store, reversed, PagesFile, 0)
			if tc.opts.Format == V2 {
				if !errors.Is(err, ErrInvalid) {
					t.Errorf("v2 manifest with its packs reversed: %v, want ErrInvalid", err)
				}
			} else if err != nil {
				t.Errorf("v1 manifest with its layers reversed (the same set): %v, want it read", err)
			}
			// Both check the set: a layer missing is refused.
			short := rewriteManifest(t, store, desc, PagesFile, 0, func(m *ocispec.Manifest) { m.Layers = m.Layers[1:] })
			if _, err := loadPartOf(t, store, short, PagesFile, 0); !errors.Is(err, ErrInvalid) {
				t.Errorf("manifest missing a layer: %v, want ErrInvalid", err)
			}
		})
	}
}

// TestPathsAreBytes holds SPEC.md section 3: paths are compared and sorted
// as bytes, never normalized, and a writer refuses a name that is not
// UTF-8. "é" as one code point (NFC) and as "e" + U+0301 (NFD) are two
// files, packed and unpacked apart; "a/b" sorts between "a.b" and "a0", as
// its bytes do (a sort by path element would put it first). Checked
// against these mutations: Finish sorting paths by element (strings
// replaced "/" by "\x00" before comparing: the index is out of order and
// LoadSnapshot refuses it); listFiles folding "e"+U+0301 into "é" (a file
// is lost); ValidatePath accepting non-UTF-8 (fs.ValidPath given the path
// made valid UTF-8, and the UTF-8 check removed: the name is packed).
func TestPathsAreBytes(t *testing.T) {
	const nfc, nfd = "\u00e9.img", "e\u0301.img"
	want := []string{"Z", "a.b", "a/b", "a0", nfd, nfc} // byte order
	for _, v := range []Version{V1, V2} {
		t.Run(v.String(), func(t *testing.T) {
			ctx := context.Background()
			src := t.TempDir()
			for i, p := range want {
				name := filepath.Join(src, filepath.FromSlash(p))
				if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(name, []byte(fmt.Sprintf("file %d: %q\n", i, p)), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			store := memory.New()
			desc, _, err := Pack(ctx, src, store, PackOptions{Format: v})
			if err != nil {
				t.Fatal(err)
			}
			snap, err := LoadSnapshot(ctx, store, desc)
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, f := range snap.Files {
				got = append(got, f.Path)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("index lists %+q, want %+q", got, want)
			}
			out := filepath.Join(t.TempDir(), "out")
			if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{}); err != nil {
				t.Fatal(err)
			}
			compareDirs(t, src, out)
			for _, p := range []string{nfc, nfd} {
				if _, err := os.Stat(filepath.Join(out, p)); err != nil {
					t.Errorf("%+q not unpacked as itself: %v", p, err)
				}
			}
		})
	}
	t.Run("non-UTF-8", func(t *testing.T) {
		src := t.TempDir()
		if err := os.WriteFile(filepath.Join(src, "bad\xff.img"), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
		if _, _, err := Pack(context.Background(), src, memory.New(), PackOptions{}); !errors.Is(err, ErrUnsupported) {
			t.Errorf("Pack of a dir holding a non-UTF-8 name: %v, want ErrUnsupported", err)
		}
		pk, err := NewPacker(memory.New(), PackOptions{Format: V2})
		if err != nil {
			t.Fatal(err)
		}
		defer pk.Close()
		if _, err := pk.AddFile(context.Background(), "sub/bad\xff.img", 0o644, strings.NewReader("x")); !errors.Is(err, ErrUnsupported) {
			t.Errorf("AddFile of a non-UTF-8 name: %v, want ErrUnsupported", err)
		}
		if err := ValidatePath("sub/bad\xff.img"); err == nil || !strings.Contains(err.Error(), "not UTF-8") {
			t.Errorf("ValidatePath of a non-UTF-8 name: %v, want an error saying it is not UTF-8", err)
		}
	})
}

// TestUnpackModes holds SPEC.md section 10: directories implied by the
// paths are created 0755 less the umask, files get their recorded mode
// whatever the umask. Under umask 027 the implied dirs are 0750 and files
// of modes 0666 and 0707 keep them (the umask would make them 0640 and
// 0700). The test sets the process's umask: no test of this package runs
// in parallel. Checked against these mutations: writeFile's parent dirs
// chmodded to 0755 after MkdirAll (the umask ignored); flushFile's Chmod
// applying the umask (0640 and 0700); the target dir itself chmodded to
// 0755 (its staging dir is made 0700 and chmodded at the end).
func TestUnpackModes(t *testing.T) {
	ctx := context.Background()
	files := map[string]fs.FileMode{"top.img": 0o666, "sub/dir/x.img": 0o707, "sub/y.img": 0o600}
	src := t.TempDir()
	for p, mode := range files {
		name := filepath.Join(src, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(name, []byte(p), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(name, mode); err != nil {
			t.Fatal(err)
		}
	}
	store := memory.New()
	desc, _, err := Pack(ctx, src, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	old := syscall.Umask(0o027)
	out := filepath.Join(t.TempDir(), "out")
	_, _, err = Unpack(ctx, store, desc, out, UnpackOptions{})
	syscall.Umask(old)
	if err != nil {
		t.Fatal(err)
	}
	for p, mode := range files {
		st, err := os.Stat(filepath.Join(out, filepath.FromSlash(p)))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != mode {
			t.Errorf("%s unpacked with mode %04o, recorded %04o", p, st.Mode().Perm(), mode)
		}
	}
	for _, d := range []string{".", "sub", "sub/dir"} {
		st, err := os.Stat(filepath.Join(out, filepath.FromSlash(d)))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o750 {
			t.Errorf("implied dir %s has mode %04o, want 0755 less the umask 027: 0750", d, st.Mode().Perm())
		}
	}
}

// readRange reads bytes [a, b) of f as SPEC.md section 5 says a random
// reader does, with format's calls alone: PartAt finds the part holding
// a, LoadPart loads that part's table only, Locate finds its chunks, on
// into the next part while chunks start before b. It returns the bytes
// and the number of tables it loaded.
func readRange(ctx context.Context, store content.Fetcher, f *File, a, b int64) ([]byte, int, error) {
	pi := f.PartAt(a)
	if pi < 0 {
		return nil, 0, fmt.Errorf("%s: no part holds byte %d", f.Path, a)
	}
	r, err := NewReader(store)
	if err != nil {
		return nil, 0, err
	}
	defer r.Close()
	var out []byte
	loaded := 0
	for ; pi < len(f.Parts) && f.Parts[pi].Offset < b; pi++ {
		pt, err := LoadPart(ctx, store, f, pi)
		if err != nil {
			return nil, loaded, err
		}
		loaded++
		first, last := pt.Table.Locate(a, b-a)
		for _, c := range pt.Table.Chunks[first:last] {
			data, err := r.Chunk(ctx, c, nil)
			if err != nil {
				return nil, loaded, err
			}
			out = append(out, data[max(a, c.Offset)-c.Offset:min(b, c.End())-c.Offset]...)
		}
	}
	return out, loaded, nil
}

// TestReadPastEOF holds SPEC.md sections 5 and 10 on format's random
// access: a read of [a, b) with b past the file's size reads up to the
// size, loading only the tables of the parts it touches, and no part
// holds a byte at or past the size (a range wholly outside the file finds
// nothing to read). The file is 4,101 chunks of 16 bytes and a 7-byte
// one, some zero, in two parts. Checked against these mutations: PartAt
// taking off == Size as inside the file, and PartAt without its upper
// bound (a read at or past the end finds a part).
func TestReadPastEOF(t *testing.T) {
	ctx := context.Background()
	data := randBytes(7, (MaxChunksPerPart+5)*16+7)
	clear(data[100*16 : 200*16])
	size := int64(len(data))
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, PagesFile), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, v := range []Version{V1, V2} {
		t.Run(v.String(), func(t *testing.T) {
			store := memory.New()
			desc, _, err := Pack(ctx, src, store, PackOptions{Format: v, Chunking: chunker.FixedSize(16)})
			if err != nil {
				t.Fatal(err)
			}
			snap, err := LoadSnapshot(ctx, store, desc)
			if err != nil {
				t.Fatal(err)
			}
			f := snap.File(PagesFile)
			if len(f.Parts) != 2 {
				t.Fatalf("%d parts, want 2", len(f.Parts))
			}
			for _, r := range []struct {
				a, b   int64
				tables int
			}{
				{0, size, 2},
				{size - 5, size + 100, 1},
				{size - 1, size + 1, 1},
				{f.Parts[1].Offset - 3, size + 4096, 2},
				{f.Parts[1].Offset, 1 << 40, 1},
				{3, size + 1, 2},
			} {
				got, tables, err := readRange(ctx, store, f, r.a, r.b)
				if err != nil {
					t.Errorf("[%d,%d): %v", r.a, r.b, err)
					continue
				}
				if !bytes.Equal(got, data[r.a:size]) {
					t.Errorf("[%d,%d) of %d bytes: read %d bytes, want the %d up to the size", r.a, r.b, size, len(got), size-r.a)
				}
				if tables != r.tables {
					t.Errorf("[%d,%d): loaded %d tables, want %d", r.a, r.b, tables, r.tables)
				}
			}
			for _, a := range []int64{size, size + 1, size + 1<<20} {
				if pi := f.PartAt(a); pi != -1 {
					t.Errorf("PartAt(%d) of a file of %d bytes = %d, want -1", a, size, pi)
				}
				if _, _, err := readRange(ctx, store, f, a, a+10); err == nil {
					t.Errorf("[%d,%d) wholly past the end of %d bytes: read", a, a+10, size)
				}
			}
			last, err := LoadPart(ctx, store, f, 1)
			if err != nil {
				t.Fatal(err)
			}
			if i, j := last.Table.Locate(size, 10); i != j {
				t.Errorf("Locate(%d, 10) past the end: chunks [%d,%d)", size, i, j)
			}
		})
	}
}

// recordingStore is a store that records the media types pushed to it.
type recordingStore struct {
	*memory.Store
	pushed map[string]int
}

func (s *recordingStore) Push(ctx context.Context, desc ocispec.Descriptor, r io.Reader) error {
	s.pushed[desc.MediaType]++
	return s.Store.Push(ctx, desc, r)
}

// TestIndexOverLimit holds SPEC.md section 9: a writer whose index would
// pass 4 MiB fails with ErrTooLarge, naming the media type and the size,
// before it pushes the index (so no tag: cryo pack tags only what Pack
// returned). 1,050 empty files with paths of 3,771 bytes (15 directories
// of 250 bytes) make an index of about 4.4 MB, under every other limit
// (fixed 4 KiB chunks and packs only keep the buffers per file small).
// Checked against these mutations: pushBytes's size check removed (Pack
// succeeds); the check moved after the push (an index is pushed).
func TestIndexOverLimit(t *testing.T) {
	src := t.TempDir()
	var deep []string
	for i := range 15 {
		deep = append(deep, strings.Repeat(string(rune('a'+i)), 250))
	}
	dir := filepath.Join(append([]string{src}, deep...)...)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	const files = 1050
	for i := range files {
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%04d", i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	msg := regexp.MustCompile(`push snapshot index: ` + regexp.QuoteMeta(ocispec.MediaTypeImageIndex) + ` of (\d+) bytes: over size limit \(limit 4194304\)`)
	for _, v := range []Version{V1, V2} {
		t.Run(v.String(), func(t *testing.T) {
			store := &recordingStore{Store: memory.New(), pushed: map[string]int{}}
			_, _, err := Pack(context.Background(), src, store, PackOptions{Format: v, Chunking: chunker.FixedSize(4096), PackSize: 4096})
			if !errors.Is(err, ErrTooLarge) {
				t.Fatalf("Pack: %v, want ErrTooLarge", err)
			}
			m := msg.FindStringSubmatch(err.Error())
			if m == nil {
				t.Fatalf("error %q does not name the index's media type, size and limit", err)
			}
			if n, _ := strconv.Atoi(m[1]); n <= MaxManifestSize {
				t.Errorf("index of %d bytes refused", n)
			}
			if n := store.pushed[ocispec.MediaTypeImageIndex]; n != 0 {
				t.Errorf("%d indexes pushed", n)
			}
			if n := store.pushed[ocispec.MediaTypeImageManifest]; n != files {
				t.Errorf("%d part manifests pushed, want %d", n, files)
			}
		})
	}
}
