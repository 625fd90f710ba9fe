// Interop tests: cryo with the oras CLI, the stock distribution registry,
// a corrupt or crashing registry and htpasswd auth, all real binaries run as
// subprocesses against registries on loopback ports.

package conformance

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/crypto/bcrypt"
)

// Media types and annotations of SPEC.md, spelled out here rather than
// imported from package format so that a change there cannot silently
// change what the conformance tests expect.
const (
	artifactTypeSnapshot = "application/vnd.cryo.snapshot.v1"
	artifactTypeFile     = "application/vnd.cryo.file.v1"
	mediaTypeChunkTable  = "application/vnd.cryo.chunktable.v1+json"
	mediaTypeChunkRaw    = "application/vnd.cryo.chunk.v1"
	mediaTypeChunkZstd   = "application/vnd.cryo.chunk.v1+zstd"
	annotationFilePath   = "vnd.cryo.file.path"
	annotationFileSize   = "vnd.cryo.file.size"
	annotationFileDigest = "vnd.cryo.file.digest"
)

// commandTimeout bounds every subprocess, so that a hung transfer fails
// the test instead of the whole test binary.
const commandTimeout = 90 * time.Second

// tools runs bin/cryo and bin/oras for one test, with DOCKER_CONFIG set to a
// directory of the test's own so that no credentials of the machine are
// read or written.
type tools struct {
	cryoBin, orasBin string
	dockerConfig     string
}

func newTools(t *testing.T) *tools {
	t.Helper()
	return &tools{
		cryoBin:      testenv.Tool(t, "cryo"),
		orasBin:      testenv.Tool(t, "oras"),
		dockerConfig: t.TempDir(),
	}
}

// result is what a finished subprocess printed.
type result struct {
	cmdline        string
	stdout, stderr string
	err            error
}

func (r result) String() string {
	return fmt.Sprintf("$ %s\nerror: %v\n--- stdout\n%s--- stderr\n%s", r.cmdline, r.err, r.stdout, r.stderr)
}

// command returns bin with args, to run in dir (if not ""), with the
// test's DOCKER_CONFIG.
func (tl *tools) command(ctx context.Context, dir, bin string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+tl.dockerConfig, "NO_COLOR=1")
	return cmd
}

// exec runs bin with args in dir and returns what it printed, without
// judging the exit status.
func (tl *tools) exec(dir, bin string, args ...string) result {
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	cmd := tl.command(ctx, dir, bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	return result{
		cmdline: filepath.Base(bin) + " " + strings.Join(args, " "),
		stdout:  stdout.String(), stderr: stderr.String(), err: err,
	}
}

// cryo runs bin/cryo and fails the test, with its output, if it fails.
func (tl *tools) cryo(t *testing.T, args ...string) string {
	t.Helper()
	r := tl.exec("", tl.cryoBin, args...)
	if r.err != nil {
		t.Fatalf("cryo failed:\n%s", r)
	}
	return r.stdout
}

// oras runs bin/oras in dir and fails the test, with its output, if it
// fails.
func (tl *tools) oras(t *testing.T, dir string, args ...string) []byte {
	t.Helper()
	r := tl.exec(dir, tl.orasBin, args...)
	if r.err != nil {
		t.Fatalf("oras failed:\n%s", r)
	}
	return []byte(r.stdout)
}

// cryoJSON runs bin/cryo with --json and decodes its output into v.
func (tl *tools) cryoJSON(t *testing.T, v any, args ...string) {
	t.Helper()
	out := tl.cryo(t, append(args, "--json")...)
	if err := json.Unmarshal([]byte(out), v); err != nil {
		t.Fatalf("cryo %s --json: %v; output:\n%s", strings.Join(args, " "), err, out)
	}
}

// pushResult is the part of `cryo push --json` the tests look at.
type pushResult struct {
	Descriptor ocispec.Descriptor `json:"descriptor"`
	Stats      struct {
		Files         int            `json:"files"`
		LogicalBytes  int64          `json:"logicalBytes"`
		Chunks        map[string]int `json:"chunks"`
		UploadedBytes int64          `json:"uploadedBytes"`
		BlobsUploaded int            `json:"blobsUploaded"`
		BlobsSkipped  int            `json:"blobsSkipped"`
		ReusedBytes   int64          `json:"reusedBytes"`
	} `json:"stats"`
	ChunkIndexHits int64               `json:"chunkIndexHits"`
	Base           *ocispec.Descriptor `json:"base"`
}

// pullResult is `cryo pull --json`.
type pullResult struct {
	Descriptor   ocispec.Descriptor `json:"descriptor"`
	Kind         string             `json:"kind"`
	Files        int                `json:"files"`
	LogicalBytes int64              `json:"logicalBytes"`
	FetchedBytes int64              `json:"fetchedBytes"`
	ReusedBytes  int64              `json:"reusedBytes"`
}

// chunkTable is a chunk table (SPEC.md section 5).
type chunkTable struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	Mode   uint32 `json:"mode"`
	Digest string `json:"digest"`
	Part   int    `json:"part"`
	Parts  int    `json:"parts"`
	Offset int64  `json:"offset"`
	Length int64  `json:"length"`
	Chunks []struct {
		Offset   int64  `json:"offset"`
		Size     int64  `json:"size"`
		Encoding string `json:"encoding"`
		Digest   string `json:"digest"`
		Blob     string `json:"blob"`
		BlobSize int64  `json:"blobSize"`
	} `json:"chunks"`
}

// mutatedCopy copies the image dir src to a fresh dir, with pages.img
// changed as a second checkpoint of the same app would be: a few
// page-aligned insertions and deletions and rewritten page runs.
func mutatedCopy(t *testing.T, src string, kind synth.Kind, indels int, rewrite float64, seed uint64) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "img2")
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"checkpoint.img", "pages_meta.img"} {
		data, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	in, err := os.Open(filepath.Join(src, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	info, err := in.Stat()
	if err != nil {
		t.Fatal(err)
	}
	out, err := os.Create(filepath.Join(dst, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	pages := info.Size() / synth.PageSize
	if _, err := synth.Mutate(out, in, pages, synth.MutationPlan(pages, indels, rewrite, seed), kind, seed); err != nil {
		out.Close()
		t.Fatalf("synth.Mutate: %v", err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	return dst
}

// fileSum is a regular file's size, permission bits and sha256.
type fileSum struct {
	size int64
	mode fs.FileMode
	sum  string
}

// treeSums returns the fileSum of every regular file under dir, by
// slash-separated relative path, and fails on anything else in the tree.
func treeSums(t *testing.T, dir string) map[string]fileSum {
	t.Helper()
	sums := map[string]fileSum{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(dir, p)
		info, err := d.Info()
		if err != nil {
			return err
		}
		if !info.Mode().IsRegular() {
			return fmt.Errorf("%s is not a regular file (%s)", rel, info.Mode())
		}
		sum, err := fileSHA256(p)
		if err != nil {
			return err
		}
		sums[filepath.ToSlash(rel)] = fileSum{size: info.Size(), mode: info.Mode().Perm(), sum: sum}
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", dir, err)
	}
	return sums
}

func fileSHA256(name string) (string, error) {
	f, err := os.Open(name)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// sameTree fails the test unless got holds exactly the regular files of
// want with the same bytes (and, if modes, the same permission bits).
func sameTree(t *testing.T, want, got string, modes bool) {
	t.Helper()
	w, g := treeSums(t, want), treeSums(t, got)
	if len(w) == 0 {
		t.Fatalf("source %s has no files", want)
	}
	for name, ws := range w {
		gs, ok := g[name]
		switch {
		case !ok:
			t.Errorf("%s: missing from %s", name, got)
		case gs.size != ws.size || gs.sum != ws.sum:
			t.Errorf("%s: %d bytes %s, want %d bytes %s", name, gs.size, gs.sum, ws.size, ws.sum)
		case modes && gs.mode != ws.mode:
			t.Errorf("%s: mode %v, want %v", name, gs.mode, ws.mode)
		}
	}
	for name := range g {
		if _, ok := w[name]; !ok {
			t.Errorf("%s: in %s but not in the source", name, got)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
}

func sha256Of(data []byte) string {
	s := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(s[:])
}

// mustNotExist fails the test if path exists.
func mustNotExist(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); err == nil {
		t.Fatalf("%s exists after a failed pull", path)
	} else if !os.IsNotExist(err) {
		t.Fatal(err)
	}
}

// TestOrasCopiesCryoLayout packs a snapshot with every chunk encoding into
// an OCI layout, uploads it with `oras cp --from-oci-layout` (which knows
// nothing of cryo's format), and checks that cryo pulls it back
// byte-identical and verifies it in the registry: the layout cryo writes is
// a standard one and its graph is complete without cryo-specific copying.
func TestOrasCopiesCryoLayout(t *testing.T) {
	tl := newTools(t)
	reg := testenv.StartRegistry(t, "")
	// halfzero: zero runs give zero chunks, random runs raw chunks, and the
	// text body of checkpoint.img a zstd chunk.
	src := testenv.ImageDir(t, synth.HalfZero, 64<<20, 1)
	layoutDir := filepath.Join(t.TempDir(), "layout")

	var packed struct {
		Digest string `json:"digest"`
	}
	tl.cryoJSON(t, &packed, "pack", src, "--layout", layoutDir, "--tag", "v1")
	var sum struct {
		Chunks struct{ Zero, Raw, Zstd int } `json:"chunks"`
	}
	tl.cryoJSON(t, &sum, "inspect", layoutDir+":v1")
	if c := sum.Chunks; c.Zero == 0 || c.Raw == 0 || c.Zstd == 0 {
		t.Fatalf("want chunks of every encoding in the packed snapshot, got %d zero, %d raw, %d zstd", c.Zero, c.Raw, c.Zstd)
	}

	ref := reg.Addr + "/repo:v1"
	tl.oras(t, "", "cp", "--no-tty", "--from-oci-layout", layoutDir+":v1", "--to-plain-http", ref)

	out := filepath.Join(t.TempDir(), "out")
	var pulled pullResult
	tl.cryoJSON(t, &pulled, "pull", ref, out)
	if pulled.Kind != "cryo" || string(pulled.Descriptor.Digest) != packed.Digest {
		t.Errorf("pull: kind %q digest %s, want a cryo snapshot %s", pulled.Kind, pulled.Descriptor.Digest, packed.Digest)
	}
	sameTree(t, src, out, true)

	verified := tl.cryo(t, "verify", ref)
	if !strings.HasPrefix(verified, "ok: "+packed.Digest) {
		t.Errorf("cryo verify %s printed %q, want it to start with %q", ref, verified, "ok: "+packed.Digest)
	}
}

// TestOrasReadsWhatCryoPushed pushes with cryo and reads the result with
// oras only, checking the graph SPEC.md describes is what a registry
// serves: the snapshot index (artifactType, one file manifest per part),
// a file manifest, its chunk table config and a chunk blob whose sha256 is
// its layer digest and whose bytes are the file's.
func TestOrasReadsWhatCryoPushed(t *testing.T) {
	tl := newTools(t)
	reg := testenv.StartRegistry(t, "")
	src := testenv.ImageDir(t, synth.HalfZero, 8<<20, 2)
	ref := reg.Addr + "/repo:v1"
	var pushed pushResult
	// Format v1's graph (sections 3-5): a chunk blob is a layer.
	tl.cryoJSON(t, &pushed, "push", "--format", "v1", src, ref)

	rawIndex := tl.oras(t, "", "manifest", "fetch", "--plain-http", ref)
	if got := sha256Of(rawIndex); got != string(pushed.Descriptor.Digest) {
		t.Fatalf("oras manifest fetch %s: digest %s, cryo push reported %s", ref, got, pushed.Descriptor.Digest)
	}
	var idx ocispec.Index
	if err := json.Unmarshal(rawIndex, &idx); err != nil {
		t.Fatalf("index: %v\n%s", err, rawIndex)
	}
	if idx.MediaType != ocispec.MediaTypeImageIndex || idx.ArtifactType != artifactTypeSnapshot {
		t.Fatalf("index mediaType %q artifactType %q, want %q and %q", idx.MediaType, idx.ArtifactType, ocispec.MediaTypeImageIndex, artifactTypeSnapshot)
	}
	var paths []string
	var pagesDesc *ocispec.Descriptor
	for i, d := range idx.Manifests {
		if d.MediaType != ocispec.MediaTypeImageManifest || d.ArtifactType != artifactTypeFile {
			t.Errorf("index entry %d: mediaType %q artifactType %q, want a file manifest", i, d.MediaType, d.ArtifactType)
		}
		p := d.Annotations[annotationFilePath]
		if !slices.Contains(paths, p) {
			paths = append(paths, p)
		}
		if p == "pages.img" && pagesDesc == nil {
			pagesDesc = &idx.Manifests[i]
		}
	}
	if want := []string{"checkpoint.img", "pages.img", "pages_meta.img"}; !slices.Equal(paths, want) {
		t.Fatalf("index lists files %q, want %q in this order", paths, want)
	}
	srcPages := filepath.Join(src, "pages.img")
	pagesSum, err := fileSHA256(srcPages)
	if err != nil {
		t.Fatal(err)
	}
	pagesData, err := os.ReadFile(srcPages)
	if err != nil {
		t.Fatal(err)
	}
	if got := pagesDesc.Annotations[annotationFileDigest]; got != pagesSum {
		t.Errorf("pages.img %s annotation %q, want %q", annotationFileDigest, got, pagesSum)
	}
	if got, want := pagesDesc.Annotations[annotationFileSize], fmt.Sprint(len(pagesData)); got != want {
		t.Errorf("pages.img %s annotation %q, want %q", annotationFileSize, got, want)
	}

	repo := reg.Addr + "/repo"
	rawManifest := tl.oras(t, "", "manifest", "fetch", "--plain-http", repo+"@"+string(pagesDesc.Digest))
	if got := sha256Of(rawManifest); got != string(pagesDesc.Digest) {
		t.Fatalf("file manifest digest %s, index says %s", got, pagesDesc.Digest)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(rawManifest, &m); err != nil {
		t.Fatalf("file manifest: %v\n%s", err, rawManifest)
	}
	if m.ArtifactType != artifactTypeFile || m.Config.MediaType != mediaTypeChunkTable || len(m.Layers) == 0 {
		t.Fatalf("file manifest: artifactType %q, config %q, %d layers; want %q, %q, layers:\n%s",
			m.ArtifactType, m.Config.MediaType, len(m.Layers), artifactTypeFile, mediaTypeChunkTable, rawManifest)
	}

	for _, l := range m.Layers {
		if l.MediaType != mediaTypeChunkRaw && l.MediaType != mediaTypeChunkZstd {
			t.Errorf("layer %s of pages.img: media type %q, want a chunk blob", l.Digest, l.MediaType)
		}
	}

	rawTable := tl.oras(t, "", "blob", "fetch", "--plain-http", "--output", "-", repo+"@"+string(m.Config.Digest))
	if got := sha256Of(rawTable); got != string(m.Config.Digest) || int64(len(rawTable)) != m.Config.Size {
		t.Fatalf("chunk table: %d bytes %s, config descriptor says %d bytes %s", len(rawTable), got, m.Config.Size, m.Config.Digest)
	}
	var table chunkTable
	if err := json.Unmarshal(rawTable, &table); err != nil {
		t.Fatalf("chunk table: %v\n%s", err, rawTable)
	}
	if table.Path != "pages.img" || table.Size != int64(len(pagesData)) || table.Digest != pagesSum || table.Offset != 0 || table.Mode != 0o644 || len(table.Chunks) == 0 {
		t.Fatalf("chunk table: path %q size %d digest %s offset %d mode %o, %d chunks; want pages.img, %d, %s, 0, 644, some chunks",
			table.Path, table.Size, table.Digest, table.Offset, table.Mode, len(table.Chunks), len(pagesData), pagesSum)
	}

	// Fetch the first raw chunk with oras: its sha256 must be its layer
	// digest and its bytes those of the source file at the chunk's offset.
	var fetched bool
	for _, c := range table.Chunks {
		if c.Encoding != "raw" {
			continue
		}
		var layer *ocispec.Descriptor
		for i := range m.Layers {
			if string(m.Layers[i].Digest) == c.Blob {
				layer = &m.Layers[i]
			}
		}
		if layer == nil {
			t.Fatalf("chunk at %d: blob %s is not a layer of the manifest", c.Offset, c.Blob)
		}
		if layer.MediaType != mediaTypeChunkRaw || layer.Size != c.BlobSize {
			t.Fatalf("layer %s: mediaType %q size %d, want %q size %d", layer.Digest, layer.MediaType, layer.Size, mediaTypeChunkRaw, c.BlobSize)
		}
		blob := tl.oras(t, "", "blob", "fetch", "--plain-http", "--output", "-", repo+"@"+string(layer.Digest))
		if got := sha256Of(blob); got != string(layer.Digest) || int64(len(blob)) != layer.Size {
			t.Fatalf("chunk blob: %d bytes %s, layer says %d bytes %s", len(blob), got, layer.Size, layer.Digest)
		}
		if !bytes.Equal(blob, pagesData[c.Offset:c.Offset+c.Size]) {
			t.Fatalf("raw chunk blob %s is not pages.img[%d:%d]", layer.Digest, c.Offset, c.Offset+c.Size)
		}
		fetched = true
		break
	}
	if !fetched {
		t.Fatalf("pages.img of a halfzero image has no raw chunk; table:\n%s", rawTable)
	}
}

// TestOrasCopyBetweenCryoRegistries pushes a snapshot to one cryo registry,
// copies it to another with `oras cp` (which copies an index and all its
// children), and pulls it from the second with cryo.
func TestOrasCopyBetweenCryoRegistries(t *testing.T) {
	tl := newTools(t)
	regA := testenv.StartRegistry(t, "")
	regB := testenv.StartRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 16<<20, 3)
	var pushed pushResult
	tl.cryoJSON(t, &pushed, "push", src, regA.Addr+"/app:v1")

	tl.oras(t, "", "cp", "--no-tty", "--from-plain-http", "--to-plain-http", regA.Addr+"/app:v1", regB.Addr+"/app:v1")

	out := filepath.Join(t.TempDir(), "out")
	var pulled pullResult
	tl.cryoJSON(t, &pulled, "pull", regB.Addr+"/app:v1", out)
	if pulled.Descriptor.Digest != pushed.Descriptor.Digest {
		t.Errorf("pulled %s from B, pushed %s to A", pulled.Descriptor.Digest, pushed.Descriptor.Digest)
	}
	sameTree(t, src, out, true)
}

// TestCryoPullsOrasPushedFiles checks that cryo pulls a plain artifact of
// whole files as `oras push` writes it, so builders can start without cryo.
func TestCryoPullsOrasPushedFiles(t *testing.T) {
	tl := newTools(t)
	reg := testenv.StartRegistry(t, "")
	src := testenv.ImageDir(t, synth.Random, 8<<20, 4)
	ref := reg.Addr + "/plain:v1"
	// Run from inside the image dir so that the layer titles are the bare
	// file names.
	tl.oras(t, src, "push", "--no-tty", "--plain-http", ref, "checkpoint.img", "pages_meta.img", "pages.img")

	out := filepath.Join(t.TempDir(), "out")
	var pulled pullResult
	tl.cryoJSON(t, &pulled, "pull", ref, out)
	t.Logf("pull of an oras artifact: %+v", pulled)
	if pulled.Kind != "files" || pulled.Files != 3 {
		t.Errorf("pull of an oras artifact: kind %q, %d files; want %q, 3 files", pulled.Kind, pulled.Files, "files")
	}
	// oras records no file modes, so only names and bytes are compared.
	sameTree(t, src, out, false)
	if pulled.LogicalBytes != pulled.FetchedBytes || pulled.LogicalBytes < 8<<20 {
		t.Errorf("pull: logicalBytes %d fetchedBytes %d, want both the size of the three files", pulled.LogicalBytes, pulled.FetchedBytes)
	}
	mustNotExist(t, filepath.Join(filepath.Dir(out), ".out.cryo-partial"))
}

// TestStockRegistry checks that cryo's client works with a registry that
// has none of cryo's extensions (the stock distribution registry): push
// without a chunk index, pull back, and dedup of a second snapshot pushed
// under a new tag: in v1 by the plain HEAD checks of the OCI distribution
// API, in v2 (the default) by a base found among the repository's tags
// (there is no latest-snapshot extension to ask).
func TestStockRegistry(t *testing.T) {
	tl := newTools(t)
	regBin := testenv.Tool(t, "registry")
	dir := t.TempDir()
	addr := testenv.FreeAddr(t)
	config := filepath.Join(dir, "config.yml")
	yaml := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %q
  delete:
    enabled: true
http:
  addr: %q
`, filepath.Join(dir, "storage"), addr)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	reg := testenv.StartCommand(t, addr, regBin, "serve", config)

	const size = 64 << 20
	src := testenv.ImageDir(t, synth.Text, size, 5)
	// A second checkpoint of the same app: 4 insertions or deletions of a
	// few pages and 1% of the pages rewritten.
	src2 := mutatedCopy(t, src, synth.Text, 4, 0.01, 6)
	for _, format := range []string{"v1", "v2"} {
		t.Run(format, func(t *testing.T) {
			repo := reg.Addr + "/app-" + format
			var first pushResult
			tl.cryoJSON(t, &first, "push", "--format", format, src, repo+":pause-9")
			if first.ChunkIndexHits != 0 {
				t.Errorf("push to the stock registry reports %d chunk index hits: it has no chunk index", first.ChunkIndexHits)
			}
			if first.Stats.UploadedBytes == 0 || first.Stats.BlobsUploaded == 0 {
				t.Fatalf("first push uploaded %d bytes in %d blobs", first.Stats.UploadedBytes, first.Stats.BlobsUploaded)
			}
			out := filepath.Join(t.TempDir(), "out")
			tl.cryo(t, "pull", repo+":pause-9", out)
			sameTree(t, src, out, true)

			// Under a new tag, in a repository that also holds an
			// artifact that is no snapshot (never taken for the base),
			// tagged after the snapshot in every order.
			tl.oras(t, src, "push", "--no-tty", "--plain-http", repo+":pause-10-notes", "checkpoint.img")
			var second pushResult
			tl.cryoJSON(t, &second, "push", "--format", format, src2, repo+":pause-10")
			t.Logf("%s: first push uploaded %d bytes, second %d (%d blobs skipped, %d bytes reused)", format, first.Stats.UploadedBytes, second.Stats.UploadedBytes, second.Stats.BlobsSkipped, second.Stats.ReusedBytes)
			if second.Stats.UploadedBytes*4 > first.Stats.UploadedBytes {
				t.Errorf("second push uploaded %d bytes, want under a quarter of the first push's %d", second.Stats.UploadedBytes, first.Stats.UploadedBytes)
			}
			switch format {
			case "v1":
				if second.Stats.BlobsSkipped == 0 {
					t.Error("second v1 push skipped no blob")
				}
			case "v2":
				if second.Base == nil || second.Base.Digest != first.Descriptor.Digest {
					t.Errorf("second v2 push used base %v, want the first snapshot %s", second.Base, first.Descriptor.Digest)
				}
			}
			out2 := filepath.Join(t.TempDir(), "out2")
			tl.cryo(t, "pull", repo+":pause-10", out2)
			sameTree(t, src2, out2, true)
		})
	}
}

// registryGet fetches path from a registry's HTTP API.
func registryGet(t *testing.T, addr, path, accept string) []byte {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %v\n%s", path, resp.Status, err, body)
	}
	return body
}

// chunkTables returns the chunk tables of every part of the snapshot at
// repo:tag in the registry at addr, read through the registry API.
func chunkTables(t *testing.T, addr, repo, tag string) []chunkTable {
	t.Helper()
	var idx ocispec.Index
	if err := json.Unmarshal(registryGet(t, addr, "/v2/"+repo+"/manifests/"+tag, ocispec.MediaTypeImageIndex), &idx); err != nil {
		t.Fatal(err)
	}
	var tables []chunkTable
	for _, d := range idx.Manifests {
		var m ocispec.Manifest
		if err := json.Unmarshal(registryGet(t, addr, "/v2/"+repo+"/manifests/"+string(d.Digest), ocispec.MediaTypeImageManifest), &m); err != nil {
			t.Fatal(err)
		}
		var table chunkTable
		if err := json.Unmarshal(registryGet(t, addr, "/v2/"+repo+"/blobs/"+string(m.Config.Digest), ""), &table); err != nil {
			t.Fatal(err)
		}
		tables = append(tables, table)
	}
	return tables
}

// blobData is where a filesystem-backed distribution registry under root
// keeps the blob dgst.
func blobData(root, dgst string) string {
	hexPart := strings.TrimPrefix(dgst, "sha256:")
	return filepath.Join(root, "docker", "registry", "v2", "blobs", "sha256", hexPart[:2], hexPart, "data")
}

// TestPullBadInput checks that cryo pull refuses what it cannot verify and
// survives a registry crash: a corrupted chunk blob in the registry's
// storage fails the pull with the digest named and nothing at the target,
// and a registry killed mid-pull fails the pull cleanly, after which the
// same pull resumes from the chunks already on disk.
func TestPullBadInput(t *testing.T) {
	t.Run("CorruptChunk", func(t *testing.T) {
		tl := newTools(t)
		reg := testenv.StartRegistry(t, "")
		src := testenv.ImageDir(t, synth.HalfZero, 16<<20, 7)
		ref := reg.Addr + "/app:v1"
		// Format v1, whose chunk tables are plain JSON and whose chunks
		// are blobs of their own (v2's corrupt frames: puller/v2_test.go).
		tl.cryo(t, "push", "--format", "v1", src, ref)

		// The first raw and the first zstd chunk of the snapshot (in a
		// halfzero image: random pages of pages.img, and pages_meta.img).
		type target struct{ encoding, path, digest, blob string }
		found := map[string]target{}
		for _, table := range chunkTables(t, reg.Addr, "app", "v1") {
			for _, c := range table.Chunks {
				if _, ok := found[c.Encoding]; !ok && c.Encoding != "zero" {
					found[c.Encoding] = target{c.Encoding, table.Path, c.Digest, c.Blob}
				}
			}
		}
		if len(found) != 2 {
			t.Fatalf("want a raw and a zstd chunk in the snapshot, found %v", found)
		}
		targets := []target{found["raw"], found["zstd"]}
		for _, tg := range targets {
			t.Run(tg.encoding, func(t *testing.T) {
				data := blobData(reg.Root, tg.blob)
				orig, err := os.ReadFile(data)
				if err != nil {
					t.Fatalf("chunk blob in the registry's storage: %v", err)
				}
				bad := bytes.Clone(orig)
				bad[len(bad)/2] ^= 0xff
				if err := os.WriteFile(data, bad, 0o644); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { os.WriteFile(data, orig, 0o644) })

				out := filepath.Join(t.TempDir(), "out")
				r := tl.exec("", tl.cryoBin, "pull", ref, out)
				if r.err == nil {
					t.Fatalf("pull of a snapshot with a corrupt %s chunk blob (of %s) succeeded:\n%s", tg.encoding, tg.path, r)
				}
				if !strings.Contains(r.stderr, tg.blob) && !strings.Contains(r.stderr, tg.digest) {
					t.Errorf("pull error names neither chunk digest %s nor blob digest %s:\n%s", tg.digest, tg.blob, r)
				}
				t.Logf("pull with a corrupt %s chunk of %s: %s", tg.encoding, tg.path, strings.TrimSpace(r.stderr))
				mustNotExist(t, out)
			})
		}
	})

	t.Run("RegistryKilled", func(t *testing.T) {
		tl := newTools(t)
		reg := testenv.StartRegistry(t, "")
		const size = 256 << 20
		src := testenv.ImageDir(t, synth.Random, size, 8)
		ref := reg.Addr + "/app:v1"
		tl.cryo(t, "push", src, ref)

		out := filepath.Join(t.TempDir(), "out")
		partial := filepath.Join(filepath.Dir(out), ".out.cryo-partial")
		ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
		defer cancel()
		cmd := tl.command(ctx, "", tl.cryoBin, "pull", ref, out)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()

		// Kill the registry once about a fifth of the image is on disk.
		var written int64
		var exited bool
		var waitErr error
		for written < size/5 {
			select {
			case waitErr = <-done:
				exited = true
			case <-time.After(2 * time.Millisecond):
			}
			if exited {
				break
			}
			written = treeBytes(partial)
		}
		if exited {
			t.Fatalf("pull ended (%v) before a fifth of the image was written (%d bytes); stdout:\n%s\nstderr:\n%s", waitErr, written, &stdout, &stderr)
		}
		reg.Stop()
		t.Logf("killed the registry with %d of %d bytes in %s", written, size, partial)
		waitErr = <-done
		first := result{cmdline: "cryo pull " + ref + " " + out, stdout: stdout.String(), stderr: stderr.String(), err: waitErr}
		if waitErr == nil {
			t.Fatalf("pull succeeded although the registry was killed in the middle:\n%s", first)
		}
		// A clear error says the connection failed; nothing was corrupt, so
		// it must not claim a digest mismatch (which would send an operator
		// looking for corruption in the registry).
		msg := strings.ToLower(first.stderr)
		network := false
		for _, s := range []string{"eof", "connection refused", "connection reset", "broken pipe"} {
			network = network || strings.Contains(msg, s)
		}
		if !strings.HasPrefix(first.stderr, "cryo: pull") || !network || strings.Contains(msg, "panic") {
			t.Errorf("interrupted pull failed without an error saying the connection to the registry failed:\n%s", first)
		}
		if strings.Contains(msg, "digest mismatch") {
			t.Errorf("interrupted pull reports a digest mismatch although no content was corrupt, only the connection cut:\n%s", first)
		}
		t.Logf("interrupted pull: %v; stderr:\n%s", waitErr, first.stderr)
		mustNotExist(t, out)
		if treeBytes(partial) == 0 {
			t.Fatalf("interrupted pull left nothing in %s to resume from", partial)
		}

		reg.Start(t)
		var pulled pullResult
		tl.cryoJSON(t, &pulled, "pull", ref, out)
		t.Logf("resumed pull: %+v", pulled)
		if pulled.ReusedBytes <= 0 {
			t.Errorf("resumed pull reused %d bytes, want the chunks the interrupted pull left", pulled.ReusedBytes)
		}
		if pulled.FetchedBytes >= size {
			t.Errorf("resumed pull fetched %d bytes, want less than the %d of the whole image", pulled.FetchedBytes, size)
		}
		sameTree(t, src, out, true)
		mustNotExist(t, partial)
	})
}

// treeBytes is the total size of the regular files under dir (0 if dir
// does not exist yet).
func treeBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if info, err := d.Info(); err == nil {
				n += info.Size()
			}
		}
		return nil
	})
	return n
}

// TestPushNeedsAuth runs cryo's registry with htpasswd auth and checks that
// cryo push is refused without credentials, with a clear error, works with
// -u/-p, and works with the credentials `cryo login` stored in Docker's
// config.
func TestPushNeedsAuth(t *testing.T) {
	tl := newTools(t)
	dir := t.TempDir()
	const user, password = "builder", "s3cret-Passw0rd"
	hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost) // the registry checks it on every request
	if err != nil {
		t.Fatal(err)
	}
	htpasswd := filepath.Join(dir, "htpasswd")
	if err := os.WriteFile(htpasswd, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	addr := testenv.FreeAddr(t)
	config := filepath.Join(dir, "config.yml")
	yaml := fmt.Sprintf(`version: 0.1
log:
  level: warn
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %q
  delete:
    enabled: true
http:
  addr: %q
auth:
  htpasswd:
    realm: cryo-test
    path: %q
`, filepath.Join(dir, "storage"), addr, htpasswd)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	reg := testenv.StartCommand(t, addr, tl.cryoBin, "registry", "serve", "--config", config, "--metrics-addr", "")

	src := testenv.ImageDir(t, synth.Text, 4<<20, 9)
	ref := reg.Addr + "/app:v1"

	r := tl.exec("", tl.cryoBin, "push", src, ref)
	if r.err == nil {
		t.Fatalf("push without credentials to a registry with auth succeeded:\n%s", r)
	}
	if msg := strings.ToLower(r.stderr); !strings.Contains(msg, "unauthorized") && !strings.Contains(msg, "credential") {
		t.Errorf("push without credentials: error says neither unauthorized nor credentials:\n%s", r)
	}
	t.Logf("push without credentials: %s", strings.TrimSpace(r.stderr))

	r = tl.exec("", tl.cryoBin, "push", "-u", user, "-p", "wrong", src, ref)
	if r.err == nil {
		t.Fatalf("push with a wrong password succeeded:\n%s", r)
	}

	tl.cryo(t, "push", "-u", user, "-p", password, src, ref)

	r = tl.exec("", tl.cryoBin, "login", reg.Addr, "-u", user, "-p", "wrong")
	if r.err == nil {
		t.Fatalf("login with a wrong password succeeded:\n%s", r)
	}
	tl.cryo(t, "login", reg.Addr, "-u", user, "-p", password)
	cfg, err := os.ReadFile(filepath.Join(tl.dockerConfig, "config.json"))
	if err != nil {
		t.Fatalf("cryo login stored nothing in DOCKER_CONFIG: %v", err)
	}
	var docker struct {
		Auths map[string]json.RawMessage `json:"auths"`
	}
	if err := json.Unmarshal(cfg, &docker); err != nil || docker.Auths[reg.Addr] == nil {
		t.Fatalf("DOCKER_CONFIG/config.json has no auths entry for %s (%v):\n%s", reg.Addr, err, cfg)
	}

	src2 := testenv.ImageDir(t, synth.Text, 4<<20, 10)
	tl.cryo(t, "push", src2, reg.Addr+"/app:v2")
	out := filepath.Join(t.TempDir(), "out")
	tl.cryo(t, "pull", reg.Addr+"/app:v2", out)
	sameTree(t, src2, out, true)
}
