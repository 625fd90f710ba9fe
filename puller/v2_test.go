package puller

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/imagefs"
	"github.com/cryo-oci/cryo/transfer"
)

// pushV2 makes a synthetic image dir and pushes it as name:v1 in format
// v2 (64 KiB chunks in 4 MiB packs).
func pushV2(t testing.TB, r *reg, name string, kind synth.Kind, size int64, seed uint64) (string, Source) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, kind, size, seed); err != nil {
		t.Fatal(err)
	}
	repo := r.repo(t, name+":v1")
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}})
	if err != nil {
		t.Fatal(err)
	}
	return dir, Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: transfer.Ranged{Repository: repo}}}}
}

// TestV2FullLoadCoalescesFrames mounts a v2 snapshot on a cold node and
// loads it whole: the frames of a pack are fetched in few range requests,
// not one request per chunk, and every byte is the source's.
func TestV2FullLoadCoalescesFrames(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 32<<20, 1)
	chunks := len(snapshotChunks(t, s))
	before := r.blobGets.Load()
	m := mount(t, newPuller(t, Options{}), s)
	waitLoaded(t, m)
	gets := r.blobGets.Load() - before
	// 32 MiB of random pages: 8 packs, about 512 chunks.
	if chunks < 256 || gets > int64(chunks)/8 {
		t.Fatalf("%d chunks loaded in %d blob requests: frames not coalesced", chunks, gets)
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		got, _ := os.ReadFile(filepath.Join(m.Dir(), name))
		want, _ := os.ReadFile(filepath.Join(src, name))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s differs", name)
		}
	}
	t.Logf("%d chunks, %d requests", chunks, gets)
}

// TestV2RandomSmallReadsMoveLittle reads 4 KiB at random offsets of a v2
// snapshot's pages.img on a cold node cache, as a mount's page faults,
// through the fetch scheduler and the read path every presenter shares
// (imagefs.ReadAt), with no background load: each read moves the one
// chunk it touches, not a pack, and brings its neighbourhood along only
// when a recent fault was near it, so that 4 KiB reads move at most 256
// KiB each.
func TestV2RandomSmallReadsMoveLittle(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 64<<20, 2)
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	chunks := snapshotChunksOf(t, s, format.PagesFile)
	c, codec := coldCache(t)
	sched := fetch.New(s.Endpoints, c, codec, fetch.Options{})
	defer sched.Close()
	file := &imagefs.File{Path: format.PagesFile, Size: int64(len(want)), Chunks: chunks, Faults: &imagefs.FaultHistory{}}
	rng := rand.New(rand.NewPCG(3, 3))
	buf := make([]byte, 4096)
	const reads = 200
	before := r.blobBytes.Load()
	for range reads {
		off := rng.Int64N(int64(len(want))/4096) * 4096
		if err := imagefs.ReadAt(context.Background(), c, file, buf, off, scheduled{s: sched, prio: fetch.Fault}, &imagefs.Stats{}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, want[off:off+4096]) {
			t.Fatalf("bytes at %d differ", off)
		}
	}
	moved := r.blobBytes.Load() - before
	if moved > reads*256<<10 {
		t.Fatalf("%d random 4 KiB reads moved %d bytes, %d per read: over 256 KiB each", reads, moved, moved/reads)
	}
	t.Logf("%d bytes per random 4 KiB read", moved/reads)
}

// TestV2NearbyFaultsBringTheirRegion: a page fault near a recent one (in
// the same aligned imagefs.NearSpan) brings that whole span's chunks
// along, in few range requests, and every byte read is the source's; the
// first fault there brought only its own chunk.
func TestV2NearbyFaultsBringTheirRegion(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 16<<20, 4)
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	chunks := snapshotChunksOf(t, s, format.PagesFile)
	c, codec := coldCache(t)
	sched := fetch.New(s.Endpoints, c, codec, fetch.Options{KeepLog: true})
	defer sched.Close()
	file := &imagefs.File{Path: format.PagesFile, Size: int64(len(want)), Chunks: chunks, Faults: &imagefs.FaultHistory{}}
	region := int64(5 * imagefs.NearSpan)
	var inRegion []format.Chunk
	for _, ch := range chunks {
		if ch.End() > region && ch.Offset < region+imagefs.NearSpan {
			inRegion = append(inRegion, ch)
		}
	}
	buf := make([]byte, 4096)
	read := func(off int64) {
		t.Helper()
		if err := imagefs.ReadAt(context.Background(), c, file, buf, off, scheduled{s: sched, prio: fetch.Fault}, &imagefs.Stats{}); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, want[off:off+4096]) {
			t.Fatalf("bytes at %d differ", off)
		}
	}
	before := r.blobGets.Load()
	read(region + 600<<10)
	// Every fetch is logged when it is taken, the neighbours a fault
	// takes along included, before the fault's bytes are served.
	if n := len(sched.Log()); n > 1 {
		t.Fatalf("a first fault in the region fetched %d chunks: it brought neighbours along", n)
	}
	read(region + 300<<10)
	settle(t, c, inRegion)
	gets := r.blobGets.Load() - before
	if gets > 5 {
		t.Errorf("%d blob requests for two faults and their region of %d chunks: not coalesced", gets, len(inRegion))
	}
	t.Logf("%d chunks in the region, %d requests", len(inRegion), gets)
}

// settle waits until every chunk of want is in the node cache c (the
// fetch scheduler writes them in the background).
func settle(t *testing.T, c *cache.Store, want []format.Chunk) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		all := true
		for _, ch := range want {
			all = all && c.Has(ch.Digest)
		}
		if all {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("chunks never reached the node cache")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// coldCache returns an empty node cache and a codec, closed at the
// test's end: for tests that drive a fetch scheduler themselves.
func coldCache(t *testing.T) (*cache.Store, *format.Codec) {
	t.Helper()
	c, err := cache.Open(t.TempDir(), 0)
	if err != nil {
		t.Fatal(err)
	}
	codec, err := format.NewCodec(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(codec.Close)
	return c, codec
}

// snapshotChunksOf lists the chunks of file path of s's snapshot, in order.
func snapshotChunksOf(t testing.TB, s Source, path string) []format.Chunk {
	t.Helper()
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, s.Endpoints[0].Store, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	f := snap.File(path)
	var out []format.Chunk
	for part := range f.Parts {
		pt, err := format.LoadPart(ctx, s.Endpoints[0].Store, f, part)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, pt.Table.Chunks...)
	}
	return out
}

// TestV2LoadsFromARegistryIgnoringRange loads a v2 snapshot from a
// registry that answers every range request with the whole pack (200):
// every byte is still right.
func TestV2LoadsFromARegistryIgnoringRange(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.HalfZero, 16<<20, 4)
	r.set(func(r *reg) { r.noRange = true })
	m := mount(t, newPuller(t, Options{}), s)
	waitLoaded(t, m)
	for _, name := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		got, _ := os.ReadFile(filepath.Join(m.Dir(), name))
		want, _ := os.ReadFile(filepath.Join(src, name))
		if !bytes.Equal(got, want) {
			t.Fatalf("%s differs", name)
		}
	}
}

// TestV2CorruptPackFailsOverToMirror serves a v2 snapshot's packs corrupt
// from the first endpoint: every frame fails verification there and is
// fetched from the second; no wrong byte is served.
func TestV2CorruptPackFailsOverToMirror(t *testing.T) {
	needFUSE(t)
	bad, good := startReg(t), startReg(t)
	src, s := pushV2(t, good, "app", synth.Random, 8<<20, 5)
	// The same snapshot on the bad registry, its packs served corrupt.
	_, sb := pushV2(t, bad, "app", synth.Random, 8<<20, 5)
	if sb.Index.Digest != s.Index.Digest {
		t.Fatalf("the two pushes differ: %s, %s", sb.Index.Digest, s.Index.Digest)
	}
	for _, c := range snapshotChunks(t, s) {
		bad.set(func(r *reg) { r.corrupt[c.Blob.String()] = true })
	}
	s.Endpoints = append(sb.Endpoints, s.Endpoints...)
	m := mount(t, newPuller(t, Options{}), s)
	waitLoaded(t, m)
	got, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs")
	}
	if good.blobGets.Load() == 0 {
		t.Fatal("nothing was fetched from the good endpoint")
	}
}

// TestV2RegistryOutageMidLoad takes the registry's blobs down right after
// a v2 mount is ready, for half a second: the range requests fail, their
// chunks are fetched on their own with retries, and every byte arrives.
func TestV2RegistryOutageMidLoad(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 16<<20, 6)
	r.set(func(r *reg) { r.delay = 20 * time.Millisecond })
	m := mount(t, newPuller(t, Options{}), s)
	r.set(func(r *reg) { r.down = true })
	time.Sleep(500 * time.Millisecond)
	r.set(func(r *reg) { r.down = false; r.delay = 0 })
	waitLoaded(t, m)
	got, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs")
	}
}

// TestFUSEFaultWindowReadServedFirst: gVisor reads a faulting window in
// pieces as large as its sweep's (256 KiB), so through FUSE only the
// sweep classifier (profile.Classifier) tells them apart. A 256 KiB read
// far ahead of the sweep is fetched at page-fault priority, the sweep's
// reads at read priority; before, every read of 256 KiB waited behind the
// sweep's.
func TestFUSEFaultWindowReadServedFirst(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 96<<20, 12)
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	// Slow requests and one worker: the background load is far from the
	// end of the file when the far read comes.
	r.set(func(r *reg) { r.delay = 100 * time.Millisecond })
	m := mount(t, newPuller(t, Options{KeepFetchLog: true, Workers: 1}), s)
	f, err := os.Open(filepath.Join(m.Dir(), format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const piece = 256 << 10
	buf := make([]byte, piece)
	read := func(off int64) {
		t.Helper()
		if _, err := f.ReadAt(buf, off); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, want[off:off+piece]) {
			t.Fatalf("bytes at %d differ", off)
		}
	}
	for off := int64(0); off < 4*piece; off += piece {
		read(off) // the sweep
	}
	far := int64(len(want)) - 2*piece
	read(far)
	r.set(func(r *reg) { r.delay = 0 })
	chunks := snapshotChunksOf(t, s, format.PagesFile)
	prio := func(off int64) fetch.Priority {
		t.Helper()
		for _, c := range chunks {
			if c.Offset <= off && off < c.End() {
				for _, e := range m.FetchLog() {
					if e.Digest == c.Digest {
						return e.Priority
					}
				}
			}
		}
		t.Fatalf("no fetch of the chunk at %d", off)
		return 0
	}
	if p := prio(far); p != fetch.Fault {
		t.Errorf("the read far ahead of the sweep was fetched at %v, want %v", p, fetch.Fault)
	}
	if p := prio(2 * piece); p == fetch.Fault {
		t.Errorf("a sweep read was fetched at %v, taken for a page fault", p)
	}
}

// TestBackgroundAwaitsTheSandbox: a mount whose background load waits for
// its sandbox (FilesOptions.AwaitSandbox, as a restore's) fetches only the
// start of pages.img gVisor's loader reads first until the sandbox reads
// pages.img; that read releases the rest, long before the wait's bound,
// and every byte read is the source's. Without a read, the load starts
// once the bound has passed; unmounted while held, it ends.
func TestBackgroundAwaitsTheSandbox(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 48<<20, 5)
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	var lead, rest []format.Chunk
	for _, c := range snapshotChunksOf(t, s, format.PagesFile) {
		switch {
		case c.Encoding == format.EncodingZero:
		case c.Offset < sandboxLead:
			lead = append(lead, c)
		default:
			rest = append(rest, c)
		}
	}
	if len(lead) == 0 || len(rest) == 0 {
		t.Fatalf("%d chunks in the lead, %d after it: the image is too small for this test", len(lead), len(rest))
	}
	ctx := context.Background()

	p := newPuller(t, Options{})
	m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{AwaitSandbox: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	settle(t, p.cache, lead)
	// A window for the bug to show: unheld, the rest of a loopback
	// registry's 48 MiB arrives within milliseconds of the lead.
	time.Sleep(300 * time.Millisecond)
	for _, c := range rest {
		if p.cache.Has(c.Digest) {
			t.Fatalf("chunk at %d fetched before the sandbox read pages.img", c.Offset)
		}
	}
	off := rest[len(rest)/2].Offset
	buf := make([]byte, 4096)
	if err := m.ReadAt(ctx, format.PagesFile, buf, off, fetch.Read); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf, want[off:off+4096]) {
		t.Fatalf("bytes at %d differ", off)
	}
	waitLoaded(t, m)
	settle(t, p.cache, rest)

	// No sandbox: the load starts after the bound.
	p2 := newPuller(t, Options{})
	m2, err := p2.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt2"), FilesOptions{AwaitSandbox: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m2.Unmount() })
	waitLoaded(t, m2)
	settle(t, p2.cache, rest)

	// Unmounted while held: the load ends, it does not wait out the bound.
	p3 := newPuller(t, Options{})
	m3, err := p3.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt3"), FilesOptions{AwaitSandbox: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	settle(t, p3.cache, lead)
	if err := m3.Unmount(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-m3.Loaded():
	case <-time.After(time.Minute):
		t.Fatal("a held load went on after its mount was unmounted")
	}
}

// TestSmallFilesInOneRequest: the small files a mount fetches before it is
// ready (a 1 MiB checkpoint.img: about 16 chunks of one pack) come in one
// range request of their pack, not one per chunk, so that a far registry
// costs the mount one round trip for them.
func TestSmallFilesInOneRequest(t *testing.T) {
	r := startReg(t)
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 4<<20, 6); err != nil {
		t.Fatal(err)
	}
	state := synth.StateFile(map[string]string{"runsc_version": "synthetic", "_timestamp": "2026-11-30 00:00:00 +0000 UTC"}, 1<<20, 6)
	if err := os.WriteFile(filepath.Join(dir, "checkpoint.img"), state, 0o644); err != nil {
		t.Fatal(err)
	}
	repo := r.repo(t, "app:v1")
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}})
	if err != nil {
		t.Fatal(err)
	}
	s := Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: transfer.Ranged{Repository: repo}}}}
	chunks := snapshotChunksOf(t, s, "checkpoint.img")
	packs := map[string]bool{}
	for _, c := range chunks {
		packs[c.Blob.String()] = true
	}
	if len(chunks) < 8 || len(packs) != 1 {
		t.Fatalf("checkpoint.img is %d chunks in %d packs: want many chunks in one", len(chunks), len(packs))
	}
	p := newPuller(t, Options{})
	m, err := p.MountFiles(context.Background(), s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{AwaitSandbox: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	got := make([]byte, len(state))
	if err := m.ReadAt(context.Background(), "checkpoint.img", got, 0, fetch.Read); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, state) {
		t.Fatal("checkpoint.img differs")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for d := range packs {
		if n := r.gets[d]; n != 1 {
			t.Errorf("checkpoint.img's %d chunks came in %d requests of their pack, want 1", len(chunks), n)
		}
	}
}

// TestLoadInWindowsLoadsEveryByte loads a 32 MiB v2 snapshot with
// PrefetchAhead of 1 MiB: pages.img is queued in about 16 windows, each
// cut at the end of a pack, the next queued only as the one before comes
// in. Every chunk of every window is loaded: the materialized dir is the
// source, byte for byte, and a second load asks the registry for nothing.
func TestLoadInWindowsLoadsEveryByte(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 32<<20, 1)
	p := newPuller(t, Options{PrefetchAhead: 1 << 20})
	if _, err := p.Load(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	img, ok := p.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("the load wrote no materialized dir")
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img", "pages.img"} {
		sameFile(t, filepath.Join(img, name), filepath.Join(src, name))
	}
	gets := r.blobGets.Load()
	if _, err := p.Load(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	if n := r.blobGets.Load() - gets; n != 0 {
		t.Errorf("a second load made %d blob requests, want 0", n)
	}
}
