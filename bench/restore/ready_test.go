package restore

import (
	"bufio"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/transfer"
)

var (
	readyGiB     = flag.String("ready-gib", "1,8", "BenchmarkReady: snapshot sizes in GiB")
	readyFormats = flag.String("ready-formats", "v1,v2", "BenchmarkReady: formats")
)

// BenchmarkReady measures how long `cryo mount` takes until its mount is
// ready (the index, the small files and their tables loaded, FUSE up),
// against the snapshot's size, for each format and link: the time a
// restore waits before gVisor can read anything; and then how long a first
// 4 KiB read of pages.img at its middle takes (a page fault: its part's
// table, then its chunk). Snapshots are half random, half zero
// pages, packed from a stream (never on disk) so that 32 GiB fits the
// machine.
func BenchmarkReady(b *testing.B) {
	testenv.NeedFUSE(b, "cryo mount")
	cryo := testenv.Tool(b, "cryo")
	reg := testenv.StartRegistry(b, "")
	links := parseLinks(b, *linksFlag)
	var sizes []int64
	for _, s := range strings.Split(*readyGiB, ",") {
		n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil {
			b.Fatalf("-ready-gib: %v", err)
		}
		sizes = append(sizes, n)
	}
	fmt.Printf("| snapshot | format | parts | chunks | table bytes | push | %s |\n|---|---|--:|--:|--:|--:|%s\n",
		strings.Join(linkNames(links, "mount ready / + first read, "), " | "), strings.Repeat("--:|", len(links)))
	for _, gib := range sizes {
		for _, f := range strings.Split(*readyFormats, ",") {
			tag := fmt.Sprintf("%dg-%s", gib, f)
			start := time.Now()
			st := pushStreamed(b, reg.Addr+"/ready:"+tag, gib<<30, f)
			pushed := time.Since(start)
			var cells []string
			for _, l := range links {
				ready, read := mountReady(b, cryo, reg.Addr, "ready:"+tag, gib<<30, l)
				cells = append(cells, fmt.Sprintf("%.2f / %.2f s", ready, read))
			}
			fmt.Printf("| %d GiB | %s | %d | %d | %.1f MB | %.0f s | %s |\n", gib, f, st.parts, st.chunks, float64(st.tableBytes)/1e6, pushed.Seconds(), strings.Join(cells, " | "))
		}
	}
}

func linkNames(links []testenv.Link, prefix string) []string {
	var out []string
	for _, l := range links {
		out = append(out, prefix+l.Name)
	}
	return out
}

// tableStats describes a pushed snapshot's chunk tables.
type tableStats struct {
	parts, chunks int
	tableBytes    int64
}

// pushStreamed pushes to ref a synthetic image dir whose pages.img has
// size bytes of half-zero memory, generated as it is packed.
func pushStreamed(b *testing.B, ref string, size int64, f string) tableStats {
	ctx := context.Background()
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		b.Fatal(err)
	}
	opts := transfer.PushOptions{NoBase: true}
	if f == "v2" {
		opts.Pack.Format = format.V2
	}
	p, err := transfer.NewPusher(ctx, repo, tag, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	meta := make([]byte, 2048)
	binary.LittleEndian.PutUint64(meta, uint64(size))
	state := synth.StateFile(map[string]string{"runsc_version": "synthetic", "container_count": "1"}, 64<<10, 1)
	for name, data := range map[string][]byte{format.CheckpointFile: state, format.PagesMetaFile: meta} {
		if _, err := p.AddFile(ctx, name, 0o644, strings.NewReader(string(data))); err != nil {
			b.Fatal(err)
		}
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(synth.WritePages(pw, synth.HalfZero, size, 1)) }()
	if _, err := p.AddFile(ctx, format.PagesFile, 0o644, pr); err != nil {
		b.Fatal(err)
	}
	res, err := p.Finish(ctx, tag)
	if err != nil {
		b.Fatal(err)
	}
	snap, err := format.LoadSnapshot(ctx, repo, res.Descriptor)
	if err != nil {
		b.Fatal(err)
	}
	var st tableStats
	for i := range snap.Files {
		file := &snap.Files[i]
		for part := range file.Parts {
			pt, err := format.LoadPart(ctx, repo, file, part)
			if err != nil {
				b.Fatal(err)
			}
			st.parts++
			st.chunks += len(pt.Table.Chunks)
			st.tableBytes += pt.Manifest.Config.Size
		}
	}
	return st
}

var readyLine = regexp.MustCompile(`^ready: .*, ([0-9.]+) ms\)`)

// mountReady runs `cryo mount` of repo (on the registry at addr, reached
// over link) on an empty node cache and returns the seconds it reports
// until ready, and the seconds a 4 KiB read of the middle of its pages.img
// (of size bytes) then takes; the mount is then stopped.
func mountReady(b *testing.B, cryo, addr, repo string, size int64, l testenv.Link) (float64, float64) {
	target := addr
	if l.BitsPerSecond > 0 || l.RTT > 0 {
		px, err := testenv.StartProxy(addr, l)
		if err != nil {
			b.Fatal(err)
		}
		defer px.Close()
		target = px.Addr()
	}
	dir := b.TempDir()
	mnt, cache := filepath.Join(dir, "mnt"), filepath.Join(dir, "cache")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(cryo, "mount", "--plain-http", "--profile", "none", "--cache", cache, target+"/"+repo, mnt)
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(syscall.SIGTERM)
		cmd.Wait()
		os.RemoveAll(cache)
	}()
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if m := readyLine.FindStringSubmatch(sc.Text()); m != nil {
			ms, _ := strconv.ParseFloat(m[1], 64)
			go io.Copy(io.Discard, out)
			return ms / 1000, firstRead(b, filepath.Join(mnt, format.PagesFile), size/2&^4095)
		}
	}
	b.Fatalf("cryo mount %s ended before ready:\n%s", repo, stderr.String())
	return 0, 0
}

// firstRead returns the seconds a 4 KiB read of file at off takes.
func firstRead(b *testing.B, file string, off int64) float64 {
	f, err := os.Open(file)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	start := time.Now()
	if _, err := f.ReadAt(make([]byte, 4096), off); err != nil {
		b.Fatalf("read %s at %d: %v", file, off, err)
	}
	return time.Since(start).Seconds()
}
