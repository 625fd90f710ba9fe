package puller

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
	"golang.org/x/sys/unix"
)

// BenchmarkNodeStore measures what the node store's crash safety and
// first-use verification cost, on a 1 GiB snapshot of random memory
// (default chunking, 1 MiB mean) served by an in-process registry:
//
//	go test -run '^$' -bench NodeStore -benchtime 3x ./puller/
//
// Sub-benchmarks:
//
//   - cold: an empty cache; the time until every chunk is local (each
//     chunk flushed to disk before it is linked into the cache) and the
//     time the materialized dir then takes (every file flushed).
//   - warm-chunks: every chunk in the cache, no materialized dir, a new
//     puller (a new process): reading all of pages.img through FUSE with
//     16 readers of 256 KiB, as gVisor's loader does, pays the first-use
//     verification of every chunk; a second read does not.
//   - warm-materialized: reading pages.img through the bind mount of the
//     materialized dir (no FUSE, no verification).
func BenchmarkNodeStore(b *testing.B) {
	needFUSE(b)
	r := startReg(b)
	dir := filepath.Join(b.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 1<<30, 1); err != nil {
		b.Fatal(err)
	}
	repo := r.repo(b, "app:v1")
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{})
	if err != nil {
		b.Fatal(err)
	}
	s := Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: repo}}}
	cacheDir := b.TempDir()
	mountAt := func(p *Puller) *Mount {
		m, err := p.Mount(context.Background(), s, filepath.Join(b.TempDir(), "mnt"))
		if err != nil {
			b.Fatal(err)
		}
		return m
	}

	b.Run("cold", func(b *testing.B) {
		var local, mat float64
		for b.Loop() {
			b.StopTimer()
			os.RemoveAll(cacheDir)
			unix.Sync()
			p := newPuller(b, Options{CacheDir: cacheDir})
			b.StartTimer()
			m := mountAt(p)
			waitLoaded(b, m)
			pr := m.Progress()
			m.Unmount()
			local += pr.LocalSeconds
			mat += pr.LoadedSeconds - pr.LocalSeconds
		}
		b.ReportMetric(local/float64(b.N), "s-local/op")
		b.ReportMetric(mat/float64(b.N), "s-materialize/op")
	})

	b.Run("warm-chunks", func(b *testing.B) {
		var second float64
		for b.Loop() {
			b.StopTimer()
			os.RemoveAll(filepath.Join(cacheDir, "images"))
			p := newPuller(b, Options{CacheDir: cacheDir})
			m := mountAt(p)
			m.cancel() // no background load: measure the reads alone
			b.StartTimer()
			readPages(b, m)
			b.StopTimer()
			t0 := time.Now()
			readPages(b, m)
			second += time.Since(t0).Seconds()
			m.Unmount()
			b.StartTimer()
		}
		b.ReportMetric(second/float64(b.N), "s-second-read/op")
	})

	b.Run("warm-materialized", func(b *testing.B) {
		p := newPuller(b, Options{CacheDir: cacheDir})
		m := mountAt(p)
		waitLoaded(b, m)
		m.Unmount()
		for b.Loop() {
			m := mountAt(p)
			readPages(b, m)
			m.Unmount()
		}
	})
}

// readPages reads all of pages.img under m's dir with 16 readers of 256 KiB
// pieces, interleaved.
func readPages(b *testing.B, m *Mount) {
	f, err := os.Open(filepath.Join(m.Dir(), "pages.img"))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	const readers, piece = 16, 256 << 10
	var wg sync.WaitGroup
	for w := range readers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, piece)
			for off := int64(w) * piece; off < fi.Size(); off += readers * piece {
				if _, err := f.ReadAt(buf, off); err != nil && err != io.EOF {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
}
