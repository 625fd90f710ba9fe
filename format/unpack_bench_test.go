package format

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/synth"
)

// BenchmarkUnpack unpacks a synthetic image dir (text-like pages.img, 1 GiB
// unless CRYO_BENCH_UNPACK_SIZE says otherwise, in bytes) from an OCI layout
// on disk into a fresh dir on the same disk, the path `cryo unpack` takes:
// fetch, decode, verify, write, fsync every file and dir, rename.
//
//	go test -run '^$' -bench BenchmarkUnpack -benchtime 3x ./format/
func BenchmarkUnpack(b *testing.B) {
	size := int64(1 << 30)
	if v := os.Getenv("CRYO_BENCH_UNPACK_SIZE"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			b.Fatal(err)
		}
		size = n
	}
	src := filepath.Join(b.TempDir(), "img")
	if err := synth.ImageDir(src, synth.Text, size, 1); err != nil {
		b.Fatal(err)
	}
	store, err := layout.New(filepath.Join(b.TempDir(), "layout"))
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	desc, _, err := Pack(ctx, src, store, PackOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(size)
	b.ResetTimer()
	for range b.N {
		out := filepath.Join(b.TempDir(), "out")
		if _, _, err := Unpack(ctx, store, desc, out, UnpackOptions{}); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		os.RemoveAll(out)
		b.StartTimer()
	}
}

// BenchmarkDecode decodes a 1 MiB text-like zstd chunk into a reused
// buffer, as the puller and Unpack do.
func BenchmarkDecode(b *testing.B) {
	codec, err := NewCodec(1)
	if err != nil {
		b.Fatal(err)
	}
	defer codec.Close()
	c, blob := codec.Encode(textLike(1, 1<<20), nil)
	blob = append([]byte(nil), blob...)
	buf := make([]byte, 0, MaxChunkSize)
	b.SetBytes(c.Size)
	b.ResetTimer()
	for range b.N {
		out, err := codec.Decode(c, blob, buf)
		if err != nil {
			b.Fatal(err)
		}
		buf = out
	}
}
