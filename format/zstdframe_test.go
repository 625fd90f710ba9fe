package format

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// TestSingleZstdFrame accepts frames cryo's encoder writes (compressed,
// raw and RLE blocks, with and without a checksum) and refuses what a
// decoder would also accept but that carries other bytes: a skippable
// frame before or after, a second frame, trailing bytes; and a cut frame.
func TestSingleZstdFrame(t *testing.T) {
	text := make([]byte, 300_000)
	for i := range text {
		text[i] = "cryo snapshots "[i%15]
	}
	random := make([]byte, 200_000)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range random {
		random[i] = byte(rng.Uint32())
	}
	zeros := make([]byte, 100_000)
	skippable := []byte{0x50, 0x2a, 0x4d, 0x18, 3, 0, 0, 0, 'h', 'i', '!'}
	for _, crc := range []bool{false, true} {
		enc, err := zstd.NewWriter(nil, zstd.WithEncoderCRC(crc))
		if err != nil {
			t.Fatal(err)
		}
		for name, data := range map[string][]byte{"text": text, "random": random, "zeros": zeros} {
			f := enc.EncodeAll(data, nil)
			if err := SingleZstdFrame(f); err != nil {
				t.Errorf("%s (crc %v): %v", name, crc, err)
			}
			for bad, b := range map[string][]byte{
				"skippable first": append(append([]byte{}, skippable...), f...),
				"skippable after": append(append([]byte{}, f...), skippable...),
				"two frames":      append(append([]byte{}, f...), f...),
				"a trailing byte": append(append([]byte{}, f...), 0),
				"cut":             f[:len(f)-1],
				"empty":           nil,
			} {
				if err := SingleZstdFrame(b); !errors.Is(err, ErrInvalid) {
					t.Errorf("%s (crc %v), %s: %v, want ErrInvalid", name, crc, bad, err)
				}
			}
		}
		enc.Close()
	}
}
