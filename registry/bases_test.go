package registry

import (
	"context"
	"errors"
	"net/http"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/transfer"
)

// TestNewTagTakesLatestBase pushes a v2 snapshot to app:p1, then a second
// checkpoint of the same memory (10% rewritten) under a new tag, app:p2,
// without --base: the push takes the snapshot the registry stored last in
// app as its base, so its unchanged chunks are referenced where they lie
// (nothing composed, that is, copied, by the registry) and only about what
// changed is uploaded. A snapshot put by digest only (no tag) is not
// recorded, a repository without v2 snapshots of its own gives no base
// (never another repository's, even if it holds the same manifest), and a
// deleted snapshot is not answered.
func TestNewTagTakesLatestBase(t *testing.T) {
	ctx := context.Background()
	reg := startRegistry(t, "")
	src := testenv.ImageDir(t, synth.Text, 24<<20, 21)
	app, tag := reg.repo(t, "app:p1")
	first, err := transfer.Push(ctx, src, app, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if first.Base != nil {
		t.Fatalf("first push of app took base %s", first.Base.Digest)
	}
	latest, err := api.LatestSnapshot(ctx, http.DefaultClient, reg.http.URL, "app")
	if err != nil || latest.Digest != first.Descriptor.Digest {
		t.Fatalf("latest of app: %v, %v; want %s", latest.Digest, err, first.Descriptor.Digest)
	}

	changed := filepath.Join(t.TempDir(), "changed")
	mutateImage(t, src, changed, 0.1)
	app, tag = reg.repo(t, "app:p2")
	second, err := transfer.Push(ctx, changed, app, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if second.Base == nil || second.Base.Digest != first.Descriptor.Digest {
		t.Fatalf("push to a new tag: base %v, want %s", second.Base, first.Descriptor.Digest)
	}
	st := second.Stats
	t.Logf("second push: %d bytes uploaded, %d reused, %d composed, of %d stored", st.UploadedBytes, st.ReusedBytes, st.ComposedBytes, st.StoredBytes)
	if st.ComposedBytes != 0 || st.ReusedBytes < st.StoredBytes/2 || st.UploadedBytes > first.Stats.UploadedBytes/3 {
		t.Errorf("second push: %d bytes uploaded (first %d), %d reused, %d composed, of %d stored; want most reused in place, nothing composed",
			st.UploadedBytes, first.Stats.UploadedBytes, st.ReusedBytes, st.ComposedBytes, st.StoredBytes)
	}
	pullsBack(t, app, tag, changed)
	if latest, err = api.LatestSnapshot(ctx, http.DefaultClient, reg.http.URL, "app"); err != nil || latest.Digest != second.Descriptor.Digest {
		t.Errorf("latest of app after the second push: %v, %v; want %s", latest.Digest, err, second.Descriptor.Digest)
	}

	// Put by digest only: not recorded.
	untagged := filepath.Join(t.TempDir(), "untagged")
	mutateImage(t, src, untagged, 0.3)
	if _, _, err := format.Pack(ctx, untagged, app, format.PackOptions{Format: format.V2}); err != nil {
		t.Fatal(err)
	}
	if latest, err = api.LatestSnapshot(ctx, http.DefaultClient, reg.http.URL, "app"); err != nil || latest.Digest != second.Descriptor.Digest {
		t.Errorf("latest of app after a push by digest only: %v, %v; want %s", latest.Digest, err, second.Descriptor.Digest)
	}

	// The first snapshot, byte-identical, in repository dup (by digest,
	// no base, nothing composed): dup holds app's recorded manifest but
	// has no record of its own.
	dup, _ := reg.repo(t, "dup:x")
	if d, _, err := format.Pack(ctx, src, dup, format.PackOptions{Format: format.V2}); err != nil || d.Digest != first.Descriptor.Digest {
		t.Fatalf("first snapshot in dup: %v, %v; want %s", d.Digest, err, first.Descriptor.Digest)
	}
	if _, ok, err := reg.srv.bases.Latest(ctx, "dup"); ok || err != nil {
		t.Errorf("dup, which has no record of its own, answered a base (%v)", err)
	}

	// Another repository has no base of its own: its push composes.
	other, tag := reg.repo(t, "other:p1")
	res, err := transfer.Push(ctx, changed, other, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	if res.Base != nil || res.Stats.ComposedBytes == 0 {
		t.Errorf("push to another repository: base %v, %d bytes composed", res.Base, res.Stats.ComposedBytes)
	}

	// Deleted: not answered.
	if err := app.Manifests().Delete(ctx, second.Descriptor); err != nil {
		t.Fatal(err)
	}
	if _, err := api.LatestSnapshot(ctx, http.DefaultClient, reg.http.URL, "app"); !errors.Is(err, api.ErrNoBase) {
		t.Errorf("latest of app after its deletion: %v, want ErrNoBase", err)
	}
	if _, err := api.LatestSnapshot(ctx, http.DefaultClient, reg.http.URL, "nothing/here"); !errors.Is(err, api.ErrNoBase) {
		t.Errorf("latest of an empty repository: %v, want ErrNoBase", err)
	}
}

// TestLatestBaseChecksAccess: the latest snapshot of a repository is
// answered only to a caller that may pull from and push to it.
func TestLatestBaseChecksAccess(t *testing.T) {
	ctx := context.Background()
	root := t.TempDir()
	open := startRegistry(t, root)
	a, tag := open.repo(t, "a:v1")
	res, err := transfer.Push(ctx, testenv.ImageDir(t, synth.Text, 4<<20, 22), a, tag, v2Push)
	if err != nil {
		t.Fatal(err)
	}
	ti := newTokenIssuer(t)
	reg := ti.startRegistry(t, root)
	client := func(grants map[string][]string) *http.Client {
		return &http.Client{Transport: bearer(ti.tokenFor(t, grants))}
	}
	got, err := api.LatestSnapshot(ctx, client(map[string][]string{"a": {"pull", "push"}}), reg.http.URL, "a")
	if err != nil || got.Digest != res.Descriptor.Digest {
		t.Fatalf("with pull and push on a: %v, %v", got.Digest, err)
	}
	for _, grants := range []map[string][]string{{"a": {"pull"}}, {"b": {"pull", "push"}}} {
		if got, err := api.LatestSnapshot(ctx, client(grants), reg.http.URL, "a"); err == nil {
			t.Errorf("with %v: answered %s", grants, got.Digest)
		}
	}
}
