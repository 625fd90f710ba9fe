package format

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
)

// pagesOf returns n bytes of synthetic memory of kind.
func pagesOf(t *testing.T, kind synth.Kind, n int, seed uint64) []byte {
	t.Helper()
	var b bytes.Buffer
	if err := synth.WritePages(&b, kind, int64(n), seed); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()[:n]
}

// TestCompressFrameSkipsOnlyWhatCannotShrink holds CompressFrame's
// entropy gate to zstd itself: for 64 KiB chunks of random memory, text,
// zeros, their mixtures page by page, and arrays of small integers in
// 2-, 4- and 8-byte fields (whose high bytes are zero: a sampler that
// saw every fourth byte only would take them for random), the frame is
// compressed exactly when zstd saves more than an eighth, and a chunk it
// stores raw is its bytes.
func TestCompressFrameSkipsOnlyWhatCannotShrink(t *testing.T) {
	codec, err := NewCodecV2(1)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	const size = 64 << 10
	random, text := pagesOf(t, synth.Random, size, 1), pagesOf(t, synth.Text, size, 2)
	cases := map[string][]byte{"random": random, "text": text}
	for _, tenths := range []int{1, 2, 3, 4, 5, 7, 9} {
		for _, other := range []string{"text", "zero"} {
			b := bytes.Clone(random)
			for p := range size / 4096 * tenths / 10 {
				page := b[p*4096*10/tenths%size:][:4096]
				if other == "text" {
					copy(page, text[p*4096:])
				} else {
					clear(page)
				}
			}
			cases[fmt.Sprintf("random with %d0%% %s", tenths, other)] = b
		}
	}
	rng := rand.New(rand.NewPCG(3, 4))
	// 3-byte records, one random byte and two zeros: a sampler starting
	// every page at the same residue modulo 3 would see only the random
	// bytes.
	records := bytes.Clone(random)
	for i := range records {
		if i%3 != 0 {
			records[i] = 0
		}
	}
	cases["3-byte records"] = records
	for _, field := range []int{2, 4, 8} {
		b := make([]byte, size)
		for i := 0; i < size; i += field {
			v := rng.Uint64() & 0xfff // 12 bits of every field
			switch field {
			case 2:
				binary.LittleEndian.PutUint16(b[i:], uint16(v))
			case 4:
				binary.LittleEndian.PutUint32(b[i:], uint32(v))
			case 8:
				binary.LittleEndian.PutUint64(b[i:], v)
			}
		}
		cases[fmt.Sprintf("%d-byte fields", field)] = b
	}
	for name, data := range cases {
		raw := codec.Identify(data)
		got, frame := codec.CompressFrame(raw, data, nil)
		z := codec.enc.EncodeAll(data, nil)
		shrinks := len(z) < len(data)-len(data)/8
		if (got.Encoding == EncodingZstd) != shrinks {
			t.Errorf("%s: encoding %s, but zstd makes %d bytes of %d", name, got.Encoding, len(z), len(data))
			continue
		}
		if got.Blob != "" || got.BlobSize != int64(len(frame)) || got.Digest != raw.Digest {
			t.Errorf("%s: entry %+v for a frame of %d bytes", name, got, len(frame))
		}
		out, err := codec.Decode(Chunk{Size: got.Size, Encoding: got.Encoding, Digest: got.Digest, BlobSize: got.BlobSize}, frame, nil)
		if err != nil || !bytes.Equal(out, data) {
			t.Errorf("%s: frame does not decode to the chunk: %v", name, err)
		}
		t.Logf("%s: %s, zstd %d of %d, spread evenly %v", name, got.Encoding, len(z), len(data), spreadEvenly(data))
	}
	// What the gate gives up, by design: random bytes repeated within the
	// chunk, which zstd halves, are stored raw (the gate is applied).
	repeated := append(bytes.Clone(random[:size/2]), random[:size/2]...)
	if z := codec.enc.EncodeAll(repeated, nil); len(z) >= size-size/8 {
		t.Fatalf("zstd makes %d bytes of a repeated half: the case tests nothing", len(z))
	}
	if got, _ := codec.CompressFrame(codec.Identify(repeated), repeated, nil); got.Encoding != EncodingRaw {
		t.Errorf("repeated random half: encoding %s, want raw (the entropy gate not applied)", got.Encoding)
	}
}

// TestCompressFrameCompressesTextChunks: v2's frames of text-like memory
// are compressed, at least 1.4x, at the chunk sizes v2 cuts (16 KiB to
// 256 KiB), and decode to their bytes. At zstd's fastest level without
// entropy coding of all-literal blocks, a 64 KiB chunk of it compressed
// 1.03x and was stored raw.
func TestCompressFrameCompressesTextChunks(t *testing.T) {
	codec, err := NewCodecV2(1)
	if err != nil {
		t.Fatal(err)
	}
	defer codec.Close()
	text := pagesOf(t, synth.Text, 1<<20, 5)
	for _, size := range []int{16 << 10, 64 << 10, 256 << 10} {
		data := text[:size]
		c, frame := codec.CompressFrame(codec.Identify(data), data, nil)
		if c.Encoding != EncodingZstd || float64(size)/float64(len(frame)) < 1.4 {
			t.Fatalf("%d KiB of text: stored %s in %d bytes (%.2fx), want zstd and at least 1.4x", size>>10, c.Encoding, len(frame), float64(size)/float64(len(frame)))
		}
		got, err := codec.Decode(c, frame, nil)
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("%d KiB of text: the frame decodes to other bytes (%v)", size>>10, err)
		}
		t.Logf("%d KiB of text: %.2fx", size>>10, float64(size)/float64(len(frame)))
	}
}
