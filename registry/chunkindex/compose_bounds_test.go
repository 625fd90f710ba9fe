package chunkindex_test

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/distribution/distribution/v3/registry/storage"
	"github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/distribution/v3/registry/storage/driver/inmemory"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
)

// newEnv returns an index on an empty in-memory registry.
func newEnv(t *testing.T) *env { return newEnvWith(t, chunkindex.Options{}, nil) }

// newEnvWith returns an index with opts on an empty in-memory registry,
// reaching its storage through wrap(the registry's driver) if wrap is
// not nil.
func newEnvWith(t *testing.T, opts chunkindex.Options, wrap func(driver.StorageDriver) driver.StorageDriver) *env {
	mem := inmemory.New()
	var index driver.StorageDriver = mem
	if wrap != nil {
		index = wrap(mem)
	}
	return envOn(t, opts, mem, index)
}

// envOn returns an index with opts, its registry on reg and its own
// storage reached through index.
func envOn(t *testing.T, opts chunkindex.Options, reg, index driver.StorageDriver) *env {
	t.Helper()
	ctx := context.Background()
	ns, err := storage.NewRegistry(ctx, reg, storage.EnableDelete)
	if err != nil {
		t.Fatal(err)
	}
	codec, err := format.NewCodecV2(1)
	if err != nil {
		t.Fatal(err)
	}
	return &env{t: t, driver: reg, ctx: ctx, ns: ns, codec: codec, ci: chunkindex.New(index, ns, codec, opts)}
}

// TestComposeReadsFramesWithoutBlobBuffers composes 16 tiny frames from
// 16 packs. The composition is charged a few KiB per frame, so what it
// allocates must stay near that: distribution's blob reader, which
// allocates a 4 MiB buffer per blob opened (64 MiB here), must not be
// what reads the frames.
func TestComposeReadsFramesWithoutBlobBuffers(t *testing.T) {
	e := newEnv(t)
	var chunks []api.ComposeChunk
	for i := 0; len(chunks) < 16; i++ {
		// Only anchors (digests ending in 0) are looked up.
		f := e.zstdPack("a", fmt.Sprintf("frame-%d-", i))
		if !strings.HasSuffix(f.chunk.Encoded(), "0") {
			continue
		}
		if err := e.pushTable("a", []frame{f}); err != nil {
			t.Fatal(err)
		}
		chunks = append(chunks, api.ComposeChunk{Digest: f.chunk, Size: f.size})
	}
	all := func(string) bool { return true }
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	resp, err := e.ci.Compose(e.ctx, "b", chunks, 0, all)
	runtime.ReadMemStats(&after)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Frames) != len(chunks) {
		t.Fatalf("composed %d frames, want %d", len(resp.Frames), len(chunks))
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 16<<20 {
		t.Errorf("composing 16 frames of %d bytes allocated %d MiB", chunks[0].Size, got>>20)
	}
}

// TestComposeSkipsAnchorsOfHiddenRepositories has a repository the
// caller cannot see record more packs claiming a chunk at offset 0 (an
// anchor) than a composition takes, all sorting before the pack of the
// repository the caller can see that truly holds it: the composition
// must still find the true frame (SPEC.md 12.2.1: only callers who may
// pull from the liar's repository can lose dedup to it).
func TestComposeSkipsAnchorsOfHiddenRepositories(t *testing.T) {
	t.Run("storage", func(t *testing.T) { composeSkipsHiddenAnchors(t, newEnv(t)) })
	t.Run("redis", func(t *testing.T) {
		composeSkipsHiddenAnchors(t, newEnvWith(t, chunkindex.Options{Redis: startRedis(t)}, nil))
	})
}

func composeSkipsHiddenAnchors(t *testing.T, e *env) {
	var real frame
	for i := 0; ; i++ {
		real = e.zstdPack("public", fmt.Sprintf("public-%d-", i))
		if real.pack.Digest.Encoded()[0] >= '8' {
			break
		}
	}
	var lies []string
	for i := 0; len(lies) < 40; i++ {
		junk := e.zstdPack("hidden", fmt.Sprintf("junk-%d-", i))
		if junk.pack.Digest.Encoded() > real.pack.Digest.Encoded() {
			continue
		}
		lie := frame{chunk: real.chunk, size: real.size, pack: junk.pack, length: junk.length}
		if err := e.pushTable("hidden", []frame{lie}); err != nil {
			t.Fatal(err)
		}
		lies = append(lies, junk.pack.Digest.String())
	}
	// The true pack is recorded last: first in none of the stores'
	// orders (paths; a small redis hash's order of insertion).
	if err := e.pushTable("public", []frame{real}); err != nil {
		t.Fatal(err)
	}
	visible := func(r string) bool { return slices.Contains([]string{"public", "mine"}, r) }
	resp, err := e.ci.Compose(e.ctx, "mine", []api.ComposeChunk{{Digest: real.chunk, Size: real.size}}, 0, visible)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Frames) != 1 {
		t.Errorf("composition found no frame of a chunk a visible repository holds, behind %d entries of a hidden one", len(lies))
	}
}

// TestPackListNamesAFrameOnce pushes a table naming one frame for two
// chunks of the file (the same memory twice): the pack's new list must
// list the frame once.
func TestPackListNamesAFrameOnce(t *testing.T) {
	e := newEnv(t)
	f := e.zstdPack("a", "twice-")
	if err := e.pushTable("a", []frame{f, f}); err != nil {
		t.Fatal(err)
	}
	data, err := e.driver.GetContent(e.ctx, chunkindex.PackListPath(f.pack.Digest))
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Frames []json.RawMessage `json:"frames"`
	}
	if err := json.Unmarshal(data, &list); err != nil {
		t.Fatal(err)
	}
	if len(list.Frames) != 1 {
		t.Errorf("a new pack list names one frame %d times: %s", len(list.Frames), data)
	}
}

// listReads counts the reads of packs' frame lists.
type listReads struct {
	driver.StorageDriver
	n atomic.Int64
}

func (l *listReads) GetContent(ctx context.Context, p string) ([]byte, error) {
	if strings.HasPrefix(p, chunkindex.PacksRoot) {
		l.n.Add(1)
	}
	return l.StorageDriver.GetContent(ctx, p)
}

// TestComposeChecksAPackOnce records a pack holding 8 anchor chunks,
// then has its repository drop it: a composition of those chunks for a
// caller who may pull from that repository must find the pack unlinked
// without reading its list once per anchor.
func TestComposeChecksAPackOnce(t *testing.T) {
	for _, store := range []string{"storage", "redis"} {
		t.Run(store, func(t *testing.T) {
			reads := &listReads{}
			e := newEnvWith(t, storeOptions(t, store), func(d driver.StorageDriver) driver.StorageDriver {
				reads.StorageDriver = d
				return reads
			})
			_, want := e.unlinkedAnchorPack(t, 8)
			before := reads.n.Load()
			resp, err := e.ci.Compose(e.ctx, "b", want, 0, func(string) bool { return true })
			if err != nil || len(resp.Frames) != 0 {
				t.Fatalf("composition from an unlinked pack: %+v, %v", resp, err)
			}
			if n := reads.n.Load() - before; n > 1 {
				t.Errorf("a composition of %d anchors of one unlinked pack read its list %d times", len(want), n)
			}
		})
	}
}

// linkReads counts the reads of repositories' links to one blob (a
// GetContent or Stat of a path under a repository's _layers naming it).
type linkReads struct {
	driver.StorageDriver
	blob string // encoded digest
	n    atomic.Int64
}

func (l *linkReads) GetContent(ctx context.Context, p string) ([]byte, error) {
	l.count(p)
	return l.StorageDriver.GetContent(ctx, p)
}

func (l *linkReads) Stat(ctx context.Context, p string) (driver.FileInfo, error) {
	l.count(p)
	return l.StorageDriver.Stat(ctx, p)
}

func (l *linkReads) count(p string) {
	if l.blob != "" && strings.Contains(p, "/_layers/") && strings.Contains(p, l.blob) {
		l.n.Add(1)
	}
}

// TestGCChecksAPackOnce: gc (Prune) asks whether a repository links a
// pack once in a pass, however many of its lists, entries and anchors
// name the pack (it checked once per anchor).
func TestGCChecksAPackOnce(t *testing.T) {
	for _, store := range []string{"storage", "redis"} {
		t.Run(store, func(t *testing.T) {
			// The registry's links are read through the counter too.
			reads := &linkReads{StorageDriver: inmemory.New()}
			e := envOn(t, storeOptions(t, store), reads, reads)
			pack, _ := e.unlinkedAnchorPack(t, 8)
			reads.blob = pack.Encoded()
			if _, err := e.ci.Prune(e.ctx); err != nil {
				t.Fatal(err)
			}
			if n := reads.n.Load(); n != 1 {
				t.Errorf("gc read repository a's link to a pack 8 anchors name %d times, want 1", n)
			}
		})
	}
}

// storeOptions returns the index options that keep anchors in store:
// "storage" (the storage driver) or "redis" (a redis-server of the test's).
func storeOptions(t *testing.T, store string) chunkindex.Options {
	if store == "redis" {
		return chunkindex.Options{Redis: startRedis(t)}
	}
	return chunkindex.Options{}
}

// unlinkedAnchorPack pushes to repository a a table of one pack holding
// n anchor chunks, then deletes the pack from a, and returns the pack and
// its chunks as a composition asks for them.
func (e *env) unlinkedAnchorPack(t *testing.T, n int) (digest.Digest, []api.ComposeChunk) {
	t.Helper()
	var frames []frame
	var data []byte
	for i := 0; len(frames) < n; i++ {
		f, enc := e.zstdFrame(fmt.Sprintf("anchor-%d-", i))
		if !strings.HasSuffix(f.chunk.Encoded(), "0") {
			continue
		}
		f.offset = int64(len(data))
		data = append(data, enc...)
		frames = append(frames, f)
	}
	pack := e.put("a", data)
	var want []api.ComposeChunk
	for i := range frames {
		frames[i].pack = pack
		want = append(want, api.ComposeChunk{Digest: frames[i].chunk, Size: frames[i].size})
	}
	if err := e.pushTable("a", frames); err != nil {
		t.Fatal(err)
	}
	named, _ := reference.WithName("a")
	r, err := e.ns.Repository(e.ctx, named)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Blobs(e.ctx).Delete(e.ctx, pack.Digest); err != nil {
		t.Fatal(err)
	}
	return pack.Digest, want
}

// TestComposeTakesNoFrameFromHiddenRepositories records one pack from a
// repository the caller cannot see and from one it can, which then drops
// the pack: the anchor names both, only the hidden one links the pack,
// and the composition must find nothing rather than copy the hidden
// repository's frame.
func TestComposeTakesNoFrameFromHiddenRepositories(t *testing.T) {
	for _, store := range []string{"storage", "redis"} {
		t.Run(store, func(t *testing.T) {
			opts := chunkindex.Options{}
			if store == "redis" {
				opts.Redis = startRedis(t)
			}
			e := newEnvWith(t, opts, nil)
			f := e.zstdPack("hidden", "secret-memory-")
			e.zstdPack("public", "secret-memory-") // the same blob, linked in public too
			for _, repo := range []string{"hidden", "public"} {
				if err := e.pushTable(repo, []frame{f}); err != nil {
					t.Fatal(err)
				}
			}
			named, _ := reference.WithName("public")
			r, err := e.ns.Repository(e.ctx, named)
			if err != nil {
				t.Fatal(err)
			}
			if err := r.Blobs(e.ctx).Delete(e.ctx, f.pack.Digest); err != nil {
				t.Fatal(err)
			}
			visible := func(r string) bool { return r == "public" || r == "mine" }
			resp, err := e.ci.Compose(e.ctx, "mine", []api.ComposeChunk{{Digest: f.chunk, Size: f.size}}, 0, visible)
			if err != nil {
				t.Fatal(err)
			}
			if len(resp.Frames) != 0 {
				t.Errorf("composed %d frames from a pack only a repository the caller cannot see links", len(resp.Frames))
			}
		})
	}
}
