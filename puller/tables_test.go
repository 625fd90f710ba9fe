package puller

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// TestMountReadyBeforeTables mounts a snapshot whose pages.img chunk
// tables (two parts) the registry does not serve: the mount is ready all
// the same (it needs only the index and the small files), a read of
// pages.img across its parts' boundary waits for their tables rather than
// failing, and once the registry serves them the read returns the source's
// bytes and the load completes.
func TestMountReadyBeforeTables(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 20<<20, 3); err != nil {
		t.Fatal(err)
	}
	// 4 KiB chunks: 5,120 for pages.img, two parts (format.MaxChunksPerPart).
	pack := format.PackOptions{Format: format.V2}
	pack.Chunking.Algorithm = "fixed"
	pack.Chunking.Min, pack.Chunking.Avg, pack.Chunking.Max = 4096, 4096, 4096
	repo := r.repo(t, "app:v1")
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{Pack: pack})
	if err != nil {
		t.Fatal(err)
	}
	s := Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: transfer.Ranged{Repository: repo}}}}
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, repo, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	pages := snap.File(format.PagesFile)
	if len(pages.Parts) < 2 {
		t.Fatalf("pages.img has %d parts, want 2 or more", len(pages.Parts))
	}
	unserved := map[string]bool{}
	for part := range pages.Parts {
		pt, err := format.LoadPart(ctx, repo, pages, part)
		if err != nil {
			t.Fatal(err)
		}
		unserved[pt.Manifest.Config.Digest.String()] = true
	}
	r.set(func(r *reg) { r.unserved = unserved })

	p := newPuller(t, Options{})
	m := mount(t, p, s)
	if mode := m.Progress().Mode; mode != "fuse" {
		t.Fatalf("mode %s, want fuse", mode)
	}
	boundary := pages.Parts[1].Offset
	got := make([]byte, 8192)
	done := make(chan error, 1)
	go func() {
		f, err := os.Open(filepath.Join(m.Dir(), format.PagesFile))
		if err != nil {
			done <- err
			return
		}
		defer f.Close()
		_, err = f.ReadAt(got, boundary-4096)
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("read of pages.img returned (%v) while its chunk tables were not served", err)
	case <-time.After(time.Second):
	}
	r.set(func(r *reg) { r.unserved = nil })
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("read across pages.img's parts once its tables were served: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("read did not complete after the tables were served")
	}
	want, err := os.ReadFile(filepath.Join(dir, format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want[boundary-4096:boundary+4096]) {
		t.Fatal("bytes across pages.img's parts differ from the source's")
	}
	waitLoaded(t, m)
	whole, _ := os.ReadFile(filepath.Join(p.MaterializedDir(s.Index.Digest), format.PagesFile))
	if !bytes.Equal(whole, want) {
		t.Fatal("materialized pages.img differs")
	}
}

// TestLyingPartTableFailsItsReads serves a pages.img whose chunk table
// disagrees with the snapshot index only when a read needs it: the mount
// is ready, the read fails at once (EIO, never bytes the table made up;
// not retried: no endpoint can serve other bytes), and the background
// load reports the table's error.
func TestLyingPartTableFailsItsReads(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	_, s := push(t, r, "app", synth.Random, 8<<20, 4)
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, s.Endpoints[0].Store, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	// A snapshot index whose pages.img digest is not its table's: pushed
	// as a new index over the same manifests.
	idx := lieAboutDigest(t, r, s, snap, format.PagesFile)
	// A deadline of an hour: a table retried like a failed fetch would
	// hold the read far past the wait below.
	p := newPuller(t, Options{Deadline: time.Hour})
	m := mount(t, p, idx)
	read := make(chan error, 1)
	go func() {
		_, err := os.ReadFile(filepath.Join(m.Dir(), format.PagesFile))
		read <- err
	}()
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("read of pages.img through a table that disagrees with the index succeeded")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("read of pages.img through an invalid table still waits after 60 s: retried as if it could heal")
	}
	select {
	case <-m.Loaded():
		if m.Err() == nil || !bytes.Contains([]byte(m.Err().Error()), []byte("disagrees with the snapshot index")) {
			t.Fatalf("background load: %v, want the table's disagreement", m.Err())
		}
	case <-time.After(60 * time.Second):
		t.Fatal("background load did not end")
	}
}

// lieAboutDigest pushes a copy of s's snapshot index in which file path's
// digest annotation names other bytes, over the same manifests, and
// returns it as a Source: its tables then disagree with it.
func lieAboutDigest(t *testing.T, r *reg, s Source, snap *format.Snapshot, path string) Source {
	t.Helper()
	ctx := context.Background()
	repo := r.repo(t, "app:v1")
	data, err := content.FetchAll(ctx, repo, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	real := snap.File(path).Digest.String()
	lie := digest.FromString("other bytes").String()
	if bytes.Count(data, []byte(real)) == 0 {
		t.Fatalf("index does not name %s's digest", path)
	}
	data = bytes.ReplaceAll(data, []byte(real), []byte(lie))
	desc := content.NewDescriptorFromBytes(ocispec.MediaTypeImageIndex, data)
	if err := repo.Push(ctx, desc, bytes.NewReader(data)); err != nil {
		t.Fatal(err)
	}
	return Source{Index: desc, Endpoints: s.Endpoints}
}

// TestTableOutageThenRecovery: the registry fails pages.img's table for
// longer than the fetch deadline: a read waits the deadline and fails
// (EIO), and once the registry serves the table again the next read
// returns the source's bytes (the failure is not kept).
func TestTableOutageThenRecovery(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 8<<20, 5)
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, s.Endpoints[0].Store, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	pt, err := format.LoadPart(ctx, s.Endpoints[0].Store, snap.File(format.PagesFile), 0)
	if err != nil {
		t.Fatal(err)
	}
	r.set(func(r *reg) { r.unserved = map[string]bool{pt.Manifest.Config.Digest.String(): true} })
	p := newPuller(t, Options{Deadline: time.Second})
	m := mount(t, p, s)
	pages := filepath.Join(m.Dir(), format.PagesFile)
	if _, err := os.ReadFile(pages); err == nil {
		t.Fatal("read of pages.img succeeded while its chunk table was not served")
	}
	r.set(func(r *reg) { r.unserved = nil })
	got, err := os.ReadFile(pages)
	want, _ := os.ReadFile(filepath.Join(src, format.PagesFile))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read of pages.img once its table is served again: %d bytes, %v", len(got), err)
	}
}

// holdingFetcher holds every fetch until its context ends, counting the
// fetches held at once.
type holdingFetcher struct {
	mu        sync.Mutex
	held, max int
}

func (h *holdingFetcher) Fetch(ctx context.Context, _ ocispec.Descriptor) (io.ReadCloser, error) {
	h.mu.Lock()
	h.held++
	h.max = max(h.max, h.held)
	h.mu.Unlock()
	<-ctx.Done()
	h.mu.Lock()
	h.held--
	h.mu.Unlock()
	return nil, ctx.Err()
}

func (h *holdingFetcher) counts() (held, most int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.held, h.max
}

// TestUrgentTableLoadsBounded: reads waiting for the tables of 40 parts
// at once (page faults all over a large snapshot) fetch at most
// urgentTableLoads of them at a time.
func TestUrgentTableLoadsBounded(t *testing.T) {
	const parts = 40
	f := format.File{Path: format.PagesFile, Size: parts << 20, Version: format.V2}
	for i := range parts {
		f.Parts = append(f.Parts, format.Part{Offset: int64(i) << 20, Length: 1 << 20,
			Manifest: ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString(fmt.Sprint(i)), Size: 100}})
	}
	src := &holdingFetcher{}
	ctx, cancel := context.WithCancel(context.Background())
	tabs := newTables(ctx, src, &format.Snapshot{Files: []format.File{f}}, time.Hour)
	var readers sync.WaitGroup
	for pi := range parts {
		readers.Add(1)
		go func() {
			defer readers.Done()
			tabs.part(ctx, 0, pi)
		}()
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if held, _ := src.counts(); held >= urgentTableLoads {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the reads' table fetches never started")
		}
	}
	time.Sleep(100 * time.Millisecond) // room for fetches beyond the bound
	_, most := src.counts()
	cancel()
	readers.Wait()
	if most > urgentTableLoads {
		t.Errorf("%d table fetches at once for reads, want at most %d", most, urgentTableLoads)
	}
}
