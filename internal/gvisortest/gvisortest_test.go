package gvisortest

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"
)

// TestCheckpointRestore checkpoints a 64 MiB app and restores it: the
// counter must continue and the buffer's hash must be unchanged.
func TestCheckpointRestore(t *testing.T) {
	runsc := Runsc(t)
	version := RunscVersion(t, runsc)
	const mib = 64
	app := StartApp(t, runsc, AppOptions{MemoryMiB: mib})
	t.Logf("runsc %s, python %s", version, app.Python())

	c1 := app.NextCount(t)
	c2 := app.NextCount(t)
	if c2 != c1+1 {
		t.Fatalf("counts %d then %d, want consecutive", c1, c2)
	}
	before := app.Hash(t)
	if before != app.StartHash() {
		t.Fatalf("hash before checkpoint %s != start hash %s", before, app.StartHash())
	}
	app.NextCount(t)

	start := time.Now()
	img := app.Checkpoint(t)
	checkpointTime := time.Since(start)
	last := app.LastCount()
	if last <= c2 {
		t.Fatalf("last count before checkpoint %d <= %d", last, c2)
	}

	for _, name := range []string{CheckpointFile, PagesMetaFile, PagesFile} {
		fi, err := os.Stat(filepath.Join(img, name))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: %d bytes", name, fi.Size())
		if name == PagesFile && fi.Size() < mib<<20 {
			t.Errorf("%s is %d bytes, want >= %d", name, fi.Size(), mib<<20)
		}
	}
	meta, err := ReadMetadata(filepath.Join(img, CheckpointFile))
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, 0, len(meta))
	for k := range meta {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := meta[k]
		if len(v) > 100 {
			v = fmt.Sprintf("%s... (%d bytes)", v[:100], len(v))
		}
		t.Logf("checkpoint.img metadata %s = %q", k, v)
	}
	if got := meta["runsc_version"]; got != version {
		t.Errorf("runsc_version in checkpoint = %q, runsc --version says %q", got, version)
	}

	start = time.Now()
	app.Restore(t, img)
	restoreCmdTime := time.Since(start)
	next := app.NextCount(t)
	firstOutput := time.Since(start)
	if next != last+1 {
		t.Fatalf("first count after restore = %d, want %d (last before checkpoint + 1)", next, last+1)
	}
	app.WaitRestored(t)
	allPages := time.Since(start)
	after := app.Hash(t)
	if after != before {
		t.Fatalf("hash after restore %s != before checkpoint %s", after, before)
	}
	if n := app.NextCount(t); n <= next {
		t.Fatalf("count after restore went from %d to %d", next, n)
	}
	t.Logf("%d MiB: checkpoint %v; restore command %v, next output %v, all pages loaded %v",
		mib, checkpointTime.Round(time.Millisecond), restoreCmdTime.Round(time.Millisecond),
		firstOutput.Round(time.Millisecond), allPages.Round(time.Millisecond))
}

// BenchmarkCheckpointRestore times checkpoint and restore of a 128 MiB app:
// go test ./internal/gvisortest -run '^$' -bench . -benchtime 3x
func BenchmarkCheckpointRestore(b *testing.B) {
	runsc := Runsc(b)
	const mib = 128
	app := StartApp(b, runsc, AppOptions{MemoryMiB: mib})
	app.NextCount(b)
	var checkpoint, restoreCmd, firstOutput, allPages time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		img := app.Checkpoint(b)
		checkpoint += time.Since(start)
		last := app.LastCount()

		start = time.Now()
		app.Restore(b, img)
		restoreCmd += time.Since(start)
		if n := app.NextCount(b); n != last+1 {
			b.Fatalf("first count after restore = %d, want %d", n, last+1)
		}
		firstOutput += time.Since(start)
		app.WaitRestored(b)
		allPages += time.Since(start)
		if err := os.RemoveAll(img); err != nil {
			b.Fatal(err)
		}
	}
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
	b.ReportMetric(ms(checkpoint), "checkpoint-ms")
	b.ReportMetric(ms(restoreCmd), "restore-cmd-ms")
	b.ReportMetric(ms(firstOutput), "restore-first-output-ms")
	b.ReportMetric(ms(allPages), "restore-all-pages-ms")
}
