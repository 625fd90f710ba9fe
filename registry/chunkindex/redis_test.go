package chunkindex_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/distribution/reference"
	"github.com/redis/go-redis/v9"
)

// startRedis starts a redis-server and returns a client of it.
func startRedis(t *testing.T) redis.UniversalClient {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: testenv.StartRedis(t)})
	t.Cleanup(func() { c.Close() })
	return c
}

// TestRedisAnchors keeps the anchors in redis: a pack pushed to a is
// found by a composition for b of a caller who may pull from a, never by
// one who may not; nothing of it is written to the storage driver's
// index; and after a drops the pack and gc runs, its anchor is gone from
// redis and compositions find nothing.
func TestRedisAnchors(t *testing.T) {
	rc := startRedis(t)
	e := newEnvWith(t, chunkindex.Options{Redis: rc}, nil)
	var f frame
	for i := 0; ; i++ {
		// An anchor (digest ending in 0) not at offset 0 of its pack
		// would be looked up too; this one is both.
		if f = e.zstdPack("a", fmt.Sprintf("redis-%d-", i)); strings.HasSuffix(f.chunk.Encoded(), "0") {
			break
		}
	}
	if err := e.pushTable("a", []frame{f}); err != nil {
		t.Fatal(err)
	}
	keys, err := rc.Keys(e.ctx, chunkindex.RedisAnchorPrefix+"*").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("redis anchor keys after one push: %v, %v", keys, err)
	}
	if _, err := e.driver.List(e.ctx, chunkindex.Root); err == nil {
		t.Errorf("anchors in redis, yet the storage driver's index holds entries")
	}
	want := []api.ComposeChunk{{Digest: f.chunk, Size: f.size}}
	mayPull := func(repos ...string) func(string) bool {
		return func(r string) bool { return slices.Contains(repos, r) }
	}
	if resp, err := e.ci.Compose(e.ctx, "b", want, 0, mayPull("b")); err != nil || len(resp.Frames) != 0 {
		t.Errorf("a caller who may not pull from a: %d frames composed, %v", len(resp.Frames), err)
	}
	if resp, err := e.ci.Compose(e.ctx, "b", want, 0, mayPull("a", "b")); err != nil || len(resp.Frames) != 1 {
		t.Fatalf("a caller who may pull from a: %+v, %v", resp, err)
	}

	// a and b (which now links the composed pack, not a's) drop a's pack.
	named, _ := reference.WithName("a")
	r, err := e.ns.Repository(e.ctx, named)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Blobs(e.ctx).Delete(e.ctx, f.pack.Digest); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ci.Prune(e.ctx); err != nil {
		t.Fatal(err)
	}
	n, err := rc.HLen(e.ctx, keys[0]).Result()
	if err != nil || n != 0 {
		t.Errorf("after gc, the anchor of a pack no repository links still names %d packs (%v)", n, err)
	}
}

// TestRedisAnchorsFloodEvictsNothing has a repository the caller cannot
// see record 200 packs claiming a chunk after the pack that holds it was
// recorded: the anchor's hash keeps every pack (a push never pushes out
// what another recorded), and a composition still finds the true one.
func TestRedisAnchorsFloodEvictsNothing(t *testing.T) {
	rc := startRedis(t)
	e := newEnvWith(t, chunkindex.Options{Redis: rc}, nil)
	real := e.zstdPack("public", "public-chunk-")
	if err := e.pushTable("public", []frame{real}); err != nil {
		t.Fatal(err)
	}
	const lies = 200
	for i := range lies {
		f, enc := e.zstdFrame("public-chunk-")
		f.pack = e.put("hidden", append(enc, fmt.Sprintf("pad-%d", i)...))
		if err := e.pushTable("hidden", []frame{f}); err != nil {
			t.Fatal(err)
		}
	}
	keys, _ := rc.Keys(e.ctx, chunkindex.RedisAnchorPrefix+"*").Result()
	if len(keys) != 1 {
		t.Fatalf("%d anchor keys, want 1", len(keys))
	}
	if n, _ := rc.HLen(e.ctx, keys[0]).Result(); n != lies+1 {
		t.Errorf("an anchor recorded in %d packs keeps %d", lies+1, n)
	}
	visible := func(r string) bool { return r == "public" || r == "mine" }
	resp, err := e.ci.Compose(e.ctx, "mine", []api.ComposeChunk{{Digest: real.chunk, Size: real.size}}, 0, visible)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Frames) != 1 {
		t.Errorf("composition found no frame of a chunk a visible repository holds, among %d packs of a hidden one", lies)
	}
}
