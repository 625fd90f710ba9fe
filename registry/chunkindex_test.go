package registry

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/distribution/distribution/v3/registry/storage"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestChunkIndexPoisoningIsRefused pushes to repository "evil", through
// oras-go, a well-formed snapshot whose chunk tables say that every chunk is
// stored zstd-encoded in a blob of junk. Then an honest push of the same
// image to repository "victim" must not be offered the junk (the registry
// never indexed it): it uploads its own chunks, and its snapshot pulls back
// byte-identical. A third push then reuses the victim's honest blobs.
func TestChunkIndexPoisoningIsRefused(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 7)
	evil, _ := reg.repo(t, "evil:v1")
	liar := newRewriter(evil, poisonChunk)
	idx, _, err := format.Pack(ctx, src, liar, format.PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if liar.count() == 0 {
		t.Fatal("no chunk was poisoned")
	}
	if idx, ok := liar.replaced(idx.Digest); !ok {
		t.Fatal("the index was not rewritten")
	} else if err := evil.Tag(ctx, idx, "v1"); err != nil {
		t.Fatal(err)
	}

	victim, tag := reg.repo(t, "victim:v1")
	res, err := transfer.Push(ctx, src, victim, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatalf("honest push after a poisoned one: %v", err)
	}
	if res.ChunkIndexHits != 0 {
		t.Errorf("the chunk index offered %d blobs of the lying table", res.ChunkIndexHits)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, victim, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatalf("pull of the honest snapshot: %v", err)
	}
	testenv.SameImage(t, src, out)

	third, tag := reg.repo(t, "third:v1")
	res, err = transfer.Push(ctx, src, third, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.ChunkIndexHits == 0 || res.Stats.UploadedBytes != 0 {
		t.Errorf("push after the honest one: %d chunk index hits, %d bytes uploaded; want the honest blobs reused", res.ChunkIndexHits, res.Stats.UploadedBytes)
	}
}

// fileChunk is one chunk of a hand-made chunk table and the blob stored for
// it.
type fileChunk struct {
	chunk format.Chunk
	blob  []byte
}

// putFileManifest uploads the blobs, a chunk table of chunks and a cryo
// file manifest naming them to repo, as any OCI client could, and returns
// the manifest PUT's status. configSize, if not 0, is the size the manifest
// claims for the table.
func putFileManifest(t *testing.T, reg *testRegistry, repo string, chunks []fileChunk, configSize int64) int {
	t.Helper()
	tab := format.Table{Path: "pages.img", Digest: digest.FromString("file"), Parts: 1, Chunks: []format.Chunk{}}
	var layers []ocispec.Descriptor
	for _, fc := range chunks {
		c := fc.chunk
		c.Offset = tab.Size
		tab.Size += c.Size
		tab.Chunks = append(tab.Chunks, c)
		if resp := uploadBlob(t, reg, repo, c.Blob, fc.blob); resp.StatusCode != http.StatusCreated {
			t.Fatalf("upload blob: %s", resp.Status)
		}
		layers = append(layers, c.BlobDescriptor())
	}
	tab.Length = tab.Size
	data, _ := json.Marshal(tab)
	if _, err := format.ParseTable(data); err != nil {
		t.Fatalf("the test's chunk table is not well-formed: %v", err)
	}
	if resp := uploadBlob(t, reg, repo, digest.FromBytes(data), data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload chunk table: %s", resp.Status)
	}
	config := ocispec.Descriptor{MediaType: format.MediaTypeChunkTable, Digest: digest.FromBytes(data), Size: int64(len(data))}
	if configSize != 0 {
		config.Size = configSize
	}
	return putManifest(t, reg, repo, ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: format.ArtifactTypeFile, Config: config, Layers: layers})
}

// putManifest PUTs m (schema version 2) to repo by its digest, as any OCI
// client could, and returns the status.
func putManifest(t *testing.T, reg *testRegistry, repo string, m ocispec.Manifest) int {
	t.Helper()
	m.SchemaVersion = 2
	body, _ := json.Marshal(m)
	req, _ := http.NewRequest(http.MethodPut, reg.http.URL+"/v2/"+repo+"/manifests/"+digest.FromBytes(body).String(), bytes.NewReader(body))
	req.Header.Set("Content-Type", ocispec.MediaTypeImageManifest)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// lookupChunk asks the registry's chunk index which blobs carry d.
func lookupChunk(t *testing.T, reg *testRegistry, d digest.Digest) []api.ChunkBlob {
	t.Helper()
	found, err := api.Lookup(context.Background(), http.DefaultClient, reg.http.URL, []digest.Digest{d})
	if err != nil {
		t.Fatal(err)
	}
	return found[d]
}

// zstdChunk returns an honest zstd table entry for data and its blob.
func zstdChunk(t *testing.T, data []byte, opts ...zstd.EOption) fileChunk {
	t.Helper()
	enc, _ := zstd.NewWriter(nil, opts...)
	defer enc.Close()
	blob := enc.EncodeAll(data, nil)
	if len(blob) >= len(data) {
		t.Fatal("test data does not compress")
	}
	return fileChunk{format.Chunk{Size: int64(len(data)), Encoding: format.EncodingZstd, Digest: digest.FromBytes(data), Blob: digest.FromBytes(blob), BlobSize: int64(len(blob))}, blob}
}

func rawChunk(data []byte) fileChunk {
	d := digest.FromBytes(data)
	return fileChunk{format.Chunk{Size: int64(len(data)), Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: int64(len(data))}, data}
}

func textData(seed string, n int) []byte {
	return []byte(strings.Repeat("cryo chunk "+seed+" ", n/(12+len(seed))+1)[:n])
}

func randomData(seed uint64, n int) []byte {
	var b bytes.Buffer
	if err := synth.WritePages(&b, synth.Random, int64(n), seed); err != nil {
		panic(err)
	}
	return b.Bytes()
}

// TestChunkIndexVerifiesBlobs pushes one well-formed chunk table in which
// two entries are true and the others lie in each way a table can: only the
// true ones may be indexed.
func TestChunkIndexVerifiesBlobs(t *testing.T) {
	reg := startRegistry(t, "")
	honestZstd := zstdChunk(t, textData("a", 64<<10))
	honestRaw := rawChunk(randomData(1, 64<<10))

	junkBlob := zstdChunk(t, textData("b", 64<<10))
	junkBlob.blob = junk([]byte("b"), len(junkBlob.blob))
	junkBlob.chunk.Blob = digest.FromBytes(junkBlob.blob)

	otherChunk := zstdChunk(t, textData("c", 64<<10))
	otherContent := zstdChunk(t, textData("c-other", 64<<10))
	otherChunk.blob, otherChunk.chunk.Blob, otherChunk.chunk.BlobSize = otherContent.blob, otherContent.chunk.Blob, otherContent.chunk.BlobSize

	wrongSize := zstdChunk(t, textData("d", 64<<10))
	wrongSize.chunk.Size += 4096

	// 64 MiB of one byte in a few KiB, claiming to be a 64 KiB chunk.
	bomb := zstdChunk(t, bytes.Repeat([]byte{'x'}, 64<<20))
	bomb.chunk.Size, bomb.chunk.Digest = 64<<10, digest.FromBytes(bytes.Repeat([]byte{'x'}, 64<<10))

	rawWrongSize := rawChunk(randomData(2, 64<<10))
	rawWrongSize.chunk.Size, rawWrongSize.chunk.BlobSize = 32<<10, 32<<10

	lies := map[string]fileChunk{"junk blob": junkBlob, "blob of another chunk": otherChunk, "wrong chunk size": wrongSize, "zstd bomb": bomb, "raw blob of another size": rawWrongSize}
	chunks := []fileChunk{honestZstd, honestRaw}
	for _, fc := range lies {
		chunks = append(chunks, fc)
	}
	if code := putFileManifest(t, reg, "mixed", chunks, 0); code != http.StatusCreated {
		t.Fatalf("manifest PUT: %d", code)
	}
	for name, fc := range map[string]fileChunk{"zstd": honestZstd, "raw": honestRaw} {
		found := lookupChunk(t, reg, fc.chunk.Digest)
		if len(found) != 1 || found[0].Digest != fc.chunk.Blob || found[0].ChunkSize != fc.chunk.Size || found[0].Repository != "mixed" {
			t.Errorf("honest %s chunk: index answers %+v", name, found)
		}
	}
	for name, fc := range lies {
		for _, b := range lookupChunk(t, reg, fc.chunk.Digest) {
			if b.Digest == fc.chunk.Blob {
				t.Errorf("%s: the index answers the lie %+v", name, b)
			}
		}
	}
}

// TestUnverifiedEntriesAreNotAnswered writes an index entry as registries
// before verification did (no mark), pointing at a live blob: lookups must
// not answer it, and gc drops it.
func TestUnverifiedEntriesAreNotAnswered(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	fc := rawChunk(randomData(3, 64<<10))
	if resp := uploadBlob(t, reg, "old", fc.chunk.Blob, fc.blob); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	old, _ := json.Marshal(api.ChunkBlob{Encoding: "raw", MediaType: format.MediaTypeChunkRaw, Digest: fc.chunk.Blob, Size: fc.chunk.BlobSize, ChunkSize: fc.chunk.Size, Repository: "old"})
	if err := reg.srv.driver.PutContent(ctx, chunkindex.EntryPath(fc.chunk.Digest, fc.chunk.Blob), old); err != nil {
		t.Fatal(err)
	}
	if found := lookupChunk(t, reg, fc.chunk.Digest); len(found) != 0 {
		t.Fatalf("an unverified entry was answered: %+v", found)
	}
	if n, err := reg.srv.chunks.Prune(ctx); err != nil || n != 1 {
		t.Fatalf("prune dropped %d entries (%v), want the unverified one", n, err)
	}
}

// recordingDriver records the paths looked at (stat, list, read) and read
// through it.
type recordingDriver struct {
	storagedriver.StorageDriver
	mu            sync.Mutex
	touches, read []string
}

func (d *recordingDriver) note(p string, read bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.touches = append(d.touches, p)
	if read {
		d.read = append(d.read, p)
	}
}

// touched returns the paths containing part that were looked at, or only
// those read.
func (d *recordingDriver) touched(part string, onlyRead bool) []string {
	d.mu.Lock()
	defer d.mu.Unlock()
	paths := d.touches
	if onlyRead {
		paths = d.read
	}
	var out []string
	for _, p := range paths {
		if strings.Contains(p, part) {
			out = append(out, p)
		}
	}
	return out
}

func (d *recordingDriver) GetContent(ctx context.Context, p string) ([]byte, error) {
	d.note(p, true)
	return d.StorageDriver.GetContent(ctx, p)
}

func (d *recordingDriver) Reader(ctx context.Context, p string, offset int64) (io.ReadCloser, error) {
	d.note(p, true)
	return d.StorageDriver.Reader(ctx, p, offset)
}

func (d *recordingDriver) Stat(ctx context.Context, p string) (storagedriver.FileInfo, error) {
	d.note(p, false)
	return d.StorageDriver.Stat(ctx, p)
}

func (d *recordingDriver) List(ctx context.Context, p string) ([]string, error) {
	d.note(p, false)
	return d.StorageDriver.List(ctx, p)
}

// recordIndexStorage makes reg's chunk index reach storage through a
// recordingDriver.
func recordIndexStorage(t *testing.T, reg *testRegistry) *recordingDriver {
	t.Helper()
	rd := &recordingDriver{StorageDriver: reg.srv.driver}
	ns, err := storage.NewRegistry(context.Background(), rd, storage.EnableDelete)
	if err != nil {
		t.Fatal(err)
	}
	reg.srv.chunks = chunkindex.New(rd, ns, reg.srv.codec, chunkindex.Options{})
	return rd
}

// TestChunkTableSizeIsChecked pushes manifests that claim a smaller chunk
// table than the blob they name: the registry must check the real size
// before reading it (never reading a large one whole) and index nothing.
func TestChunkTableSizeIsChecked(t *testing.T) {
	reg := startRegistry(t, "")
	rd := recordIndexStorage(t, reg)
	fc := zstdChunk(t, textData("e", 64<<10))
	if code := putFileManifest(t, reg, "small", []fileChunk{fc}, 100); code != http.StatusCreated {
		t.Fatalf("manifest PUT: %d", code)
	}
	if found := lookupChunk(t, reg, fc.chunk.Digest); len(found) != 0 {
		t.Fatalf("a table read past its claimed size was indexed: %+v", found)
	}

	// A 32 MiB "table" claimed to be 100 bytes is not read at all.
	big := junk([]byte("big"), 32<<20)
	bigDigest := digest.FromBytes(big)
	if resp := uploadBlob(t, reg, "big", bigDigest, big); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: format.ArtifactTypeFile,
		Config: ocispec.Descriptor{MediaType: format.MediaTypeChunkTable, Digest: bigDigest, Size: 100}, Layers: []ocispec.Descriptor{}}
	m.SchemaVersion = 2
	body, _ := json.Marshal(m)
	req, _ := http.NewRequest(http.MethodPut, reg.http.URL+"/v2/big/manifests/v1", bytes.NewReader(body))
	req.Header.Set("Content-Type", ocispec.MediaTypeImageManifest)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if read := rd.touched(distlayout.BlobDataPath(bigDigest), true); len(read) != 0 {
		t.Fatalf("the registry read the oversized table: %v", read)
	}
}

// TestLookupChecksAccessFirst looks a chunk up that two repositories carry
// (in two encodings) for a caller who may see only one: the other
// repository's blob must not even be looked at.
func TestLookupChecksAccessFirst(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	data := textData("f", 64<<10)
	for repo, crc := range map[string]bool{"public": false, "private": true} {
		if code := putFileManifest(t, reg, repo, []fileChunk{zstdChunk(t, data, zstd.WithEncoderCRC(crc))}, 0); code != http.StatusCreated {
			t.Fatalf("manifest PUT: %d", code)
		}
	}
	d := digest.FromBytes(data)
	if found := lookupChunk(t, reg, d); len(found) != 2 {
		t.Fatalf("the index has %d blobs for the chunk, want 2: %+v", len(found), found)
	}
	rd := recordIndexStorage(t, reg)
	found, err := reg.srv.chunks.Lookup(ctx, d, func(repo string) bool { return repo == "public" })
	if err != nil {
		t.Fatal(err)
	}
	if len(found) != 1 || found[0].Repository != "public" {
		t.Fatalf("lookup for a caller who sees only public: %+v", found)
	}
	if touched := rd.touched("/repositories/private/", false); len(touched) != 0 {
		t.Fatalf("the lookup looked into a repository the caller may not pull from: %v", touched)
	}
}

// TestChunkIndexAfterGC pushes a v1 snapshot to a, the same memory to b
// (whose blobs are then a's, cross-mounted), deletes a's snapshot and
// collects garbage. A push of the same memory to c must still find every
// chunk through the index, in b, and upload nothing.
func TestChunkIndexAfterGC(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 17)
	a, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, a, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, tag := reg.repo(t, "b:v1")
	if res, err := transfer.Push(ctx, src, b, tag, transfer.PushOptions{}); err != nil || res.Stats.UploadedBytes != 0 {
		t.Fatalf("push to b: %v, %+v", err, res)
	}
	if err := a.Delete(ctx, first.Descriptor); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.srv.Maintenance().GC(ctx, maintenance.GCOptions{RemoveUntagged: true}); err != nil {
		t.Fatal(err)
	}
	c, tag := reg.repo(t, "c:v1")
	res, err := transfer.Push(ctx, src, c, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.UploadedBytes != 0 || res.ChunkIndexHits == 0 {
		t.Errorf("push to c after a was collected: %d bytes uploaded, %d chunk index hits", res.Stats.UploadedBytes, res.ChunkIndexHits)
	}
	pullsBack(t, c, tag, src)
}

// failingIndexDriver fails every write under the chunk index's root
// while fail is set (the index's storage down).
type failingIndexDriver struct {
	storagedriver.StorageDriver
	fail atomic.Bool
}

func (d *failingIndexDriver) PutContent(ctx context.Context, p string, content []byte) error {
	if d.fail.Load() && strings.HasPrefix(p, chunkindex.Root) {
		return errors.New("index storage down")
	}
	return d.StorageDriver.PutContent(ctx, p, content)
}

// TestIndexFailureIsCounted pushes a manifest while the index's storage
// fails: the manifest is stored (201) and the failure counted in
// /metrics, and a later PUT of the same manifest records its chunk.
func TestIndexFailureIsCounted(t *testing.T) {
	reg := startRegistry(t, "")
	fd := &failingIndexDriver{StorageDriver: reg.srv.driver}
	ns, err := storage.NewRegistry(context.Background(), fd, storage.EnableDelete)
	if err != nil {
		t.Fatal(err)
	}
	reg.srv.chunks = chunkindex.New(fd, ns, reg.srv.codec, chunkindex.Options{})
	fc := zstdChunk(t, textData("f", 64<<10))
	fd.fail.Store(true)
	if code := putFileManifest(t, reg, "a", []fileChunk{fc}, 0); code != http.StatusCreated {
		t.Fatalf("manifest PUT while the index is down: %d, want 201", code)
	}
	rec := httptest.NewRecorder()
	reg.srv.MetricsHandler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if !strings.Contains(rec.Body.String(), "cryo_registry_chunk_index_failures_total 1") {
		t.Errorf("a failed indexing is not counted:\n%s", grepLines(rec.Body.String(), "cryo_registry_chunk_index"))
	}
	fd.fail.Store(false)
	if code := putFileManifest(t, reg, "a", []fileChunk{fc}, 0); code != http.StatusCreated {
		t.Fatalf("manifest PUT again: %d", code)
	}
	if found := lookupChunk(t, reg, fc.chunk.Digest); len(found) != 1 {
		t.Errorf("after a PUT with the index back, lookup found %v", found)
	}
}

// grepLines returns the lines of s that contain sub.
func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
