package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestInspectBaseCLI pushes a synthetic image dir to an in-process cryo
// registry, rewrites 10% of its pages and pushes it again with the first
// as its base, and checks the lines `cryo inspect --base` prints against
// the set differences of the two snapshots' chunk digests and packs, read
// here from the tables, and against what the second push uploaded. The
// same snapshot against itself has nothing new, a v1 base in a layout
// leaves packs uncompared, a bare tag names a snapshot beside the
// inspected one, and a base that does not exist is an error naming
// --base.
func TestInspectBaseCLI(t *testing.T) {
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	reg := startAuthRegistry(t)
	const size = 8 << 20
	img1 := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(img1, synth.Text, size, 1); err != nil {
		t.Fatal(err)
	}
	img2 := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(img2, synth.Text, size, 1); err != nil {
		t.Fatal(err)
	}
	src, err := os.Open(filepath.Join(img1, "pages.img"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := synth.WriteFile(filepath.Join(img2, "pages.img"), func(w io.Writer) error {
		pages := int64(size / synth.PageSize)
		_, err := synth.Mutate(w, src, pages, synth.MutationPlan(pages, 0, 0.10, 2), synth.Text, 2)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	ref := reg.host + "/app"
	if _, stderr, err := runCryo(t, "", "push", img1, ref+":one"); err != nil {
		t.Fatalf("push one: %v\n%s", err, stderr)
	}
	stdout, stderr, err := runCryo(t, "", "push", "--json", "--base", "one", img2, ref+":two")
	if err != nil {
		t.Fatalf("push two: %v\n%s", err, stderr)
	}
	var pushed transfer.PushResult
	if err := json.Unmarshal([]byte(stdout), &pushed); err != nil {
		t.Fatal(err)
	}

	// What the lines must say, from the tables read here.
	repo, _, err := (&remoteOptions{}).repository(ref + ":one")
	if err != nil {
		t.Fatal(err)
	}
	store := transfer.Ranged{Repository: repo}
	chunks1, packs1 := chunksAndPacks(t, store, "one")
	chunks2, packs2 := chunksAndPacks(t, store, "two")
	var stored, newBytes, newPackBytes, sharedPackBytes int64
	var newChunks, newPacks int
	for d, n := range chunks2 {
		stored += n
		if _, ok := chunks1[d]; !ok {
			newChunks++
			newBytes += n
		}
	}
	for d, n := range packs2 {
		if _, ok := packs1[d]; ok {
			sharedPackBytes += n
		} else {
			newPacks++
			newPackBytes += n
		}
	}
	if newPackBytes != pushed.Stats.UploadedBytes || newChunks == 0 || newChunks*4 > len(chunks2) {
		t.Fatalf("the test's own numbers: %d of %d chunks new, new packs of %d bytes; the push uploaded %d", newChunks, len(chunks2), newPackBytes, pushed.Stats.UploadedBytes)
	}
	sharedChunks := len(chunks2) - newChunks
	want := []string{
		fmt.Sprintf("base      %s (v2)", descOf(t, store, "one").Digest),
		fmt.Sprintf("shared    %d chunks, %s stored (%s of stored): also in the base", sharedChunks, humanBytes(stored-newBytes), percent(stored-newBytes, stored)),
		fmt.Sprintf("new       %d chunks, %s stored (%s of stored): what a node holding the base still fetches", newChunks, humanBytes(newBytes), percent(newBytes, stored)),
		fmt.Sprintf("packs     %d shared with the base (%s), %d new (%s): stored for this snapshot beyond the base", len(packs2)-newPacks, humanBytes(sharedPackBytes), newPacks, humanBytes(newPackBytes)),
	}
	out, stderr, err := runCryo(t, "", "inspect", ref+":two", "--base", "one")
	if err != nil {
		t.Fatalf("inspect: %v\n%s", err, stderr)
	}
	t.Logf("cryo inspect %s:two --base one:\n%s", ref, out)
	for _, line := range want {
		if !strings.Contains(out, "\n"+line+"\n") {
			t.Errorf("output lacks the line\n%s", line)
		}
	}

	// The same snapshot against itself, by reference: nothing new.
	out, stderr, err = runCryo(t, "", "inspect", "--json", ref+":two", "--base", ref+":two")
	if err != nil {
		t.Fatalf("inspect --json: %v\n%s", err, stderr)
	}
	var self format.Summary
	if err := json.Unmarshal([]byte(out), &self); err != nil {
		t.Fatal(err)
	}
	if r := self.Reuse; r == nil || r.NewChunks != 0 || r.NewBytes != 0 || r.SharedChunks != len(chunks2) || r.Packs == nil || r.Packs.New != 0 || r.Packs.Shared != len(packs2) {
		t.Errorf("against itself: %s", out)
	}

	// A v1 base in a layout: chunks compared (64 KiB chunking in both, so
	// the same digests), packs not.
	layout := filepath.Join(t.TempDir(), "layout")
	if _, stderr, err := runCryo(t, "", "pack", "--format", "v1", "--chunk-size", "65536", img2, "--layout", layout, "--tag", "v1"); err != nil {
		t.Fatalf("pack: %v\n%s", err, stderr)
	}
	out, stderr, err = runCryo(t, "", "inspect", ref+":two", "--base", layout+":v1")
	if err != nil {
		t.Fatalf("inspect against a layout: %v\n%s", err, stderr)
	}
	for _, line := range []string{
		"new       0 chunks, 0 B stored (0.0% of stored): what a node holding the base still fetches",
		"packs     not compared: the base is v1 (packs are compared only between v2 snapshots)",
	} {
		if !strings.Contains(out, "\n"+line+"\n") {
			t.Errorf("against a v1 layout, output lacks the line\n%s\n%s", line, out)
		}
	}

	// A bare tag names a snapshot of the inspected layout.
	out, stderr, err = runCryo(t, "", "inspect", layout+":v1", "--base", "v1")
	if err != nil {
		t.Fatalf("inspect a layout against its own tag: %v\n%s", err, stderr)
	}
	if !strings.Contains(out, "\nnew       0 chunks, 0 B stored") || strings.Contains(out, "\npacks ") {
		t.Errorf("a v1 layout against itself:\n%s", out)
	}

	if _, _, err := runCryo(t, "", "inspect", ref+":two", "--base", "nosuchtag"); err == nil || !strings.Contains(err.Error(), "--base nosuchtag") {
		t.Errorf("a missing base: %v", err)
	}
}

// descOf resolves tag in store's repository.
func descOf(t *testing.T, store transfer.Ranged, tag string) ocispec.Descriptor {
	t.Helper()
	desc, err := store.Repository.Resolve(context.Background(), tag)
	if err != nil {
		t.Fatal(err)
	}
	return desc
}

// chunksAndPacks reads the snapshot tag's tables: the stored size of its
// non-zero chunks by digest, and the size of the packs its manifests list.
func chunksAndPacks(t *testing.T, store transfer.Ranged, tag string) (chunks, packs map[digest.Digest]int64) {
	t.Helper()
	ctx := context.Background()
	snap, err := format.LoadSnapshot(ctx, store, descOf(t, store, tag))
	if err != nil {
		t.Fatal(err)
	}
	chunks, packs = map[digest.Digest]int64{}, map[digest.Digest]int64{}
	for i := range snap.Files {
		f := &snap.Files[i]
		for part := range f.Parts {
			pt, err := format.LoadPart(ctx, store, f, part)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range pt.Table.Chunks {
				if c.Encoding != format.EncodingZero {
					chunks[c.Digest] = c.BlobSize
				}
			}
			for _, l := range pt.Manifest.Layers {
				if l.MediaType == format.MediaTypePack {
					packs[l.Digest] = l.Size
				}
			}
		}
	}
	return chunks, packs
}

// TestInspectBaseCredentials: credentials given on the command line go to
// the registry the inspected reference names, and to the base's only if
// it is the same registry (the base's registry gets none here, and its
// answer without them is a clear error naming --base).
func TestInspectBaseCredentials(t *testing.T) {
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	primary, other := startAuthRegistry(t), startAuthRegistry(t)
	for _, ref := range []string{primary.host + "/app:one", primary.host + "/app:two", other.host + "/app:one"} {
		img := filepath.Join(t.TempDir(), "img")
		if err := synth.ImageDir(img, synth.Text, 1<<20, 1); err != nil {
			t.Fatal(err)
		}
		if _, stderr, err := runCryo(t, "", "push", img, ref); err != nil {
			t.Fatalf("push %s: %v\n%s", ref, err, stderr)
		}
	}
	primary.Require("alice", "s3cret")
	other.Require("bob", "other")
	pw := writeFile(t, "s3cret")

	// The same registry: the base is read with alice's credentials.
	if _, stderr, err := runCryo(t, "", "inspect", "-u", "alice", "--password-file", pw, primary.host+"/app:two", "--base", primary.host+"/app:one"); err != nil {
		t.Fatalf("base in the same registry: %v\n%s", err, stderr)
	}
	// Another registry: alice's credentials are not sent there.
	_, _, err := runCryo(t, "", "inspect", "-u", "alice", "--password-file", pw, primary.host+"/app:two", "--base", other.host+"/app:one")
	if err == nil || !strings.Contains(err.Error(), "--base "+other.host+"/app:one") {
		t.Errorf("a base in a registry that wants other credentials: %v", err)
	}
	if other.Requests() == 0 {
		t.Fatal("the base's registry was never asked: the test tested nothing")
	}
	for _, h := range other.Seen() {
		if h == testenv.BasicAuth("alice", "s3cret") {
			t.Fatal("the base's registry received the inspected registry's credentials")
		}
	}
}
