package format

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/cryo-oci/cryo/format/statefile"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/memory"
	"oras.land/oras-go/v2/content/oci"
)

// fakeCheckpoint returns a checkpoint.img with a gVisor state file header.
func fakeCheckpoint(md map[string]string, body string) []byte {
	js, _ := json.Marshal(md)
	var b bytes.Buffer
	b.WriteString("gVisorSF")
	binary.Write(&b, binary.BigEndian, uint64(len(js)))
	b.Write(js)
	b.WriteString(body)
	return b.Bytes()
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 7))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// textLike returns n bytes of words that zstd compresses about 2x-4x.
func textLike(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 9))
	words := []string{"sandbox", "restore", "page", "memory", "gvisor", "chunk", "zstd", "registry", "node", "cache", "the", "a", "of"}
	var b bytes.Buffer
	for b.Len() < n {
		b.WriteString(words[r.IntN(len(words))])
		b.WriteByte(" \n"[r.IntN(2)])
		fmt.Fprintf(&b, "%d ", r.IntN(100000))
	}
	return b.Bytes()[:n]
}

// makeImageDir writes a small checkpoint-like image dir and returns it.
func makeImageDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	pages := bytes.Join([][]byte{
		make([]byte, 1<<20), // zero pages
		randBytes(1, 3<<20), // incompressible
		textLike(2, 2<<20),  // compressible
		make([]byte, 512<<10),
		randBytes(3, 100<<10+17), // unaligned tail
	}, nil)
	files := map[string][]byte{
		"checkpoint.img": fakeCheckpoint(map[string]string{"runsc_version": "release-20260905.0", "_timestamp": "2026-11-30 05:12:34.123456789 +0000 UTC", "container_count": "1"}, "state"),
		"pages_meta.img": []byte("meta"),
		"pages.img":      pages,
		"fs/empty":       nil,
		"fs/sub/x.img":   textLike(4, 5000),
	}
	for name, data := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func packToLayout(t *testing.T, dir string, opts PackOptions) (*oci.Store, ocispec.Descriptor, *PackStats) {
	t.Helper()
	store, err := oci.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	desc, st, err := Pack(context.Background(), dir, store, opts)
	if err != nil {
		t.Fatal(err)
	}
	return store, desc, st
}

// compareDirs fails unless b holds exactly a's regular files, bytes and modes.
func compareDirs(t *testing.T, a, b string) {
	t.Helper()
	list := func(root string) map[string]string {
		out := map[string]string{}
		filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				t.Fatal(err)
			}
			if d.Type().IsRegular() {
				data, err := os.ReadFile(p)
				if err != nil {
					t.Fatal(err)
				}
				info, _ := d.Info()
				rel, _ := filepath.Rel(root, p)
				out[rel] = fmt.Sprintf("%x %v", sha256.Sum256(data), info.Mode().Perm())
			}
			return nil
		})
		return out
	}
	la, lb := list(a), list(b)
	if len(la) != len(lb) {
		t.Fatalf("%d files in source, %d unpacked", len(la), len(lb))
	}
	for k, v := range la {
		if lb[k] != v {
			t.Errorf("%s: source %s, unpacked %q", k, v, lb[k])
		}
	}
}

func TestPackUnpackRoundTrip(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, st := packToLayout(t, src, PackOptions{})
	if st.Chunks[EncodingZero] == 0 || st.Chunks[EncodingRaw] == 0 || st.Chunks[EncodingZstd] == 0 {
		t.Errorf("want all three encodings, got %v", st.Chunks)
	}
	if st.StoredBytes >= st.LogicalBytes {
		t.Errorf("stored %d bytes for %d logical", st.StoredBytes, st.LogicalBytes)
	}
	out := filepath.Join(t.TempDir(), "out")
	snap, _, err := Unpack(ctx, store, desc, out, UnpackOptions{Concurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	if snap.RunscVersion() != "release-20260905.0" {
		t.Errorf("runsc version %q", snap.RunscVersion())
	}
	if snap.Created() != "2026-11-30T05:12:34.123456789Z" {
		t.Errorf("created %q, want the checkpoint's timestamp", snap.Created())
	}
	if _, vs, err := Verify(ctx, store, desc, 2); err != nil || vs.Files != 5 {
		t.Fatalf("verify: %v %+v", err, vs)
	}
	// Unpacking into a non-empty dir is refused and leaves it alone.
	if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{}); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("unpack over a non-empty dir: %v", err)
	}
}

func TestPackIsDeterministic(t *testing.T) {
	src := makeImageDir(t)
	_, d1, _ := packToLayout(t, src, PackOptions{})
	_, d2, _ := packToLayout(t, src, PackOptions{Concurrency: 1})
	if d1.Digest != d2.Digest {
		t.Fatalf("two packs of one dir: %s and %s", d1.Digest, d2.Digest)
	}
	created := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	store, d3, _ := packToLayout(t, src, PackOptions{Created: created})
	if d3.Digest == d1.Digest {
		t.Fatal("creation time did not change the index")
	}
	snap, err := LoadSnapshot(context.Background(), store, d3)
	if err != nil || snap.Created() != "2026-01-02T03:04:05Z" {
		t.Fatalf("created %q, %v", snap.Created(), err)
	}
}

func TestPackSkipsBlobsTheStoreHas(t *testing.T) {
	src := makeImageDir(t)
	store := memory.New()
	ctx := context.Background()
	_, st1, err := Pack(ctx, src, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_, st2, err := Pack(ctx, src, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if st1.BlobsUploaded == 0 || st2.BlobsUploaded != 0 || st2.UploadedBytes != 0 || st2.BlobsSkipped != st1.BlobsUploaded {
		t.Fatalf("first pack %+v, second %+v", st1, st2)
	}
}

func TestSplitsLargeFilesIntoParts(t *testing.T) {
	dir := t.TempDir()
	// 4096+100 chunks of 4 KiB: two parts.
	data := randBytes(5, (MaxChunksPerPart+100)*4096)
	os.WriteFile(filepath.Join(dir, "pages.img"), data, 0o644)
	store, desc, _ := packToLayout(t, dir, PackOptions{Chunking: chunker.FixedSize(4096)})
	snap, err := LoadSnapshot(context.Background(), store, desc)
	if err != nil {
		t.Fatal(err)
	}
	f := snap.File("pages.img")
	if f == nil || len(f.Parts) != 2 || f.Parts[1].Offset != MaxChunksPerPart*4096 {
		t.Fatalf("parts: %+v", f)
	}
	// Random access: byte ranges map to the right part and chunks.
	for _, off := range []int64{0, 4095, 4096, MaxChunksPerPart*4096 - 1, MaxChunksPerPart * 4096, int64(len(data)) - 1} {
		pi := f.PartAt(off)
		pt, err := LoadPart(context.Background(), store, f, pi)
		if err != nil {
			t.Fatal(err)
		}
		i, j := pt.Table.Locate(off, 1)
		if j-i != 1 || pt.Table.Chunks[i].Offset > off || pt.Table.Chunks[i].End() <= off {
			t.Fatalf("offset %d: part %d chunks [%d,%d)", off, pi, i, j)
		}
	}
	if f.PartAt(int64(len(data))) != -1 || f.PartAt(-1) != -1 {
		t.Fatal("PartAt outside the file")
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(context.Background(), store, desc, out, UnpackOptions{Concurrency: 2}); err != nil {
		t.Fatal(err)
	}
	compareDirs(t, dir, out)
}

func TestLocate(t *testing.T) {
	tab := &Table{Chunks: []Chunk{{Offset: 0, Size: 10}, {Offset: 10, Size: 5}, {Offset: 15, Size: 20}}}
	cases := []struct {
		off, n      int64
		first, last int
	}{
		{0, 1, 0, 1}, {9, 2, 0, 2}, {10, 5, 1, 2}, {14, 100, 1, 3}, {35, 1, 3, 3}, {0, 35, 0, 3}, {12, 0, 1, 1},
	}
	for _, c := range cases {
		i, j := tab.Locate(c.off, c.n)
		if i != c.first || j != c.last {
			t.Errorf("Locate(%d,%d) = [%d,%d), want [%d,%d)", c.off, c.n, i, j, c.first, c.last)
		}
	}
}

func TestPackRefusesBadDirs(t *testing.T) {
	ctx := context.Background()
	cases := map[string]struct {
		mk   func(dir string) string
		want error
	}{
		"missing":   {func(dir string) string { return filepath.Join(dir, "nope") }, fs.ErrNotExist},
		"not a dir": {func(dir string) string { p := filepath.Join(dir, "f"); os.WriteFile(p, nil, 0o644); return p }, syscall.ENOTDIR},
		"empty":     {func(dir string) string { return dir }, ErrInvalid},
		"symlink": {func(dir string) string {
			os.WriteFile(filepath.Join(dir, "a"), nil, 0o644)
			os.Symlink("/etc/passwd", filepath.Join(dir, "b"))
			return dir
		}, ErrUnsupported},
		"fifo":      {func(dir string) string { mkfifo(t, filepath.Join(dir, "p")); return dir }, ErrUnsupported},
		"backslash": {func(dir string) string { os.WriteFile(filepath.Join(dir, `a\b`), nil, 0o644); return dir }, ErrUnsupported},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			dir := tc.mk(t.TempDir())
			store := memory.New()
			_, _, err := Pack(ctx, dir, store, PackOptions{})
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			t.Log(err)
		})
	}
}

func TestDecodeRefusesBadBlobs(t *testing.T) {
	codec, err := NewCodec(1)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	text := textLike(1, 1<<20)
	c, blob := codec.Encode(text, nil)
	if c.Encoding != EncodingZstd {
		t.Fatalf("text-like chunk stored as %s", c.Encoding)
	}
	if out, err := codec.Decode(c, blob, nil); err != nil || !bytes.Equal(out, text) {
		t.Fatalf("decode: %v", err)
	}
	rnd := randBytes(1, 1<<20)
	rc, rblob := codec.Encode(rnd, nil)
	if rc.Encoding != EncodingRaw || !bytes.Equal(rblob, rnd) {
		t.Fatalf("random chunk stored as %s", rc.Encoding)
	}
	// A bomb: 16 MiB+ of zeros compresses to a few hundred bytes.
	bombData := make([]byte, MaxChunkSize+4096)
	bombData[0] = 1
	bomb := codec.enc.EncodeAll(bombData, nil)
	corrupt := bytes.Clone(blob)
	corrupt[len(corrupt)/2] ^= 0xff
	wrongSize := c
	wrongSize.Size = c.Size - 1
	cases := map[string]struct {
		c    Chunk
		blob []byte
		want error
	}{
		"bomb":            {Chunk{Size: 4096, Encoding: EncodingZstd, Digest: c.Digest, Blob: c.Blob, BlobSize: int64(len(bomb))}, bomb, ErrTooLarge},
		"corrupt zstd":    {c, corrupt, ErrDigestMismatch},
		"truncated zstd":  {Chunk{Size: c.Size, Encoding: EncodingZstd, Digest: c.Digest, BlobSize: c.BlobSize - 10}, blob[:len(blob)-10], ErrDigestMismatch},
		"short raw":       {rc, rblob[:100], ErrDigestMismatch},
		"flipped raw":     {rc, append([]byte{rblob[0] ^ 1}, rblob[1:]...), ErrDigestMismatch},
		"wrong size":      {wrongSize, blob, ErrTooLarge},
		"unknown":         {Chunk{Size: 1, Encoding: "lz4"}, []byte{1}, ErrInvalid},
		"zero over limit": {Chunk{Size: MaxChunkSize + 1, Encoding: EncodingZero}, nil, ErrTooLarge},
		// Sizes no table validation let through, handed to Decode directly:
		// an error, never a panic or output of another length.
		"zero negative size": {Chunk{Size: -1, Encoding: EncodingZero}, nil, ErrInvalid},
		"zstd size 0":        {Chunk{Size: 0, Encoding: EncodingZstd, Digest: c.Digest, Blob: c.Blob, BlobSize: c.BlobSize}, blob, ErrInvalid},
		"raw over limit":     {Chunk{Size: MaxChunkSize + 1, Encoding: EncodingRaw, Digest: rc.Digest, Blob: rc.Blob, BlobSize: MaxChunkSize + 1}, rblob, ErrTooLarge},
		"zstd size too big":  {Chunk{Size: c.Size + 1, Encoding: EncodingZstd, Digest: c.Digest, Blob: c.Blob, BlobSize: c.BlobSize}, blob, ErrDigestMismatch},
		"two frames":         {Chunk{Size: c.Size, Encoding: EncodingZstd, Digest: c.Digest, Blob: c.Blob, BlobSize: 2 * c.BlobSize}, append(bytes.Clone(blob), blob...), ErrTooLarge},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			out, err := codec.Decode(tc.c, tc.blob, nil)
			if !errors.Is(err, tc.want) || out != nil {
				t.Fatalf("got %d bytes, %v; want %v", len(out), err, tc.want)
			}
		})
	}
}

// TestDecodeStopsAtChunkSize checks that a zstd blob that expands beyond
// its chunk's size is refused after decompressing about that many bytes,
// not the 16 MiB every decode is capped at, whether or not its frame
// header declares the content size: a table naming many small chunks in
// such blobs must not make every decode allocate 16 MiB.
func TestDecodeStopsAtChunkSize(t *testing.T) {
	codec, err := NewCodec(1)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	bombData := make([]byte, 12<<20) // under the 16 MiB cap
	bombData[0] = 1
	withSize := codec.enc.EncodeAll(bombData, nil)
	var stream bytes.Buffer
	zw, err := zstd.NewWriter(&stream, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	zw.Write(bombData)
	zw.Close()
	if h := (zstd.Header{}); h.Decode(stream.Bytes()) != nil || h.HasFCS {
		t.Fatalf("streamed frame declares its content size (%v)", h.Decode(stream.Bytes()))
	}
	// A frame that declares its size is refused for it; without a declared
	// size the decoder stops when the buffer is full and reports that as a
	// corrupt block.
	want := map[string]error{"frame with content size": ErrTooLarge, "frame without content size": ErrDigestMismatch}
	for name, blob := range map[string][]byte{"frame with content size": withSize, "frame without content size": stream.Bytes()} {
		t.Run(name, func(t *testing.T) {
			ch := Chunk{Size: 4096, Encoding: EncodingZstd, Digest: digest.FromBytes(bombData[:4096]), Blob: digest.FromBytes(blob), BlobSize: int64(len(blob))}
			// Warm the decoder up, then measure one decode's allocations.
			codec.Decode(ch, blob, nil)
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			out, err := codec.Decode(ch, blob, nil)
			runtime.ReadMemStats(&after)
			if !errors.Is(err, want[name]) || out != nil {
				t.Fatalf("got %d bytes, %v; want %v", len(out), err, want[name])
			}
			// One zstd block (128 KiB) past the chunk may be decoded before
			// the decoder stops.
			if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
				t.Fatalf("decoding a bomb for a 4 KiB chunk allocated %d bytes", alloc)
			}
		})
	}
}

// TestDecodeKeepsBuffer checks that a decoded chunk comes back in the
// caller's buffer with its capacity, so buffers are reused across chunks.
func TestDecodeKeepsBuffer(t *testing.T) {
	codec, err := NewCodec(1)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	text := textLike(3, 64<<10)
	c, blob := codec.Encode(text, nil)
	buf := make([]byte, 0, 1<<20)
	out, err := codec.Decode(c, blob, buf)
	if err != nil || !bytes.Equal(out, text) {
		t.Fatalf("decode: %v", err)
	}
	if cap(out) != cap(buf) || &out[0] != &buf[:1][0] {
		t.Fatalf("decoded into a new buffer of cap %d, not the caller's of cap %d", cap(out), cap(buf))
	}
}

// TestParseIndexRefusesFileThatIsADir checks that no path of a snapshot may
// be a file and also a directory of another path, wherever sorting puts the
// two ("a-x" sorts between "a" and "a/b").
func TestParseIndexRefusesFileThatIsADir(t *testing.T) {
	for _, paths := range [][]string{
		{"a", "a/b"},
		{"a", "a-x", "a/b"},
		{"a", "a b", "a.img", "a/b/c"},
		{"fs", "fs-1/x", "fs.d", "fs/sub/deep/file"},
		{"x/a", "x/a-x", "x/a/b"},
	} {
		t.Run(strings.Join(paths, ","), func(t *testing.T) {
			data := indexOf(paths)
			_, err := ParseIndex(ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromBytes(data), Size: int64(len(data))}, data)
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "is a file and also a directory") {
				t.Fatalf("got %v, want ErrInvalid for a file that is a directory", err)
			}
		})
	}
	data := indexOf([]string{"a", "a-x", "a.d/b", "ab/c"})
	if _, err := ParseIndex(ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromBytes(data), Size: int64(len(data))}, data); err != nil {
		t.Fatalf("paths that only share a prefix: %v", err)
	}
}

// TestParseIndexRefusesNonCanonicalAnnotations: numbers in annotations are
// plain decimal (no sign, no leading zero), modes 4 octal digits, keys
// exact and unique, as cryo writes them (SPEC.md section 3); anything else
// could be read two ways by two readers.
func TestParseIndexRefusesNonCanonicalAnnotations(t *testing.T) {
	good := indexOf([]string{"pages.img"})
	parse := func(data []byte) error {
		_, err := ParseIndex(ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromBytes(data), Size: int64(len(data))}, data)
		return err
	}
	if err := parse(good); err != nil {
		t.Fatalf("good index: %v", err)
	}
	for name, r := range map[string][2]string{
		"size with sign":       {`"vnd.cryo.file.size":"1"`, `"vnd.cryo.file.size":"+1"`},
		"size leading zero":    {`"vnd.cryo.file.size":"1"`, `"vnd.cryo.file.size":"01"`},
		"offset with sign":     {`"vnd.cryo.part.offset":"0"`, `"vnd.cryo.part.offset":"-0"`},
		"mode without 0":       {`"vnd.cryo.file.mode":"0644"`, `"vnd.cryo.file.mode":"644"`},
		"mode of 5 digits":     {`"vnd.cryo.file.mode":"0644"`, `"vnd.cryo.file.mode":"00644"`},
		"key in another case":  {`"manifests":`, `"Manifests":`},
		"annotation key twice": {`"vnd.cryo.file.size":"1"`, `"vnd.cryo.file.size":"1","vnd.cryo.file.size":"2"`},
	} {
		data := bytes.Replace(good, []byte(r[0]), []byte(r[1]), 1)
		if bytes.Equal(data, good) {
			t.Fatalf("%s: %s not in the index", name, r[0])
		}
		if err := parse(data); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: got %v, want ErrInvalid", name, err)
		}
	}
}

// indexOf returns a snapshot index of one-byte files at paths (sorted).
func indexOf(paths []string) []byte {
	idx := ocispec.Index{Versioned: specsVersioned, MediaType: ocispec.MediaTypeImageIndex, ArtifactType: ArtifactTypeSnapshot}
	d := digest.FromString("x")
	for _, p := range paths {
		idx.Manifests = append(idx.Manifests, ocispec.Descriptor{
			MediaType: ocispec.MediaTypeImageManifest, ArtifactType: ArtifactTypeFile, Digest: d, Size: 100,
			Annotations: map[string]string{
				AnnotationFilePath: p, AnnotationFileSize: "1", AnnotationFileMode: "0644", AnnotationFileDigest: d.String(),
				AnnotationPartOffset: "0", AnnotationPartLength: "1",
			},
		})
	}
	data, _ := json.Marshal(idx)
	return data
}

func TestParseTableRefusesBadTables(t *testing.T) {
	d := "sha256:" + strings.Repeat("ab", 32)
	e := "sha256:" + strings.Repeat("cd", 32)
	good := func() map[string]any {
		return map[string]any{
			"path": "pages.img", "size": 30, "mode": 0o644, "digest": d, "part": 0, "parts": 1, "offset": 0, "length": 30,
			"chunks": []map[string]any{
				{"offset": 0, "size": 10, "encoding": "zero"},
				{"offset": 10, "size": 10, "encoding": "raw", "digest": d, "blob": d, "blobSize": 10},
				{"offset": 20, "size": 10, "encoding": "zstd", "digest": d, "blob": e, "blobSize": 5},
			},
		}
	}
	enc := func(m map[string]any) []byte { b, _ := json.Marshal(m); return b }
	if _, err := ParseTable(enc(good())); err != nil {
		t.Fatalf("good table: %v", err)
	}
	chunk := func(m map[string]any, i int) map[string]any { return m["chunks"].([]map[string]any)[i] }
	cases := map[string]func(m map[string]any){
		"overlap":          func(m map[string]any) { chunk(m, 1)["offset"] = 5 },
		"gap":              func(m map[string]any) { chunk(m, 1)["offset"] = 12 },
		"past end":         func(m map[string]any) { chunk(m, 2)["size"] = 20 },
		"short":            func(m map[string]any) { m["length"] = 40; m["size"] = 40 },
		"unknown encoding": func(m map[string]any) { chunk(m, 1)["encoding"] = "lz4" },
		"zero with blob":   func(m map[string]any) { chunk(m, 0)["blob"] = d },
		"raw blob differs": func(m map[string]any) { chunk(m, 1)["blob"] = e },
		"zstd grows":       func(m map[string]any) { chunk(m, 2)["blobSize"] = 11 },
		"bad digest":       func(m map[string]any) { chunk(m, 1)["digest"] = "sha256:xyz"; chunk(m, 1)["blob"] = "sha256:xyz" },
		"md5 digest":       func(m map[string]any) { m["digest"] = "md5:" + strings.Repeat("a", 32) },
		"traversal":        func(m map[string]any) { m["path"] = "../etc/passwd" },
		"absolute":         func(m map[string]any) { m["path"] = "/etc/passwd" },
		"dot":              func(m map[string]any) { m["path"] = "a/./b" },
		"part range":       func(m map[string]any) { m["part"] = 1 },
		"mode bits":        func(m map[string]any) { m["mode"] = 0o100644 },
		"huge chunk":       func(m map[string]any) { chunk(m, 0)["size"] = MaxChunkSize + 1 },
		"negative size":    func(m map[string]any) { chunk(m, 0)["size"] = -10 },
	}
	for name, mutate := range cases {
		t.Run(name, func(t *testing.T) {
			m := good()
			mutate(m)
			if _, err := ParseTable(enc(m)); !errors.Is(err, ErrInvalid) {
				t.Fatalf("got %v, want ErrInvalid", err)
			}
		})
	}
	if _, err := ParseTable(append(enc(good()), []byte("{}")...)); !errors.Is(err, ErrInvalid) {
		t.Errorf("trailing data: %v", err)
	}
	// Keys are exact and unique (SPEC.md section 8): Go would take
	// "Size" for "size" and the last of two "size"s; another reader not.
	for name, data := range map[string][]byte{
		"key in another case":   bytes.Replace(enc(good()), []byte(`"size":30`), []byte(`"Size":30`), 1),
		"key twice":             bytes.Replace(enc(good()), []byte(`"size":30`), []byte(`"size":30,"size":30`), 1),
		"key folded by Unicode": bytes.Replace(enc(good()), []byte(`"size":30`), []byte(`"size":30,"\u017fize":30`), 1),
		"lone surrogate":        bytes.Replace(enc(good()), []byte(`"pages.img"`), []byte(`"pages\ud800.img"`), 1),
		"chunks null":           bytes.Replace(enc(good()), []byte(`"chunks":[`), []byte(`"chunks":null,"x":[`), 1),
		"non-UTF-8 path":        bytes.Replace(enc(good()), []byte(`"pages.img"`), []byte("\"pages\xff.img\""), 1),
	} {
		if _, err := ParseTable(data); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: got %v, want ErrInvalid", name, err)
		}
	}
	if _, err := ParseTable(make([]byte, MaxTableSize+1)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("oversized table: %v", err)
	}
}

var errConnReset = errors.New("connection reset")

// failingFetcher fails every fetch of a chunk blob after the first n with
// errConnReset.
type failingFetcher struct {
	content.Fetcher
	mu sync.Mutex
	n  int
}

func (f *failingFetcher) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	if desc.MediaType == MediaTypeChunkRaw || desc.MediaType == MediaTypeChunkZstd {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.n <= 0 {
			return nil, errConnReset
		}
		f.n--
	}
	return f.Fetcher.Fetch(ctx, desc)
}

func TestUnpackResumesAfterInterruption(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{Chunking: chunker.DefaultPageCDC(64 << 10)})
	out := filepath.Join(t.TempDir(), "out")
	_, _, err := Unpack(ctx, &failingFetcher{Fetcher: store, n: 30}, desc, out, UnpackOptions{Concurrency: 1})
	if !errors.Is(err, errConnReset) {
		t.Fatalf("interrupted unpack: %v, want the fetcher's %v", err, errConnReset)
	}
	if _, err := os.Stat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("an interrupted unpack left %s: %v", out, err)
	}
	// Corrupt a byte the first run wrote: that chunk must be fetched again.
	partial := PartialDir(out)
	pf, err := os.OpenFile(filepath.Join(partial, "pages.img"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	pf.WriteAt([]byte{0xff}, 1<<20+5)
	pf.Close()
	_, st, err := Unpack(ctx, store, desc, out, UnpackOptions{Concurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	if st.ChunksReused == 0 || st.ChunksReused >= 30 || st.ChunksFetched == 0 {
		t.Fatalf("resume reused %d chunks and fetched %d; want some of the first run's 30 reused", st.ChunksReused, st.ChunksFetched)
	}
	if _, err := os.Stat(partial); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("partial dir left behind: %v", err)
	}
}

func TestUnpackRefusesCorruptBlob(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	layoutDir := t.TempDir()
	store, err := oci.New(layoutDir)
	if err != nil {
		t.Fatal(err)
	}
	desc, _, err := Pack(ctx, src, store, PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	snap, _ := LoadSnapshot(ctx, store, desc)
	pt, _ := LoadPart(ctx, store, snap.File("pages.img"), 0)
	var victim Chunk
	for _, c := range pt.Table.Chunks {
		if c.Encoding == EncodingRaw {
			victim = c
		}
	}
	blob := filepath.Join(layoutDir, "blobs", "sha256", victim.Blob.Encoded())
	os.Chmod(blob, 0o644)
	data, _ := os.ReadFile(blob)
	data[len(data)/2] ^= 1
	os.WriteFile(blob, data, 0o644)
	out := filepath.Join(t.TempDir(), "out")
	_, _, err = Unpack(ctx, store, desc, out, UnpackOptions{})
	if !errors.Is(err, ErrDigestMismatch) || !strings.Contains(err.Error(), victim.Digest.String()) {
		t.Fatalf("want a digest mismatch naming chunk %s, got %v", victim.Digest, err)
	}
	if _, err := os.Stat(out); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a failed unpack left %s", out)
	}
	if _, _, err := Verify(ctx, store, desc, 0); !errors.Is(err, ErrDigestMismatch) {
		t.Fatalf("verify: %v", err)
	}
}

// TestPackerStreamsGiveThePackedSnapshot adds an image dir's files to a
// Packer as streams, all at once from pipes written in small pieces (as a
// checkpoint gofer gets them from the sentry), and checks that the index
// is the one Pack writes for the dir: same digest, so same tables, chunks
// and annotations (checkpoint.img's header read from its stream). Adding a
// file twice, or finishing while one is still being added, fails.
func TestPackerStreamsGiveThePackedSnapshot(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	for _, v := range []Version{V1, V2} {
		t.Run(v.String(), func(t *testing.T) { streamsGiveThePackedSnapshot(t, src, v) })
	}
	pk2, _ := NewPacker(memory.New(), PackOptions{})
	defer pk2.Close()
	pr, pw := io.Pipe()
	started := make(chan struct{})
	go func() {
		pw.Write([]byte("some"))
		close(started)
	}()
	go pk2.AddFile(ctx, "pages.img", 0o644, pr)
	<-started
	if _, _, err := pk2.Finish(ctx); err == nil {
		t.Error("Finish with a file still being added: no error")
	}
	pw.CloseWithError(errors.New("gone"))
}

// streamsGiveThePackedSnapshot adds the files of src to a Packer of
// format v as concurrent streams: the snapshot is the one Pack makes.
func streamsGiveThePackedSnapshot(t *testing.T, src string, v Version) {
	ctx := context.Background()
	_, want, _ := packToLayout(t, src, PackOptions{Format: v})

	files, err := listFiles(src)
	if err != nil {
		t.Fatal(err)
	}
	store := memory.New()
	pk, err := NewPacker(store, PackOptions{Format: v})
	if err != nil {
		t.Fatal(err)
	}
	defer pk.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 2*len(files))
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(src, filepath.FromSlash(f.path)))
		if err != nil {
			t.Fatal(err)
		}
		pr, pw := io.Pipe()
		wg.Add(2)
		go func() {
			defer wg.Done()
			for len(data) > 0 {
				n := min(len(data), 64<<10+17)
				pw.Write(data[:n])
				data = data[n:]
			}
			pw.Close()
		}()
		go func() {
			defer wg.Done()
			if _, err := pk.AddFile(ctx, f.path, f.mode, pr); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if _, err := pk.AddFile(ctx, files[0].path, 0o644, strings.NewReader("again")); !errors.Is(err, ErrInvalid) {
		t.Errorf("a file added twice: %v", err)
	}
	got, st, err := pk.Finish(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != want.Digest || st.Files != len(files) {
		t.Fatalf("streamed snapshot %s (%d files), packed %s (%d)", got.Digest, st.Files, want.Digest, len(files))
	}

}

// TestCreatedFromTimestamp pins which checkpoint.img _timestamp forms give
// org.opencontainers.image.created, and how it is written (SPEC.md
// section 3): RFC 3339 in UTC, as many fraction digits as needed, none for
// whole seconds; an unparsable timestamp gives no created at all.
func TestCreatedFromTimestamp(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"2026-11-30 04:59:22.364981031 +0000 UTC", "2026-11-30T04:59:22.364981031Z"},
		{"2026-11-30 04:59:22.5 +0000 UTC", "2026-11-30T04:59:22.5Z"},
		{"2026-11-30 04:59:22 +0000 UTC", "2026-11-30T04:59:22Z"},
		{"2026-11-30 05:59:22.1 +0100 CET", "2026-11-30T04:59:22.1Z"},
		{"2026-11-30 10:44:22 +0545 +0545", "2026-11-30T04:59:22Z"},
		{"2026-11-30 04:59:22.364981031 +0000 UTC m=+12.000000001", "2026-11-30T04:59:22.364981031Z"},
		{"2026-11-30T00:00:00Z", "2026-11-30T00:00:00Z"},
		{"2026-11-30T01:00:00.250+01:00", "2026-11-30T00:00:00.25Z"},
		{"yesterday", ""},
		{"", ""},
	} {
		md := map[string]string{statefile.KeyTimestamp: tc.in}
		got := snapshotAnnotations(md, time.Time{})[AnnotationCreated]
		if got != tc.want {
			t.Errorf("_timestamp %q: created %q, want %q", tc.in, got, tc.want)
		}
		if tc.in != "" && snapshotAnnotations(md, time.Time{})[AnnotationRunscTimestamp] != tc.in {
			t.Errorf("_timestamp %q not kept verbatim", tc.in)
		}
	}
}

// TestZstdBlobOfSeveralFrames pins SPEC.md section 7: a zstd blob may be
// several frames, concatenated, with skippable frames among them; it
// decodes as the concatenation of its frames' output.
func TestZstdBlobOfSeveralFrames(t *testing.T) {
	codec, err := NewCodec(0)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	data := bytes.Repeat([]byte("cryo memory page "), 4096)
	enc, _ := zstd.NewWriter(nil)
	defer enc.Close()
	skippable := []byte{0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 'a', 'b', 'c'}
	var blob []byte
	blob = enc.EncodeAll(data[:len(data)/3], blob)
	blob = append(blob, skippable...)
	blob = enc.EncodeAll(data[len(data)/3:], blob)
	c := Chunk{Size: int64(len(data)), Encoding: EncodingZstd, Digest: digest.FromBytes(data), Blob: digest.FromBytes(blob), BlobSize: int64(len(blob))}
	got, err := codec.Decode(c, blob, nil)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("two frames and a skippable one: %v", err)
	}
}
