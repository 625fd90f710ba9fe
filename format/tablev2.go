package format

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// MaxPackSize bounds a pack blob. A reader refuses a table naming a larger
// one before fetching anything; a registry that ignores Range sends the
// whole pack, so this also bounds what one read can cost.
const MaxPackSize = 16 << 20

// DefaultPackSize is the size a writer fills packs to (SPEC.md 15.3).
const DefaultPackSize = 4 << 20

// DefaultAvgChunkSizeV2 is the mean chunk size of format v2. SPEC.md
// section 15 gives the measurements behind it.
const DefaultAvgChunkSizeV2 = 64 << 10

// tableV2 is a v2 chunk table as it is written: the pack list, then the
// chunks, whose offsets are implied (each starts where the one before
// ends) and whose packs are indices into the list.
type tableV2 struct {
	Path    string         `json:"path"`
	Size    int64          `json:"size"`
	Mode    uint32         `json:"mode"`
	Digest  digest.Digest  `json:"digest"`
	Part    int            `json:"part"`
	Parts   int            `json:"parts"`
	Offset  int64          `json:"offset"`
	Length  int64          `json:"length"`
	Chunker chunker.Params `json:"chunker"`
	Packs   []packRef      `json:"packs"`
	Chunks  []chunkV2      `json:"chunks"`
}

// packRef names a pack in a v2 table.
type packRef struct {
	Digest digest.Digest `json:"digest"`
	Size   int64         `json:"size"`
}

// chunkV2 is one chunk of a v2 table. The pointers are nil for zero
// chunks, which have no frame.
type chunkV2 struct {
	Size       int64         `json:"size"`
	Encoding   Encoding      `json:"encoding"`
	Digest     digest.Digest `json:"digest,omitempty"`
	Pack       *int          `json:"pack,omitempty"`
	PackOffset *int64        `json:"packOffset,omitempty"`
	PackLength *int64        `json:"packLength,omitempty"`
}

// marshalV2 writes t as a v2 chunk table. Its chunks' packs must be in
// t.Packs.
func (t *Table) marshalV2() ([]byte, error) {
	w := tableV2{Path: t.Path, Size: t.Size, Mode: t.Mode, Digest: t.Digest, Part: t.Part, Parts: t.Parts,
		Offset: t.Offset, Length: t.Length, Chunker: t.Chunker, Packs: []packRef{}, Chunks: make([]chunkV2, len(t.Chunks))}
	index := make(map[digest.Digest]int, len(t.Packs))
	for i, p := range t.Packs {
		index[p.Digest] = i
		w.Packs = append(w.Packs, packRef{Digest: p.Digest, Size: p.Size})
	}
	for i, c := range t.Chunks {
		w.Chunks[i] = chunkV2{Size: c.Size, Encoding: c.Encoding, Digest: c.Digest}
		if c.Encoding == EncodingZero {
			continue
		}
		p, ok := index[c.Blob]
		if !ok {
			return nil, fmt.Errorf("chunk %d's pack %s is not in the table's packs", i, c.Blob)
		}
		off, n := c.PackOffset, c.BlobSize
		w.Chunks[i].Pack, w.Chunks[i].PackOffset, w.Chunks[i].PackLength = &p, &off, &n
	}
	return json.Marshal(w)
}

// ParseTableV2 decodes and validates a v2 chunk table. The chunks it
// returns carry their offsets and their packs' digests and sizes.
func ParseTableV2(data []byte) (*Table, error) {
	var w tableV2
	if err := decodeTable(data, &w); err != nil {
		return nil, err
	}
	t := &Table{Path: w.Path, Size: w.Size, Mode: w.Mode, Digest: w.Digest, Part: w.Part, Parts: w.Parts,
		Offset: w.Offset, Length: w.Length, Chunker: w.Chunker, Version: V2}
	if err := ValidatePath(t.Path); err != nil {
		return nil, err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("chunk table of %q: %s: %w", t.Path, fmt.Sprintf(format, args...), ErrInvalid)
	}
	if len(w.Chunks) > MaxChunksPerPart {
		return nil, fmt.Errorf("chunk table of %q: %d chunks: %w (limit %d)", t.Path, len(w.Chunks), ErrTooLarge, MaxChunksPerPart)
	}
	if len(w.Packs) > len(w.Chunks) {
		return nil, bad("%d packs for %d chunks", len(w.Packs), len(w.Chunks))
	}
	seen := make(map[digest.Digest]bool, len(w.Packs))
	for i, p := range w.Packs {
		if err := validSHA256(p.Digest); err != nil {
			return nil, bad("pack %d: %v", i, err)
		}
		if p.Size <= 0 || p.Size > MaxPackSize {
			return nil, bad("pack %d (%s) has %d bytes, want 1..%d", i, p.Digest, p.Size, MaxPackSize)
		}
		if seen[p.Digest] {
			return nil, bad("pack %s listed twice", p.Digest)
		}
		seen[p.Digest] = true
		t.Packs = append(t.Packs, ocispec.Descriptor{MediaType: MediaTypePack, Digest: p.Digest, Size: p.Size})
	}
	used := make([]bool, len(w.Packs))
	t.Chunks = make([]Chunk, len(w.Chunks))
	off := t.Offset
	for i, wc := range w.Chunks {
		c := Chunk{Offset: off, Size: wc.Size, Encoding: wc.Encoding, Digest: wc.Digest}
		if wc.Size <= 0 || wc.Size > MaxChunkSize {
			return nil, bad("chunk %d has size %d, want 1..%d", i, wc.Size, MaxChunkSize)
		}
		if off > t.Offset+t.Length-wc.Size {
			return nil, bad("chunk %d ends past the part's end at %d", i, t.Offset+t.Length)
		}
		if wc.Encoding != EncodingZero {
			if wc.Pack == nil || wc.PackOffset == nil || wc.PackLength == nil {
				return nil, bad("chunk %d (%s) lacks pack, packOffset or packLength", i, wc.Encoding)
			}
			if *wc.Pack < 0 || *wc.Pack >= len(w.Packs) {
				return nil, bad("chunk %d names pack %d of %d", i, *wc.Pack, len(w.Packs))
			}
			p := w.Packs[*wc.Pack]
			used[*wc.Pack] = true
			c.Blob, c.PackSize, c.PackOffset, c.BlobSize = p.Digest, p.Size, *wc.PackOffset, *wc.PackLength
		} else if wc.Pack != nil || wc.PackOffset != nil || wc.PackLength != nil {
			return nil, bad("zero chunk %d names a pack", i)
		}
		if err := c.validateEncoding(); err != nil {
			return nil, bad("chunk %d: %v", i, err)
		}
		t.Chunks[i] = c
		off += wc.Size
	}
	if off != t.Offset+t.Length {
		return nil, bad("chunks end at %d, part ends at %d", off, t.Offset+t.Length)
	}
	for i, u := range used {
		if !u {
			return nil, bad("pack %d (%s) is used by no chunk", i, w.Packs[i].Digest)
		}
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	return t, nil
}

// validateFrame checks a packed chunk's frame: inside its pack, of a
// length its encoding allows.
func (c Chunk) validateFrame() error {
	if err := validSHA256(c.Blob); err != nil {
		return fmt.Errorf("pack: %v", err)
	}
	if c.PackSize <= 0 || c.PackSize > MaxPackSize {
		return fmt.Errorf("pack %s of %d bytes, want 1..%d", c.Blob, c.PackSize, MaxPackSize)
	}
	if c.PackOffset < 0 || c.BlobSize <= 0 || c.PackOffset > c.PackSize-c.BlobSize {
		return fmt.Errorf("frame [%d,+%d) outside pack %s of %d bytes", c.PackOffset, c.BlobSize, c.Blob, c.PackSize)
	}
	switch c.Encoding {
	case EncodingRaw:
		if c.BlobSize != c.Size {
			return fmt.Errorf("raw frame of %d bytes for a chunk of %d bytes", c.BlobSize, c.Size)
		}
	case EncodingZstd:
		if c.BlobSize >= c.Size {
			return fmt.Errorf("zstd frame of %d bytes for a chunk of %d bytes", c.BlobSize, c.Size)
		}
	}
	return nil
}

// CompressTable returns the stored bytes of a v2 table's JSON data: one
// zstd frame, at ZstdLevelV2Tables for a NewCodecV2 codec (the same table
// gives the same bytes with the same library version). Tables hold a hex
// digest per chunk and compress to about a quarter (docs/benchmarks.md).
func (c *Codec) CompressTable(data []byte) []byte {
	enc := c.enc
	if c.tables != nil {
		enc = c.tables
	}
	return enc.EncodeAll(data, make([]byte, 0, len(data)/2))
}

// DecodeTableBlob returns the JSON of a chunk table stored as mediaType:
// data itself, or, for MediaTypeChunkTableV2Zstd, data decompressed. A
// compressed table must be exactly one zstd frame (SingleZstdFrame) with a
// window of at most 2 x MaxTableSize (zstd's streaming writers use 8 MiB)
// that decodes to at most MaxTableSize bytes: a frame whose header says
// more is refused before it is decoded, and decoding stops at
// 2 x MaxTableSize whatever the header says.
func DecodeTableBlob(mediaType string, data []byte) ([]byte, error) {
	if mediaType != MediaTypeChunkTableV2Zstd {
		return data, nil
	}
	if err := SingleZstdFrame(data); err != nil {
		return nil, fmt.Errorf("compressed chunk table: %w", err)
	}
	var h zstd.Header
	if err := h.Decode(data); err != nil {
		return nil, fmt.Errorf("compressed chunk table: %v: %w", err, ErrInvalid)
	}
	if h.HasFCS && h.FrameContentSize > MaxTableSize {
		return nil, fmt.Errorf("compressed chunk table decodes to %d bytes: %w (limit %d)", h.FrameContentSize, ErrTooLarge, MaxTableSize)
	}
	dec, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(2*MaxTableSize),
		zstd.WithDecoderMaxWindow(2*MaxTableSize))
	if err != nil {
		return nil, fmt.Errorf("zstd decoder: %w", err)
	}
	defer dec.Close()
	out, err := dec.DecodeAll(data, nil)
	switch {
	case errors.Is(err, zstd.ErrDecoderSizeExceeded) || errors.Is(err, zstd.ErrWindowSizeExceeded) || (err == nil && len(out) > MaxTableSize):
		return nil, fmt.Errorf("compressed chunk table decodes to more than %d bytes: %w", MaxTableSize, ErrTooLarge)
	case err != nil:
		return nil, fmt.Errorf("decompress chunk table: %v: %w", err, ErrInvalid)
	}
	return out, nil
}
