package profile_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

// plainRegistry starts distribution's own registry binary, which has no
// referrers API: oras-go falls back to the referrers tag schema there.
func plainRegistry(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	addr := testenv.FreeAddr(t)
	config := filepath.Join(dir, "config.yml")
	yaml := fmt.Sprintf("version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %q\n  delete:\n    enabled: true\nhttp:\n  addr: %q\n", filepath.Join(dir, "storage"), addr)
	if err := os.WriteFile(config, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	testenv.StartCommand(t, addr, testenv.Tool(t, "registry"), "serve", config)
	return addr
}

// snapshotIn pushes a small snapshot to addr/app:v1 and returns the
// repository and the snapshot's index descriptor.
func snapshotIn(t *testing.T, addr string, seed uint64) (*remote.Repository, ocispec.Descriptor) {
	t.Helper()
	ctx := context.Background()
	client, err := transfer.NewClient(transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	repo, _, err := client.Repository(addr + "/app:v1")
	if err != nil {
		t.Fatal(err)
	}
	res, err := transfer.Push(ctx, testenv.ImageDir(t, synth.Random, 1<<20, seed), repo, "v1", transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return repo, res.Descriptor
}

func profileOf(subject digest.Digest, offsets ...int64) *profile.Profile {
	p := &profile.Profile{MediaType: profile.MediaType, Subject: subject}
	for i, off := range offsets {
		p.Ranges = append(p.Ranges, profile.Range{Path: "pages.img", Offset: off, Length: 4096, AtMillis: int64(i)})
	}
	return p
}

// TestPushListFindMerge, on cryo's registry (referrers API) and on
// distribution's (the referrers tag schema): two profiles pushed are
// listed newest first and merged by Auto; ByDigest finds one.
func TestPushListFindMerge(t *testing.T) {
	for name, addr := range map[string]func(*testing.T) string{
		"cryo registry":                  func(t *testing.T) string { return testenv.StartRegistry(t, "").Addr },
		"registry without referrers API": plainRegistry,
	} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			repo, index := snapshotIn(t, addr(t), 1)
			older, err := profile.Push(ctx, repo, index, profileOf(index.Digest, 0, 8192), time.Unix(1000, 0))
			if err != nil {
				t.Fatal(err)
			}
			newer, err := profile.Push(ctx, repo, index, profileOf(index.Digest, 4096, 8192), time.Unix(2000, 0))
			if err != nil {
				t.Fatal(err)
			}
			descs, err := profile.List(ctx, repo, index)
			if err != nil {
				t.Fatal(err)
			}
			if len(descs) != 2 || descs[0].Digest != newer.Digest || descs[1].Digest != older.Digest {
				t.Fatalf("listed %v, want %s then %s", descs, newer.Digest, older.Digest)
			}
			p, info, warnings, err := profile.Auto{Repo: repo}.Find(ctx, index)
			if err != nil || len(warnings) != 0 {
				t.Fatalf("Find: %v %v", err, warnings)
			}
			if info.Digest != newer.Digest || info.Merged != 2 || info.Bytes != 3*4096 || p.Bytes() != 3*4096 {
				t.Errorf("found %+v (%d bytes), want the 2 merged, 3 pages", info, p.Bytes())
			}
			one, info, _, err := profile.ByDigest{Repo: repo, Digest: older.Digest}.Find(ctx, index)
			if err != nil || info.Merged != 1 || len(one.Ranges) != 2 || one.Ranges[0].Offset != 0 {
				t.Errorf("ByDigest: %+v %+v %v", one, info, err)
			}
		})
	}
}

// TestFindIgnoresBadProfiles: profiles that are corrupt, oversize, of
// another snapshot or not profiles at all are ignored with a warning each,
// and the good one is used; a snapshot with no profile finds nothing and
// no error, on a registry without the referrers API too.
func TestFindIgnoresBadProfiles(t *testing.T) {
	ctx := context.Background()
	addr := testenv.StartRegistry(t, "").Addr
	repo, index := snapshotIn(t, addr, 2)
	_, other := snapshotIn(t, addr, 3)
	sub := ocispec.Descriptor{MediaType: index.MediaType, Digest: index.Digest, Size: index.Size}

	// attach pushes a manifest with subject index and one layer of data.
	attach := func(layerType string, data []byte, layerSize int64, created string) {
		t.Helper()
		layer := content.NewDescriptorFromBytes(layerType, data)
		if err := repo.Push(ctx, layer, bytes.NewReader(data)); err != nil && !strings.Contains(err.Error(), "exists") {
			t.Fatal(err)
		}
		if layerSize != 0 {
			layer.Size = layerSize
		}
		if _, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, profile.ArtifactType, oras.PackManifestOptions{
			Subject: &sub, Layers: []ocispec.Descriptor{layer},
			ManifestAnnotations: map[string]string{ocispec.AnnotationCreated: created},
		}); err != nil {
			t.Fatal(err)
		}
	}
	attach(profile.MediaType, []byte(`{"mediaType": "application/vnd.cryo.profile.v1+json", "subject": 7}`), 0, "2026-01-01T00:00:05Z") // corrupt
	attach(profile.MediaType, []byte("{}"), profile.MaxSize+1, "2026-01-01T00:00:04Z")                                                  // oversize
	foreign, _ := profileOf(other.Digest, 0).Encode()
	attach(profile.MediaType, foreign, 0, "2026-01-01T00:00:03Z") // of another snapshot
	attach("application/octet-stream", []byte("x"), 0, "2026-01-01T00:00:02Z")
	good, err := profile.Push(ctx, repo, index, profileOf(index.Digest, 12288), time.Date(2026, 1, 1, 0, 0, 1, 0, time.UTC))
	if err != nil {
		t.Fatal(err)
	}
	p, info, warnings, err := profile.Auto{Repo: repo}.Find(ctx, index)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 4 {
		t.Errorf("warnings %q, want one per bad profile (4)", warnings)
	}
	if p == nil || info.Digest != good.Digest || info.Merged != 1 || len(p.Ranges) != 1 || p.Ranges[0].Offset != 12288 {
		t.Errorf("found %+v %+v, want the one good profile %s", p, info, good.Digest)
	}
	// Pushing a profile for another subject is refused.
	if _, err := profile.Push(ctx, repo, index, profileOf(other.Digest, 0), time.Now()); !errors.Is(err, profile.ErrInvalid) {
		t.Errorf("push of another snapshot's profile: %v, want ErrInvalid", err)
	}
	// No profiles at all, on a registry without the referrers API.
	plainRepo, plainIndex := snapshotIn(t, plainRegistry(t), 4)
	p, info, warnings, err = profile.Auto{Repo: plainRepo}.Find(ctx, plainIndex)
	if err != nil || p != nil || len(warnings) != 0 || info.Merged != 0 {
		t.Errorf("a snapshot without profiles: %+v %+v %v %v, want nothing", p, info, warnings, err)
	}
}
