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
}

// Inspect loads the index and every chunk table of the snapshot desc (no
// chunk blobs) and summarizes them.
func Inspect(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor) (*Summary, error) {
	snap, err := LoadSnapshot(ctx, src, desc)
	if err != nil {
		return nil, err
	}
	sum := &Summary{Digest: desc.Digest, Annotations: snap.Annotations, LogicalBytes: snap.LogicalSize(), Version: snap.Version}
	all := map[digest.Digest]bool{}
	packs := map[digest.Digest]int64{}
	for i := range snap.Files {
		f := &snap.Files[i]
		fs := FileSummary{Path: f.Path, Size: f.Size, Mode: fmt.Sprintf("%04o", uint32(f.Mode.Perm())), Digest: f.Digest, Parts: len(f.Parts)}
		inFile := map[digest.Digest]bool{}
		for part := range f.Parts {
			pt, err := LoadPart(ctx, src, f, part)
			if err != nil {
				return nil, err
			}
			for _, c := range pt.Table.Chunks {
				fs.Chunks.add(c)
				sum.Chunks.add(c)
				if c.Encoding == EncodingZero {
					continue
				}
				// A chunk is stored once: as its own blob (v1) or as a
				// frame of a pack (v2).
				key := c.Blob
				if c.Packed() {
					key = c.Digest
					packs[c.Blob] = c.PackSize
				}
				if !inFile[key] {
					inFile[key] = true
					fs.StoredBytes += c.BlobSize
				}
				if !all[key] {
					all[key] = true
					sum.StoredBytes += c.BlobSize
				}
			}
		}
		sum.Files = append(sum.Files, fs)
	}
	sum.Blobs = len(all)
	if snap.Version == V2 {
		sum.Blobs = len(packs)
		for _, n := range packs {
			sum.PackBytes += n
		}
	}
	return sum, nil
}
