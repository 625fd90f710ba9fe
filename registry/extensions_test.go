package registry

import (
	"context"
	"net/http"
	"path"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/cryo-oci/cryo/registry/referrers"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/opencontainers/go-digest"
	"github.com/redis/go-redis/v9"
	"oras.land/oras-go/v2"
)

// TestManifestDeleteDropsReferrer deletes a referrer through the registry
// API: the repository middleware must drop its entry from storage at once
// (not only hide it when the list is read).
func TestManifestDeleteDropsReferrer(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	repo, tag := reg.repo(t, "app:v1")
	res, err := transfer.Push(ctx, testenv.ImageDir(t, synth.Random, 1<<20, 3), repo, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	subject := res.Descriptor
	sig, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, "application/vnd.example.signature", oras.PackManifestOptions{Subject: &subject})
	if err != nil {
		t.Fatal(err)
	}
	entry := path.Join(referrers.Root, "app", "sha256", subject.Digest.Encoded(), sig.Digest.Encoded())
	if _, err := reg.srv.driver.Stat(ctx, entry); err != nil {
		t.Fatalf("no referrer entry after the PUT: %v", err)
	}
	if err := repo.Delete(ctx, sig); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.srv.driver.Stat(ctx, entry); err == nil {
		t.Fatal("the referrer entry outlived its manifest's DELETE")
	}
}

// TestConfigIsNotChanged builds two registries from one configuration (the
// second must not find cryo's middleware already in it) and refuses a
// configuration that names cryo's middleware itself.
func TestConfigIsNotChanged(t *testing.T) {
	cfg, err := DefaultConfig(t.TempDir(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		srv, err := New(context.Background(), cfg, Options{ReadOnlyPoll: -1})
		if err != nil {
			t.Fatal(err)
		}
		srv.Close()
	}
	if len(cfg.Middleware["registry"]) != 0 {
		t.Fatalf("New changed the caller's configuration: %+v", cfg.Middleware)
	}
	cfg.Middleware = map[string][]configuration.Middleware{"registry": {{Name: middlewareName}}}
	if _, err := New(context.Background(), cfg, Options{ReadOnlyPoll: -1}); err == nil || !strings.Contains(err.Error(), `registry middleware "cryo" is cryo's own`) {
		t.Fatalf("a configuration naming cryo's middleware: %v", err)
	}
}

// TestBlobLayoutIsDistributions pins distribution's on-disk blob layout,
// which serveBlobFile (sendfile) and gc's grace period read directly: a blob
// uploaded through the API must be at blobDataPath.
func TestBlobLayoutIsDistributions(t *testing.T) {
	reg := startRegistry(t, "")
	data := []byte(strings.Repeat("layout", 1000))
	d := digest.FromBytes(data)
	if resp := uploadBlob(t, reg, "layout", d, data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	fi, err := reg.srv.driver.Stat(context.Background(), distlayout.BlobDataPath(d))
	if err != nil || fi.Size() != int64(len(data)) {
		t.Fatalf("distribution no longer stores blobs at %s (%v): update blobs.go", distlayout.BlobDataPath(d), err)
	}
}

// TestRedisKeyPatternsAreDistributions pins the key patterns of
// distribution's redis blob descriptor cache, which gc flushes: after an
// upload and a HEAD have filled the cache, a flush must leave no key.
func TestRedisKeyPatternsAreDistributions(t *testing.T) {
	addr := testenv.StartRedis(t)
	cfg, err := DefaultConfig(t.TempDir(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Storage["cache"] = map[string]any{"blobdescriptor": "redis"}
	cfg.Redis.Options.Addrs = []string{addr}
	reg := startRegistryWith(t, cfg)
	ctx := context.Background()
	data := []byte(strings.Repeat("cache", 1000))
	d := digest.FromBytes(data)
	if resp := uploadBlob(t, reg, "team/app", d, data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	if resp, err := http.Head(reg.http.URL + "/v2/team/app/blobs/" + d.String()); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("HEAD: %v %v", resp, err)
	}
	rc := redis.NewClient(&redis.Options{Addr: addr})
	defer rc.Close()
	before, err := rc.Keys(ctx, "*").Result()
	if err != nil || len(before) == 0 {
		t.Fatalf("distribution cached nothing in redis (%v): the test no longer tests anything", err)
	}
	if _, err := reg.srv.Maintenance().FlushBlobDescriptorCache(ctx); err != nil {
		t.Fatal(err)
	}
	if left, _ := rc.Keys(ctx, "*").Result(); len(left) != 0 {
		t.Fatalf("distribution's cache keys %v survive a flush (of %v): its key patterns changed; update maintenance/rediscache.go", left, before)
	}
}
