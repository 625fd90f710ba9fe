package format

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/cryo-oci/cryo/format/chunker"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
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

// packVector packs the test vector with the defaults into a memory store.
func packVector(t *testing.T) (*memory.Store, ocispec.Descriptor, *Snapshot) {
	t.Helper()
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
	return store, desc, snap
}

// TestVector packs the SPEC.md test vector and compares the index digest and
// every chunk table with testdata/vector.json, which SPEC.md quotes.
func TestVector(t *testing.T) {
	ctx := context.Background()
	store, desc, snap := packVector(t)
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

// TestJSONAsWritten holds, byte for byte, the JSON cryo writes for the test
// vector (SPEC.md section 8): its index, and pages.img's part manifest and
// chunk table, in testdata/vector-*.json. A second writer that reproduces
// these reproduces the member order, escaping and number forms.
func TestJSONAsWritten(t *testing.T) {
	ctx := context.Background()
	store, desc, snap := packVector(t)
	pt, err := LoadPart(ctx, store, snap.File(PagesFile), 0)
	if err != nil {
		t.Fatal(err)
	}
	for name, d := range map[string]ocispec.Descriptor{
		"vector-index.json":          desc,
		"vector-pages-manifest.json": snap.File(PagesFile).Parts[0].Manifest,
		"vector-pages-table.json":    pt.Manifest.Config,
	} {
		got, err := content.FetchAll(ctx, store, d)
		if err != nil {
			t.Fatal(err)
		}
		checkGolden(t, name, got)
	}
}

// TestJSONAsWrittenV2 holds, byte for byte, the JSON cryo writes for the
// test vector in format v2 with its defaults (SPEC.md sections 8, 11 and
// 15): the index, pages.img's part manifest and the JSON of its chunk
// table, in testdata/vector-v2-*.json. No chunk compresses, so the table's
// JSON and the packs do not depend on the zstd encoder; the table is
// stored as a zstd frame of that JSON, whose digest the manifest names,
// so the manifest's and the index's bytes do.
func TestJSONAsWrittenV2(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	writeVectorDir(t, dir)
	store := memory.New()
	desc, _, err := Pack(ctx, dir, store, PackOptions{Format: V2})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	for i := range snap.Files {
		for p := range snap.Files[i].Parts {
			pt, err := LoadPart(ctx, store, &snap.Files[i], p)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range pt.Table.Chunks {
				if c.Encoding == EncodingZstd {
					t.Fatalf("the vector must not depend on zstd's output, but %s has a zstd chunk", snap.Files[i].Path)
				}
			}
		}
	}
	pages := snap.File(PagesFile)
	pt, err := LoadPart(ctx, store, pages, 0)
	if err != nil {
		t.Fatal(err)
	}
	if pt.Manifest.Config.MediaType != MediaTypeChunkTableV2Zstd {
		t.Fatalf("table stored as %q", pt.Manifest.Config.MediaType)
	}
	stored, err := content.FetchAll(ctx, store, pt.Manifest.Config)
	if err != nil {
		t.Fatal(err)
	}
	table, err := DecodeTableBlob(pt.Manifest.Config.MediaType, stored)
	if err != nil {
		t.Fatal(err)
	}
	index, err := content.FetchAll(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	manifest, err := content.FetchAll(ctx, store, pages.Parts[0].Manifest)
	if err != nil {
		t.Fatal(err)
	}
	for name, got := range map[string][]byte{
		"vector-v2-index.json":          index,
		"vector-v2-pages-manifest.json": manifest,
		"vector-v2-pages-table.json":    table,
	} {
		checkGolden(t, name, got)
	}
}

// writeVector2Dir writes test vector 2 (SPEC.md section 11): vector 1's
// files plus an empty file and, in a subdirectory, a file of 4,097 pages
// (every odd page incompressible, every even page zero) that, cut into
// fixed 4 KiB chunks, takes two parts, the second all zero.
func writeVector2Dir(t *testing.T, dir string) {
	t.Helper()
	writeVectorDir(t, dir)
	if err := os.WriteFile(filepath.Join(dir, "empty.img"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(dir, "empty.img"), 0o644)
	many := make([]byte, 4097*4096)
	for i := 1; i < 4097; i += 2 {
		for j := range 128 {
			sum := sha256.Sum256([]byte(strconv.Itoa(i*1000 + j)))
			copy(many[i*4096+32*j:], sum[:])
		}
	}
	if err := os.MkdirAll(filepath.Join(dir, "sub", "dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "sub", "dir", "many.img")
	if err := os.WriteFile(p, many, 0o600); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, 0o600)
}

// TestVector2 packs test vector 2 with fixed 4 KiB chunks and compares the
// digests of its index and of every part's manifest and table with
// testdata/vector2.json, which SPEC.md quotes: a multi-part file, an empty
// file, a subdirectory and a part whose only layer is the empty descriptor.
func TestVector2(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	writeVector2Dir(t, dir)
	store := memory.New()
	opts := PackOptions{Chunking: chunker.FixedSize(4096)}
	desc, _, err := Pack(ctx, dir, store, opts)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	type part struct {
		Manifest string `json:"manifest"`
		Table    string `json:"table"`
	}
	got := struct {
		Index string            `json:"index"`
		Parts map[string][]part `json:"parts"`
	}{Index: desc.Digest.String(), Parts: map[string][]part{}}
	for i := range snap.Files {
		f := &snap.Files[i]
		for p := range f.Parts {
			pt, err := LoadPart(ctx, store, f, p)
			if err != nil {
				t.Fatal(err)
			}
			got.Parts[f.Path] = append(got.Parts[f.Path], part{Manifest: f.Parts[p].Manifest.Digest.String(), Table: pt.Manifest.Config.Digest.String()})
		}
	}
	if n := len(snap.File("sub/dir/many.img").Parts); n != 2 {
		t.Fatalf("sub/dir/many.img in %d parts, want 2", n)
	}
	last, err := LoadPart(ctx, store, snap.File("sub/dir/many.img"), 1)
	if err != nil {
		t.Fatal(err)
	}
	if l := last.Manifest.Layers; len(l) != 1 || l[0].Digest != ocispec.DescriptorEmptyJSON.Digest {
		t.Fatalf("the all-zero part's layers: %v, want the empty descriptor", l)
	}
	empty, err := LoadPart(ctx, store, snap.File("empty.img"), 0)
	if err != nil || empty.Table.Length != 0 || len(empty.Table.Chunks) != 0 {
		t.Fatalf("empty.img: %v, %+v", err, empty)
	}
	data, _ := json.MarshalIndent(got, "", "  ")
	path := filepath.Join("testdata", "vector2.json")
	if *updateVector {
		if err := os.WriteFile(path, append(data, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(append(data, '\n'), want) {
		t.Errorf("vector 2 packs to\n%s\nwant\n%s", data, want)
	}
}

// checkGolden compares got with testdata/name byte for byte (with
// -update-vector, writes it there first).
func checkGolden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *updateVector {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s: cryo writes\n%s\nwant\n%s", name, got, want)
	}
}

// vectorV2PlainIndex is the index digest of test vector 1 packed in
// format v2 with plain tables (SPEC.md section 11): it depends on no
// compressor.
const vectorV2PlainIndex = "sha256:bd4fbb76ce1c2c788ce1dc5ff509d2f41d97d195d0c56f988a37b6960f90432e"

// TestVectorV2PlainTables packs test vector 1 in format v2 with plain
// tables: pages.img's manifest names its table by the digest of the
// table's JSON that SPEC.md gives, and the index digest is the one SPEC.md
// gives, which no zstd encoder can change.
func TestVectorV2PlainTables(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	writeVectorDir(t, dir)
	store := memory.New()
	desc, _, err := Pack(ctx, dir, store, PackOptions{Format: V2, PlainTables: true})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := LoadSnapshot(ctx, store, desc)
	if err != nil {
		t.Fatal(err)
	}
	pt, err := LoadPart(ctx, store, snap.File(PagesFile), 0)
	if err != nil {
		t.Fatal(err)
	}
	const tableJSON = "sha256:5c7c1b2c75f587208f6186b4c4fbbcf19b1065302f3919ccc6723a1807ef959b"
	if c := pt.Manifest.Config; c.MediaType != MediaTypeChunkTableV2 || c.Digest != tableJSON {
		t.Errorf("pages.img's table stored as %s %s, want %s %s", c.MediaType, c.Digest, MediaTypeChunkTableV2, tableJSON)
	}
	if desc.Digest != vectorV2PlainIndex {
		t.Errorf("index digest %s, want %s", desc.Digest, vectorV2PlainIndex)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{}); err != nil {
		t.Fatalf("unpack: %v", err)
	}
	for _, name := range []string{CheckpointFile, PagesMetaFile, PagesFile} {
		want, _ := os.ReadFile(filepath.Join(dir, name))
		got, err := os.ReadFile(filepath.Join(out, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s unpacked differs (%v)", name, err)
		}
	}
}
