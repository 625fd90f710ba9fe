// Package rangeload benchmarks what a cold node moves to read a snapshot,
// format v1 (a blob per 1 MiB chunk) beside format v2 (64 KiB chunks
// whose frames are read by range out of 4 MiB packs), in one run, through
// the puller (puller.Load: the background load every restore path runs)
// and its shared read path (imagefs.ReadAt through the fetch scheduler,
// as FUSE reads and the checkpoint gofer's file API do): blob requests,
// bytes and time for a full cold load, and for 1,000 random 4 KiB reads
// on an empty node cache, counted by a proxy in front of the registry.
//
//	go test ./bench/rangeload -run '^$' -bench RangeLoad -benchtime 1x -mib 1024
package rangeload

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/imagefs"
	"github.com/cryo-oci/cryo/transfer"
)

var mibFlag = flag.Int64("mib", 1024, "size of pages.img in MiB")

// counter is a reverse proxy that counts blob GETs and their body bytes.
type counter struct {
	gets, bytes atomic.Int64
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func BenchmarkRangeLoad(b *testing.B) {
	reg := testenv.StartRegistry(b, "")
	b.Setenv("DOCKER_CONFIG", b.TempDir())
	target, _ := url.Parse("http://" + reg.Addr)
	var c counter
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.ModifyResponse = func(resp *http.Response) error {
		if resp.Request.Method == http.MethodGet && strings.Contains(resp.Request.URL.Path, "/blobs/sha256:") {
			c.gets.Add(1)
			resp.Body = countingBody{resp.Body, &c.bytes}
		}
		return nil
	}
	srv := httptest.NewServer(proxy)
	b.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	dir := testenv.ImageDir(b, synth.HalfZero, *mibFlag<<20, 1)
	var rows []string
	for range b.N {
		for _, v := range []format.Version{format.V1, format.V2} {
			repo, _, err := transfer.Repository(fmt.Sprintf("%s/app-%s:a", host, v), transfer.ClientOptions{})
			if err != nil {
				b.Fatal(err)
			}
			res, err := transfer.Push(context.Background(), dir, repo, "a", transfer.PushOptions{Pack: format.PackOptions{Format: v}})
			if err != nil {
				b.Fatal(err)
			}
			src := puller.Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "registry", Store: transfer.Ranged{Repository: repo}}}}
			// Full cold load.
			p, err := puller.New(puller.Options{CacheDir: b.TempDir(), NoFUSE: true})
			if err != nil {
				b.Fatal(err)
			}
			g0, n0, t0, cpu0 := c.gets.Load(), c.bytes.Load(), time.Now(), benchutil.CPUTime(reg.PID())
			snap, err := p.Load(context.Background(), src)
			if err != nil {
				b.Fatal(err)
			}
			loadGets, loadBytes, loadTime := c.gets.Load()-g0, c.bytes.Load()-n0, time.Since(t0)
			// The registry's CPU per GiB it delivered.
			regCPU := (benchutil.CPUTime(reg.PID()) - cpu0).Seconds() / (float64(loadBytes) / (1 << 30))
			p.Close()
			chunks := 0
			var file *imagefs.File
			for i := range snap.Files {
				f := &snap.Files[i]
				var all []format.Chunk
				for part := range f.Parts {
					pt, err := format.LoadPart(context.Background(), repo, f, part)
					if err != nil {
						b.Fatal(err)
					}
					all = append(all, pt.Table.Chunks...)
				}
				chunks += len(all)
				if f.Path == format.PagesFile {
					file = &imagefs.File{Path: f.Path, Size: f.Size, Chunks: all}
				}
			}
			// 1,000 random 4 KiB reads on an empty node cache.
			store, err := cache.Open(b.TempDir(), 0)
			if err != nil {
				b.Fatal(err)
			}
			codec, err := format.NewCodec(0)
			if err != nil {
				b.Fatal(err)
			}
			sched := fetch.New(src.Endpoints, store, codec, fetch.Options{})
			rng := rand.New(rand.NewPCG(7, 7))
			buf := make([]byte, 4096)
			g0, n0, t0 = c.gets.Load(), c.bytes.Load(), time.Now()
			for range 1000 {
				off := rng.Int64N(file.Size/4096) * 4096
				if err := imagefs.ReadAt(context.Background(), store, file, buf, off, source{sched}, &imagefs.Stats{}); err != nil {
					b.Fatal(err)
				}
			}
			randGets, randBytes, randTime := c.gets.Load()-g0, c.bytes.Load()-n0, time.Since(t0)
			sched.Close()
			codec.Close()
			rows = append(rows, fmt.Sprintf("| %s | %d | %d | %d | %s | %.2f s | %.2f s | %d | %s | %.2f s |", v, *mibFlag, chunks,
				loadGets, mib(loadBytes), loadTime.Seconds(), regCPU, randGets, kib(randBytes/1000), randTime.Seconds()))
		}
	}
	b.Logf("\n| format | MiB | chunks | cold full load: requests | bytes | time | registry CPU per GiB delivered | 1,000 random 4 KiB reads: requests | bytes per read | time |\n|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n%s", strings.Join(rows, "\n"))
}

// source reads chunks through a scheduler at page-fault priority, as a
// sandbox's faults are.
type source struct{ s *fetch.Scheduler }

func (s source) Chunk(ctx context.Context, c format.Chunk, buf []byte) ([]byte, error) {
	return s.s.Get(ctx, c, buf, fetch.Fault)
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
func kib(n int64) string { return fmt.Sprintf("%.0f KiB", float64(n)/1024) }
