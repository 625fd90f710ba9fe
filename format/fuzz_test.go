package format

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// FuzzParseTable checks that no input makes the chunk table parser panic or
// accept a table that breaks the invariants the puller relies on.
// Seed corpus: testdata/fuzz/FuzzParseTable.
func FuzzParseTable(f *testing.F) {
	f.Add([]byte(`{"path":"pages.img","size":8192,"mode":420,"digest":"sha256:` + hex64 + `","part":0,"parts":1,"offset":0,"length":8192,"chunks":[{"offset":0,"size":4096,"encoding":"zero"},{"offset":4096,"size":4096,"encoding":"raw","digest":"sha256:` + hex64 + `","blob":"sha256:` + hex64 + `","blobSize":4096}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		tab, err := ParseTable(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrTooLarge) {
				t.Fatalf("error without a sentinel: %v", err)
			}
			return
		}
		next := tab.Offset
		for _, c := range tab.Chunks {
			if c.Offset != next || c.Size <= 0 || c.Size > MaxChunkSize {
				t.Fatalf("accepted bad chunk %+v", c)
			}
			next = c.End()
		}
		if next != tab.Offset+tab.Length || tab.Offset+tab.Length > tab.Size {
			t.Fatalf("accepted a table whose chunks end at %d", next)
		}
		for _, off := range []int64{tab.Offset, tab.Offset + tab.Length/2, next - 1} {
			i, j := tab.Locate(off, 1)
			if tab.Length > 0 && (j-i != 1 || tab.Chunks[i].Offset > off || tab.Chunks[i].End() <= off) {
				t.Fatalf("Locate(%d) = [%d,%d)", off, i, j)
			}
		}
		again, err := json.Marshal(tab)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParseTable(again); err != nil {
			t.Fatalf("re-encoded table does not parse: %v", err)
		}
	})
}

// FuzzParseTableV2 checks that no input makes the v2 chunk table parser
// panic or accept a table whose frames lie outside their packs or whose
// chunks do not tile the part, and that what it accepts encodes back to a
// table it accepts.
func FuzzParseTableV2(f *testing.F) {
	f.Add([]byte(`{"path":"pages.img","size":12288,"mode":420,"digest":"sha256:` + hex64 + `","part":0,"parts":1,"offset":0,"length":12288,"chunker":{"algorithm":"page-cdc","min":16384,"avg":65536,"max":262144},"packs":[{"digest":"sha256:` + hex64 + `","size":5000}],"chunks":[{"size":4096,"encoding":"zero"},{"size":4096,"encoding":"raw","digest":"sha256:` + hex64 + `","pack":0,"packOffset":0,"packLength":4096},{"size":4096,"encoding":"zstd","digest":"sha256:` + hex64 + `","pack":0,"packOffset":4096,"packLength":904}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		tab, err := ParseTableV2(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrTooLarge) {
				t.Fatalf("error without a sentinel: %v", err)
			}
			return
		}
		next := tab.Offset
		for _, c := range tab.Chunks {
			if c.Offset != next || c.Size <= 0 || c.Size > MaxChunkSize {
				t.Fatalf("accepted bad chunk %+v", c)
			}
			if c.Encoding != EncodingZero && (!c.Packed() || c.PackOffset < 0 || c.PackOffset+c.BlobSize > c.PackSize || c.PackSize > MaxPackSize || c.BlobSize <= 0) {
				t.Fatalf("accepted a frame outside its pack: %+v", c)
			}
			next = c.End()
		}
		if next != tab.Offset+tab.Length || tab.Offset+tab.Length > tab.Size {
			t.Fatalf("accepted a table whose chunks end at %d", next)
		}
		again, err := tab.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParseTableV2(again); err != nil {
			t.Fatalf("re-encoded table does not parse: %v", err)
		}
	})
}

const hex64 = "0000000000000000000000000000000000000000000000000000000000000000"

// FuzzParseIndex checks that no input makes the snapshot index parser panic
// or accept files whose paths escape the image dir or whose parts do not
// tile the file. Seed corpus: testdata/fuzz/FuzzParseIndex.
func FuzzParseIndex(f *testing.F) {
	f.Add([]byte(`{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","artifactType":"application/vnd.cryo.snapshot.v1","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","artifactType":"application/vnd.cryo.file.v1","digest":"sha256:` + hex64 + `","size":100,"annotations":{"vnd.cryo.file.path":"pages.img","vnd.cryo.file.size":"10","vnd.cryo.file.mode":"0644","vnd.cryo.file.digest":"sha256:` + hex64 + `","vnd.cryo.part.offset":"0","vnd.cryo.part.length":"10"}}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		desc := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromBytes(data), Size: int64(len(data))}
		s, err := ParseIndex(desc, data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrTooLarge) {
				t.Fatalf("error without a sentinel: %v", err)
			}
			return
		}
		for i, f := range s.Files {
			if ValidatePath(f.Path) != nil {
				t.Fatalf("accepted path %q", f.Path)
			}
			if i > 0 && s.Files[i-1].Path >= f.Path {
				t.Fatalf("files out of order: %q then %q", s.Files[i-1].Path, f.Path)
			}
			var next int64
			for _, p := range f.Parts {
				if p.Offset != next {
					t.Fatalf("%q: part at %d, want %d", f.Path, p.Offset, next)
				}
				next += p.Length
			}
			if next != f.Size {
				t.Fatalf("%q: parts end at %d, size %d", f.Path, next, f.Size)
			}
		}
	})
}
