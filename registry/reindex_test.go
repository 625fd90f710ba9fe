package registry

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/cryo-oci/cryo/registry/referrers"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/registry/remote"
)

// TestReindexBringsBackALostIndex pushes a v1 and a v2 snapshot and a
// referrer of one, deletes the chunk index and the referrers from the
// storage (as a lost redis or a wiped prefix would), and runs Reindex:
// lookups answer again, the referrer is listed again, and new pushes to
// other repositories reuse what is stored (v1 by lookups, v2 by
// compositions) as much as on a registry whose index was never lost. It
// refuses to run while a garbage collection holds read-only mode.
func TestReindexBringsBackALostIndex(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 8<<20, 41)
	v1repo, tag := reg.repo(t, "a:v1")
	first, err := transfer.Push(ctx, src, v1repo, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	srcV2 := testenv.ImageDir(t, synth.Text, 8<<20, 42)
	v2repo, tag2 := reg.repo(t, "a2:v1")
	firstV2, err := transfer.Push(ctx, srcV2, v2repo, tag2, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	subject := first.Descriptor
	profile, err := oras.PackManifest(ctx, v1repo, oras.PackManifestVersion1_1, "application/vnd.cryo.profile.v1+json", oras.PackManifestOptions{Subject: &subject})
	if err != nil {
		t.Fatal(err)
	}
	chunk := firstChunk(t, v1repo, first.Descriptor)
	if found := lookupChunk(t, reg, chunk); len(found) == 0 {
		t.Fatalf("chunk %s not in the index after its push", chunk)
	}
	referrersOf := func() []ocispec.Descriptor {
		var found []ocispec.Descriptor
		if err := v1repo.Referrers(ctx, subject, "", func(r []ocispec.Descriptor) error { found = append(found, r...); return nil }); err != nil {
			t.Fatal(err)
		}
		return found
	}

	for _, root := range []string{chunkindex.Root, chunkindex.PacksRoot, referrers.Root} {
		if err := reg.srv.Driver().Delete(ctx, root); err != nil {
			t.Fatalf("delete %s: %v", root, err)
		}
	}
	if found := lookupChunk(t, reg, chunk); len(found) != 0 {
		t.Fatalf("chunk %s still answered with the index deleted: %+v", chunk, found)
	}
	if r := referrersOf(); len(r) != 0 {
		t.Fatalf("referrers still listed with their entries deleted: %+v", r)
	}

	res, err := reg.srv.Reindex(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reindex: %+v", res)
	if res.Repositories != 2 || res.Failed != 0 || res.Manifests < 4 {
		t.Errorf("reindex: %+v, want 2 repositories, at least 4 manifests, none failed", res)
	}
	if found := lookupChunk(t, reg, chunk); len(found) == 0 {
		t.Errorf("chunk %s not in the index after Reindex", chunk)
	}
	if r := referrersOf(); len(r) != 1 || r[0].Digest != profile.Digest {
		t.Errorf("referrers after Reindex: %+v, want %s", r, profile.Digest)
	}

	b, tag := reg.repo(t, "b:v1")
	again, err := transfer.Push(ctx, src, b, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if again.ChunkIndexHits == 0 || again.Stats.UploadedBytes != 0 {
		t.Errorf("v1 push after Reindex: %d chunk index hits, %d bytes uploaded; want the stored chunks reused", again.ChunkIndexHits, again.Stats.UploadedBytes)
	}
	// The same pushes on a registry that never lost its index.
	control := startRegistry(t, "")
	for _, p := range []struct {
		name, src string
		opts      transfer.PushOptions
	}{{"a:v1", src, transfer.PushOptions{}}, {"a2:v1", srcV2, v2Push}} {
		r, tag := control.repo(t, p.name)
		if _, err := transfer.Push(ctx, p.src, r, tag, p.opts); err != nil {
			t.Fatal(err)
		}
	}
	cb2, ctag := control.repo(t, "b2:v1")
	want, err := transfer.Push(ctx, srcV2, cb2, ctag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	b2, tag := reg.repo(t, "b2:v1")
	againV2, err := transfer.Push(ctx, srcV2, b2, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if againV2.Stats.ComposedBytes < firstV2.Stats.StoredBytes/2 || againV2.Stats.UploadedBytes != want.Stats.UploadedBytes || againV2.Stats.ComposedBytes != want.Stats.ComposedBytes {
		t.Errorf("v2 push after Reindex: %d bytes uploaded, %d composed; with the index never lost %d and %d (of %d stored)",
			againV2.Stats.UploadedBytes, againV2.Stats.ComposedBytes, want.Stats.UploadedBytes, want.Stats.ComposedBytes, firstV2.Stats.StoredBytes)
	}
	pullsBack(t, b2, tag, srcV2)

	// Not while a garbage collection holds read-only mode.
	lease, err := reg.srv.Maintenance().EnterReadOnly(ctx, "garbage collection", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	if _, err := reg.srv.Reindex(ctx); err == nil || !strings.Contains(err.Error(), "read-only") {
		t.Errorf("reindex during read-only mode: %v, want it refused", err)
	}
}

// firstChunk returns the digest of a stored (not zero) chunk of the
// snapshot.
func firstChunk(t *testing.T, repo *remote.Repository, idx ocispec.Descriptor) digest.Digest {
	t.Helper()
	for _, tb := range snapshotTables(t, repo, idx) {
		for _, c := range tb.Chunks {
			if c.Encoding != format.EncodingZero {
				return c.Digest
			}
		}
	}
	t.Fatal("the snapshot stores no chunk")
	return ""
}
