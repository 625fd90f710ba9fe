package registry

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/transfer"
	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/memory"
	"oras.land/oras-go/v2/registry/remote"
)

var v2Push = transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}}

// snapshotTables loads the chunk tables of the snapshot tag names in src.
func snapshotTables(t *testing.T, src content.ReadOnlyStorage, idx ocispec.Descriptor) []*format.Table {
	t.Helper()
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, src, idx)
	if err != nil {
		t.Fatal(err)
	}
	tables, err := format.LoadTables(ctx, src, snap)
	if err != nil {
		t.Fatal(err)
	}
	return tables
}

// packsHoldOnlyTheirFrames fails t unless every byte of every pack the
// tables list is a frame one of the tables uses: a snapshot's packs hold
// nothing but its own chunks.
func packsHoldOnlyTheirFrames(t *testing.T, tables []*format.Table) {
	t.Helper()
	type frame struct {
		pack digest.Digest
		off  int64
	}
	used := map[digest.Digest]int64{}
	size := map[digest.Digest]int64{}
	seen := map[frame]bool{}
	for _, tab := range tables {
		for _, c := range tab.Chunks {
			if !c.Packed() {
				continue
			}
			size[c.Blob] = c.PackSize
			if k := (frame{c.Blob, c.PackOffset}); !seen[k] {
				seen[k] = true
				used[c.Blob] += c.BlobSize
			}
		}
	}
	for p, n := range size {
		if used[p] != n {
			t.Errorf("pack %s holds %d bytes, the snapshot's frames %d: it holds memory of another snapshot", p, n, used[p])
		}
	}
}

// TestComposeDedupsAcrossRepositories pushes one v2 snapshot to
// repository a, then the same memory, and then a changed copy of it, to
// repository b. The registry composes b's packs from a's frames: nothing
// it holds is uploaded again, each of b's packs holds only b's own chunks
// (never a pack of a, which holds other chunks too), and b pulls back
// byte-identical.
func TestComposeDedupsAcrossRepositories(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 24<<20, 3)
	a, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if first.Stats.ComposedBytes != 0 || first.Stats.UploadedBytes == 0 {
		t.Fatalf("first push: %d bytes composed, %d uploaded", first.Stats.ComposedBytes, first.Stats.UploadedBytes)
	}

	b, tag := reg.repo(t, "b:v1")
	res, err := transfer.Push(ctx, src, b, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.UploadedBytes != 0 || res.Stats.ComposedBytes != first.Stats.StoredBytes {
		t.Errorf("same memory in another repository: %d bytes uploaded, %d composed; want 0 and %d", res.Stats.UploadedBytes, res.Stats.ComposedBytes, first.Stats.StoredBytes)
	}
	packsHoldOnlyTheirFrames(t, snapshotTables(t, b, res.Descriptor))
	pullsBack(t, b, tag, src)

	// A second snapshot of the memory, 10% of it rewritten, in a third
	// repository: the unchanged chunks are composed, the others uploaded.
	changed := filepath.Join(t.TempDir(), "changed")
	mutateImage(t, src, changed, 0.1)
	c, tag := reg.repo(t, "c:v1")
	res, err = transfer.Push(ctx, changed, c, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.ComposedBytes < res.Stats.StoredBytes/2 || res.Stats.UploadedBytes > res.Stats.StoredBytes/2 {
		t.Errorf("10%% changed: %d bytes composed, %d uploaded of %d stored", res.Stats.ComposedBytes, res.Stats.UploadedBytes, res.Stats.StoredBytes)
	}
	t.Logf("10%% changed: %d bytes composed in %d packs, %d uploaded, %d stored", res.Stats.ComposedBytes, res.Stats.PacksComposed, res.Stats.UploadedBytes, res.Stats.StoredBytes)
	packsHoldOnlyTheirFrames(t, snapshotTables(t, c, res.Descriptor))
	pullsBack(t, c, tag, changed)
}

// pullsBack pulls tag of repo and fails t unless it is the image dir src.
func pullsBack(t *testing.T, repo *remote.Repository, tag, src string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(context.Background(), repo, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, src, out)
}

// mutateImage writes to dst the image dir src with frac of pages.img's
// pages rewritten.
func mutateImage(t *testing.T, src, dst string, frac float64) {
	t.Helper()
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{format.CheckpointFile, format.PagesMetaFile} {
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	in, err := os.Open(filepath.Join(src, format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	st, _ := in.Stat()
	pages := st.Size() / 4096
	err = synth.WriteFile(filepath.Join(dst, format.PagesFile), func(w io.Writer) error {
		_, err := synth.Mutate(w, in, pages, synth.MutationPlan(pages, 0, frac, 9), synth.Text, 9)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestComposeRefusesLyingFrames has repository "evil" claim, in v2 chunk
// tables, that every chunk of an image lies in frames that decode to other
// bytes of the same size. An honest push of that image to "victim" must
// not get them: the registry checks each frame's sha256 as it copies it,
// drops the lying frames from their pack lists and composes nothing, so the victim uploads its chunks and pulls back byte-identical.
func TestComposeRefusesLyingFrames(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 5)
	mem := memory.New()
	idx, _, err := format.Pack(ctx, src, mem, format.PackOptions{Format: format.V2})
	if err != nil {
		t.Fatal(err)
	}
	var lies []string
	for _, tab := range snapshotTables(t, mem, idx) {
		lies = append(lies, putLyingV2Manifest(t, reg, "evil", tab)...)
	}
	if len(lies) == 0 {
		t.Fatal("no pack was lied about")
	}
	before := map[string]int{}
	for _, p := range lies {
		before[p] = listedFrames(t, reg, p)
	}

	victim, tag := reg.repo(t, "victim:v1")
	res, err := transfer.Push(ctx, src, victim, tag, v2Push)
	if err != nil {
		t.Fatalf("honest push after a lying one: %v", err)
	}
	if res.Stats.ComposedBytes != 0 || res.Stats.UploadedBytes == 0 {
		t.Errorf("honest push: %d bytes composed from the lies, %d uploaded", res.Stats.ComposedBytes, res.Stats.UploadedBytes)
	}
	pullsBack(t, victim, tag, src)
	dropped := 0
	for _, p := range lies {
		dropped += before[p] - listedFrames(t, reg, p)
	}
	if dropped == 0 {
		t.Error("no lying frame was dropped from its pack list after it failed")
	}
	t.Logf("%d lying frames dropped", dropped)
}

// putLyingV2Manifest stores in repo tab's file manifest with every frame
// replaced by a well-formed frame of other bytes of the chunk's size (zstd
// where that is smaller, else raw), in packs of those frames, so that only
// the sha256 check can tell; it returns where the lying packs' frame lists
// are recorded.
func putLyingV2Manifest(t *testing.T, reg *testRegistry, repo string, tab *format.Table) []string {
	t.Helper()
	enc, err := zstd.NewWriter(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer enc.Close()
	lied := *tab
	lied.Packs = nil
	lied.Chunks = append([]format.Chunk(nil), tab.Chunks...)
	packs := map[digest.Digest][]byte{}
	var order []digest.Digest
	for i, c := range lied.Chunks {
		if !c.Packed() {
			continue
		}
		other := textData(string(c.Digest), int(c.Size))
		frame, encoding := enc.EncodeAll(other, nil), format.EncodingZstd
		if int64(len(frame)) >= c.Size {
			frame, encoding = other, format.EncodingRaw
		}
		if _, ok := packs[c.Blob]; !ok {
			order = append(order, c.Blob)
		}
		lied.Chunks[i].Encoding, lied.Chunks[i].PackOffset, lied.Chunks[i].BlobSize = encoding, int64(len(packs[c.Blob])), int64(len(frame))
		packs[c.Blob] = append(packs[c.Blob], frame...)
	}
	var lists []string
	junk := map[digest.Digest]ocispec.Descriptor{}
	for _, honest := range order {
		data := packs[honest]
		d := ocispec.Descriptor{MediaType: format.MediaTypePack, Digest: digest.FromBytes(data), Size: int64(len(data))}
		junk[honest] = d
		lied.Packs = append(lied.Packs, d)
		lists = append(lists, chunkindex.PackListPath(d.Digest))
		if resp := uploadBlob(t, reg, repo, d.Digest, data); resp.StatusCode != http.StatusCreated {
			t.Fatalf("upload lying pack: %s", resp.Status)
		}
	}
	for i, c := range lied.Chunks {
		if c.Packed() {
			lied.Chunks[i].Blob, lied.Chunks[i].PackSize = junk[c.Blob].Digest, junk[c.Blob].Size
		}
	}
	data, err := lied.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := format.ParseTableV2(data); err != nil {
		t.Fatalf("the lying table is not well-formed: %v", err)
	}
	if resp := uploadBlob(t, reg, repo, digest.FromBytes(data), data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload chunk table: %s", resp.Status)
	}
	m := ocispec.Manifest{MediaType: ocispec.MediaTypeImageManifest, ArtifactType: format.ArtifactTypeFileV2,
		Config: ocispec.Descriptor{MediaType: format.MediaTypeChunkTableV2, Digest: digest.FromBytes(data), Size: int64(len(data))},
		Layers: lied.Packs}
	if len(m.Layers) == 0 {
		m.Layers = []ocispec.Descriptor{ocispec.DescriptorEmptyJSON}
	}
	if code := putManifest(t, reg, repo, m); code != http.StatusCreated {
		t.Fatalf("lying manifest PUT: %d", code)
	}
	return lists
}

// listedFrames is the number of frames the pack list at p names.
func listedFrames(t *testing.T, reg *testRegistry, p string) int {
	t.Helper()
	data, err := reg.srv.Driver().GetContent(context.Background(), p)
	if err != nil {
		t.Fatalf("pack list %s: %v", p, err)
	}
	var list struct{ Frames []json.RawMessage }
	if err := json.Unmarshal(data, &list); err != nil {
		t.Fatal(err)
	}
	return len(list.Frames)
}

// TestComposeChecksAccess asks, through distribution's token access
// controller, for a pack of chunks that only repository "a" holds: with
// pull on a, and pull and push on b, b gets the pack; without pull on a,
// nothing is composed; without push on b, the request is challenged for
// the scope it lacks.
func TestComposeChecksAccess(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	open := startRegistry(t, root)
	src := testenv.ImageDir(t, synth.Text, 8<<20, 11)
	a, tag := open.repo(t, "a:v1")
	res, err := transfer.Push(ctx, src, a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	// The first 16 chunks of pages.img's first pack.
	var want []api.ComposeChunk
	for _, tab := range snapshotTables(t, a, res.Descriptor) {
		if tab.Path != format.PagesFile || tab.Part != 0 {
			continue
		}
		for _, c := range tab.Chunks {
			if c.Packed() && c.Blob == tab.Packs[0].Digest && len(want) < 16 {
				want = append(want, api.ComposeChunk{Digest: c.Digest, Size: c.Size})
			}
		}
	}
	if len(want) < 2 {
		t.Fatalf("pages.img's first pack holds %d chunks", len(want))
	}

	ti := newTokenIssuer(t)
	reg := ti.startRegistry(t, root)
	compose := func(grants map[string][]string) (*api.ComposeResponse, error) {
		client := &http.Client{Transport: bearer(ti.tokenFor(t, grants))}
		return api.Compose(ctx, client, reg.http.URL, api.ComposeRequest{Repository: "b", Chunks: want})
	}
	got, err := compose(map[string][]string{"a": {"pull"}, "b": {"pull", "push"}})
	if err != nil {
		t.Fatal(err)
	}
	if got.Pack == nil || len(got.Frames) != len(want) {
		t.Fatalf("with pull on a: pack %v, %d frames of %d", got.Pack, len(got.Frames), len(want))
	}
	got, err = compose(map[string][]string{"b": {"pull", "push"}})
	if err != nil {
		t.Fatal(err)
	}
	if got.Pack != nil || len(got.Frames) != 0 {
		t.Errorf("without pull on a: pack %v, %d frames", got.Pack, len(got.Frames))
	}
	body, _ := json.Marshal(api.ComposeRequest{Repository: "b", Chunks: want})
	req, _ := http.NewRequest(http.MethodPost, reg.http.URL+api.PacksPath, bytes.NewReader(body))
	resp, err := (&http.Client{Transport: bearer(ti.tokenFor(t, map[string][]string{"a": {"pull"}, "b": {"pull"}}))}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(resp.Header.Get("WWW-Authenticate"), "push") {
		t.Errorf("without push on b: %s, challenge %q", resp.Status, resp.Header.Get("WWW-Authenticate"))
	}

	// Bounds: a minimum it cannot reach makes no pack; a bad chunk is a
	// 400.
	client := http.DefaultClient
	got, err = api.Compose(ctx, client, open.http.URL, api.ComposeRequest{Repository: "b", Chunks: want, MinLength: api.MaxComposePack})
	if err != nil || got.Pack != nil {
		t.Errorf("minimum out of reach: pack %v, %v", got, err)
	}
	bad := append([]api.ComposeChunk(nil), want...)
	bad[0].Size = format.MaxChunkSize + 1
	if _, err := api.Compose(ctx, client, open.http.URL, api.ComposeRequest{Repository: "b", Chunks: bad}); err == nil || !strings.Contains(err.Error(), "400") {
		t.Errorf("a chunk over the size limit: %v", err)
	}
	twice := append(append([]api.ComposeChunk(nil), want...), api.ComposeChunk{Digest: want[0].Digest, Size: want[0].Size + 1})
	if _, err := api.Compose(ctx, client, open.http.URL, api.ComposeRequest{Repository: "b", Chunks: twice}); err == nil || !strings.Contains(err.Error(), "400") {
		t.Errorf("a chunk asked for with two sizes: %v", err)
	}
}

// TestComposeAfterGC composes b's packs from a's, deletes a's snapshot and
// collects garbage: the frame lists no longer name a, and a push of the
// same memory to c is composed from b's packs, which the registry indexed
// when b's manifests were put.
func TestComposeAfterGC(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 13)
	a, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	aTables := snapshotTables(t, a, first.Descriptor)
	b, tag := reg.repo(t, "b:v1")
	if res, err := transfer.Push(ctx, src, b, tag, v2Push); err != nil || res.Stats.UploadedBytes != 0 {
		t.Fatalf("push to b: %v, %+v", err, res)
	}
	if err := a.Delete(ctx, first.Descriptor); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.srv.Maintenance().GC(ctx, maintenance.GCOptions{RemoveUntagged: true}); err != nil {
		t.Fatal(err)
	}
	// b's packs are byte for byte a's (the same frames in the same
	// order), so they stay, linked in b only.
	for _, tab := range aTables {
		for _, p := range tab.Packs {
			if exists, err := a.Blobs().Exists(ctx, p); err != nil || exists {
				t.Fatalf("gc left pack %s linked in a (%v): the test cannot tell the index from distribution's links", p.Digest, err)
			}
			data, err := reg.srv.Driver().GetContent(ctx, chunkindex.PackListPath(p.Digest))
			if err != nil {
				t.Errorf("pack %s, linked in b, lost its frame list: %v", p.Digest, err)
				continue
			}
			var list struct{ Repositories []string }
			if err := json.Unmarshal(data, &list); err != nil || !slices.Equal(list.Repositories, []string{"b"}) {
				t.Errorf("pack %s is listed in %v after a was collected, want [b] (%v)", p.Digest, list.Repositories, err)
			}
		}
	}
	c, tag := reg.repo(t, "c:v1")
	res, err := transfer.Push(ctx, src, c, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if res.Stats.UploadedBytes != 0 || res.Stats.ComposedBytes == 0 {
		t.Errorf("push to c after a was collected: %d bytes uploaded, %d composed", res.Stats.UploadedBytes, res.Stats.ComposedBytes)
	}
	pullsBack(t, c, tag, src)
}

// TestComposeFailureFallsBack pushes, through a front that fails every
// composition with 500, the same memory to a second repository: the push
// must upload what it would have had composed, and pull back whole.
func TestComposeFailureFallsBack(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	var asked atomic.Int32
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == api.PacksPath {
			asked.Add(1)
			http.Error(w, "composition unavailable", http.StatusInternalServerError)
			return
		}
		reg.srv.Handler().ServeHTTP(w, r)
	}))
	t.Cleanup(front.Close)
	src := testenv.ImageDir(t, synth.Text, 48<<20, 19)
	a, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := transfer.Repository(strings.TrimPrefix(front.URL, "http://")+"/b:v1", transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := transfer.Push(ctx, src, b, "v1", v2Push)
	if err != nil {
		t.Fatalf("push with failing compositions: %v", err)
	}
	if asked.Load() == 0 || res.Stats.ComposedBytes != 0 || res.Stats.UploadedBytes != first.Stats.UploadedBytes {
		t.Errorf("%d compositions asked; %d bytes composed, %d uploaded, want %d uploaded", asked.Load(), res.Stats.ComposedBytes, res.Stats.UploadedBytes, first.Stats.UploadedBytes)
	}
	// 3 failures in a row turn compositions off; 4 packs are stored at
	// once.
	if n := asked.Load(); n > 3+4 || int(n) >= first.Stats.BlobsUploaded {
		t.Errorf("%d compositions asked for %d packs, want at most 7: they kept failing", n, first.Stats.BlobsUploaded)
	}
	pullsBack(t, b, "v1", src)
}

// TestComposeUploadsOnlyWhatIsNew pushes a snapshot to repository a, then
// changed copies of it to other repositories, whose packs the registry
// composes from a's frames. Each must upload no more than the frames of
// chunks a does not have:
//   - scattered rewrites change the sizes of frames, so the copy's packs
//     are cut elsewhere than a's: each asks for the tail of one of a's
//     packs and the head of the next, and a tail may hold no anchor (the
//     lists' neighbors find it);
//   - a contiguous 2 MiB edit fills most of a pack or two: the unchanged
//     chunks beside it, under half of such a pack, are composed too.
func TestComposeUploadsOnlyWhatIsNew(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.HalfZero, 32<<20, 5)
	a, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	had := map[digest.Digest]bool{}
	for _, tab := range snapshotTables(t, a, first.Descriptor) {
		for _, ch := range tab.Chunks {
			had[ch.Digest] = true
		}
	}
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, dst string)
	}{
		{"scattered", func(t *testing.T, dst string) { mutateImage(t, src, dst, 0.05) }},
		{"contiguous", func(t *testing.T, dst string) { editImage(t, src, dst, 8<<20, 2<<20) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			changed := filepath.Join(t.TempDir(), "changed")
			tc.change(t, changed)
			c, tag := reg.repo(t, tc.name+":v1")
			res, err := transfer.Push(ctx, changed, c, tag, v2Push)
			if err != nil {
				t.Fatal(err)
			}
			var newBytes int64
			counted := map[digest.Digest]bool{}
			for _, tab := range snapshotTables(t, c, res.Descriptor) {
				for _, ch := range tab.Chunks {
					if ch.Packed() && !had[ch.Digest] && !counted[ch.Digest] {
						counted[ch.Digest] = true
						newBytes += ch.BlobSize
					}
				}
			}
			t.Logf("%d bytes uploaded, %d composed in %d packs; frames of chunks a lacks: %d bytes", res.Stats.UploadedBytes, res.Stats.ComposedBytes, res.Stats.PacksComposed, newBytes)
			if newBytes == 0 {
				t.Fatal("the changed copy has no chunk the first lacks: the test changes nothing")
			}
			if res.Stats.UploadedBytes > newBytes+newBytes/20 {
				t.Errorf("uploaded %d bytes, want at most the %d bytes of frames of chunks a lacks (+5%%): chunks a holds were uploaded again", res.Stats.UploadedBytes, newBytes)
			}
			packsHoldOnlyTheirFrames(t, snapshotTables(t, c, res.Descriptor))
			pullsBack(t, c, tag, changed)
		})
	}
}

// editImage writes to dst the image dir src with n bytes of pages.img at
// off overwritten with random pages.
func editImage(t *testing.T, src, dst string, off, n int64) {
	t.Helper()
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{format.CheckpointFile, format.PagesMetaFile, format.PagesFile} {
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == format.PagesFile {
			p, err := synth.NewPages(synth.Random, 77)
			if err != nil {
				t.Fatal(err)
			}
			p.Fill(data[off:off+n], off/synth.PageSize)
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// TestGCDropsDeletedNeighbors pushes a snapshot and an edit of it to one
// repository (the edit's new packs lie beside the first's), deletes the
// edit and collects garbage: the frame lists that stay must not name the
// edit's packs as neighbors any more (a dead neighbor holds one of a
// list's few slots and sends compositions to a list that is gone).
func TestGCDropsDeletedNeighbors(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.HalfZero, 16<<20, 21)
	a, tag := reg.repo(t, "a:v1")
	if _, err := transfer.Push(ctx, src, a, tag, v2Push); err != nil {
		t.Fatal(err)
	}
	edited := filepath.Join(t.TempDir(), "edited")
	editImage(t, src, edited, 6<<20, 1<<20)
	second, err := transfer.Push(ctx, edited, a, "v2", v2Push)
	if err != nil {
		t.Fatal(err)
	}
	lists := func() map[digest.Digest][]digest.Digest {
		t.Helper()
		out := map[digest.Digest][]digest.Digest{}
		err := reg.srv.Driver().Walk(ctx, chunkindex.PacksRoot, func(fi storagedriver.FileInfo) error {
			if fi.IsDir() {
				return nil
			}
			data, err := reg.srv.Driver().GetContent(ctx, fi.Path())
			if err != nil {
				return err
			}
			var l struct{ Neighbors []digest.Digest }
			if err := json.Unmarshal(data, &l); err != nil {
				return err
			}
			out[digest.Digest("sha256:"+filepath.Base(fi.Path()))] = l.Neighbors
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	before := lists()
	if err := a.Delete(ctx, second.Descriptor); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.srv.Maintenance().GC(ctx, maintenance.GCOptions{RemoveUntagged: true}); err != nil {
		t.Fatal(err)
	}
	after := lists()
	dead := 0
	for p, nbs := range before {
		if _, kept := after[p]; !kept {
			continue
		}
		for _, nb := range nbs {
			if _, ok := after[nb]; !ok {
				dead++
			}
		}
	}
	if dead == 0 {
		t.Fatal("no list that stays named a pack gc dropped: the test deletes no neighbor")
	}
	for p, nbs := range after {
		for _, nb := range nbs {
			if _, ok := after[nb]; !ok {
				t.Errorf("pack %s still names %s as a neighbor after gc dropped its list", p, nb)
			}
		}
	}
}
