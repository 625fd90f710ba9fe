package format

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/synth"
)

// BenchmarkPack packs a 256 MiB synthetic pages.img of each kind into an OCI
// layout on disk, the path `cryo pack` takes, in each format.
func BenchmarkPack(b *testing.B) {
	for _, v := range []Version{V1, V2} {
		for _, kind := range synth.Kinds {
			benchmarkPack(b, v, kind)
		}
	}
}

func benchmarkPack(b *testing.B, v Version, kind synth.Kind) {
	{
		b.Run(fmt.Sprintf("v%d/%s", v, kind), func(b *testing.B) {
			dir := b.TempDir()
			if err := synth.ImageDir(dir, kind, 256<<20, 1); err != nil {
				b.Fatal(err)
			}
			b.SetBytes(256 << 20)
			b.ResetTimer()
			for range b.N {
				b.StopTimer()
				dir2 := filepath.Join(b.TempDir(), "layout")
				store, err := layout.New(dir2)
				if err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
				if _, _, err := Pack(context.Background(), dir, store, PackOptions{Format: v}); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				os.RemoveAll(dir2)
				b.StartTimer()
			}
		})
	}
}
