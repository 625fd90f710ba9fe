package layout_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestLayoutAsSpecified checks the OCI layout SPEC.md section 10 names:
// oci-layout, every manifest index.json lists under blobs/sha256/<hex>
// with its digest and size,
// index.json listing the tagged snapshot index with
// org.opencontainers.image.ref.name and every other manifest (part
// manifests, and a snapshot whose tag moved on) without it; a snapshot
// found by its tag or digest; an ingest/ dir left beside them ignored.
func TestLayoutAsSpecified(t *testing.T) {
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "layout")
	pack := func(seed uint64) ocispec.Descriptor {
		t.Helper()
		store, err := layout.New(dir)
		if err != nil {
			t.Fatal(err)
		}
		desc, _, err := format.Pack(ctx, testenv.ImageDir(t, synth.Text, 2<<20, seed), store, format.PackOptions{Format: format.V2})
		if err != nil {
			t.Fatal(err)
		}
		if err := store.Tag(ctx, desc, "v1"); err != nil {
			t.Fatal(err)
		}
		return desc
	}
	old := pack(1)
	cur := pack(2)

	var marker ocispec.ImageLayout
	data, err := os.ReadFile(filepath.Join(dir, ocispec.ImageLayoutFile))
	if err != nil || json.Unmarshal(data, &marker) != nil || marker.Version != ocispec.ImageLayoutVersion {
		t.Fatalf("oci-layout: %q, %v", data, err)
	}
	var index ocispec.Index
	data, err = os.ReadFile(filepath.Join(dir, ocispec.ImageIndexFile))
	if err != nil || json.Unmarshal(data, &index) != nil {
		t.Fatalf("index.json: %q, %v", data, err)
	}
	listed := map[digest.Digest]string{}
	for _, m := range index.Manifests {
		listed[m.Digest] = m.Annotations[ocispec.AnnotationRefName]
		blob, err := os.ReadFile(filepath.Join(dir, "blobs", m.Digest.Algorithm().String(), m.Digest.Encoded()))
		if err != nil || digest.FromBytes(blob) != m.Digest || int64(len(blob)) != m.Size {
			t.Errorf("index.json lists %s: its blob %d bytes, %v", m.Digest, len(blob), err)
		}
	}
	if ref, ok := listed[cur.Digest]; !ok || ref != "v1" {
		t.Errorf("index.json lists the tagged snapshot %s as %q (listed: %v), want ref.name v1", cur.Digest, ref, ok)
	}
	if ref, ok := listed[old.Digest]; !ok || ref != "" {
		t.Errorf("index.json lists the snapshot whose tag moved on, %s, as %q (listed: %v), want no ref.name", old.Digest, ref, ok)
	}

	// An upload left in ingest/ (oras-go's) is not part of the layout.
	if err := os.MkdirAll(filepath.Join(dir, "ingest"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "ingest", "partial"), []byte("half a blob"), 0o644); err != nil {
		t.Fatal(err)
	}
	store, err := layout.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"v1", cur.Digest.String()} {
		desc, err := store.Resolve(ctx, ref)
		if err != nil || desc.Digest != cur.Digest {
			t.Errorf("resolve %s: %s, %v; want %s", ref, desc.Digest, err, cur.Digest)
		}
	}
	snap, err := format.LoadSnapshot(ctx, store, cur)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range snap.Files {
		for _, p := range f.Parts {
			if _, ok := listed[p.Manifest.Digest]; !ok {
				t.Errorf("part manifest %s of %s not in index.json", p.Manifest.Digest, f.Path)
			} else if ref := listed[p.Manifest.Digest]; ref != "" {
				t.Errorf("part manifest %s listed with ref.name %q", p.Manifest.Digest, ref)
			}
		}
	}
	if _, _, err := format.Unpack(ctx, store, cur, filepath.Join(t.TempDir(), "out"), format.UnpackOptions{}); err != nil {
		t.Errorf("unpack beside an ingest/ dir: %v", err)
	}
}
