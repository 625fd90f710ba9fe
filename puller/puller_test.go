package puller

import (
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

func TestMain(m *testing.M) {
	logrus.SetLevel(logrus.ErrorLevel)
	os.Exit(m.Run())
}

// needFUSE skips (or fails under CI=true) without root and /dev/fuse.
func needFUSE(t testing.TB) {
	t.Helper()
	testenv.NeedFUSE(t, "mounting")
}

// reg is an in-process registry whose HTTP handler tests can wrap.
type reg struct {
	srv  *registry.Server
	http *httptest.Server
	root string
	host string
	// blobGets counts blob GETs served; blobBytes the bytes of their
	// bodies.
	blobGets  atomic.Int64
	blobBytes atomic.Int64
	mu        sync.Mutex
	// gets counts the GETs of each blob, by digest.
	gets     map[string]int
	delay    time.Duration
	down     bool
	corrupt  map[string]bool // blob digests served with a flipped byte
	unserved map[string]bool // blob digests answered 503
	// noRange drops Range headers: the registry answers 200 with the
	// whole blob, as some registries and mirrors do.
	noRange bool
}

func startReg(t testing.TB) *reg {
	t.Helper()
	root := t.TempDir()
	cfg, err := registry.DefaultConfig(root, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := registry.New(context.Background(), cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	r := &reg{srv: srv, root: root, corrupt: map[string]bool{}, gets: map[string]int{}}
	h := srv.Handler()
	r.http = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		delay, down := r.delay, r.down
		if r.noRange {
			req.Header.Del("Range")
		}
		corrupt := false
		for d := range r.corrupt {
			if strings.HasSuffix(req.URL.Path, "/blobs/"+d) {
				corrupt = true
			}
		}
		for d := range r.unserved {
			if strings.HasSuffix(req.URL.Path, "/blobs/"+d) {
				down = true
			}
		}
		r.mu.Unlock()
		isBlob := strings.Contains(req.URL.Path, "/blobs/sha256:") && req.Method == http.MethodGet
		if down && isBlob {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		if isBlob {
			r.blobGets.Add(1)
			r.mu.Lock()
			_, d, _ := strings.Cut(req.URL.Path, "/blobs/")
			r.gets[d]++
			r.mu.Unlock()
			time.Sleep(delay)
		}
		if corrupt {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, req)
			body := rec.Body.Bytes()
			if len(body) > 0 {
				body[len(body)/2] ^= 0xff
			}
			for k, v := range rec.Header() {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.Code)
			w.Write(body)
			return
		}
		if isBlob {
			w = &countingWriter{ResponseWriter: w, n: &r.blobBytes}
		}
		h.ServeHTTP(w, req)
	}))
	t.Cleanup(func() { r.http.Close(); srv.Close() })
	r.host = strings.TrimPrefix(r.http.URL, "http://")
	return r
}

// countingWriter counts the body bytes written through it.
type countingWriter struct {
	http.ResponseWriter
	n *atomic.Int64
}

func (w *countingWriter) Write(p []byte) (int, error) {
	n, err := w.ResponseWriter.Write(p)
	w.n.Add(int64(n))
	return n, err
}

func (r *reg) set(f func(r *reg)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(r)
}

func (r *reg) repo(t testing.TB, name string) *remote.Repository {
	t.Helper()
	repo, _, err := transfer.Repository(r.host+"/"+name, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return repo
}

// push makes a synthetic image dir and pushes it as name:v1.
func push(t testing.TB, r *reg, name string, kind synth.Kind, size int64, seed uint64) (string, Source) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, kind, size, seed); err != nil {
		t.Fatal(err)
	}
	return dir, pushDir(t, r, name, dir)
}

func pushDir(t testing.TB, r *reg, name, dir string) Source {
	t.Helper()
	repo := r.repo(t, name+":v1")
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{Pack: format.PackOptions{Chunking: smallChunks}})
	if err != nil {
		t.Fatal(err)
	}
	return Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: repo}}}
}

// smallChunks gives test images many chunks.
var smallChunks = format.PackOptions{}.Chunking

func init() {
	smallChunks.Algorithm = "page-cdc"
	smallChunks.Min, smallChunks.Avg, smallChunks.Max = 64<<10, 256<<10, 1<<20
}

func newPuller(t testing.TB, opts Options) *Puller {
	t.Helper()
	if opts.CacheDir == "" {
		opts.CacheDir = t.TempDir()
	}
	if opts.Deadline == 0 {
		opts.Deadline = time.Minute
	}
	p, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func mount(t testing.TB, p *Puller, src Source) *Mount {
	t.Helper()
	m, err := p.Mount(context.Background(), src, filepath.Join(t.TempDir(), "mnt"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	return m
}

// snapshotChunks lists the chunks of every file of s's snapshot that the
// node cache holds (all but zero chunks), read from its first endpoint.
func snapshotChunks(t testing.TB, s Source) []format.Chunk {
	t.Helper()
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, s.Endpoints[0].Store, s.Index)
	if err != nil {
		t.Fatal(err)
	}
	var out []format.Chunk
	for i := range snap.Files {
		for part := range snap.Files[i].Parts {
			pt, err := format.LoadPart(ctx, s.Endpoints[0].Store, &snap.Files[i], part)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range pt.Table.Chunks {
				if c.Encoding != format.EncodingZero {
					out = append(out, c)
				}
			}
		}
	}
	return out
}

// waitPrepared waits until m's load has every chunk table and has pinned
// its chunks (a FUSE mount loads them in the background).
func waitPrepared(t testing.TB, m *Mount) {
	t.Helper()
	select {
	case <-m.l.prepared:
	case <-time.After(60 * time.Second):
		t.Fatal("chunk tables not loaded after 60 s")
	}
}

func waitLoaded(t testing.TB, m *Mount) {
	t.Helper()
	select {
	case <-m.Loaded():
		if err := m.Err(); err != nil {
			t.Fatalf("load: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("not loaded after 60 s")
	}
}

func TestConcurrentReadsReturnSourceBytes(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	r.set(func(r *reg) { r.delay = 2 * time.Millisecond })
	src, s := push(t, r, "app", synth.HalfZero, 32<<20, 1)
	m := mount(t, newPuller(t, Options{}), s)
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	f, err := os.Open(filepath.Join(m.Dir(), "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 128)
	for w := range 128 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			buf := make([]byte, 256<<10)
			for range 8 {
				off := rng.Int64N(int64(len(want))/4096) * 4096
				n, err := f.ReadAt(buf, off)
				if err != nil && n == 0 {
					errs <- err
					return
				}
				if !bytes.Equal(buf[:n], want[off:off+int64(n)]) {
					errs <- errors.New("bytes differ")
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img"} {
		got, _ := os.ReadFile(filepath.Join(m.Dir(), name))
		exp, _ := os.ReadFile(filepath.Join(src, name))
		if !bytes.Equal(got, exp) {
			t.Fatalf("%s differs", name)
		}
	}
	waitLoaded(t, m)
	got, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs after full load")
	}
}

func TestDemandReadsOvertakeBackground(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	r.set(func(r *reg) { r.delay = 20 * time.Millisecond })
	_, s := push(t, r, "app", synth.Random, 32<<20, 2)
	p := newPuller(t, Options{KeepFetchLog: true, Workers: 2})
	m := mount(t, p, s)
	f, err := os.Open(filepath.Join(m.Dir(), "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	info, _ := f.Stat()
	buf := make([]byte, 4096)
	end := info.Size() - 4096
	if _, err := f.ReadAt(buf, end); err != nil {
		t.Fatal(err)
	}
	log := m.FetchLog()
	demand := -1
	for i, e := range log {
		if e.Demand() && e.Offset <= end && end < e.Offset+(1<<20) {
			demand = i
			break
		}
	}
	if demand < 0 {
		t.Fatalf("no demand fetch for offset %d in %d fetches", end, len(log))
	}
	// Background fetches go in ascending order; the demand read at the end
	// of the file must have started before most of them.
	if demand > len(log)/2 && demand > 8 {
		t.Fatalf("demand fetch was number %d of %d", demand, len(log))
	}
	waitLoaded(t, m)
	final := m.FetchLog()
	later := 0
	for _, e := range final[demand+1:] {
		if !e.Demand() && e.Offset < end {
			later++
		}
	}
	if later == 0 {
		t.Fatal("no background fetch of lower offsets came after the demand fetch")
	}
}

func TestRegistryOutageMidLoad(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	r.set(func(r *reg) { r.delay = 100 * time.Millisecond })
	src, s := push(t, r, "app", synth.Random, 24<<20, 3)
	m := mount(t, newPuller(t, Options{}), s)
	time.Sleep(50 * time.Millisecond) // mid-way through the first wave of fetches
	r.set(func(r *reg) { r.down = true })
	if pr := m.Progress(); pr.LocalBytes >= pr.TotalBytes {
		t.Fatal("everything was loaded before the outage began: the test tests nothing")
	}
	// A read during the outage blocks, then succeeds once it ends.
	done := make(chan []byte, 1)
	go func() {
		data, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
		done <- data
	}()
	time.Sleep(700 * time.Millisecond)
	select {
	case <-done:
		t.Fatal("the read of the whole file finished while the registry was down")
	default:
	}
	r.set(func(r *reg) { r.down = false })
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	select {
	case got := <-done:
		if !bytes.Equal(got, want) {
			t.Fatal("pages.img differs after the outage")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("read did not complete after the registry came back")
	}
	waitLoaded(t, m)
}

func TestCorruptMirrorFailsOverToPrimary(t *testing.T) {
	needFUSE(t)
	primary := startReg(t)
	src, s := push(t, primary, "app", synth.Random, 8<<20, 4)
	mirror := startReg(t)
	pushDir(t, mirror, "app", src)
	// The mirror (tried first) corrupts every chunk blob it serves.
	snap, _ := format.LoadSnapshot(context.Background(), s.Endpoints[0].Store, s.Index)
	pt, _ := format.LoadPart(context.Background(), s.Endpoints[0].Store, snap.File("pages.img"), 0)
	mirror.set(func(r *reg) {
		for _, c := range pt.Table.Chunks {
			r.corrupt[c.Blob.String()] = true
		}
	})
	s.Endpoints = []fetch.Endpoint{{Name: "mirror", Store: mirror.repo(t, "app")}, s.Endpoints[0]}
	m := mount(t, newPuller(t, Options{}), s)
	got, err := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("served bytes differ: corrupt data reached the reader")
	}
	if primary.blobGets.Load() == 0 || mirror.blobGets.Load() == 0 {
		t.Fatalf("blob GETs: mirror %d, primary %d", mirror.blobGets.Load(), primary.blobGets.Load())
	}
	waitLoaded(t, m)

	// With every endpoint corrupt, the read fails (EIO) naming nothing
	// wrong to the reader, and the scheduler's error names the chunk.
	only := Source{Index: s.Index, Endpoints: s.Endpoints[:1]}
	m2, err := newPuller(t, Options{Deadline: 2 * time.Second}).Mount(context.Background(), only, filepath.Join(t.TempDir(), "mnt"))
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Unmount()
	if _, err := os.ReadFile(filepath.Join(m2.Dir(), "pages.img")); err == nil {
		t.Fatal("read of chunks that are corrupt everywhere succeeded")
	}
	<-m2.Loaded()
	if err := m2.Err(); err == nil || !strings.Contains(err.Error(), "failed verification from every endpoint") || !strings.Contains(err.Error(), "sha256:") {
		t.Fatalf("load error %v, want one naming the chunk", err)
	}
}

func TestSmallCacheNeverBreaksLiveMount(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	srcA, a := push(t, r, "a", synth.Random, 16<<20, 5)
	_, b := push(t, r, "b", synth.Random, 16<<20, 6)
	// A cap smaller than one snapshot: pinned chunks must stay anyway.
	p := newPuller(t, Options{CacheCap: 4 << 20})
	ma := mount(t, p, a)
	waitLoaded(t, ma)
	mb := mount(t, p, b)
	waitLoaded(t, mb)
	// Both snapshots stay in the cache, far over the cap, while mounted:
	// every chunk of each, 32 MiB of chunks at least.
	kept := map[digest.Digest]int64{}
	for name, s := range map[string]Source{"a": a, "b": b} {
		for _, c := range snapshotChunks(t, s) {
			if !p.Cache().Has(c.Digest) {
				t.Fatalf("with two live mounts, chunk %s of snapshot %s left the cache", c.Digest, name)
			}
			kept[c.Digest] = c.Size
		}
	}
	var chunkBytes int64
	for _, size := range kept {
		chunkBytes += size
	}
	if st := p.Cache().Stats(); chunkBytes < 32<<20 || st.Bytes < chunkBytes {
		t.Fatalf("with two live mounts: %+v, chunks of both snapshots %d bytes; want both snapshots' 32 MiB kept", st, chunkBytes)
	}
	got, _ := os.ReadFile(filepath.Join(ma.Dir(), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(srcA, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("live mount a lost data")
	}
	ma.Unmount()
	mb.Unmount()
	// With no live mount left, the cap is enforced.
	if st := p.Cache().Stats(); st.Bytes > 4<<20 || st.Pinned != 0 {
		t.Fatalf("after unmount: %+v", st)
	}
}

func TestSharedChunksFetchedOnce(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	srcA, a := push(t, r, "a", synth.Random, 8<<20, 7)
	// b = a with its last MiB of pages rewritten.
	dirB := filepath.Join(t.TempDir(), "b")
	os.CopyFS(dirB, os.DirFS(srcA))
	f, _ := os.OpenFile(filepath.Join(dirB, "pages.img"), os.O_RDWR, 0)
	f.WriteAt(bytes.Repeat([]byte{7, 1, 3}, 1<<18), 7<<20)
	f.Close()
	b := pushDir(t, r, "b", dirB)
	p := newPuller(t, Options{})
	before := r.blobGets.Load()
	waitLoaded(t, mount(t, p, a))
	afterA := r.blobGets.Load()
	waitLoaded(t, mount(t, p, b))
	afterB := r.blobGets.Load()
	if afterB-afterA >= (afterA-before)/2 {
		t.Fatalf("snapshot b fetched %d blobs after a fetched %d: shared chunks fetched again", afterB-afterA, afterA-before)
	}
	// A remount of a uses the materialized dir: nothing is fetched.
	ma := mount(t, p, a)
	if ma.Progress().Mode != "materialized" || r.blobGets.Load() != afterB {
		t.Fatalf("remount: mode %s, %d blobs fetched", ma.Progress().Mode, r.blobGets.Load()-afterB)
	}
	got, _ := os.ReadFile(filepath.Join(ma.Dir(), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(srcA, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("materialized pages.img differs")
	}
}

// TestSameSnapshotMountedTwiceAtOnce mounts one snapshot twice at the same
// moment in one puller (two sandboxes restored from it on a node): both
// load, the snapshot is materialized once and intact, and no chunk is
// fetched more than about once.
func TestSameSnapshotMountedTwiceAtOnce(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	r.set(func(r *reg) { r.delay = time.Millisecond })
	src, s := push(t, r, "app", synth.Random, 16<<20, 11)
	p := newPuller(t, Options{})
	before := r.blobGets.Load()
	m1, m2 := mount(t, p, s), mount(t, p, s)
	waitLoaded(t, m1)
	waitLoaded(t, m2)
	chunks := int64(0)
	for _, fc := range m1.l.chunks {
		for _, c := range fc {
			if c.Encoding != format.EncodingZero {
				chunks++
			}
		}
	}
	// Each mount reads the index, tables and small files itself; a chunk
	// both mounts need is one fetch (two, one per mount, without the
	// node-wide in-flight set: about 1.6x the chunks here).
	gets := r.blobGets.Load() - before
	t.Logf("%d blob GETs for %d chunks mounted twice", gets, chunks)
	if gets > chunks*3/2 {
		t.Errorf("%d blob GETs for %d chunks mounted twice: chunks fetched once per mount", gets, chunks)
	}
	got, err := os.ReadFile(filepath.Join(p.MaterializedDir(s.Index.Digest), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("materialized pages.img: %v, equal %v", err, bytes.Equal(got, want))
	}
	leftovers, _ := filepath.Glob(p.MaterializedDir(s.Index.Digest) + ".tmp-*")
	if len(leftovers) > 0 {
		t.Errorf("temporary dirs left: %v", leftovers)
	}
}

func TestEagerFallbackWithoutFUSE(t *testing.T) {
	if os.Geteuid() != 0 {
		testenv.SkipOrFatal(t, "the fallback bind-mounts, which needs root")
	}
	r := startReg(t)
	src, s := push(t, r, "app", synth.HalfZero, 8<<20, 8)
	m := mount(t, newPuller(t, Options{NoFUSE: true}), s)
	if m.Progress().Mode != "eager" || !m.Progress().Loaded {
		t.Fatalf("progress %+v", m.Progress())
	}
	got, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
	want, _ := os.ReadFile(filepath.Join(src, "pages.img"))
	if !bytes.Equal(got, want) {
		t.Fatal("pages.img differs")
	}
	// The file API (the daemon hands any mount to a checkpoint gofer)
	// reads an eager mount through its bind mount.
	part := make([]byte, 4096)
	if err := m.ReadAt(context.Background(), format.PagesFile, part, 1<<20, fetch.Read); err != nil || !bytes.Equal(part, want[1<<20:1<<20+4096]) {
		t.Fatalf("ReadAt of an eager mount: %v", err)
	}
}

// staticProfile finds one profile.
type staticProfile struct{ p *profile.Profile }

func (s staticProfile) Find(ctx context.Context, subject ocispec.Descriptor) (*profile.Profile, profile.Info, []string, error) {
	return s.p, profile.Info{Digest: digest.FromString("static"), Merged: 1, Ranges: len(s.p.Ranges), Bytes: s.p.Bytes()}, nil, nil
}

// TestProfileComesFirst: the chunks of a profile's ranges are fetched
// first, in its order, ahead of the background load, and the mount says
// which profile it used; a range past the end of its file is dropped.
func TestProfileComesFirst(t *testing.T) {
	needFUSE(t)
	r := startReg(t)
	_, s := push(t, r, "app", synth.Random, 8<<20, 9)
	info := int64(8 << 20)
	s.Profile = staticProfile{&profile.Profile{MediaType: profile.MediaType, Subject: s.Index.Digest, Ranges: []profile.Range{
		{Path: "pages.img", Offset: info - (1 << 20), Length: 1 << 20},
		{Path: "pages.img", Offset: 3 << 20, Length: 4096, AtMillis: 5},
		{Path: "pages.img", Offset: 64 << 20, Length: 4096, AtMillis: 6}, // past the end
	}}}
	m := mount(t, newPuller(t, Options{KeepFetchLog: true, Workers: 1}), s)
	waitLoaded(t, m)
	if pr := m.Progress(); pr.Profile == nil || pr.Profile.Ranges != 2 || pr.Profile.Bytes != 1<<20+4096 {
		t.Errorf("progress says profile %+v, want the 2 ranges within the file", pr.Profile)
	}
	var log []fetch.LogEntry
	for _, e := range m.FetchLog() {
		if !e.Demand() { // the small files were fetched on demand before
			log = append(log, e)
		}
	}
	if len(log) < 4 {
		t.Fatalf("only %d prefetches", len(log))
	}
	// With one worker, the listed ranges are fetched first, in list order.
	if log[0].Priority != fetch.Profile || log[0].Offset > info-(1<<20) || log[0].Offset+(1<<20) <= info-(1<<20) {
		t.Errorf("first fetch %+v, want the profile's chunk covering the last MiB", log[0])
	}
	found := false
	for _, e := range log[:4] {
		if e.Priority == fetch.Profile && e.Offset <= 3<<20 && 3<<20 < e.Offset+(1<<20) {
			found = true
		}
	}
	if !found {
		t.Errorf("the chunk at 3 MiB was not among the first fetches: %+v", log[:4])
	}
}

// TestRegistryKilledMidLoad kills the registry process (SIGKILL) right after
// the mount is ready and starts it again a second later on the same
// storage: reads made meanwhile wait, the load completes, the bytes are
// right.
func TestRegistryKilledMidLoad(t *testing.T) {
	needFUSE(t)
	real := testenv.StartRegistry(t, "")
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 32<<20, 10); err != nil {
		t.Fatal(err)
	}
	repo, _, err := transfer.Repository(real.Addr+"/app:v1", transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := transfer.Push(context.Background(), dir, repo, "v1", transfer.PushOptions{Pack: format.PackOptions{Chunking: smallChunks}})
	if err != nil {
		t.Fatal(err)
	}
	src := Source{Index: res.Descriptor, Endpoints: []fetch.Endpoint{{Name: "primary", Store: repo}}}
	chunks := snapshotChunks(t, src)
	p := newPuller(t, Options{Workers: 2})
	m := mount(t, p, src)
	// The chunk tables are in (TestTableOutageThenRecovery has the
	// registry fail them): a read can only wait for chunks.
	waitPrepared(t, m)
	real.Stop()
	if pr := m.Progress(); pr.LocalBytes >= pr.TotalBytes {
		t.Fatal("the load finished before the registry was killed: test data too small")
	}
	demand := m.Progress().DemandChunks
	done := make(chan []byte, 1)
	go func() {
		data, _ := os.ReadFile(filepath.Join(m.Dir(), "pages.img"))
		done <- data
	}()
	time.Sleep(time.Second)
	// A second into the outage, fetches that were under way when the
	// registry died have ended: a chunk missing from the cache now was
	// never fetched, so the read cannot have finished, and it must be
	// waiting for a chunk, not have failed.
	missing := 0
	for _, c := range chunks {
		if !p.Cache().Has(c.Digest) {
			missing++
		}
	}
	if missing == 0 {
		t.Fatal("every chunk was fetched before the registry was killed: the test tests nothing")
	}
	select {
	case data := <-done:
		t.Fatalf("the read of pages.img returned (%d bytes) while the registry was down with %d chunks missing", len(data), missing)
	default:
	}
	if got := m.Progress().DemandChunks; got <= demand {
		t.Fatalf("no read waited for a chunk during the outage (demand chunks %d before the read, %d after)", demand, got)
	}
	real.Start(t)
	want, _ := os.ReadFile(filepath.Join(dir, "pages.img"))
	select {
	case got := <-done:
		if !bytes.Equal(got, want) {
			t.Fatal("pages.img differs after the registry restarted")
		}
	case <-time.After(60 * time.Second):
		t.Fatal("read did not complete after the registry restarted")
	}
	waitLoaded(t, m)
}

// TestLoadWithoutMount loads a snapshot with Load, which presents nothing:
// every chunk ends in the node cache, written once, in place, into the
// materialized dir, private (files 0600, dirs 0700) and complete, with no
// chunk file beside it; the pins are released; a second load finds it local
// and fetches nothing; and a mount of it (with root) bind-mounts that dir,
// no FUSE.
func TestLoadWithoutMount(t *testing.T) {
	r := startReg(t)
	src, s := push(t, r, "app", synth.HalfZero, 8<<20, 12)
	p := newPuller(t, Options{})
	ctx := context.Background()
	snap, err := p.Load(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	if snap.Descriptor.Digest != s.Index.Digest {
		t.Fatalf("loaded %s, want %s", snap.Descriptor.Digest, s.Index.Digest)
	}
	for _, c := range snapshotChunks(t, s) {
		if !p.Cache().Has(c.Digest) {
			t.Fatalf("after Load, chunk %s at %d is not in the node cache", c.Digest, c.Offset)
		}
	}
	img, ok := p.Materialized(s.Index.Digest)
	if !ok {
		t.Fatal("Load wrote no materialized dir")
	}
	if n := chunkFiles(t, p.Cache().Root()); n != 0 {
		t.Errorf("%d chunk files beside the materialized dir: bytes written twice", n)
	}
	if _, err := os.Stat(filepath.Join(img, cache.ImageMarker)); err != nil {
		t.Errorf("no completion marker: %v", err)
	}
	filepath.WalkDir(img, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		info, _ := d.Info()
		switch rel, _ := filepath.Rel(img, p); {
		case rel == cache.ImageMarker || rel == cache.ChunkList:
		case d.IsDir() && info.Mode().Perm() != 0o700:
			t.Errorf("materialized dir %s has mode %v, want 0700", rel, info.Mode().Perm())
		case !d.IsDir() && info.Mode().Perm() != 0o600:
			t.Errorf("materialized file %s has mode %v, want 0600", rel, info.Mode().Perm())
		case !d.IsDir():
			sameFile(t, p, filepath.Join(src, rel))
		}
		return nil
	})
	if st := p.Cache().Stats(); st.Pinned != 0 {
		t.Fatalf("after Load: %d pins left", st.Pinned)
	}
	gets := r.blobGets.Load()
	if _, err := p.Load(ctx, s); err != nil {
		t.Fatal(err)
	}
	if n := r.blobGets.Load() - gets; n != 0 {
		t.Errorf("a load of a materialized snapshot fetched %d blobs", n)
	}
	if os.Geteuid() != 0 {
		testenv.SkipOrFatal(t, "mounting the materialized dir bind-mounts, which needs root")
	}
	m := mount(t, p, s)
	if mode := m.Progress().Mode; mode != "materialized" {
		t.Errorf("a mount after Load is %q, want materialized", mode)
	}
	sameFile(t, filepath.Join(m.Dir(), format.PagesFile), filepath.Join(src, format.PagesFile))
}

// chunkFiles counts the chunk files of the node cache under root.
func chunkFiles(t *testing.T, root string) int {
	t.Helper()
	n := 0
	err := filepath.WalkDir(filepath.Join(root, "chunks"), func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// stallChunks serves everything but chunk blobs, whose fetches wait until
// they are canceled; started is closed at the first.
type stallChunks struct {
	content.Fetcher
	once    sync.Once
	started chan struct{}
}

func (s *stallChunks) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	if desc.MediaType != format.MediaTypeChunkRaw && desc.MediaType != format.MediaTypeChunkZstd {
		return s.Fetcher.Fetch(ctx, desc)
	}
	s.once.Do(func() { close(s.started) })
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestLoadCanceled cancels a load whose chunks cannot be fetched: Load
// returns the cancellation, and its pins are released (a canceled
// preload must not hold cache space forever).
func TestLoadCanceled(t *testing.T) {
	r := startReg(t)
	_, s := push(t, r, "app", synth.Random, 4<<20, 13)
	stall := &stallChunks{Fetcher: s.Endpoints[0].Store, started: make(chan struct{})}
	s.Endpoints = []fetch.Endpoint{{Name: "stalled", Store: stall}}
	p := newPuller(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := p.Load(ctx, s)
		done <- err
	}()
	select {
	case <-stall.started:
	case err := <-done:
		t.Fatalf("Load returned %v before fetching a chunk", err)
	}
	if st := p.Cache().Stats(); st.Pinned == 0 {
		t.Fatal("a load fetching chunks pins nothing")
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Load returned %v, want context.Canceled", err)
	}
	if st := p.Cache().Stats(); st.Pinned != 0 {
		t.Fatalf("a canceled load left %d pins", st.Pinned)
	}
}
