package chunkindex_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/chunkindex"
	"github.com/distribution/distribution/v3"
	"github.com/distribution/distribution/v3/registry/storage/driver"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// TestReadErrorKeepsSharedIndexState has repository b push a table
// naming a pack a recorded while every read of the index fails (a storage
// timeout): the push's indexing must fail, not overwrite the pack's list
// and anchor with b's view, so that a caller who may pull only from a
// still finds the frame.
func TestReadErrorKeepsSharedIndexState(t *testing.T) {
	var fd *flaky
	e := newEnvWith(t, chunkindex.Options{}, func(d driver.StorageDriver) driver.StorageDriver {
		fd = &flaky{StorageDriver: d}
		return fd
	})
	ctx := e.ctx
	f := e.zstdPack("a", "shared-data-")
	if err := e.pushTable("a", []frame{f}); err != nil {
		t.Fatal(err)
	}
	e.zstdPack("b", "shared-data-") // the same bytes, uploaded to b
	fd.fail.Store(true)
	if err := e.pushTable("b", []frame{f}); err == nil {
		t.Error("indexing b's table while the index cannot be read succeeded")
	}
	fd.fail.Store(false)
	onlyA := func(r string) bool { return r == "a" }
	resp, err := e.ci.Compose(ctx, "a", []api.ComposeChunk{{Digest: f.chunk, Size: f.size}}, 0, onlyA)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Frames) == 0 {
		l, _ := e.driver.GetContent(ctx, chunkindex.PackListPath(f.pack.Digest))
		t.Errorf("repository a's frame lost after a failed read during b's push; the pack's list: %s", l)
	}
}

// flaky fails GetContent under /cryo/v1/ while fail is set (a storage timeout).
type flaky struct {
	driver.StorageDriver
	fail atomic.Bool
}

func (f *flaky) GetContent(ctx context.Context, p string) ([]byte, error) {
	if f.fail.Load() && strings.HasPrefix(p, "/cryo/v1/") {
		return nil, errors.New("storage timeout")
	}
	return f.StorageDriver.GetContent(ctx, p)
}

// env indexes tables and packs in one in-memory registry.
type env struct {
	t      *testing.T
	driver driver.StorageDriver
	ctx    context.Context
	ns     distribution.Namespace
	ci     *chunkindex.Index
	codec  *format.Codec
}

// put uploads data to repo as a pack.
func (e *env) put(repo string, data []byte) ocispec.Descriptor {
	named, _ := reference.WithName(repo)
	r, err := e.ns.Repository(e.ctx, named)
	if err != nil {
		e.t.Fatal(err)
	}
	desc, err := r.Blobs(e.ctx).Put(e.ctx, format.MediaTypePack, data)
	if err != nil {
		e.t.Fatal(err)
	}
	return desc
}

// frame is one chunk's frame: chunk digest/size, pack, offset, length.
type frame struct {
	chunk  digest.Digest
	size   int64
	pack   ocispec.Descriptor
	length int64
	offset int64 // in the pack
}

// pushTable records a v2 table listing frames (each at its offset in its
// pack) in repo, and returns IndexManifest's error.
func (e *env) pushTable(repo string, frames []frame) error {
	tab := &format.Table{Path: "f", Mode: 0o600, Digest: digest.FromString("whole"), Parts: 1, Version: format.V2}
	seen := map[digest.Digest]bool{}
	var off int64
	for _, f := range frames {
		tab.Chunks = append(tab.Chunks, format.Chunk{Offset: off, Size: f.size, Encoding: format.EncodingZstd, Digest: f.chunk,
			Blob: f.pack.Digest, BlobSize: f.length, PackSize: f.pack.Size, PackOffset: f.offset})
		if !seen[f.pack.Digest] {
			seen[f.pack.Digest] = true
			tab.Packs = append(tab.Packs, ocispec.Descriptor{MediaType: format.MediaTypePack, Digest: f.pack.Digest, Size: f.pack.Size})
		}
		off += f.size
	}
	tab.Size, tab.Length = off, off
	data, err := tab.Marshal()
	if err != nil {
		e.t.Fatal(err)
	}
	cfg := e.put(repo, data)
	m := ocispec.Manifest{ArtifactType: format.ArtifactTypeFileV2, Config: ocispec.Descriptor{MediaType: format.MediaTypeChunkTableV2, Digest: cfg.Digest, Size: cfg.Size}}
	body, _ := json.Marshal(m)
	return e.ci.IndexManifest(e.ctx, repo, body)
}

// zstdPack makes a pack of one zstd frame of a 4 KiB chunk.
func (e *env) zstdPack(repo, seed string) frame {
	f, enc := e.zstdFrame(seed)
	f.pack = e.put(repo, enc)
	return f
}

// zstdFrame returns the zstd frame of a 4 KiB chunk made of seed, and its
// bytes (f.pack unset).
func (e *env) zstdFrame(seed string) (frame, []byte) {
	chunk := bytes.Repeat([]byte(seed), 4096/len(seed)+1)[:4096]
	ch := format.Chunk{Size: 4096, Encoding: format.EncodingZstd, Digest: digest.FromBytes(chunk)}
	got, enc := e.codec.Compress(ch, chunk, nil)
	if got.Encoding != format.EncodingZstd {
		e.t.Fatal("not compressed")
	}
	return frame{chunk: ch.Digest, size: 4096, length: int64(len(enc))}, enc
}
