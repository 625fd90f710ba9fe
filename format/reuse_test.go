package format

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/oci"
)

// tableSets is what a test reads of a snapshot's tables on its own, to
// check InspectBase against: the stored size of each non-zero chunk by
// digest, and the packs its manifests list as layers, with their sizes.
type tableSets struct {
	chunks map[digest.Digest]int64
	packs  map[digest.Digest]int64
}

func readTableSets(t *testing.T, store content.Fetcher, desc ocispec.Descriptor) tableSets {
	t.Helper()
	_, pts := loadTables(t, store, desc)
	s := tableSets{chunks: map[digest.Digest]int64{}, packs: map[digest.Digest]int64{}}
	for _, pt := range pts {
		for _, c := range pt.Table.Chunks {
			if c.Encoding != EncodingZero {
				s.chunks[c.Digest] = c.BlobSize
			}
		}
		for _, l := range pt.Manifest.Layers {
			if l.MediaType == MediaTypePack {
				s.packs[l.Digest] = l.Size
			}
		}
	}
	return s
}

// wantReuse computes, by set difference, what InspectBase must report for
// a snapshot with sets s against a base with sets base.
func wantReuse(s, base tableSets, packs bool) Reuse {
	var r Reuse
	for d, n := range s.chunks {
		if _, ok := base.chunks[d]; ok {
			r.SharedChunks++
			r.SharedBytes += n
		} else {
			r.NewChunks++
			r.NewBytes += n
		}
	}
	if packs {
		r.Packs = &PackReuse{}
		for d, n := range s.packs {
			if _, ok := base.packs[d]; ok {
				r.Packs.Shared++
				r.Packs.SharedBytes += n
			} else {
				r.Packs.New++
				r.Packs.NewBytes += n
			}
		}
	}
	return r
}

func checkReuse(t *testing.T, what string, sum *Summary, want Reuse) {
	t.Helper()
	got := sum.Reuse
	if got == nil {
		t.Fatalf("%s: no Reuse", what)
	}
	if got.SharedChunks != want.SharedChunks || got.SharedBytes != want.SharedBytes || got.NewChunks != want.NewChunks || got.NewBytes != want.NewBytes {
		t.Errorf("%s: chunks shared %d (%d bytes), new %d (%d bytes); want shared %d (%d), new %d (%d)", what,
			got.SharedChunks, got.SharedBytes, got.NewChunks, got.NewBytes, want.SharedChunks, want.SharedBytes, want.NewChunks, want.NewBytes)
	}
	if got.SharedBytes+got.NewBytes != sum.StoredBytes {
		t.Errorf("%s: shared %d + new %d bytes, stored %d", what, got.SharedBytes, got.NewBytes, sum.StoredBytes)
	}
	switch {
	case want.Packs == nil && got.Packs != nil:
		t.Errorf("%s: packs compared: %+v", what, *got.Packs)
	case want.Packs != nil && got.Packs == nil:
		t.Errorf("%s: packs not compared", what)
	case want.Packs != nil:
		if *got.Packs != *want.Packs {
			t.Errorf("%s: packs %+v, want %+v", what, *got.Packs, *want.Packs)
		}
		if got.Packs.SharedBytes+got.Packs.NewBytes != sum.PackBytes {
			t.Errorf("%s: shared %d + new %d pack bytes, packs of %d", what, got.Packs.SharedBytes, got.Packs.NewBytes, sum.PackBytes)
		}
	}
}

// TestInspectBase packs a snapshot in v2, rewrites about 10% of its pages,
// packs the second snapshot in v2 with the first as its base (so it
// references the first's packs), and in v1 with v2's chunking, and checks
// what InspectBase reports against set differences of the tables' chunk
// digests and of the manifests' layers, against what Pack says it
// uploaded, and that a snapshot against itself or its v1 twin has nothing
// new.
func TestInspectBase(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, err := oci.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	d1, _, err := Pack(ctx, src, store, PackOptions{Format: V2})
	if err != nil {
		t.Fatal(err)
	}
	// 10 runs of 17 pages rewritten across the random and text-like
	// memory: 170 of pages.img's 1,690 pages.
	pages := filepath.Join(src, "pages.img")
	data, err := os.ReadFile(pages)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		copy(data[1<<20+i*(500<<10):], randBytes(uint64(100+i), 17*4096))
	}
	if err := os.WriteFile(pages, data, 0o640); err != nil {
		t.Fatal(err)
	}
	_, pts := loadTables(t, store, d1)
	var tables []*Table
	for _, pt := range pts {
		tables = append(tables, pt.Table)
	}
	d2, st2, err := Pack(ctx, src, store, PackOptions{Format: V2, Resolver: NewTableResolver(tables)})
	if err != nil {
		t.Fatal(err)
	}
	d3, _, err := Pack(ctx, src, store, PackOptions{Chunking: chunker.DefaultPageCDC(DefaultAvgChunkSizeV2)})
	if err != nil {
		t.Fatal(err)
	}
	s1, s2, s3 := readTableSets(t, store, d1), readTableSets(t, store, d2), readTableSets(t, store, d3)

	sum, err := InspectBase(ctx, store, d2, store, d1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("second against first: stored %d, reuse %+v, packs %+v; push uploaded %d bytes in %d packs, reused %d", sum.StoredBytes, *sum.Reuse, *sum.Reuse.Packs, st2.UploadedBytes, st2.BlobsUploaded, st2.ReusedBytes)
	want := wantReuse(s2, s1, true)
	checkReuse(t, "second against first", sum, want)
	// The rest of the summary is Inspect's.
	plain, err := Inspect(ctx, store, d2)
	if err != nil {
		t.Fatal(err)
	}
	without := *sum
	without.Reuse = nil
	if !reflect.DeepEqual(&without, plain) {
		t.Errorf("InspectBase's summary differs from Inspect's beyond Reuse:\n%+v\n%+v", without, *plain)
	}
	if r := sum.Reuse; r.Base != d1.Digest || r.BaseVersion != V2 {
		t.Errorf("base %s %v, want %s v2", r.Base, r.BaseVersion, d1.Digest)
	}
	// The packs new to the base are the ones Pack uploaded; the rewrite
	// left most chunks and some packs shared, and made some new.
	if p := sum.Reuse.Packs; p.New != st2.BlobsUploaded || p.NewBytes != st2.UploadedBytes {
		t.Errorf("%d new packs of %d bytes; Pack uploaded %d packs of %d bytes", p.New, p.NewBytes, st2.BlobsUploaded, st2.UploadedBytes)
	}
	if want.NewChunks == 0 || want.SharedChunks < 2*want.NewChunks || want.Packs.Shared == 0 || want.Packs.New == 0 {
		t.Errorf("the rewrite should leave most chunks and some packs shared: %+v, packs %+v", want, *want.Packs)
	}

	// Against itself, and a v2 snapshot against its v1 twin (same
	// chunking, so the same chunk digests; no packs to compare): nothing
	// new.
	for _, c := range []struct {
		what        string
		desc, base  ocispec.Descriptor
		s, baseSets tableSets
		packs       bool // both v2
		wantNew     bool
		baseVersion Version
	}{
		{"second against itself", d2, d2, s2, s2, true, false, V2},
		{"second against its v1 twin", d2, d3, s2, s3, false, false, V1},
		{"v1 twin against the second", d3, d2, s3, s2, false, false, V2},
		{"v1 twin against the first", d3, d1, s3, s1, false, true, V2},
	} {
		sum, err := InspectBase(ctx, store, c.desc, store, c.base)
		if err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		checkReuse(t, c.what, sum, wantReuse(c.s, c.baseSets, c.packs))
		r := sum.Reuse
		if (r.NewChunks > 0) != c.wantNew || (r.Packs != nil && r.Packs.New != 0) {
			t.Errorf("%s: %d new chunks (%d bytes), packs %+v", c.what, r.NewChunks, r.NewBytes, r.Packs)
		}
		if r.BaseVersion != c.baseVersion {
			t.Errorf("%s: base version %v", c.what, r.BaseVersion)
		}
	}

	// A base that cannot be read is an error that names it.
	missing := ocispec.Descriptor{MediaType: ocispec.MediaTypeImageIndex, Digest: digest.FromString("no such index"), Size: 13}
	if _, err := InspectBase(ctx, store, d2, store, missing); err == nil {
		t.Error("a missing base gave no error")
	} else if want := "base " + missing.Digest.String(); !strings.Contains(err.Error(), want) {
		t.Errorf("error %q does not name the base (%q)", err, want)
	}
}
