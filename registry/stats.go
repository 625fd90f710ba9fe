package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Stats describe what a registry stores.
type Stats struct {
	// Blobs and BlobBytes count every stored blob once.
	Blobs     int   `json:"blobs"`
	BlobBytes int64 `json:"blobBytes"`
	// Repositories is the number of repositories.
	Repositories int `json:"repositories"`
	// Snapshots counts distinct cryo snapshot indexes; LogicalBytes sums
	// their file sizes.
	Snapshots    int   `json:"snapshots"`
	LogicalBytes int64 `json:"logicalBytes"`
	// ChunkBlobs and ChunkBlobBytes count the distinct chunk blobs the
	// snapshots use.
	ChunkBlobs     int   `json:"chunkBlobs"`
	ChunkBlobBytes int64 `json:"chunkBlobBytes"`
}

// DedupRatio is LogicalBytes / ChunkBlobBytes: how many bytes of snapshots
// each stored chunk byte serves (compression and dedup together).
func (s *Stats) DedupRatio() float64 {
	if s.ChunkBlobBytes == 0 {
		return 0
	}
	return float64(s.LogicalBytes) / float64(s.ChunkBlobBytes)
}

// Stats walks the storage and counts blobs, repositories and snapshots. It
// reads every manifest: it is meant for metrics scraped now and then and
// for `cryo registry stats`, not for a request path.
func (s *Server) Stats(ctx context.Context) (*Stats, error) {
	st := &Stats{}
	statter := s.ns.BlobStatter()
	err := s.ns.Blobs().Enumerate(ctx, func(d digest.Digest) error {
		desc, err := statter.Stat(ctx, d)
		if err != nil {
			return nil // deleted meanwhile
		}
		st.Blobs++
		st.BlobBytes += desc.Size
		return nil
	})
	if err != nil && !extstore.IsNotFound(err) {
		return nil, fmt.Errorf("enumerate blobs: %w", err)
	}
	seenIndex := map[digest.Digest]bool{}
	seenChunk := map[digest.Digest]bool{}
	err = s.eachManifest(ctx, func(string) { st.Repositories++ }, func(_ string, d digest.Digest, mt string, payload []byte) error {
		switch mt {
		case ocispec.MediaTypeImageIndex:
			if !seenIndex[d] {
				seenIndex[d] = true
				st.addSnapshot(payload)
			}
		case ocispec.MediaTypeImageManifest:
			st.addChunks(payload, seenChunk)
		}
		return nil
	}, nil)
	if err != nil && !errors.Is(err, errNoEnumeration) {
		return nil, err
	}
	return st, nil
}

// errNoEnumeration is eachManifest's error for a storage whose
// namespace cannot list its repositories.
var errNoEnumeration = errors.New("the registry's storage cannot list its repositories")

// eachManifest calls repo with the name of every repository in the
// storage, then fn with each manifest stored in it (its digest, media
// type and bytes). Manifests deleted meanwhile are skipped; a manifest
// that cannot be read or parsed goes to fail, if set (else it is
// skipped too).
func (s *Server) eachManifest(ctx context.Context, repo func(name string), fn func(repo string, d digest.Digest, mediaType string, payload []byte) error, fail func(repo string, d digest.Digest, err error)) error {
	enum, ok := s.ns.(distribution.RepositoryEnumerator)
	if !ok {
		return errNoEnumeration
	}
	if fail == nil {
		fail = func(string, digest.Digest, error) {}
	}
	err := enum.Enumerate(ctx, func(name string) error {
		repo(name)
		named, err := reference.WithName(name)
		if err != nil {
			fail(name, "", err)
			return nil
		}
		r, err := s.ns.Repository(ctx, named)
		if err != nil {
			return fmt.Errorf("repository %s: %w", name, err)
		}
		ms, err := r.Manifests(ctx)
		if err != nil {
			return fmt.Errorf("manifests of %s: %w", name, err)
		}
		me, ok := ms.(distribution.ManifestEnumerator)
		if !ok {
			return fmt.Errorf("manifests of %s: %w", name, errNoEnumeration)
		}
		err = me.Enumerate(ctx, func(d digest.Digest) error {
			m, err := ms.Get(ctx, d)
			var unknown distribution.ErrManifestUnknownRevision
			if errors.As(err, &unknown) || extstore.IsNotFound(err) {
				return nil // deleted meanwhile
			}
			if err != nil {
				fail(name, d, err)
				return nil
			}
			mt, payload, err := m.Payload()
			if err != nil {
				fail(name, d, err)
				return nil
			}
			return fn(name, d, mt, payload)
		})
		if err != nil && !extstore.IsNotFound(err) {
			return fmt.Errorf("manifests of %s: %w", name, err)
		}
		return nil
	})
	if err != nil && !extstore.IsNotFound(err) {
		return fmt.Errorf("enumerate repositories: %w", err)
	}
	return nil
}

// countBlobs counts the stored blobs and their bytes (for gc).
func (s *Server) countBlobs(ctx context.Context) (int, int64, error) {
	st, err := s.Stats(ctx)
	if err != nil {
		return 0, 0, err
	}
	return st.Blobs, st.BlobBytes, nil
}

func (st *Stats) addSnapshot(payload []byte) {
	var idx ocispec.Index
	if json.Unmarshal(payload, &idx) != nil || !format.IsSnapshotArtifactType(idx.ArtifactType) {
		return
	}
	st.Snapshots++
	for _, m := range idx.Manifests {
		if n, err := strconv.ParseInt(m.Annotations[format.AnnotationPartLength], 10, 64); err == nil {
			st.LogicalBytes += n
		}
	}
}

func (st *Stats) addChunks(payload []byte, seen map[digest.Digest]bool) {
	var m ocispec.Manifest
	if json.Unmarshal(payload, &m) != nil || !format.IsFileArtifactType(m.ArtifactType) {
		return
	}
	for _, l := range m.Layers {
		if (l.MediaType == format.MediaTypeChunkRaw || l.MediaType == format.MediaTypeChunkZstd || l.MediaType == format.MediaTypePack) && !seen[l.Digest] {
			seen[l.Digest] = true
			st.ChunkBlobs++
			st.ChunkBlobBytes += l.Size
		}
	}
}
