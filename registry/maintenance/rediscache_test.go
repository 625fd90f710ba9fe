package maintenance

import (
	"context"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/storage"
	"github.com/distribution/distribution/v3/registry/storage/driver/filesystem"
	"github.com/redis/go-redis/v9"
)

// TestOwedCacheFlush checks a replica's part of the cache flush a garbage
// collection owes: writes are refused while a flush is owed; with no
// maintainer holding read-only mode the replica flushes distribution's blob
// descriptor keys (and no other key) itself, in the background, and then
// accepts writes; it keeps refusing them while redis is unreachable.
// (registry's tests check that a refused write is a 503.)
func TestOwedCacheFlush(t *testing.T) {
	addr := testenv.StartRedis(t)
	ctx := context.Background()
	driver := filesystem.New(filesystem.DriverParameters{RootDirectory: t.TempDir(), MaxThreads: 25})
	ns, err := storage.NewRegistry(ctx, driver)
	if err != nil {
		t.Fatal(err)
	}
	redisCfg := &configuration.Redis{}
	redisCfg.Options.Addrs = []string{addr}
	redisCfg.Options.DialTimeout = 500 * time.Millisecond
	srv, err := New(Options{Driver: driver, Namespace: ns, Redis: redisCfg,
		Count: func(context.Context) (int, int64, error) { return 0, 0, nil }})
	if err != nil {
		t.Fatal(err)
	}
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	seed := func() {
		for _, k := range []string{"blobs::sha256:aa", "repository::app::blobs", "repository::app::blobs::sha256:aa", "someone-else"} {
			if err := rc.Set(ctx, k, "x", 0).Err(); err != nil {
				t.Fatal(err)
			}
		}
	}
	refused := func() bool { return srv.WritesRefused() != "" }
	// settled polls the replica until no flush is owed.
	settled := func() bool {
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			srv.Refresh(ctx)
			if !srv.flushPending.Load() {
				return true
			}
		}
		return false
	}

	// A maintainer in read-only mode owes a flush: the replica waits for it.
	seed()
	lease, err := srv.EnterReadOnly(ctx, "garbage collection", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	flag, err := srv.oweCacheFlush(ctx, lease.Marker().Holder)
	if err != nil {
		t.Fatal(err)
	}
	srv.Refresh(ctx)
	time.Sleep(200 * time.Millisecond)
	if !srv.flushPending.Load() {
		t.Fatal("no flush pending while the maintainer owes one")
	}
	if n, _ := rc.Exists(ctx, "blobs::sha256:aa").Result(); n != 1 {
		t.Fatal("the replica flushed while the maintainer held read-only mode")
	}
	// The maintainer dies: its marker goes, its flag stays.
	if err := srv.LeaveReadOnly(ctx); err != nil {
		t.Fatal(err)
	}
	if !refused() {
		t.Fatal("writes accepted with a flush owed")
	}
	if !settled() {
		t.Fatal("the replica did not settle the owed flush")
	}
	keys, _ := rc.Keys(ctx, "*").Result()
	if len(keys) != 1 || keys[0] != "someone-else" {
		t.Fatalf("keys after the flush: %v; want only someone-else", keys)
	}
	if _, err := srv.driver.Stat(ctx, flag); err == nil {
		t.Fatal("the owed-flush flag survived a successful flush")
	}
	if refused() {
		t.Fatalf("writes refused after the flush: %s", srv.WritesRefused())
	}

	// idle waits for a background flush to end (before the test changes
	// the configuration it reads).
	idle := func() {
		for deadline := time.Now().Add(10 * time.Second); srv.flushing.Load(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("background flush did not end")
			}
		}
	}

	// With redis unreachable the replica refuses writes until it can flush.
	idle()
	if _, err := srv.oweCacheFlush(ctx, "gc-dead"); err != nil {
		t.Fatal(err)
	}
	redisCfg.Options.Addrs = []string{testenv.FreeAddr(t)}
	srv.Refresh(ctx)
	idle() // the background flush failed
	srv.Refresh(ctx)
	idle()
	if !srv.flushPending.Load() || !refused() {
		t.Fatal("writes accepted while the owed flush cannot be done")
	}
	redisCfg.Options.Addrs = []string{addr}
	if !settled() {
		t.Fatal("flush still pending once redis is back")
	}
}
