package scale

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	goredis "github.com/redis/go-redis/v9"
)

// chartConfig renders the cryo-registry Helm chart for replicas on the
// SeaweedFS bucket with the shared redis cache, and writes the distribution
// configuration it puts in its ConfigMap: the replicas run exactly what the
// chart would give them. Secrets reach them through the environment, as the
// chart's Deployment passes them (REGISTRY_HTTP_SECRET and
// REGISTRY_STORAGE_S3_* from Secrets).
func chartConfig(t *testing.T, w *testenv.SeaweedFS, redis string) string {
	t.Helper()
	root, err := testenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out := testenv.Run(t, testenv.Tool(t, "helm"), "template", "scale", filepath.Join(root, "charts", "cryo-registry"),
		"--show-only", "templates/configmap.yaml",
		"--set", "replicaCount=2", "--set", "storage.type=s3", "--set", "storage.s3.bucket="+w.Bucket,
		"--set", "storage.s3.regionEndpoint="+w.S3, "--set", "storage.s3.forcePathStyle=true", "--set", "storage.s3.secure=false",
		"--set", "storage.s3.existingSecret=s3-keys", "--set", "redis.enabled=true", "--set", "redis.addr="+redis,
		"--set", "logLevel=warn")
	// The ConfigMap's config.yml block: the lines indented under it.
	var cfg strings.Builder
	in := false
	for _, line := range strings.Split(out, "\n") {
		if strings.TrimSpace(line) == "config.yml: |" {
			in = true
			continue
		}
		if in {
			if rest, ok := strings.CutPrefix(line, "    "); ok {
				cfg.WriteString(rest + "\n")
			} else if strings.TrimSpace(line) != "" {
				break
			}
		}
	}
	if !strings.Contains(cfg.String(), "regionendpoint: "+w.S3) {
		t.Fatalf("no S3 configuration in the chart's ConfigMap:\n%s", out)
	}
	path := filepath.Join(t.TempDir(), "registry.yml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("REGISTRY_HTTP_SECRET", "one-secret-shared-by-every-replica")
	return path
}

// startReplica starts `cryo registry serve --config cfg` on a free port.
func startReplica(t *testing.T, cryo, cfg string) *testenv.Registry {
	t.Helper()
	addr, maddr := testenv.FreeAddr(t), testenv.FreeAddr(t)
	// As the chart runs them with redis.chunkIndexAnchors.
	r := testenv.StartCommand(t, addr, cryo, "registry", "serve", "--config", cfg, "--addr", addr, "--metrics-addr", maddr, "--chunk-index-anchors", "redis")
	r.MetricsAddr = maddr
	return r
}

// TestReplicasOnSeaweedFS runs two registry replicas on one SeaweedFS
// bucket and one redis, configured by the Helm chart: what one replica is pushed, the other serves, to
// cryo pull and to the puller's FUSE mount; a replica killed mid-push
// leaves nothing half visible; gc runs against the shared store while the
// replicas serve; the store going away turns readiness false with a clear
// reason and loses nothing.
func TestReplicasOnSeaweedFS(t *testing.T) {
	cryo := testenv.Tool(t, "cryo")
	redis := testenv.StartRedis(t)
	weed := testenv.StartSeaweedFS(t)
	for _, kv := range weed.Env() {
		k, v, _ := strings.Cut(kv, "=")
		t.Setenv(k, v)
	}
	cfg := chartConfig(t, weed, redis)
	rc := goredis.NewClient(&goredis.Options{Addr: redis})
	defer rc.Close()
	a := startReplica(t, cryo, cfg)
	b := startReplica(t, cryo, cfg)

	img1 := testenv.ImageDir(t, synth.HalfZero, 48<<20, 1)
	img2 := editedCopy(t, img1, 8<<20, 2<<20, 99)

	t.Run("push through one, pull through the other", func(t *testing.T) {
		r := push(t, cryo, img1, a.Addr+"/app:v1")
		if r.Stats.UploadedBytes == 0 {
			t.Fatal("first push uploaded nothing")
		}
		testenv.SameImage(t, img1, pull(t, cryo, b.Addr+"/app:v1"))
		// A later snapshot in another repository, through the other
		// replica: the chunk index on the shared store finds the chunks.
		// Format v1 reuses them as blobs; v2 (the default) has replica B
		// compose packs of them: the packs holding the 2 MiB edit are
		// composed in part (the rest is the edit, uploaded).
		// app:v1 is v2: v1's chunk blobs come from a v1 push of the same.
		push(t, cryo, img1, a.Addr+"/app-v1:v1", "--format", "v1")
		for _, f := range []struct {
			format, repo string
			maxPart      int64 // uploaded bytes, at most a 1/maxPart of stored
		}{{"v1", "other-v1", 5}, {"v2", "other", 8}} {
			r2 := push(t, cryo, img2, b.Addr+"/"+f.repo+":v1", "--format", f.format)
			t.Logf("%s second snapshot: uploaded %d of %d stored bytes, %d chunk index hits, %d bytes composed", f.format, r2.Stats.UploadedBytes, r2.Stats.StoredBytes, r2.ChunkIndexHits, r2.Stats.ComposedBytes)
			reused := r2.ChunkIndexHits
			if f.format == "v2" {
				reused = int(r2.Stats.ComposedBytes)
			}
			if reused == 0 || r2.Stats.UploadedBytes*f.maxPart > r2.Stats.StoredBytes {
				t.Errorf("%s second snapshot through replica B uploaded %d of %d stored bytes (%d chunk index hits, %d bytes composed); want < 1/%d through the shared chunk index",
					f.format, r2.Stats.UploadedBytes, r2.Stats.StoredBytes, r2.ChunkIndexHits, r2.Stats.ComposedBytes, f.maxPart)
			}
			testenv.SameImage(t, img2, pull(t, cryo, a.Addr+"/"+f.repo+":v1"))
		}
		// The v2 compositions found their packs through anchors in the
		// shared redis, not in the object store.
		if n := anchorPacks(t, rc); n == 0 {
			t.Error("no chunk index anchors in redis after v2 pushes through replicas that keep them there")
		}
	})

	t.Run("stream through the puller from the other replica", func(t *testing.T) {
		dir, stop := mount(t, cryo, b.Addr+"/app:v1")
		defer stop()
		// pages.img is read through FUSE while it loads: what a restoring
		// sandbox sees.
		got, err := os.ReadFile(filepath.Join(dir, "pages.img"))
		if err != nil {
			t.Fatal(err)
		}
		want, _ := os.ReadFile(filepath.Join(img1, "pages.img"))
		if !bytes.Equal(got, want) {
			t.Fatal("pages.img read through the puller differs from the source")
		}
	})

	t.Run("replica killed during a push", func(t *testing.T) {
		big := testenv.ImageDir(t, synth.Random, 96<<20, 3)
		cmd := exec.Command(cryo, "push", "--concurrency", "2", big, a.Addr+"/big:v1")
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Kill replica A once part of the snapshot is uploaded: a
		// quarter of it, so that some 4 MiB packs are whole in the
		// store, not only received.
		deadline := time.Now().Add(time.Minute)
		for metric(t, "http://"+a.MetricsAddr+"/metrics", "cryo_registry_request_bytes_total", `kind="blob"`) < 24<<20 {
			if time.Now().After(deadline) {
				t.Fatalf("push did not get going:\n%s", out.String())
			}
			time.Sleep(20 * time.Millisecond)
		}
		a.Stop()
		if err := cmd.Wait(); err == nil {
			t.Fatalf("push through a killed replica succeeded:\n%s", out.String())
		}
		t.Logf("push through the killed replica: %s", lastLine(out.String()))
		if code := manifestStatus(t, b.Addr, "big", "v1"); code != http.StatusNotFound {
			t.Fatalf("after the replica died mid-push, the tag answers %d on the other replica; want 404 (nothing half visible)", code)
		}
		// Pushing again through the survivor completes the snapshot,
		// reusing the chunks that did arrive.
		r := push(t, cryo, big, b.Addr+"/big:v1")
		if r.Stats.UploadedBytes >= r.Stats.StoredBytes {
			t.Errorf("second push uploaded everything again (%d of %d bytes)", r.Stats.UploadedBytes, r.Stats.StoredBytes)
		}
		testenv.SameImage(t, big, pull(t, cryo, b.Addr+"/big:v1"))
		a.Start(t)
		testenv.SameImage(t, big, pull(t, cryo, a.Addr+"/big:v1"))
	})

	t.Run("gc against the shared store while replicas serve", func(t *testing.T) {
		deleteSnapshot(t, a.Addr, "app", "v1")
		anchorsBefore := anchorPacks(t, rc)
		gc := exec.Command(cryo, "registry", "gc", "--json", "--config", cfg, "--delete-untagged", "--read-only-wait", "15s", "--grace", "0", "--chunk-index-anchors", "redis")
		var out, errOut bytes.Buffer
		gc.Stdout, gc.Stderr = &out, &errOut
		if err := gc.Start(); err != nil {
			t.Fatal(err)
		}
		// Both replicas refuse pushes while gc holds read-only mode; pulls
		// go on.
		for _, r := range []*testenv.Registry{a, b} {
			// Replicas re-read the marker every 5 s; gc holds it 15 s.
			code, body := uploadStatus(r.Addr, http.StatusServiceUnavailable, 12*time.Second)
			if code != http.StatusServiceUnavailable || !strings.Contains(body, "read-only") {
				t.Errorf("replica %s during gc: upload answered %d %s; want 503 read-only", r.Addr, code, body)
			}
		}
		testenv.SameImage(t, img2, pull(t, cryo, b.Addr+"/other:v1"))
		if err := gc.Wait(); err != nil {
			t.Fatalf("gc: %v\n%s%s", err, out.String(), errOut.String())
		}
		var res struct{ BlobsBefore, BlobsAfter, CacheEntriesCleared int }
		if err := json.Unmarshal(out.Bytes(), &res); err != nil {
			t.Fatalf("gc --json: %v\n%s", err, out.String())
		}
		t.Logf("gc: %+v", res)
		if res.BlobsAfter >= res.BlobsBefore {
			t.Fatalf("gc deleted nothing: %+v", res)
		}
		if res.CacheEntriesCleared == 0 {
			t.Errorf("gc flushed no redis cache entries: %+v", res)
		}
		// app:v1's packs are gone: so are the anchors naming them.
		if after := anchorPacks(t, rc); after >= anchorsBefore {
			t.Errorf("anchors in redis name %d packs after gc deleted a snapshot's, %d before", after, anchorsBefore)
		}
		for _, r := range []*testenv.Registry{a, b} {
			if code, body := uploadStatus(r.Addr, http.StatusAccepted, 10*time.Second); code != http.StatusAccepted {
				t.Errorf("replica %s after gc: upload answered %d %s", r.Addr, code, body)
			}
		}
		// What remains is intact, through either replica.
		testenv.SameImage(t, img2, pull(t, cryo, a.Addr+"/other:v1"))
		if code := manifestStatus(t, b.Addr, "app", "v1"); code != http.StatusNotFound {
			t.Errorf("deleted snapshot answers %d", code)
		}
		// Pushing the deleted snapshot again must upload the chunks gc
		// deleted: a replica that still believed them present (a stale
		// redis cache) would accept a manifest whose blobs are gone.
		push(t, cryo, img1, b.Addr+"/app:v1")
		testenv.SameImage(t, img1, pull(t, cryo, a.Addr+"/app:v1"))
	})

	t.Run("object store unreachable", func(t *testing.T) {
		weed.Stop()
		code, body := httpStatus("http://"+a.Addr+"/readyz", http.StatusServiceUnavailable, 30*time.Second)
		if code != http.StatusServiceUnavailable || !strings.Contains(body, "storage s3aws unreachable") {
			t.Fatalf("readyz with the store down: %d %q; want 503 naming the storage", code, body)
		}
		out, err := exec.Command(cryo, "pull", b.Addr+"/other:v1", filepath.Join(t.TempDir(), "x")).CombinedOutput()
		if err == nil {
			t.Fatal("pull with the store down succeeded")
		}
		t.Logf("pull with the store down: %s", lastLine(string(out)))
		if !strings.Contains(string(out), "other:v1") || !strings.Contains(string(out), "/readyz") {
			t.Errorf("pull error does not name the snapshot and point at the registry's readiness: %s", out)
		}
		// Nothing is lost: with the store back, everything is served again.
		weed.Start(t)
		if code, body := httpStatus("http://"+a.Addr+"/readyz", http.StatusOK, 60*time.Second); code != http.StatusOK {
			t.Fatalf("readyz with the store back: %d %s", code, body)
		}
		testenv.SameImage(t, img2, pull(t, cryo, b.Addr+"/other:v1"))
		testenv.SameImage(t, img1, pull(t, cryo, a.Addr+"/app:v1"))
	})
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// anchorPacks counts the packs the chunk index's anchors in redis name.
func anchorPacks(t *testing.T, rc *goredis.Client) int64 {
	t.Helper()
	ctx := context.Background()
	var n int64
	iter := rc.Scan(ctx, 0, chunkindex.RedisAnchorPrefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		c, err := rc.HLen(ctx, iter.Val()).Result()
		if err != nil {
			t.Fatal(err)
		}
		n += c
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}
