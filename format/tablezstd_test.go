package format

import (
	"bytes"
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/klauspost/compress/zstd"
	"oras.land/oras-go/v2/content/memory"
)

// TestV2TablesAreCompressed packs a v2 snapshot and checks that every
// part's table is stored as one zstd frame, smaller than its JSON, that
// the snapshot loads from it, and that packing again gives the same index.
func TestV2TablesAreCompressed(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.HalfZero, 32<<20, 3); err != nil {
		t.Fatal(err)
	}
	mem := memory.New()
	idx, _, err := Pack(ctx, dir, mem, PackOptions{Format: V2})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := LoadSnapshot(ctx, mem, idx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range snap.Files {
		f := &snap.Files[i]
		for part := range f.Parts {
			pt, err := LoadPart(ctx, mem, f, part)
			if err != nil {
				t.Fatal(err)
			}
			if pt.Manifest.Config.MediaType != MediaTypeChunkTableV2Zstd {
				t.Fatalf("%s part %d: table stored as %q", f.Path, part, pt.Manifest.Config.MediaType)
			}
			stored, err := FetchVerified(ctx, mem, pt.Manifest.Config, MaxTableSize)
			if err != nil {
				t.Fatal(err)
			}
			js, err := pt.Table.Marshal()
			if err != nil {
				t.Fatal(err)
			}
			if err := SingleZstdFrame(stored); err != nil || (len(pt.Table.Chunks) > 64 && len(stored) >= len(js)/2) {
				t.Errorf("%s part %d: table of %d chunks stored in %d bytes for %d of JSON (%v)", f.Path, part, len(pt.Table.Chunks), len(stored), len(js), err)
			}
		}
	}
	again, _, err := Pack(ctx, dir, memory.New(), PackOptions{Format: V2})
	if err != nil {
		t.Fatal(err)
	}
	if again.Digest != idx.Digest {
		t.Errorf("packing the same dir twice gave %s and %s", idx.Digest, again.Digest)
	}
}

// TestDecodeTableBlob passes uncompressed tables through and refuses
// compressed ones that would decode past MaxTableSize (whether or not the
// frame says its size) or that carry anything besides one zstd frame.
func TestDecodeTableBlob(t *testing.T) {
	js := []byte(`{"path":"pages.img"}`)
	if out, err := DecodeTableBlob(MediaTypeChunkTableV2, js); err != nil || !bytes.Equal(out, js) {
		t.Fatalf("uncompressed table: %q, %v", out, err)
	}
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	if out, err := DecodeTableBlob(MediaTypeChunkTableV2Zstd, enc.EncodeAll(js, nil)); err != nil || !bytes.Equal(out, js) {
		t.Fatalf("compressed table: %q, %v", out, err)
	}
	big := make([]byte, MaxTableSize+1)
	if _, err := DecodeTableBlob(MediaTypeChunkTableV2Zstd, enc.EncodeAll(big, nil)); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a bomb that says its size: %v, want ErrTooLarge", err)
	}
	// A streamed frame does not say its size, and has an 8 MiB window:
	// a small one decodes, a large one is stopped at the limit.
	var small bytes.Buffer
	w, err := zstd.NewWriter(&small, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	w.Write(js)
	w.Close()
	if out, err := DecodeTableBlob(MediaTypeChunkTableV2Zstd, small.Bytes()); err != nil || !bytes.Equal(out, js) {
		t.Errorf("a small streamed table: %q, %v", out, err)
	}
	var streamed bytes.Buffer
	w, err = zstd.NewWriter(&streamed, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	for range 4 {
		w.Write(big[:MaxTableSize/2+1])
	}
	w.Close()
	var h zstd.Header
	if h.Decode(streamed.Bytes()); h.HasFCS {
		t.Fatal("the streamed frame says its size: the test cannot reach the limit")
	}
	if _, err := DecodeTableBlob(MediaTypeChunkTableV2Zstd, streamed.Bytes()); !errors.Is(err, ErrTooLarge) {
		t.Errorf("a bomb that does not say its size: %v, want ErrTooLarge", err)
	}
	skippable := []byte{0x50, 0x2a, 0x4d, 0x18, 1, 0, 0, 0, 'x'}
	if _, err := DecodeTableBlob(MediaTypeChunkTableV2Zstd, append(enc.EncodeAll(js, nil), skippable...)); !errors.Is(err, ErrInvalid) {
		t.Errorf("a table with a skippable frame after it: %v, want ErrInvalid", err)
	}
}
