package registry

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"io"
	"sync"

	"github.com/cryo-oci/cryo/format"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

// rewriter is a content.Storage in front of a repository (oras-go's client)
// that pushes what another pusher would: every chunk blob Pack pushes goes
// through rewrite, which may store other bytes for it, and the chunk tables,
// manifests and index that name a rewritten blob are fixed to name the new
// one. Pack pushes from several goroutines, hence the lock.
type rewriter struct {
	target  *remote.Repository
	rewrite chunkRewrite

	mu    sync.Mutex
	blobs map[digest.Digest]ocispec.Descriptor // blob Pack pushed -> blob stored
	n     int
}

// chunkRewrite returns the encoding and bytes to store instead of chunk blob
// data of media type mediaType, or nil bytes to store it as it is.
type chunkRewrite func(mediaType string, data []byte) (format.Encoding, []byte, error)

func newRewriter(target *remote.Repository, rewrite chunkRewrite) *rewriter {
	return &rewriter{target: target, rewrite: rewrite, blobs: map[digest.Digest]ocispec.Descriptor{}}
}

// count is the number of chunk blobs rewritten.
func (r *rewriter) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.n
}

func (r *rewriter) replaced(d digest.Digest) (ocispec.Descriptor, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	nd, ok := r.blobs[d]
	return nd, ok
}

func (r *rewriter) record(old digest.Digest, nd ocispec.Descriptor, chunk bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.blobs[old] = nd
	if chunk {
		r.n++
	}
}

func (r *rewriter) Exists(ctx context.Context, d ocispec.Descriptor) (bool, error) {
	return false, nil
}

func (r *rewriter) Fetch(ctx context.Context, d ocispec.Descriptor) (io.ReadCloser, error) {
	return r.target.Fetch(ctx, d)
}

func (r *rewriter) Push(ctx context.Context, d ocispec.Descriptor, rd io.Reader) error {
	data, err := io.ReadAll(rd)
	if err != nil {
		return err
	}
	fixed := func(v any) error {
		data, _ = json.Marshal(v)
		nd := content.NewDescriptorFromBytes(d.MediaType, data)
		nd.ArtifactType = d.ArtifactType
		r.record(d.Digest, nd, false)
		return r.target.Push(ctx, nd, bytes.NewReader(data))
	}
	switch d.MediaType {
	case format.MediaTypeChunkZstd, format.MediaTypeChunkRaw:
		enc, other, err := r.rewrite(d.MediaType, data)
		if err != nil || other == nil {
			if err != nil {
				return err
			}
			return r.target.Push(ctx, d, bytes.NewReader(data))
		}
		nd := content.NewDescriptorFromBytes(format.Chunk{Encoding: enc}.MediaType(), other)
		r.record(d.Digest, nd, true)
		return r.target.Push(ctx, nd, bytes.NewReader(other))
	case format.MediaTypeChunkTable:
		var tab format.Table
		if err := json.Unmarshal(data, &tab); err != nil {
			return err
		}
		for i, c := range tab.Chunks {
			if nd, ok := r.replaced(c.Blob); ok {
				tab.Chunks[i].Blob, tab.Chunks[i].BlobSize = nd.Digest, nd.Size
				if nd.MediaType == format.MediaTypeChunkZstd {
					tab.Chunks[i].Encoding = format.EncodingZstd
				}
			}
		}
		return fixed(tab)
	case ocispec.MediaTypeImageManifest:
		var m ocispec.Manifest
		if err := json.Unmarshal(data, &m); err != nil {
			return err
		}
		if nd, ok := r.replaced(m.Config.Digest); ok {
			m.Config.Digest, m.Config.Size = nd.Digest, nd.Size
		}
		for i, l := range m.Layers {
			if nd, ok := r.replaced(l.Digest); ok {
				m.Layers[i].MediaType, m.Layers[i].Digest, m.Layers[i].Size = nd.MediaType, nd.Digest, nd.Size
			}
		}
		return fixed(m)
	case ocispec.MediaTypeImageIndex:
		var idx ocispec.Index
		if err := json.Unmarshal(data, &idx); err != nil {
			return err
		}
		for i, m := range idx.Manifests {
			if nd, ok := r.replaced(m.Digest); ok {
				idx.Manifests[i].Digest, idx.Manifests[i].Size = nd.Digest, nd.Size
			}
		}
		return fixed(idx)
	}
	return r.target.Push(ctx, d, bytes.NewReader(data))
}

// reencodeZstd re-compresses zstd chunk blobs with another zstd level, as a
// pusher with another zstd version would: other blobs, same chunks.
func reencodeZstd(mediaType string, data []byte) (format.Encoding, []byte, error) {
	if mediaType != format.MediaTypeChunkZstd {
		return "", nil, nil
	}
	dec, err := zstd.NewReader(nil)
	if err != nil {
		return "", nil, err
	}
	plain, err := dec.DecodeAll(data, nil)
	dec.Close()
	if err != nil {
		return "", nil, err
	}
	enc, _ := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBestCompression))
	defer enc.Close()
	return format.EncodingZstd, enc.EncodeAll(plain, nil), nil
}

// poisonChunk stores junk instead of every chunk blob, claiming it is the
// chunk zstd-encoded: a table that lies.
func poisonChunk(mediaType string, data []byte) (format.Encoding, []byte, error) {
	return format.EncodingZstd, junk(data, len(data)/2+1), nil
}

// junk returns n bytes that are no zstd frame, different for each seed.
func junk(seed []byte, n int) []byte {
	sum := sha256.Sum256(seed)
	out := bytes.Repeat(sum[:], n/len(sum)+1)[:n]
	out[0] = 'J' // never the zstd magic number
	return out
}
