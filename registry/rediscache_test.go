package registry

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// TestOwedCacheFlush checks a replica's part of the cache flush a garbage
// collection owes: it flushes distribution's blob descriptor keys (and no
// other key), and refuses writes while it cannot.
func TestOwedCacheFlush(t *testing.T) {
	addr := testenv.StartRedis(t)
	root := t.TempDir()
	cfg, err := DefaultConfig(root, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Storage["cache"] = map[string]any{"blobdescriptor": "redis"}
	cfg.Redis.Options.Addrs = []string{addr}
	cfg.Redis.Options.DialTimeout = 500 * time.Millisecond
	srv, err := New(context.Background(), cfg, Options{ReadOnlyPoll: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ctx := context.Background()
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	for _, k := range []string{"blobs::sha256:aa", "repository::app::blobs", "repository::app::blobs::sha256:aa", "someone-else"} {
		if err := rc.Set(ctx, k, "x", 0).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := srv.oweCacheFlush(ctx); err != nil {
		t.Fatal(err)
	}
	srv.refreshReadOnly(ctx)
	if srv.flushPending.Load() {
		t.Fatal("flush still pending with redis up")
	}
	keys, _ := rc.Keys(ctx, "*").Result()
	if len(keys) != 1 || keys[0] != "someone-else" {
		t.Fatalf("keys after the flush: %v; want only someone-else", keys)
	}
	if _, err := srv.driver.Stat(ctx, cacheFlushPath); err == nil {
		t.Fatal("the owed-flush flag survived a successful flush")
	}

	// With redis unreachable the replica refuses writes until it can flush.
	if err := srv.oweCacheFlush(ctx); err != nil {
		t.Fatal(err)
	}
	srv.cfg.Redis.Options.Addrs = []string{testenv.FreeAddr(t)}
	srv.refreshReadOnly(ctx)
	if !srv.flushPending.Load() {
		t.Fatal("no flush pending with redis unreachable")
	}
	rec := &statusRecorder{header: http.Header{}}
	req, _ := http.NewRequest(http.MethodPost, "/v2/app/blobs/uploads/", nil)
	srv.Handler().ServeHTTP(rec, req)
	if rec.code != http.StatusServiceUnavailable {
		t.Fatalf("upload while a flush is owed: %d", rec.code)
	}
	srv.cfg.Redis.Options.Addrs = []string{addr}
	srv.refreshReadOnly(ctx)
	if srv.flushPending.Load() {
		t.Fatal("flush still pending once redis is back")
	}
}

type statusRecorder struct {
	header http.Header
	code   int
}

func (r *statusRecorder) Header() http.Header         { return r.header }
func (r *statusRecorder) Write(b []byte) (int, error) { return len(b), nil }
func (r *statusRecorder) WriteHeader(code int)        { r.code = code }
