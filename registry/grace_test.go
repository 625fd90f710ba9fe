package registry

import (
	"context"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/transfer"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestGCSparesPushInFlight runs gc, removing untagged manifests, in the
// middle of a push:
//
//   - "chunks uploaded": after the push uploaded its first file's chunks,
//     before it put any manifest;
//   - "manifests put, chunks old": after it put every file manifest, before
//     the tagged index, with every blob and blob link aged past the grace
//     period, as for chunks a push reused (HEAD said present) that were
//     uploaded long ago by a snapshot since deleted: only the young
//     manifests that reference them can keep them.
//
// With the default grace the push completes and its snapshot pulls back
// intact. With grace 0 (distribution's sweep) the same sequence loses the
// snapshot, which shows that the test can fail.
func TestGCSparesPushInFlight(t *testing.T) {
	for _, tc := range []struct {
		name  string
		hold  func(r *http.Request) bool
		aged  bool
		grace time.Duration
	}{
		{"chunks uploaded", isManifestPut, false, maintenance.DefaultGCGrace},
		{"chunks uploaded, grace 0", isManifestPut, false, 0},
		{"manifests put, chunks old", isIndexPut, true, maintenance.DefaultGCGrace},
		{"manifests put, chunks old, grace 0", isIndexPut, true, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			root := t.TempDir()
			cfg, _ := DefaultConfig(root, "127.0.0.1:0")
			srv, err := New(ctx, cfg, Options{})
			if err != nil {
				t.Fatal(err)
			}
			held, release := make(chan struct{}), make(chan struct{})
			var once sync.Once
			h := srv.Handler()
			hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.hold(r) {
					once.Do(func() { close(held); <-release })
				}
				h.ServeHTTP(w, r)
			}))
			t.Cleanup(func() { hs.Close(); srv.Close() })

			src := testenv.ImageDir(t, synth.Text, 8<<20, 11)
			repo, tag, err := transfer.Repository(strings.TrimPrefix(hs.URL, "http://")+"/app:v1", transfer.ClientOptions{})
			if err != nil {
				t.Fatal(err)
			}
			pushed := make(chan error, 1)
			go func() {
				_, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{})
				pushed <- err
			}()
			select {
			case <-held:
			case err := <-pushed:
				t.Fatalf("push ended before the hold point: %v", err)
			}
			if tc.aged {
				ageBlobs(t, root, 2*maintenance.DefaultGCGrace)
			}
			res, err := srv.Maintenance().GC(ctx, maintenance.GCOptions{RemoveUntagged: true, Grace: tc.grace})
			close(release)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("gc: %+v", res)
			out := filepath.Join(t.TempDir(), "out")
			err = <-pushed
			if err == nil {
				_, err = transfer.Pull(ctx, repo, tag, out, transfer.PullOptions{})
			}
			if tc.grace == 0 {
				if err == nil {
					t.Fatal("without a grace period the snapshot survived gc during its push: the test cannot fail")
				}
				t.Logf("without a grace period: %v", err)
				return
			}
			if err != nil {
				t.Fatalf("push or pull after gc ran during the push: %v", err)
			}
			testenv.SameImage(t, src, out)
			if res.BlobsKeptForGrace == 0 || res.BlobsAfter != res.BlobsBefore {
				t.Errorf("gc deleted %d blobs and kept %d for grace; want all kept for grace", res.BlobsBefore-res.BlobsAfter, res.BlobsKeptForGrace)
			}
		})
	}
}

func isManifestPut(r *http.Request) bool {
	return r.Method == http.MethodPut && strings.Contains(r.URL.Path, "/manifests/")
}

func isIndexPut(r *http.Request) bool {
	return isManifestPut(r) && r.Header.Get("Content-Type") == ocispec.MediaTypeImageIndex
}

// ageBlobs sets the modification time of every blob's data and every
// repository's blob link under the filesystem storage root to age ago;
// manifest revision links keep theirs.
func ageBlobs(t *testing.T, root string, age time.Duration) {
	t.Helper()
	old := time.Now().Add(-age)
	n := 0
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		slash := filepath.ToSlash(p)
		if strings.Contains(slash, "/docker/registry/v2/blobs/") || strings.Contains(slash, "/_layers/") {
			n++
			return os.Chtimes(p, old, old)
		}
		return nil
	})
	if err != nil || n == 0 {
		t.Fatalf("aged %d files: %v", n, err)
	}
}
