// Package dedup benchmarks what a second snapshot of mostly the same
// memory adds to storage, format v1 (a blob per 1 MiB chunk) beside format
// v2 (small chunks in packs, reusing the first snapshot's frames), as a
// pause of a long-running sandbox pushes it: the first snapshot is packed
// into an OCI layout, then the second into the same layout, and the bytes
// the second adds to the layout's blobs (chunks, packs, tables and
// manifests) are reported as a share of the first's.
//
// The memory is the synthetic mix (runs of 50% random, 30%
// text-like, 20% zero pages); the second snapshot rewrites a share of the
// pages in runs of 16-256 pages and inserts 16 runs of 1-8 pages.
//
//	go test ./bench/dedup -run '^$' -bench Dedup -benchtime 1x
package dedup

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/transfer"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

var avgsFlag = flag.String("v2-avgs", "32768,65536,131072", "v2 mean chunk sizes to compare (bytes)")

// scenario is one pair of snapshots.
type scenario struct {
	name    string
	mib     int64
	rewrite float64
}

var scenarios = []scenario{
	{"256 MiB, 5% of pages rewritten", 256, 0.05},
	{"64 MiB, 10% rewritten", 64, 0.10},
}

func BenchmarkDedup(b *testing.B) {
	var avgs []int
	for _, s := range strings.Split(*avgsFlag, ",") {
		var v int
		if _, err := fmt.Sscan(strings.TrimSpace(s), &v); err != nil {
			b.Fatal(err)
		}
		avgs = append(avgs, v)
	}
	type variant struct {
		label string
		opts  format.PackOptions
	}
	variants := []variant{{"v1, 1 MiB chunks", format.PackOptions{}}}
	for _, a := range avgs {
		variants = append(variants, variant{fmt.Sprintf("v2, %d KiB chunks", a>>10),
			format.PackOptions{Format: format.V2, Chunking: chunker.DefaultPageCDC(a)}})
	}
	var out strings.Builder
	fmt.Fprintf(&out, "\n| second snapshot | %s |\n|---|", strings.Join(labels(variants, func(v variant) string { return v.label }), " | "))
	for range variants {
		out.WriteString("--:|")
	}
	out.WriteString("\n")
	for range b.N {
		for _, sc := range scenarios {
			first, second := makePair(b, sc)
			fmt.Fprintf(&out, "| %s: storage the second push adds, vs the first's |", sc.name)
			for _, v := range variants {
				added, firstSize, st := addedBytes(b, first, second, v.opts)
				fmt.Fprintf(&out, " %.1f%% |", 100*float64(added)/float64(firstSize))
				b.Logf("%s, %s: first %d bytes, second adds %d (%d chunks: %v, %d blobs uploaded)", sc.name, v.label, firstSize, added, totalChunks(st), st.Chunks, st.BlobsUploaded)
			}
			out.WriteString("\n")
		}
	}
	b.Log(out.String())
}

func labels[T any](v []T, f func(T) string) []string {
	var out []string
	for _, x := range v {
		out = append(out, f(x))
	}
	return out
}

func totalChunks(st *format.PackStats) int {
	n := 0
	for _, c := range st.Chunks {
		n += c
	}
	return n
}

// addedBytes packs first into a new layout, then second (against first's
// tables in v2), and returns the bytes the second added to the layout's
// blobs and the first's.
func addedBytes(b *testing.B, first, second string, opts format.PackOptions) (added, firstSize int64, st *format.PackStats) {
	ctx := context.Background()
	root := b.TempDir()
	store, err := layout.New(root)
	if err != nil {
		b.Fatal(err)
	}
	d1, _, err := format.Pack(ctx, first, store, opts)
	if err != nil {
		b.Fatal(err)
	}
	firstSize = blobBytes(b, root)
	if opts.Format == format.V2 {
		opts.Resolver = format.NewTableResolver(snapshotTables(b, store, d1))
	}
	_, st, err = format.Pack(ctx, second, store, opts)
	if err != nil {
		b.Fatal(err)
	}
	return blobBytes(b, root) - firstSize, firstSize, st
}

// blobBytes sums the sizes of the blobs of the layout at root.
func blobBytes(b *testing.B, root string) int64 {
	n, err := transfer.DirSize(filepath.Join(root, "blobs"))
	if err != nil {
		b.Fatal(err)
	}
	return n
}

// makePair writes the two image dirs of a scenario.
func makePair(b *testing.B, sc scenario) (first, second string) {
	first, second = filepath.Join(b.TempDir(), "a"), filepath.Join(b.TempDir(), "b")
	pages := sc.mib << 20 / synth.PageSize
	for _, d := range []string{first, second} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			b.Fatal(err)
		}
		for name, data := range map[string][]byte{
			format.CheckpointFile: synth.StateFile(map[string]string{"runsc_version": "bench"}, 1<<20, 1),
			format.PagesMetaFile:  []byte("meta"),
		} {
			if err := os.WriteFile(filepath.Join(d, name), data, 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	if err := synth.WriteFile(filepath.Join(first, format.PagesFile), func(w io.Writer) error { return mixedPages(w, pages, 1) }); err != nil {
		b.Fatal(err)
	}
	edits := secondPlan(pages, sc.rewrite, 2)
	src, err := os.Open(filepath.Join(first, format.PagesFile))
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	err = synth.WriteFile(filepath.Join(second, format.PagesFile), func(w io.Writer) error {
		_, err := synth.Mutate(w, bufio.NewReader(src), pages, edits, synth.Random, 5)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	return first, second
}

// secondPlan is the edits that make the next snapshot of an app of pages
// pages: rewrite of the pages in runs of 16-256, and 16 inserted runs of
// 1-8 pages, sorted and not overlapping.
func secondPlan(pages int64, rewrite float64, seed uint64) []synth.Edit {
	plan := synth.MutationPlan(pages, 0, rewrite, seed)
	rng := rand.New(rand.NewPCG(seed, 4))
	for range 16 {
		plan = append(plan, synth.Edit{Page: rng.Int64N(pages), Insert: 1 + rng.Int64N(8)})
	}
	sort.Slice(plan, func(i, j int) bool { return plan[i].Page < plan[j].Page })
	var edits []synth.Edit
	var end int64
	for _, e := range plan {
		if e.Page >= end {
			edits = append(edits, e)
			end = e.Page + max(e.Rewrite, 1)
		}
	}
	return edits
}

// mixedPages writes n pages in runs of 1-64 pages: 50% random, 30%
// text-like, 20% zero.
func mixedPages(w io.Writer, n int64, seed uint64) error {
	random, err := synth.NewPages(synth.Random, seed)
	if err != nil {
		return err
	}
	text, err := synth.NewPages(synth.Text, seed+1)
	if err != nil {
		return err
	}
	rng := rand.New(rand.NewPCG(seed, 99))
	buf := make([]byte, 64*synth.PageSize)
	for at := int64(0); at < n; {
		run := min(1+rng.Int64N(64), n-at)
		p := buf[:run*synth.PageSize]
		switch r := rng.IntN(10); {
		case r < 5:
			random.Fill(p, at)
		case r < 8:
			text.Fill(p, at)
		default:
			clear(p)
		}
		if _, err := w.Write(p); err != nil {
			return err
		}
		at += run
	}
	return nil
}

// BenchmarkChainWaste pushes a chain of 20 snapshots of one app, each
// the one before with 5% of its pages rewritten and 16 runs inserted,
// each against the one before as its base, then deletes the oldest 15,
// and reports the waste: the bytes of the packs the 5 live snapshots list
// that none of their chunks uses, as a share of the bytes their chunks
// use.
func BenchmarkChainWaste(b *testing.B) {
	const links, live = 20, 5
	for range b.N {
		for _, minLive := range []float64{0, 0.5, 0.7, 0.8} {
			ctx := context.Background()
			store, err := layout.New(b.TempDir())
			if err != nil {
				b.Fatal(err)
			}
			dir, next := makePair(b, scenario{mib: 64, rewrite: 0.05})
			var tables [][]*format.Table
			var pushed int64 // by the 19 pushes after the first
			for i := range links {
				opts := format.PackOptions{Format: format.V2}
				if i > 0 {
					opts.Resolver = format.NewTableResolverLive(tables[i-1], minLive)
				}
				d, st, err := format.Pack(ctx, dir, store, opts)
				if err != nil {
					b.Fatal(err)
				}
				if i > 0 {
					pushed += st.UploadedBytes
				}
				tables = append(tables, snapshotTables(b, store, d))
				if i < links-1 {
					dir = mutate(b, dir, next, uint64(10+i))
				}
			}
			// Frames by place (a chunk stored anew is a second frame),
			// chunks by digest.
			frames, chunks, packs := map[string]int64{}, map[string]int64{}, map[string]int64{}
			for _, ts := range tables[links-live:] {
				for _, t := range ts {
					for _, c := range t.Chunks {
						if c.Packed() {
							frames[fmt.Sprint(c.Blob, c.PackOffset)] = c.BlobSize
							chunks[c.Digest.String()] = c.BlobSize
							packs[c.Blob.String()] = c.PackSize
						}
					}
				}
			}
			var used, distinct, listed int64
			for _, n := range frames {
				used += n
			}
			for _, n := range chunks {
				distinct += n
			}
			for _, n := range packs {
				listed += n
			}
			b.Logf("chain of %d, %d live, reuse from packs at least %.0f%% live in the base: live frames %d bytes (chunks %d), their packs %d bytes: dead %.1f%% of live, duplicate frames %.1f%%; later pushes uploaded %d bytes each on average",
				links, live, 100*minLive, used, distinct, listed, 100*float64(listed-used)/float64(used), 100*float64(used-distinct)/float64(distinct), pushed/(links-1))
		}
	}
}

// snapshotTables loads every chunk table of snapshot d.
func snapshotTables(b *testing.B, store *layout.Store, d ocispec.Descriptor) []*format.Table {
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, store, d)
	if err != nil {
		b.Fatal(err)
	}
	out, err := format.LoadTables(ctx, store, snap)
	if err != nil {
		b.Fatal(err)
	}
	return out
}

// mutate writes a new image dir: dir with its pages.img mutated (seed).
func mutate(b *testing.B, dir, _ string, seed uint64) string {
	out := filepath.Join(b.TempDir(), "img")
	if err := os.CopyFS(out, os.DirFS(dir)); err != nil {
		b.Fatal(err)
	}
	src, err := os.Open(filepath.Join(dir, format.PagesFile))
	if err != nil {
		b.Fatal(err)
	}
	defer src.Close()
	info, _ := src.Stat()
	pages := info.Size() / synth.PageSize
	edits := secondPlan(pages, 0.05, seed)
	os.Remove(filepath.Join(out, format.PagesFile))
	err = synth.WriteFile(filepath.Join(out, format.PagesFile), func(w io.Writer) error {
		_, err := synth.Mutate(w, bufio.NewReader(src), pages, edits, synth.Random, seed)
		return err
	})
	if err != nil {
		b.Fatal(err)
	}
	return out
}
