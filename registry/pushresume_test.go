package registry

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/transfer"
)

// TestPushResumesAfterRegistryFailure cuts a push off after some blob
// uploads (the registry answers 503 from then on, as a dying replica
// would): the push fails with an error, the tag does not exist (the index
// is pushed last, so nothing half-written is visible), and a second push
// uploads only what is missing and yields a complete snapshot.
func TestPushResumesAfterRegistryFailure(t *testing.T) {
	ctx := context.Background()
	cfg, _ := DefaultConfig(t.TempDir(), "127.0.0.1:0")
	srv, err := New(ctx, cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var uploads, limit atomic.Int64
	limit.Store(10)
	h := srv.Handler()
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut && strings.Contains(r.URL.Path, "/blobs/uploads/") && uploads.Add(1) > limit.Load() {
			http.Error(w, "registry going down", http.StatusServiceUnavailable)
			return
		}
		h.ServeHTTP(w, r)
	}))
	defer hs.Close()
	host := strings.TrimPrefix(hs.URL, "http://")
	img := filepath.Join(t.TempDir(), "img")
	synth.ImageDir(img, synth.Random, 16<<20, 3)
	opts := transfer.PushOptions{}
	opts.Pack.Chunking.Algorithm = "page-cdc"
	opts.Pack.Chunking.Min, opts.Pack.Chunking.Avg, opts.Pack.Chunking.Max = 64<<10, 256<<10, 1<<20
	repo, tag, _ := transfer.Repository(host+"/app:v1", transfer.ClientOptions{})
	if _, err := transfer.Push(ctx, img, repo, tag, opts); err == nil {
		t.Fatal("push through a failing registry succeeded")
	}
	if _, err := repo.Resolve(ctx, tag); err == nil {
		t.Fatal("a failed push left a visible tag")
	}
	limit.Store(1 << 30)
	res, err := transfer.Push(ctx, img, repo, tag, opts)
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.BlobsSkipped == 0 || res.Stats.UploadedBytes >= res.Stats.StoredBytes {
		t.Fatalf("second push uploaded %d of %d stored bytes, skipped %d blobs: nothing was resumed", res.Stats.UploadedBytes, res.Stats.StoredBytes, res.Stats.BlobsSkipped)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, repo, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, img, out)
}
