package imagefs

import (
	"bytes"
	"context"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/opencontainers/go-digest"
)

// fixedSource serves the same bytes for every chunk.
type fixedSource []byte

func (s fixedSource) Chunk(ctx context.Context, c format.Chunk, buf []byte) ([]byte, error) {
	return s, nil
}

// TestLyingSizeNeverServedOrPanics reads a chunk whose table entry says it
// is larger than the bytes its source returns: the read fails (the FUSE
// read answers EIO, the retry path) instead of panicking the daemon or
// serving bytes past what the chunk holds.
func TestLyingSizeNeverServedOrPanics(t *testing.T) {
	c, err := cache.Open(t.TempDir(), 0)
	if err != nil {
		t.Fatal(err)
	}
	data := bytes.Repeat([]byte{9}, 4096)
	lie := format.Chunk{Offset: 0, Size: 1 << 20, Encoding: format.EncodingRaw, Digest: digest.FromBytes(data), Blob: digest.FromBytes(data), BlobSize: 1 << 20}
	file := &File{Path: "pages.img", Size: lie.Size, Chunks: []format.Chunk{lie}}
	for _, off := range []int64{0, 2048, 8192} {
		dest := bytes.Repeat([]byte{0xee}, 4096)
		if err := ReadAt(context.Background(), c, file, dest, off, fixedSource(data), &Stats{}); err == nil {
			t.Errorf("read at %d of a chunk %d bytes long that its table says is %d: no error", off, len(data), lie.Size)
		}
	}
}

// TestFaultHistoryNear: a fault brings its aligned NearSpan along only
// when one of the file's last RecentFaults faults lies in it too; a
// fault far from every recent one (a random read) brings nothing, and a
// region stops counting once RecentFaults faults elsewhere have pushed
// it out.
func TestFaultHistoryNear(t *testing.T) {
	var h FaultHistory
	span := func(off int64) int64 { lo, hi := h.Near(off); return hi - lo }
	base := int64(7 * NearSpan)
	if n := span(base + 4096); n != 0 {
		t.Fatalf("a first fault brings %d bytes along, want 0", n)
	}
	if lo, hi := h.Near(base + NearSpan - 4096); lo != base || hi != base+NearSpan {
		t.Fatalf("a second fault in the span brings [%d,%d), want [%d,%d)", lo, hi, base, base+NearSpan)
	}
	if n := span(base + NearSpan); n != 0 {
		t.Fatalf("a fault in the next span brings %d bytes along, want 0", n)
	}
	for i := range RecentFaults {
		span(int64(100+2*i) * NearSpan)
	}
	if n := span(base + 8192); n != 0 {
		t.Fatalf("a fault in a span %d faults ago brings %d bytes along, want 0", RecentFaults, n)
	}
}
