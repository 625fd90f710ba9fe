package format

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/oci"
)

// loadTables loads every chunk table of the snapshot desc in store.
func loadTables(t *testing.T, store content.Fetcher, desc ocispec.Descriptor) (*Snapshot, []*PartTable) {
	t.Helper()
	ctx := context.Background()
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	var pts []*PartTable
	for i := range snap.Files {
		f := &snap.Files[i]
		for part := range f.Parts {
			pt, err := LoadPart(ctx, store, f, part)
			if err != nil {
				t.Fatal(err)
			}
			pts = append(pts, pt)
		}
	}
	return snap, pts
}

func TestV2PackUnpackRoundTrip(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, st := packToLayout(t, src, PackOptions{Format: V2})
	if st.Chunks[EncodingZero] == 0 || st.Chunks[EncodingRaw] == 0 || st.Chunks[EncodingZstd] == 0 {
		t.Errorf("want all three encodings, got %v", st.Chunks)
	}
	snap, pts := loadTables(t, store, desc)
	if snap.Version != V2 {
		t.Fatalf("version %v", snap.Version)
	}
	packs := map[digest.Digest]bool{}
	for _, pt := range pts {
		for _, c := range pt.Table.Chunks {
			if c.Encoding == EncodingZero {
				continue
			}
			if !c.Packed() || c.Size > 256<<10 {
				t.Fatalf("chunk %+v: want a packed chunk of at most 256 KiB", c)
			}
			packs[c.Blob] = true
		}
	}
	// About 5.7 MiB of non-zero pages, stored in 4 MiB packs: 2 or 3 packs
	// for pages.img, one for each small file.
	if len(packs) < 3 || len(packs) > 8 || st.BlobsUploaded != len(packs) {
		t.Errorf("%d packs, %d uploaded", len(packs), st.BlobsUploaded)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{Concurrency: 4}); err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	if _, vs, err := Verify(ctx, store, desc, 2); err != nil || vs.Files != 5 {
		t.Fatalf("verify: %v %+v", err, vs)
	}
	// Packing again gives the same index: packs are deterministic.
	_, desc2, _ := packToLayout(t, src, PackOptions{Format: V2, Concurrency: 1})
	if desc2.Digest != desc.Digest {
		t.Errorf("packed twice: %s, then %s", desc.Digest, desc2.Digest)
	}
}

// TestV2ReusesFramesOfABase packs a second snapshot that differs from the
// first in a few pages against the first's tables: only the changed
// chunks are stored anew, the rest are frames of the first's packs.
func TestV2ReusesFramesOfABase(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, err := oci.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	d1, st1, err := Pack(ctx, src, store, PackOptions{Format: V2})
	if err != nil {
		t.Fatal(err)
	}
	// Rewrite 8 pages in the middle of the random run, insert 3 pages.
	pages := filepath.Join(src, "pages.img")
	data, err := os.ReadFile(pages)
	if err != nil {
		t.Fatal(err)
	}
	copy(data[2<<20:], randBytes(9, 8*4096))
	data = append(data[:3<<20], append(randBytes(10, 3*4096), data[3<<20:]...)...)
	if err := os.WriteFile(pages, data, 0o640); err != nil {
		t.Fatal(err)
	}
	_, pts := loadTables(t, store, d1)
	var tables []*Table
	for _, pt := range pts {
		tables = append(tables, pt.Table)
	}
	d2, st2, err := Pack(ctx, src, store, PackOptions{Format: V2, Resolver: NewTableResolver(tables)})
	if err != nil {
		t.Fatal(err)
	}
	if st2.UploadedBytes*10 > st1.UploadedBytes || st2.ReusedBytes*10 < st1.StoredBytes*8 {
		t.Errorf("second push uploaded %d bytes and reused %d, first stored %d", st2.UploadedBytes, st2.ReusedBytes, st1.StoredBytes)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(ctx, store, d2, out, UnpackOptions{}); err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	// The manifests list the first snapshot's packs they use as layers.
	_, pts2 := loadTables(t, store, d2)
	old := map[digest.Digest]bool{}
	for _, pt := range pts {
		for _, l := range pt.Manifest.Layers {
			old[l.Digest] = true
		}
	}
	shared := 0
	for _, pt := range pts2 {
		for _, l := range pt.Manifest.Layers {
			if old[l.Digest] {
				shared++
			}
		}
	}
	if shared == 0 {
		t.Error("the second snapshot's manifests list none of the first's packs")
	}
}

// TestParseTableV2RefusesLyingTables checks the rules of SPEC.md 15.4 on
// tables that break one each.
func TestParseTableV2RefusesLyingTables(t *testing.T) {
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{Format: V2})
	_, pts := loadTables(t, store, desc)
	var good []byte
	for _, pt := range pts {
		if pt.Table.Path == PagesFile {
			var err error
			if good, err = pt.Table.Marshal(); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := ParseTableV2(good); err != nil {
		t.Fatalf("good table: %v", err)
	}
	edit := func(f func(m map[string]any)) []byte {
		var m map[string]any
		if err := json.Unmarshal(good, &m); err != nil {
			t.Fatal(err)
		}
		f(m)
		b, _ := json.Marshal(m)
		return b
	}
	firstData := func(m map[string]any) map[string]any {
		for _, c := range m["chunks"].([]any) {
			if c := c.(map[string]any); c["encoding"] != "zero" {
				return c
			}
		}
		t.Fatal("no data chunk")
		return nil
	}
	cases := map[string][]byte{
		"frame past its pack": edit(func(m map[string]any) {
			c := firstData(m)
			p := m["packs"].([]any)[int(c["pack"].(float64))].(map[string]any)
			c["packOffset"] = p["size"].(float64) - c["packLength"].(float64) + 1
		}),
		"pack index out of range": edit(func(m map[string]any) { firstData(m)["pack"] = 99 }),
		"missing packLength":      edit(func(m map[string]any) { delete(firstData(m), "packLength") }),
		"raw frame of another length": edit(func(m map[string]any) {
			for _, c := range m["chunks"].([]any) {
				if c := c.(map[string]any); c["encoding"] == "raw" {
					c["packLength"] = c["packLength"].(float64) - 1
					return
				}
			}
		}),
		"zero chunk with a pack": edit(func(m map[string]any) {
			for _, c := range m["chunks"].([]any) {
				if c := c.(map[string]any); c["encoding"] == "zero" {
					c["pack"] = 0
					return
				}
			}
		}),
		"unused pack": edit(func(m map[string]any) {
			m["packs"] = append(m["packs"].([]any), map[string]any{"digest": digest.FromString("x").String(), "size": 10})
		}),
		"pack over the limit": edit(func(m map[string]any) {
			m["packs"].([]any)[0].(map[string]any)["size"] = MaxPackSize + 1
		}),
		"chunks short of the part": edit(func(m map[string]any) {
			cs := m["chunks"].([]any)
			m["chunks"] = cs[:len(cs)-1]
		}),
		"key in another case": bytes.Replace(good, []byte(`"packOffset"`), []byte(`"PackOffset"`), 1),
		"key twice":           bytes.Replace(good, []byte(`{"path":`), []byte(`{"path":"x","path":`), 1),
	}
	for name, data := range cases {
		if bytes.Equal(data, good) {
			t.Fatalf("%s: edit changed nothing", name)
		}
		_, err := ParseTableV2(data)
		if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrTooLarge) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		} else if !strings.Contains(err.Error(), "chunk table") {
			t.Errorf("%s: error %q does not say what it is about", name, err)
		}
	}
}
