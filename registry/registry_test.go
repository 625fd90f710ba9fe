package registry

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/distribution/distribution/v3/registry/storage/driver/factory"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/registry/remote"
)

// testRegistry is an in-process registry on the embedded default config.
type testRegistry struct {
	srv  *Server
	http *httptest.Server
	root string
	host string
}

func startRegistry(t *testing.T, root string) *testRegistry {
	t.Helper()
	if root == "" {
		root = t.TempDir()
	}
	cfg, err := DefaultConfig(root, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	reg := startRegistryWith(t, cfg)
	reg.root = root
	return reg
}

// startRegistryWith serves a registry of cfg on a test HTTP server.
func startRegistryWith(t *testing.T, cfg *configuration.Configuration) *testRegistry {
	t.Helper()
	srv, err := New(context.Background(), cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { hs.Close(); srv.Close() })
	return &testRegistry{srv: srv, http: hs, host: strings.TrimPrefix(hs.URL, "http://")}
}

func (r *testRegistry) repo(t *testing.T, name string) (*remote.Repository, string) {
	t.Helper()
	repo, ref, err := transfer.Repository(r.host+"/"+name, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return repo, ref
}

func TestPushPullRoundTrip(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.HalfZero, 16<<20, 1)
	repo, tag := reg.repo(t, "app:v1")
	res, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.UploadedBytes == 0 || res.Stats.UploadedBytes >= res.Stats.LogicalBytes {
		t.Fatalf("uploaded %d of %d logical bytes", res.Stats.UploadedBytes, res.Stats.LogicalBytes)
	}
	out := filepath.Join(t.TempDir(), "out")
	pr, err := transfer.Pull(ctx, repo, tag, out, transfer.PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, src, out)
	if pr.Kind != "cryo" || pr.FetchedBytes != res.Stats.StoredBytes {
		t.Fatalf("pull fetched %d bytes, snapshot stores %d", pr.FetchedBytes, res.Stats.StoredBytes)
	}
	// A second push of the same dir uploads nothing.
	res2, err := transfer.Push(ctx, src, repo, "v2", transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res2.Stats.UploadedBytes != 0 || res2.Descriptor.Digest != res.Descriptor.Digest {
		t.Fatalf("second push uploaded %d bytes, digest %s vs %s", res2.Stats.UploadedBytes, res2.Descriptor.Digest, res.Descriptor.Digest)
	}
}

// TestChunkIndexSkipsDifferentlyEncodedChunks pushes into repo "a" a
// snapshot whose chunks were compressed by another zstd encoder (other blob
// digests, same chunk digests), then pushes the same dir into repo "b" with
// cryo's encoder: the chunk index must supply a's blobs (mounted into b), so
// nothing is uploaded, and b pulls back byte-identical.
func TestChunkIndexSkipsDifferentlyEncodedChunks(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 2)
	repoA, _ := reg.repo(t, "a:v1")
	foreign := newRewriter(repoA, reencodeZstd)
	if _, _, err := format.Pack(ctx, src, foreign, format.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	if foreign.count() == 0 {
		t.Fatal("no chunk was re-encoded")
	}
	repoB, tag := reg.repo(t, "b:v1")
	res, err := transfer.Push(ctx, src, repoB, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.UploadedBytes != 0 || res.ChunkIndexHits == 0 {
		t.Fatalf("push to b uploaded %d bytes with %d chunk index hits; want 0 bytes", res.Stats.UploadedBytes, res.ChunkIndexHits)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, repoB, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, src, out)

	// The extension API answers single lookups too, and 404s unknown chunks.
	resp, err := http.Get(reg.http.URL + api.ChunksPath + "/" + digest.FromString("nope").String())
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("unknown chunk: %s", resp.Status)
	}
}

func TestReferrers(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Random, 1<<20, 3)
	repo, tag := reg.repo(t, "app:v1")
	res, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	subject := res.Descriptor
	attach := func(artifactType string) ocispec.Descriptor {
		desc, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, artifactType, oras.PackManifestOptions{Subject: &subject})
		if err != nil {
			t.Fatal(err)
		}
		return desc
	}
	profile := attach("application/vnd.cryo.prefetch.v1+json")
	sig := attach("application/vnd.example.signature")
	list := func(query string) ([]ocispec.Descriptor, http.Header) {
		resp, err := http.Get(reg.http.URL + "/v2/app/referrers/" + subject.Digest.String() + query)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Type") != ocispec.MediaTypeImageIndex {
			t.Fatalf("referrers: %s %s", resp.Status, resp.Header.Get("Content-Type"))
		}
		var idx ocispec.Index
		json.NewDecoder(resp.Body).Decode(&idx)
		return idx.Manifests, resp.Header
	}
	all, _ := list("")
	if len(all) != 2 {
		t.Fatalf("got %d referrers, want 2", len(all))
	}
	only, h := list("?artifactType=application/vnd.cryo.prefetch.v1%2Bjson")
	if len(only) != 1 || only[0].Digest != profile.Digest || h.Get("OCI-Filters-Applied") != "artifactType" {
		t.Fatalf("filtered referrers: %+v %v", only, h)
	}
	// oras-go's client discovers them through the referrers API too.
	var found []ocispec.Descriptor
	if err := repo.Referrers(ctx, subject, "", func(r []ocispec.Descriptor) error { found = append(found, r...); return nil }); err != nil {
		t.Fatal(err)
	}
	if len(found) != 2 {
		t.Fatalf("oras-go found %d referrers", len(found))
	}
	// A deleted referrer disappears.
	if err := repo.Delete(ctx, sig); err != nil {
		t.Fatal(err)
	}
	if all, _ := list(""); len(all) != 1 || all[0].Digest != profile.Digest {
		t.Fatalf("after delete: %+v", all)
	}
	// An unknown subject has no referrers, not a 404.
	resp, _ := http.Get(reg.http.URL + "/v2/app/referrers/" + digest.FromString("x").String())
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("unknown subject: %s", resp.Status)
	}
}

func TestOCISubjectHeader(t *testing.T) {
	reg := startRegistry(t, "")
	subject := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageManifest, Digest: digest.FromString("s"), Size: 1}
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: "application/x", Config: ocispec.DescriptorEmptyJSON, Layers: []ocispec.Descriptor{ocispec.DescriptorEmptyJSON}, Subject: &subject}
	m.SchemaVersion = 2
	var body []byte
	// The empty blob must exist first.
	if resp := uploadBlob(t, reg, "r", ocispec.DescriptorEmptyJSON.Digest, []byte("{}")); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	m.Config.Data, m.Layers[0].Data = nil, nil
	body, _ = json.Marshal(m)
	req, _ := http.NewRequest(http.MethodPut, reg.http.URL+"/v2/r/manifests/"+digest.FromBytes(body).String(), bytes.NewReader(body))
	req.Header.Set("Content-Type", ocispec.MediaTypeImageManifest)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || resp.Header.Get("OCI-Subject") != subject.Digest.String() {
		t.Fatalf("PUT: %s, OCI-Subject %q", resp.Status, resp.Header.Get("OCI-Subject"))
	}
}

// TestGCKeepsSharedChunks pushes two snapshots that share most chunks,
// deletes one and collects garbage: every chunk of the other stays (it pulls
// back byte-identical), the chunks only the deleted one used are freed, and
// the chunk index forgets them.
func TestGCKeepsSharedChunks(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	first := testenv.ImageDir(t, synth.Random, 16<<20, 4)
	second := filepath.Join(t.TempDir(), "img2")
	if err := os.CopyFS(second, os.DirFS(first)); err != nil {
		t.Fatal(err)
	}
	// Rewrite the last 4 MiB of pages.img in the second snapshot.
	f, _ := os.OpenFile(filepath.Join(second, "pages.img"), os.O_RDWR, 0)
	tail := make([]byte, 4<<20)
	for i := range tail {
		tail[i] = byte(i*31 + 7)
	}
	f.WriteAt(tail, 12<<20)
	f.Close()
	repo, _ := reg.repo(t, "app:one")
	r1, err := transfer.Push(ctx, first, repo, "one", transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r2, err := transfer.Push(ctx, second, repo, "two", transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if r2.Stats.UploadedBytes >= r2.Stats.LogicalBytes/2 {
		t.Fatalf("second snapshot uploaded %d of %d bytes", r2.Stats.UploadedBytes, r2.Stats.LogicalBytes)
	}
	onlyFirst := chunkBlobs(t, ctx, repo, r1.Descriptor)
	for d := range chunkBlobs(t, ctx, repo, r2.Descriptor) {
		delete(onlyFirst, d)
	}
	if len(onlyFirst) == 0 {
		t.Fatal("the snapshots share every chunk: test data is wrong")
	}
	if err := repo.Delete(ctx, r1.Descriptor); err != nil {
		t.Fatal(err)
	}
	res, err := reg.srv.Maintenance().GC(ctx, maintenance.GCOptions{RemoveUntagged: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.BlobsAfter >= res.BlobsBefore || res.ChunkIndexPruned < len(onlyFirst) {
		t.Fatalf("gc freed %d blobs, pruned %d index entries; want at least the %d chunks only the deleted snapshot used", res.BlobsBefore-res.BlobsAfter, res.ChunkIndexPruned, len(onlyFirst))
	}
	for d := range onlyFirst {
		if _, err := reg.srv.ns.BlobStatter().Stat(ctx, d); err == nil {
			t.Fatalf("chunk blob %s of the deleted snapshot survived gc", d)
		}
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, repo, "two", out, transfer.PullOptions{}); err != nil {
		t.Fatalf("the kept snapshot lost chunks: %v", err)
	}
	testenv.SameImage(t, second, out)
}

func chunkBlobs(t *testing.T, ctx context.Context, repo *remote.Repository, idx ocispec.Descriptor) map[digest.Digest]bool {
	t.Helper()
	snap, err := format.LoadSnapshot(ctx, repo, idx)
	if err != nil {
		t.Fatal(err)
	}
	out := map[digest.Digest]bool{}
	for i := range snap.Files {
		for p := range snap.Files[i].Parts {
			pt, err := format.LoadPart(ctx, repo, &snap.Files[i], p)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range pt.Table.Chunks {
				if c.Encoding != format.EncodingZero {
					out[c.Blob] = true
				}
			}
		}
	}
	return out
}

func TestBadConfigIsAnError(t *testing.T) {
	const base = "version: 0.1\nstorage:\n  inmemory: {}\nhttp:\n  addr: 127.0.0.1:0\n"
	cases := []struct {
		name, yaml string
		// want is a substring of the error naming what is wrong.
		want string
	}{
		{"not yaml", "{{{", "yaml: line 1: did not find expected node content"},
		{"no storage", "version: 0.1\nhttp:\n  addr: 127.0.0.1:0\n", "no storage configuration provided"},
		{"unknown driver", "version: 0.1\nstorage:\n  nosuchdriver: {}\nhttp:\n  addr: 127.0.0.1:0\n", "storage driver nosuchdriver: StorageDriver not registered"},
		{"bad mirror", base + "proxy:\n  remoteurl: ftp://x\n", `--mirror-of "ftp://x": want an http:// or https:// registry URL`},
		{"half tls", base + "  tls:\n    certificate: /x.pem\n", "http.tls needs both certificate and key"},
		{"bad readonly", "version: 0.1\nstorage:\n  inmemory: {}\n  maintenance:\n    readonly: yes-please\nhttp:\n  addr: 127.0.0.1:0\n", "readonly config key must contain additional keys"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "config.yml")
			if err := os.WriteFile(p, []byte(c.yaml), 0o644); err != nil {
				t.Fatal(err)
			}
			cfg, err := LoadConfig(p)
			if err == nil {
				_, err = New(context.Background(), cfg, Options{})
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %v, want one containing %q", err, c.want)
			}
			var unregistered factory.InvalidStorageDriverError
			if c.name == "unknown driver" && (!errors.As(err, &unregistered) || unregistered.Name != "nosuchdriver") {
				t.Fatalf("error %v does not wrap distribution's InvalidStorageDriverError for nosuchdriver", err)
			}
		})
	}
}

func TestMirrorPullsThrough(t *testing.T) {
	ctx := context.Background()
	primary := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.HalfZero, 8<<20, 5)
	repo, tag := primary.repo(t, "app:v1")
	if _, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg, _ := DefaultConfig(t.TempDir(), "127.0.0.1:0")
	if err := SetMirrorOf(cfg, primary.http.URL); err != nil {
		t.Fatal(err)
	}
	msrv, err := New(ctx, cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	mhttp := httptest.NewServer(msrv.Handler())
	defer mhttp.Close()
	mrepo, _, err := transfer.Repository(strings.TrimPrefix(mhttp.URL, "http://")+"/app:v1", transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, mrepo, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, src, out)
	// Pushing to a mirror is refused.
	if _, err := transfer.Push(ctx, src, mrepo, "v2", transfer.PushOptions{}); err == nil {
		t.Fatal("push to a mirror succeeded")
	}
}

// uploadBlob uploads data as d with a POST and a monolithic PUT.
func uploadBlob(t *testing.T, reg *testRegistry, repo string, d digest.Digest, data []byte) *http.Response {
	t.Helper()
	resp, err := http.Post(reg.http.URL+"/v2/"+repo+"/blobs/uploads/", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	loc, err := resp.Location()
	if err != nil {
		t.Fatal(err)
	}
	q := loc.Query()
	q.Set("digest", d.String())
	loc.RawQuery = q.Encode()
	req, _ := http.NewRequest(http.MethodPut, loc.String(), bytes.NewReader(data))
	req.Header.Set("Content-Type", "application/octet-stream")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp
}

func TestUploadWithWrongDigestIsRefused(t *testing.T) {
	reg := startRegistry(t, "")
	resp := uploadBlob(t, reg, "app", digest.FromString("other"), []byte("content"))
	if resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("upload with a wrong digest: %s", resp.Status)
	}
	if resp := uploadBlob(t, reg, "app", digest.FromString("content"), []byte("content")); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload with the right digest: %s", resp.Status)
	}
}

func TestOversizedManifestIsRefused(t *testing.T) {
	reg := startRegistry(t, "")
	big := `{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","annotations":{"x":"` + strings.Repeat("a", 5<<20) + `"}}`
	req, _ := http.NewRequest(http.MethodPut, reg.http.URL+"/v2/app/manifests/big", strings.NewReader(big))
	req.Header.Set("Content-Type", ocispec.MediaTypeImageManifest)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	// Refused for its size, not for its (missing) config and layers.
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "request body too large") {
		t.Fatalf("5 MiB manifest: %s %s; want 400 for its size", resp.Status, body)
	}
}

func TestStatsCountDedup(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Random, 4<<20, 6)
	for _, name := range []string{"a:v1", "b:v1"} {
		repo, tag := reg.repo(t, name)
		if _, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	st, err := reg.srv.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// One snapshot in two repositories: stored once.
	if st.Repositories != 2 || st.Snapshots != 1 || st.ChunkBlobBytes > st.LogicalBytes+4096 || st.DedupRatio() < 0.99 {
		t.Fatalf("stats %+v ratio %.2f", st, st.DedupRatio())
	}
	rec := httptest.NewRecorder()
	reg.srv.MetricsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	for _, m := range []string{"cryo_registry_dedup_ratio", "cryo_registry_snapshot_logical_bytes", "cryo_registry_chunk_index_lookups_total", "cryo_registry_response_bytes_total"} {
		if !strings.Contains(rec.Body.String(), m) {
			t.Errorf("/metrics lacks %s", m)
		}
	}
}

// TestBlobServing checks the sendfile fast path against what distribution
// does: full GET, HEAD, Range, and a blob that exists in the registry but is
// not linked in the repository asked for (404, as distribution answers).
func TestBlobServing(t *testing.T) {
	reg := startRegistry(t, "")
	data := bytes.Repeat([]byte("cryo blob "), 1000)
	d := digest.FromBytes(data)
	if resp := uploadBlob(t, reg, "a", d, data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	get := func(method, repo, rng string) (*http.Response, []byte) {
		req, _ := http.NewRequest(method, reg.http.URL+"/v2/"+repo+"/blobs/"+d.String(), nil)
		if rng != "" {
			req.Header.Set("Range", rng)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, body
	}
	resp, body := get(http.MethodGet, "a", "")
	if resp.StatusCode != http.StatusOK || !bytes.Equal(body, data) || resp.Header.Get("Docker-Content-Digest") != d.String() {
		t.Fatalf("GET: %s, %d bytes, digest header %q", resp.Status, len(body), resp.Header.Get("Docker-Content-Digest"))
	}
	resp, body = get(http.MethodHead, "a", "")
	if resp.StatusCode != http.StatusOK || resp.ContentLength != int64(len(data)) || len(body) != 0 {
		t.Fatalf("HEAD: %s, length %d", resp.Status, resp.ContentLength)
	}
	resp, body = get(http.MethodGet, "a", "bytes=10-19")
	if resp.StatusCode != http.StatusPartialContent || !bytes.Equal(body, data[10:20]) {
		t.Fatalf("Range: %s %q", resp.Status, body)
	}
	resp, _ = get(http.MethodGet, "b", "")
	if resp.StatusCode != http.StatusNotFound {
		t.Fatalf("blob not linked in b: %s", resp.Status)
	}
	// The answers above came from the sendfile path for a, from
	// distribution for b.
	for repo, want := range map[string]bool{"a": true, "b": false} {
		req := httptest.NewRequest(http.MethodGet, "/v2/"+repo+"/blobs/"+d.String(), nil)
		if got := reg.srv.serveBlobFile(httptest.NewRecorder(), req, repo, d.String()); got != want {
			t.Errorf("serveBlobFile for repository %s: %v, want %v", repo, got, want)
		}
	}
}
