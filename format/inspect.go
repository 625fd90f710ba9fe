package format

import (
	"context"
	"fmt"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// EncodingCounts counts chunks, and their uncompressed bytes, by encoding.
type EncodingCounts struct {
	Zero      int   `json:"zero"`
	Raw       int   `json:"raw"`
	Zstd      int   `json:"zstd"`
	ZeroBytes int64 `json:"zeroBytes"`
	RawBytes  int64 `json:"rawBytes"`
	ZstdBytes int64 `json:"zstdBytes"`
}

// Total is the number of chunks.
func (e EncodingCounts) Total() int { return e.Zero + e.Raw + e.Zstd }

func (e *EncodingCounts) add(c Chunk) {
	switch c.Encoding {
	case EncodingZero:
		e.Zero++
		e.ZeroBytes += c.Size
	case EncodingRaw:
		e.Raw++
		e.RawBytes += c.Size
	case EncodingZstd:
		e.Zstd++
		e.ZstdBytes += c.Size
	}
}

// FileSummary describes one file of a snapshot.
type FileSummary struct {
	Path   string        `json:"path"`
	Size   int64         `json:"size"`
	Mode   string        `json:"mode"`
	Digest digest.Digest `json:"digest"`
	Parts  int           `json:"parts"`
	// Chunks counts the file's chunks by encoding.
	Chunks EncodingCounts `json:"chunks"`
	// StoredBytes is the size of the distinct blobs the file uses.
	StoredBytes int64 `json:"storedBytes"`
}

// Summary describes a snapshot: what inspect prints.
type Summary struct {
	Digest       digest.Digest     `json:"digest"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	Files        []FileSummary     `json:"files"`
	LogicalBytes int64             `json:"logicalBytes"`
	// StoredBytes is the size of the distinct chunk blobs of the snapshot,
	// what a registry holding nothing else would store for its chunks.
	StoredBytes int64 `json:"storedBytes"`
	// Blobs is the number of distinct chunk blobs (format v2: packs).
	Blobs  int            `json:"blobs"`
	Chunks EncodingCounts `json:"chunks"`
	// Version is the snapshot's format.
	Version Version `json:"version"`
	// PackBytes (format v2) is the size of the packs the snapshot lists:
	// StoredBytes plus the frames of other snapshots' chunks in the packs
	// it shares with them.
	PackBytes int64 `json:"packBytes,omitempty"`
	// Reuse is what the snapshot shares with a base snapshot; set only by
	// InspectBase.
	Reuse *Reuse `json:"reuse,omitempty"`
}

// Reuse is what a snapshot shares with another one, its base: what a node
// that holds the base's chunks must still fetch, and what a registry that
// holds the base stored for the snapshot. Chunks are compared by digest,
// so across formats; packs only between two v2 snapshots.
type Reuse struct {
	// Base is the digest of the base's index, BaseVersion its format.
	Base        digest.Digest `json:"base"`
	BaseVersion Version       `json:"baseVersion"`
	// SharedChunks counts the snapshot's stored chunks (the non-zero ones,
	// each counted once, as Summary.StoredBytes counts them) whose digest
	// the base holds too; SharedBytes is their stored size in this
	// snapshot.
	SharedChunks int   `json:"sharedChunks"`
	SharedBytes  int64 `json:"sharedBytes"`
	// NewChunks and NewBytes are the other stored chunks and their size:
	// what a node holding the base's chunks still fetches (before a
	// reader's coalescing of frames). SharedBytes + NewBytes is
	// Summary.StoredBytes.
	NewChunks int   `json:"newChunks"`
	NewBytes  int64 `json:"newBytes"`
	// Packs compares the packs of two v2 snapshots; nil if either is v1.
	Packs *PackReuse `json:"packs,omitempty"`
}

// PackReuse splits the packs a v2 snapshot lists into those its v2 base
// lists too and the others.
type PackReuse struct {
	// Shared counts the packs the base lists too, SharedBytes their size.
	Shared      int   `json:"shared"`
	SharedBytes int64 `json:"sharedBytes"`
	// New counts the packs the base does not list, NewBytes their size:
	// what a registry holding the base stored for this snapshot.
	// SharedBytes + NewBytes is Summary.PackBytes.
	New      int   `json:"new"`
	NewBytes int64 `json:"newBytes"`
}

// Inspect loads the index and every chunk table of the snapshot desc (no
// chunk blobs) and summarizes them.
func Inspect(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor) (*Summary, error) {
	sum, _, err := inspect(ctx, src, desc)
	return sum, err
}

// InspectBase is Inspect, and also compares the snapshot with the snapshot
// base in baseSrc (Summary.Reuse), loading the base's index and chunk
// tables too (no chunk blobs). The two may be of different formats.
func InspectBase(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, baseSrc content.Fetcher, base ocispec.Descriptor) (*Summary, error) {
	sum, st, err := inspect(ctx, src, desc)
	if err != nil {
		return nil, err
	}
	baseSnap, err := LoadSnapshot(ctx, baseSrc, base)
	if err != nil {
		return nil, fmt.Errorf("base %s: %w", base.Digest, err)
	}
	baseChunks := map[digest.Digest]bool{}
	basePacks := map[digest.Digest]bool{}
	err = eachChunk(ctx, baseSrc, baseSnap, func(_ int, c Chunk) {
		if c.Encoding == EncodingZero {
			return
		}
		baseChunks[c.Digest] = true
		if c.Packed() {
			basePacks[c.Blob] = true
		}
	})
	if err != nil {
		return nil, fmt.Errorf("base %s: %w", base.Digest, err)
	}
	r := &Reuse{Base: base.Digest, BaseVersion: baseSnap.Version}
	for _, c := range st.stored {
		if baseChunks[c.Digest] {
			r.SharedChunks++
			r.SharedBytes += c.BlobSize
		} else {
			r.NewChunks++
			r.NewBytes += c.BlobSize
		}
	}
	if sum.Version == V2 && baseSnap.Version == V2 {
		r.Packs = &PackReuse{}
		for pack, size := range st.packs {
			if basePacks[pack] {
				r.Packs.Shared++
				r.Packs.SharedBytes += size
			} else {
				r.Packs.New++
				r.Packs.NewBytes += size
			}
		}
	}
	sum.Reuse = r
	return sum, nil
}

// stored is what a snapshot stores: by the key it is stored under (v1:
// blob digest, v2: chunk digest), the entry of each non-zero chunk, and
// the size of each pack (v2).
type stored struct {
	stored map[digest.Digest]Chunk
	packs  map[digest.Digest]int64
}

func inspect(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor) (*Summary, *stored, error) {
	snap, err := LoadSnapshot(ctx, src, desc)
	if err != nil {
		return nil, nil, err
	}
	sum := &Summary{Digest: desc.Digest, Annotations: snap.Annotations, LogicalBytes: snap.LogicalSize(), Version: snap.Version}
	st := &stored{stored: map[digest.Digest]Chunk{}, packs: map[digest.Digest]int64{}}
	for i := range snap.Files {
		f := &snap.Files[i]
		sum.Files = append(sum.Files, FileSummary{Path: f.Path, Size: f.Size, Mode: fmt.Sprintf("%04o", uint32(f.Mode.Perm())), Digest: f.Digest, Parts: len(f.Parts)})
	}
	inFile := map[digest.Digest]bool{}
	last := -1
	err = eachChunk(ctx, src, snap, func(i int, c Chunk) {
		fs := &sum.Files[i]
		if i != last {
			clear(inFile)
			last = i
		}
		fs.Chunks.add(c)
		sum.Chunks.add(c)
		if c.Encoding == EncodingZero {
			return
		}
		// A chunk is stored once: as its own blob (v1) or as a frame of a
		// pack (v2).
		key := c.Blob
		if c.Packed() {
			key = c.Digest
			st.packs[c.Blob] = c.PackSize
		}
		if !inFile[key] {
			inFile[key] = true
			fs.StoredBytes += c.BlobSize
		}
		if _, ok := st.stored[key]; !ok {
			st.stored[key] = c
			sum.StoredBytes += c.BlobSize
		}
	})
	if err != nil {
		return nil, nil, err
	}
	sum.Blobs = len(st.stored)
	if snap.Version == V2 {
		sum.Blobs = len(st.packs)
		for _, n := range st.packs {
			sum.PackBytes += n
		}
	}
	return sum, st, nil
}

// eachChunk loads the chunk tables of snap's parts, in order, and calls fn
// with the index of the file and each chunk of the part.
func eachChunk(ctx context.Context, src content.Fetcher, snap *Snapshot, fn func(file int, c Chunk)) error {
	for i := range snap.Files {
		f := &snap.Files[i]
		for part := range f.Parts {
			pt, err := LoadPart(ctx, src, f, part)
			if err != nil {
				return err
			}
			for _, c := range pt.Table.Chunks {
				fn(i, c)
			}
		}
	}
	return nil
}
