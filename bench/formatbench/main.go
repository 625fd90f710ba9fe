// Command formatbench is the format benchmark that `make bench` runs. It
// measures two things and prints them as Markdown tables ready for
// docs/benchmarks.md (progress goes to stderr). Part 1, pack throughput: for
// synthetic checkpoint image dirs of random, text-like and half-zero memory
// (internal/synth), it times format.Pack into a fresh OCI layout, format v1
// and v2, against the
// naive path that `oras push` / `oras cp --oci-layout` at best amounts to
// (read each file, sha256 it and copy it into a blob file in one pass), with
// the reps of both interleaved and the page cache warm, and reports MB/s,
// the pack/naive ratio, stored bytes and chunk counts by encoding. Part 2,
// dedup between two snapshots: a base pages.img and a copy mutated as two
// checkpoints of one app would differ (page-aligned insertions, deletions and
// rewrites; synth.MutationPlan) are cut with fixed and page-aligned CDC
// chunking at several mean chunk sizes, and for each it reports how many of
// the unchanged bytes land in chunks the base already has, how many chunks
// a puller of the second snapshot fetches, and how much a push of the second
// snapshot uploads. Neither path fsyncs, so part 1 measures CPU and page
// cache work, not the disk.
//
// Usage:
//
//	go run ./bench/formatbench [-size N] [-reps N] [-only pack|dedup|all] [-dedup-kinds random,text] [-dir DIR]
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/benchutil"
	"github.com/cryo-oci/cryo/internal/progress"
	"github.com/cryo-oci/cryo/internal/synth"
)

// Parameters of the dedup benchmark's second snapshot.
const (
	baseSeed    = 1
	mutateSeed  = 2
	indels      = 64
	rewriteFrac = 0.05
)

// dedupAvgs are the mean chunk sizes the dedup benchmark compares.
var dedupAvgs = []int{256 << 10, 1 << 20, 4 << 20}

type config struct {
	size       int64
	reps       int
	only       string
	dedupKinds []synth.Kind
}

func main() {
	size := flag.Int64("size", 1<<30, "size in bytes of each synthetic pages.img")
	dir := flag.String("dir", "", "parent of the scratch dir (default /var/tmp); a fresh temp dir is made inside it and removed at the end")
	reps := flag.Int("reps", 3, "timed repetitions of each pack measurement; the median and min-max spread are reported")
	only := flag.String("only", "all", "which part to run: pack, dedup or all")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	dedupKinds := flag.String("dedup-kinds", "random", "comma-separated kinds of memory for the dedup part: random, text, halfzero")
	flag.Usage = func() {
		w := flag.CommandLine.Output()
		fmt.Fprintf(w, `usage: formatbench [flags]

formatbench measures cryo's format on synthetic checkpoint image dirs and
prints Markdown tables to stdout (progress to stderr):

  pack   format.Pack into an OCI layout vs. a naive read+sha256+copy of each
         file, per kind of memory (random, text, halfzero): MB/s, stored bytes
         and chunk counts.
  dedup  a snapshot vs. a mutated copy of it (page-aligned insertions,
         deletions, rewrites), cut with fixed and page-cdc chunking at 256 KiB,
         1 MiB and 4 MiB: bytes shared, chunks to fetch, bytes to upload.

It needs about 2x -size of free space in the scratch dir.

flags:
`)
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 0 {
		flag.Usage()
		os.Exit(2)
	}
	cfg := config{size: *size, reps: *reps, only: *only}
	if cfg.size < chunker.PageSize || cfg.reps < 1 {
		fatalf("-size must be at least %d and -reps at least 1", chunker.PageSize)
	}
	switch cfg.only {
	case "pack", "dedup", "all":
	default:
		fatalf("-only must be pack, dedup or all, not %q", cfg.only)
	}
	for _, k := range strings.Split(*dedupKinds, ",") {
		k = strings.TrimSpace(k)
		if k == "" {
			continue
		}
		if _, err := synth.NewPages(synth.Kind(k), 0); err != nil {
			fatalf("-dedup-kinds: %v", err)
		}
		cfg.dedupKinds = append(cfg.dedupKinds, synth.Kind(k))
	}
	parent := *dir
	if parent == "" {
		parent = "/var/tmp"
	}
	scratch, err := os.MkdirTemp(parent, "formatbench-")
	if err != nil {
		fatalf("scratch dir: %v", err)
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fatalf("%v", err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fatalf("%v", err)
		}
		defer func() { pprof.StopCPUProfile(); f.Close() }()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = run(ctx, cfg, scratch)
	stop()
	if rerr := os.RemoveAll(scratch); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		pprof.StopCPUProfile()
		fatalf("%v", err)
	}
}

func fatalf(f string, args ...any) {
	fmt.Fprintf(os.Stderr, "formatbench: "+f+"\n", args...)
	os.Exit(1)
}

func logf(f string, args ...any) {
	fmt.Fprintf(os.Stderr, f+"\n", args...)
}

func run(ctx context.Context, cfg config, scratch string) error {
	logf("scratch dir %s, load average %s", scratch, loadavg())
	defer func() { logf("done, load average %s", loadavg()) }()
	fmt.Printf("`formatbench %s` — GOMAXPROCS=%d, %s, %s/%s, %s, %s\n",
		strings.Join(quoteArgs(os.Args[1:]), " "), runtime.GOMAXPROCS(0), runtime.Version(),
		runtime.GOOS, runtime.GOARCH, cpuModel(), time.Now().UTC().Format("2006-01-02 15:04 MST"))
	if cfg.only != "dedup" {
		if err := packBench(ctx, cfg, scratch); err != nil {
			return err
		}
	}
	if cfg.only != "pack" {
		if err := dedupBench(ctx, cfg, scratch); err != nil {
			return err
		}
	}
	return nil
}

// --- Part 1: pack throughput ---

type packRow struct {
	kind                synth.Kind
	logical             int64
	cryo, cryoV2, naive []float64 // MB/s of each rep
	stored, storedV2    int64
	zero, raw, zs       int
	chunksV2            int
}

func packBench(ctx context.Context, cfg config, scratch string) error {
	var rows []packRow
	for _, kind := range synth.Kinds {
		row, err := packKind(ctx, cfg, scratch, kind)
		if err != nil {
			return fmt.Errorf("pack %s: %w", kind, err)
		}
		rows = append(rows, row)
	}
	fmt.Printf("\n### Pack throughput, %s pages.img, %d reps\n\n", progress.Bytes(cfg.size), cfg.reps)
	fmt.Println("| kind | logical | cryo pack v1 MB/s | cryo pack v2 MB/s | naive read+sha256+copy MB/s | v1 / naive | v2 / naive | stored v1 / v2 | v1 chunks zero / raw / zstd | v2 chunks |")
	fmt.Println("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
	for _, r := range rows {
		cm, c2, nm := benchutil.Median(r.cryo), benchutil.Median(r.cryoV2), benchutil.Median(r.naive)
		fmt.Printf("| %s | %s | %s | %s | %s | %.2f | %.2f | %s / %s | %d / %d / %d | %d |\n",
			r.kind, progress.Bytes(r.logical), benchutil.Spread(r.cryo, "%.0f"), benchutil.Spread(r.cryoV2, "%.0f"), benchutil.Spread(r.naive, "%.0f"), cm/nm, c2/nm,
			progress.Bytes(r.stored), progress.Bytes(r.storedV2), r.zero, r.raw, r.zs, r.chunksV2)
	}
	fmt.Println()
	fmt.Println("MB/s is 10^6 bytes of image dir per second of wall time: median of the reps, min–max in parentheses.",
		"cryo pack is `format.Pack` into a fresh OCI layout (v1: page-cdc, 1 MiB mean, a blob per chunk, zstd at the fastest level;",
		"v2: 64 KiB mean, 4 MiB packs, zstd at the fastest level with all-literal blocks entropy-coded; GOMAXPROCS workers);",
		"naive reads each file once, hashing it with sha256 while `io.Copy` writes it to a blob file in a fresh dir.",
		"Reps alternate between the two, with the image in the page cache, and neither path fsyncs.")
	return nil
}

func packKind(ctx context.Context, cfg config, scratch string, kind synth.Kind) (packRow, error) {
	row := packRow{kind: kind}
	img := filepath.Join(scratch, "img-"+string(kind))
	logf("pack %s: writing %s image dir", kind, progress.Bytes(cfg.size))
	if err := synth.ImageDir(img, kind, cfg.size, baseSeed); err != nil {
		return row, err
	}
	defer os.RemoveAll(img)
	logical, err := warm(img)
	if err != nil {
		return row, err
	}
	row.logical = logical
	out := filepath.Join(scratch, "out")
	for rep := 1; rep <= cfg.reps; rep++ {
		// cryo, v1 then v2
		for _, v := range []format.Version{format.V1, format.V2} {
			syscall.Sync()
			cpu0, start := cpuTime(), time.Now()
			store, err := layout.New(out)
			if err != nil {
				return row, err
			}
			_, stats, err := format.Pack(ctx, img, store, format.PackOptions{Format: v})
			if err != nil {
				return row, err
			}
			d, cpu := time.Since(start), cpuTime()-cpu0
			if err := os.RemoveAll(out); err != nil {
				return row, err
			}
			if stats.LogicalBytes != logical {
				return row, fmt.Errorf("pack read %d bytes, image dir holds %d", stats.LogicalBytes, logical)
			}
			if v == format.V2 {
				row.cryoV2 = append(row.cryoV2, mbps(logical, d))
				row.storedV2 = stats.StoredBytes
				row.chunksV2 = stats.Chunks[format.EncodingZero] + stats.Chunks[format.EncodingRaw] + stats.Chunks[format.EncodingZstd]
			} else {
				row.cryo = append(row.cryo, mbps(logical, d))
				row.stored = stats.StoredBytes
				row.zero, row.raw, row.zs = stats.Chunks[format.EncodingZero], stats.Chunks[format.EncodingRaw], stats.Chunks[format.EncodingZstd]
			}
			logf("pack %s rep %d/%d: cryo %s %6.2fs %7.0f MB/s (CPU %.2fs)", kind, rep, cfg.reps, v, d.Seconds(), mbps(logical, d), cpu.Seconds())
		}

		// naive
		syscall.Sync()
		cpu0, start := cpuTime(), time.Now()
		n, err := naiveCopy(ctx, img, out)
		if err != nil {
			return row, err
		}
		d, cpu := time.Since(start), cpuTime()-cpu0
		if err := os.RemoveAll(out); err != nil {
			return row, err
		}
		if n != logical {
			return row, fmt.Errorf("naive copy read %d bytes, image dir holds %d", n, logical)
		}
		row.naive = append(row.naive, mbps(logical, d))
		logf("pack %s rep %d/%d: naive %6.2fs %7.0f MB/s (CPU %.2fs)", kind, rep, cfg.reps, d.Seconds(), mbps(logical, d), cpu.Seconds())
	}
	syscall.Sync()
	return row, nil
}

// warm reads every file of dir once so that both paths find it in the page
// cache, and returns the total size.
func warm(dir string) (int64, error) {
	var total int64
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		defer f.Close()
		n, err := io.Copy(io.Discard, f)
		total += n
		return err
	})
	return total, err
}

// naiveCopy is the one-file-one-blob path: each file of dir is read once,
// hashed with sha256 and copied into dst/blobs/sha256/<hex>. It returns the
// bytes copied.
func naiveCopy(ctx context.Context, dir, dst string) (int64, error) {
	blobs := filepath.Join(dst, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o755); err != nil {
		return 0, err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, err
	}
	var total int64
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return total, err
		}
		if !e.Type().IsRegular() {
			continue
		}
		n, err := naiveBlob(filepath.Join(dir, e.Name()), blobs)
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}

func naiveBlob(name, blobs string) (int64, error) {
	src, err := os.Open(name)
	if err != nil {
		return 0, err
	}
	defer src.Close()
	tmp, err := os.CreateTemp(blobs, ".ingest-*")
	if err != nil {
		return 0, err
	}
	h := sha256.New()
	n, err := io.Copy(tmp, io.TeeReader(src, h))
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(blobs, hex.EncodeToString(h.Sum(nil))))
	}
	if err != nil {
		os.Remove(tmp.Name())
	}
	return n, err
}

// --- Part 2: dedup between two snapshots ---

type dedupRow struct {
	kind      synth.Kind
	params    chunker.Params
	chunks    int   // chunks of the second file
	size      int64 // size of the second file
	shared    int64 // bytes of the second file in chunks the first has
	upload    int64 // bytes of the second file's distinct non-zero chunks the first lacks
	unchanged int64
}

type dedupInput struct {
	kind      synth.Kind
	edits     int
	size      int64
	unchanged int64
}

func dedupBench(ctx context.Context, cfg config, scratch string) error {
	pages := (cfg.size + synth.PageSize - 1) / synth.PageSize
	plan := synth.MutationPlan(pages, indels, rewriteFrac, mutateSeed)
	var rows []dedupRow
	var inputs []dedupInput
	for _, kind := range cfg.dedupKinds {
		base := filepath.Join(scratch, "base-"+string(kind)+".img")
		second := filepath.Join(scratch, "second-"+string(kind)+".img")
		logf("dedup %s: writing base and mutated copy (%s each)", kind, progress.Bytes(cfg.size))
		unchanged, err := makePair(base, second, kind, cfg.size, pages, plan)
		if err != nil {
			return fmt.Errorf("dedup %s: %w", kind, err)
		}
		st, err := os.Stat(second)
		if err != nil {
			return err
		}
		inputs = append(inputs, dedupInput{kind: kind, edits: len(plan), size: st.Size(), unchanged: unchanged})
		for _, alg := range []string{chunker.Fixed, chunker.PageCDC} {
			for _, avg := range dedupAvgs {
				p := chunker.FixedSize(avg)
				if alg == chunker.PageCDC {
					p = chunker.DefaultPageCDC(avg)
				}
				if err := ctx.Err(); err != nil {
					return err
				}
				start := time.Now()
				r, err := dedupPair(base, second, p)
				if err != nil {
					return fmt.Errorf("dedup %s %s/%s: %w", kind, alg, progress.Bytes(int64(avg)), err)
				}
				r.kind, r.unchanged = kind, unchanged
				rows = append(rows, r)
				logf("dedup %s %-8s %7s: %d chunks, shared %.1f%% of unchanged (%.1fs)", kind, alg, progress.Bytes(int64(avg)),
					r.chunks, 100*float64(r.shared)/float64(unchanged), time.Since(start).Seconds())
			}
		}
		os.Remove(base)
		os.Remove(second)
	}
	fmt.Printf("\n### Dedup between two snapshots, %s pages.img\n\n", progress.Bytes(cfg.size))
	for _, in := range inputs {
		fmt.Printf("- %s: base is %s of %s pages (seed %d); the second is `synth.Mutate` of it with `MutationPlan(%d pages, %d, %.2f, %d)`: %d edits, %s, of which %s (%.1f%%) are unchanged pages of the base.\n",
			in.kind, progress.Bytes(cfg.size), in.kind, baseSeed, pages, indels, rewriteFrac, mutateSeed, in.edits,
			progress.Bytes(in.size), progress.Bytes(in.unchanged), 100*float64(in.unchanged)/float64(in.size))
	}
	fmt.Println()
	fmt.Println("| kind | chunking | avg | chunks of 2nd (fetches) | mean chunk | shared / unchanged | upload / size of 2nd |")
	fmt.Println("|---|---|--:|--:|--:|--:|--:|")
	for _, r := range rows {
		fmt.Printf("| %s | %s | %s | %d | %s | %.1f%% | %.1f%% |\n",
			r.kind, r.params.Algorithm, progress.Bytes(int64(r.params.Avg)), r.chunks,
			progress.Bytes(r.size/int64(max(r.chunks, 1))), 100*float64(r.shared)/float64(r.unchanged),
			100*float64(r.upload)/float64(r.size))
	}
	fmt.Println()
	fmt.Println("Shared bytes are the bytes of the second file's chunks whose sha256 is also among the base's chunks, as a share of the bytes Mutate left unchanged;",
		"upload is the size of the second file's distinct chunks the base lacks, all-zero chunks excepted (cryo stores them as nothing). page-cdc uses min avg/4, max 4·avg.")
	return nil
}

// makePair writes the base pages and the mutated copy and returns how many
// bytes of the copy are unchanged base bytes.
func makePair(base, second string, kind synth.Kind, size, pages int64, plan []synth.Edit) (int64, error) {
	if err := synth.WriteFile(base, func(w io.Writer) error { return synth.WritePages(w, kind, size, baseSeed) }); err != nil {
		return 0, err
	}
	src, err := os.Open(base)
	if err != nil {
		return 0, err
	}
	defer src.Close()
	var unchanged int64
	err = synth.WriteFile(second, func(w io.Writer) error {
		var err error
		unchanged, err = synth.Mutate(w, bufio.NewReaderSize(src, 1<<20), pages, plan, kind, mutateSeed)
		return err
	})
	return unchanged, err
}

type chunkSum struct {
	sum  [sha256.Size]byte
	size int
	zero bool // all zero bytes: cryo stores it as nothing
}

// zeros is only ever compared against.
var zeros = make([]byte, chunker.MaxChunkSize)

// chunkFile cuts the file name with p and returns the sha256 and size of each
// chunk in order.
func chunkFile(name string, p chunker.Params) ([]chunkSum, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	c, err := chunker.New(f, p)
	if err != nil {
		return nil, err
	}
	var sums []chunkSum
	for {
		data, _, err := c.Next()
		if errors.Is(err, io.EOF) {
			return sums, nil
		}
		if err != nil {
			return nil, err
		}
		zero := len(data) > 0 && data[0] == 0 && bytes.Equal(data, zeros[:len(data)])
		sums = append(sums, chunkSum{sum: sha256.Sum256(data), size: len(data), zero: zero})
	}
}

// dedupPair chunks both files (at once, one per core) and compares them.
func dedupPair(base, second string, p chunker.Params) (dedupRow, error) {
	var baseSums, secondSums []chunkSum
	var baseErr, secondErr error
	var wg sync.WaitGroup
	wg.Go(func() { baseSums, baseErr = chunkFile(base, p) })
	secondSums, secondErr = chunkFile(second, p)
	wg.Wait()
	if err := errors.Join(baseErr, secondErr); err != nil {
		return dedupRow{}, err
	}
	have := make(map[[sha256.Size]byte]bool, len(baseSums))
	for _, c := range baseSums {
		have[c.sum] = true
	}
	r := dedupRow{params: p, chunks: len(secondSums)}
	uploaded := map[[sha256.Size]byte]bool{}
	for _, c := range secondSums {
		r.size += int64(c.size)
		switch {
		case have[c.sum]:
			r.shared += int64(c.size)
		case !c.zero && !uploaded[c.sum]:
			uploaded[c.sum] = true
			r.upload += int64(c.size)
		}
	}
	return r, nil
}

// --- helpers ---

// cpuTime is the user+system CPU time the process has used so far; progress
// lines show it next to wall time so that a rep slowed by other work on the
// machine stands out.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// loadavg returns the first line of /proc/loadavg, or "".
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func mbps(n int64, d time.Duration) float64 {
	return float64(n) / 1e6 / d.Seconds()
}

func quoteArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t\"'`$\\") {
			a = strconv.Quote(a)
		}
		out[i] = a
	}
	return out
}

// cpuModel returns the CPU model from /proc/cpuinfo, or "unknown CPU".
func cpuModel() string {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown CPU"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "unknown CPU"
}
