package format

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"oras.land/oras-go/v2/content/memory"
)

var updateVector = flag.Bool("update-vector", false, "rewrite testdata/vector.json from the current implementation")

// writeVectorDir writes the test vector image dir of SPEC.md ("Test vector").
func writeVectorDir(t *testing.T, dir string) {
	t.Helper()
	md := `{"_timestamp":"2026-11-30 00:00:00 +0000 UTC","container_count":"1","runsc_version":"vector"}`
	ckpt := append([]byte("gVisorSF"), 0, 0, 0, 0, 0, 0, 0, byte(len(md)))
	ckpt = append(append(ckpt, md...), "state"...)
	pages := make([]byte, 640*4096)
	for k := 0; 128*4096+32*k < len(pages); k++ {
		sum := sha256.Sum256([]byte(strconv.Itoa(k)))
		copy(pages[128*4096+32*k:], sum[:])
	}
	for name, data := range map[string][]byte{
		"checkpoint.img": ckpt,
		"pages_meta.img": []byte("cryo test vector"),
		"pages.img":      pages,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
		os.Chmod(filepath.Join(dir, name), 0o644) // umask-proof
	}
}

// vector is what testdata/vector.json records: the index digest and, per
// file, the chunk tables.
type vector struct {
	Index  string             `json:"index"`
	Tables map[string][]Chunk `json:"tables"`
}

// TestVector packs the SPEC.md test vector and compares the index digest and
// every chunk table with testdata/vector.json, which SPEC.md quotes.
func TestVector(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	writeVectorDir(t, dir)
	store := memory.New()
	desc, _, err := Pack(ctx, dir, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	got := vector{Index: desc.Digest.String(), Tables: map[string][]Chunk{}}
	for i := range snap.Files {
		pt, err := LoadPart(ctx, store, &snap.Files[i], 0)
		if err != nil {
			t.Fatal(err)
		}
		got.Tables[snap.Files[i].Path] = pt.Table.Chunks
		for _, c := range pt.Table.Chunks {
			if c.Encoding == EncodingZstd {
				t.Fatalf("the vector must not depend on zstd's output, but %s has a zstd chunk", snap.Files[i].Path)
			}
		}
	}
	path := filepath.Join("testdata", "vector.json")
	if *updateVector {
		data, _ := json.MarshalIndent(got, "", "  ")
		if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var want vector
	if err := json.Unmarshal(data, &want); err != nil {
		t.Fatal(err)
	}
	for name, chunks := range want.Tables {
		g := got.Tables[name]
		if len(g) != len(chunks) {
			t.Errorf("%s: %d chunks, want %d", name, len(g), len(chunks))
			continue
		}
		for i := range chunks {
			if g[i] != chunks[i] {
				t.Errorf("%s chunk %d: %+v, want %+v", name, i, g[i], chunks[i])
			}
		}
	}
	if got.Index != want.Index {
		t.Errorf("index digest %s, want %s", got.Index, want.Index)
	}
}
