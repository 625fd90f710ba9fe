package puller

import (
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
)

// TestWindowKeepsAPackWhole checks that a window of a load's queue ends
// at the end of the pack its last stored chunk lies in, across zero
// chunks between that pack's frames: a window cut inside a pack costs a
// second request for the pack's rest.
func TestWindowKeepsAPackWhole(t *testing.T) {
	const kib = 1 << 10
	packA, packB := digest.FromString("a"), digest.FromString("b")
	stored := func(pack digest.Digest) format.Chunk {
		return format.Chunk{Size: 64 * kib, Encoding: format.EncodingRaw, Blob: pack, PackSize: 1 << 20}
	}
	zero := format.Chunk{Size: 64 * kib, Encoding: format.EncodingZero}
	for _, tc := range []struct {
		name   string
		chunks []format.Chunk
		max    int64
		want   int
	}{
		{"pack continues after a zero chunk", []format.Chunk{stored(packA), zero, stored(packA), stored(packB)}, 64 * kib, 3},
		{"the window ends on a zero chunk inside a pack", []format.Chunk{stored(packA), zero, zero, stored(packA), stored(packB)}, 128 * kib, 4},
		{"zero chunks before the next pack stay out", []format.Chunk{stored(packA), zero, stored(packB)}, 64 * kib, 1},
		{"only zero chunks", []format.Chunk{zero, zero, zero}, 64 * kib, 1},
		{"less than max", []format.Chunk{stored(packA), zero}, 1 << 30, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := len(window(tc.chunks, tc.max)); got != tc.want {
				t.Errorf("window kept %d chunks, want %d", got, tc.want)
			}
		})
	}
}
