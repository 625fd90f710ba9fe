package format

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strings"
	"unicode/utf8"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Encoding says how a chunk's bytes are stored.
type Encoding string

// The chunk encodings.
const (
	// EncodingZero is an all-zero chunk: no blob at all.
	EncodingZero Encoding = "zero"
	// EncodingRaw is a chunk stored as is: its blob digest is its digest.
	EncodingRaw Encoding = "raw"
	// EncodingZstd is a chunk stored as one zstd frame.
	EncodingZstd Encoding = "zstd"
)

// Chunk is one entry of a chunk table: a range of a file and how it is stored.
type Chunk struct {
	// Offset is where the chunk starts in the file.
	Offset int64 `json:"offset"`
	// Size is the chunk's uncompressed length.
	Size int64 `json:"size"`
	// Encoding says how the chunk is stored.
	Encoding Encoding `json:"encoding"`
	// Digest is the sha256 of the uncompressed bytes: the chunk's identity.
	// Empty for zero chunks.
	Digest digest.Digest `json:"digest,omitempty"`
	// Blob is the digest of the stored bytes. Empty for zero chunks, equal
	// to Digest for raw chunks.
	Blob digest.Digest `json:"blob,omitempty"`
	// BlobSize is the length of the stored bytes; 0 for zero chunks. In
	// format v2 these are a frame of the pack Blob.
	BlobSize int64 `json:"blobSize,omitempty"`
	// PackOffset is where the chunk's stored bytes start in its blob, a
	// pack (format v2); 0 in v1, where the blob holds the chunk alone.
	PackOffset int64 `json:"-"`
	// PackSize is the size of the pack blob holding the chunk's frame
	// (format v2); 0 in v1.
	PackSize int64 `json:"-"`
}

// Packed reports whether the chunk is stored as a frame of a pack (format
// v2) rather than as a blob of its own.
func (c Chunk) Packed() bool { return c.PackSize > 0 }

// End is the offset just past the chunk.
func (c Chunk) End() int64 { return c.Offset + c.Size }

// MediaType is the media type of the chunk's blob, or "" for zero chunks.
func (c Chunk) MediaType() string {
	if c.Packed() {
		return MediaTypePack
	}
	switch c.Encoding {
	case EncodingRaw:
		return MediaTypeChunkRaw
	case EncodingZstd:
		return MediaTypeChunkZstd
	}
	return ""
}

// Table is a chunk table: the config blob of a file part's manifest. It
// describes the whole file (path, size, mode, digest) and, in order, the
// chunks of the part.
type Table struct {
	// Path is the file's slash-separated path in the image dir.
	Path string `json:"path"`
	// Size is the size of the whole file.
	Size int64 `json:"size"`
	// Mode is the file's permission bits.
	Mode uint32 `json:"mode"`
	// Digest is the sha256 of the whole file.
	Digest digest.Digest `json:"digest"`
	// Part is the index of this part, from 0.
	Part int `json:"part"`
	// Parts is the number of parts of the file.
	Parts int `json:"parts"`
	// Offset is where this part starts in the file.
	Offset int64 `json:"offset"`
	// Length is the number of bytes this part covers.
	Length int64 `json:"length"`
	// Chunker records how the chunks were cut. Readers do not need it.
	Chunker chunker.Params `json:"chunker"`
	// Chunks are the part's chunks in file order, contiguous from Offset.
	Chunks []Chunk `json:"chunks"`
	// Version is the format the table was read or is written in (0: V1).
	Version Version `json:"-"`
	// Packs are the packs the chunks' frames lie in, in order of first
	// use (format v2; the part manifest's layers).
	Packs []ocispec.Descriptor `json:"-"`
}

// Marshal encodes the table in its format version.
func (t *Table) Marshal() ([]byte, error) {
	if t.Version == V2 {
		return t.marshalV2()
	}
	return json.Marshal(t)
}

// decodeTable decodes chunk table data (either version) into v: at most
// MaxTableSize bytes, one JSON object with exact, unique keys
// (strictUnmarshal).
func decodeTable(data []byte, v any) error {
	if len(data) > MaxTableSize {
		return fmt.Errorf("chunk table of %d bytes: %w (limit %d)", len(data), ErrTooLarge, MaxTableSize)
	}
	if err := strictUnmarshal(data, v); err != nil {
		return fmt.Errorf("decode chunk table: %v: %w", err, ErrInvalid)
	}
	return nil
}

// ParseTable decodes and validates a chunk table.
func ParseTable(data []byte) (*Table, error) {
	var t Table
	if err := decodeTable(data, &t); err != nil {
		return nil, err
	}
	if t.Chunks == nil {
		return nil, fmt.Errorf("chunk table of %q has no chunks array (an empty part has \"chunks\":[]): %w", t.Path, ErrInvalid)
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	return &t, nil
}

// Validate checks every rule SPEC.md sets for a chunk table.
func (t *Table) Validate() error {
	if err := ValidatePath(t.Path); err != nil {
		return err
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("chunk table of %q: %s: %w", t.Path, fmt.Sprintf(format, args...), ErrInvalid)
	}
	switch {
	case t.Size < 0:
		return bad("negative file size %d", t.Size)
	case t.Mode&^uint32(fs.ModePerm) != 0:
		return bad("mode %o has bits other than permissions", t.Mode)
	case validSHA256(t.Digest) != nil:
		return bad("file digest: %v", validSHA256(t.Digest))
	case t.Parts < 1 || t.Parts > MaxParts || t.Part < 0 || t.Part >= t.Parts:
		return bad("part %d of %d", t.Part, t.Parts)
	case t.Offset < 0 || t.Length < 0 || t.Offset > t.Size || t.Length > t.Size-t.Offset:
		return bad("part range [%d,+%d) outside file of %d bytes", t.Offset, t.Length, t.Size)
	case len(t.Chunks) > MaxChunksPerPart:
		return fmt.Errorf("chunk table of %q: %d chunks: %w (limit %d)", t.Path, len(t.Chunks), ErrTooLarge, MaxChunksPerPart)
	}
	next := t.Offset
	for i, c := range t.Chunks {
		if c.Offset != next {
			if c.Offset < next {
				return bad("chunk %d at offset %d overlaps the chunk before it (ends at %d)", i, c.Offset, next)
			}
			return bad("gap before chunk %d: offset %d, previous chunk ends at %d", i, c.Offset, next)
		}
		if c.Size <= 0 || c.Size > MaxChunkSize {
			return bad("chunk %d has size %d, want 1..%d", i, c.Size, MaxChunkSize)
		}
		if err := c.validateEncoding(); err != nil {
			return bad("chunk %d: %v", i, err)
		}
		next += c.Size
	}
	if next != t.Offset+t.Length {
		return bad("chunks end at %d, part ends at %d", next, t.Offset+t.Length)
	}
	return nil
}

// Check validates one chunk table entry on its own, as a table's
// validation does: a size of 1..MaxChunkSize and a well-formed encoding,
// digests and, in format v2, frame. For entries that come from elsewhere
// than a verified table (a peer's request).
func (c Chunk) Check() error {
	if c.Size <= 0 || c.Size > MaxChunkSize {
		return fmt.Errorf("size %d, want 1..%d: %w", c.Size, MaxChunkSize, ErrInvalid)
	}
	if err := c.validateEncoding(); err != nil {
		return fmt.Errorf("%v: %w", err, ErrInvalid)
	}
	return nil
}

func (c Chunk) validateEncoding() error {
	if c.Packed() {
		if c.Encoding != EncodingRaw && c.Encoding != EncodingZstd {
			return fmt.Errorf("packed chunk of encoding %q", c.Encoding)
		}
		if err := validSHA256(c.Digest); err != nil {
			return err
		}
		return c.validateFrame()
	}
	switch c.Encoding {
	case EncodingZero:
		if c.Digest != "" || c.Blob != "" || c.BlobSize != 0 {
			return fmt.Errorf("zero chunk has a digest or blob")
		}
	case EncodingRaw:
		if err := validSHA256(c.Digest); err != nil {
			return err
		}
		if c.Blob != c.Digest || c.BlobSize != c.Size {
			return fmt.Errorf("raw chunk's blob %s (%d bytes) is not its content %s (%d bytes)", c.Blob, c.BlobSize, c.Digest, c.Size)
		}
	case EncodingZstd:
		if err := validSHA256(c.Digest); err != nil {
			return err
		}
		if err := validSHA256(c.Blob); err != nil {
			return fmt.Errorf("blob: %v", err)
		}
		if c.BlobSize <= 0 || c.BlobSize >= c.Size {
			return fmt.Errorf("zstd blob of %d bytes for a chunk of %d bytes", c.BlobSize, c.Size)
		}
	default:
		return fmt.Errorf("unknown encoding %q", c.Encoding)
	}
	return nil
}

// Locate returns the indices [first, last) of the chunks that cover the byte
// range [off, off+n) of the file, clipped to this part, in O(log chunks).
func (t *Table) Locate(off, n int64) (first, last int) {
	if n <= 0 {
		first = sort.Search(len(t.Chunks), func(i int) bool { return t.Chunks[i].End() > off })
		return first, first
	}
	end := off + n
	first = sort.Search(len(t.Chunks), func(i int) bool { return t.Chunks[i].End() > off })
	last = sort.Search(len(t.Chunks), func(i int) bool { return t.Chunks[i].Offset >= end })
	if last < first {
		last = first
	}
	return first, last
}

// ValidatePath checks that p is a clean, relative, slash-separated path that
// stays inside the image dir: no "..", no ".", no empty or absolute parts.
func ValidatePath(p string) error {
	// UTF-8 first: fs.ValidPath refuses what is not, with the vaguer
	// message below.
	if !utf8.ValidString(p) {
		return fmt.Errorf("file path %q is not UTF-8 (a JSON string cannot carry it): %w", p, ErrInvalid)
	}
	if p == "" || p == "." || len(p) > 4096 || !fs.ValidPath(p) || strings.ContainsAny(p, "\\\x00") || path.Clean(p) != p {
		return fmt.Errorf("file path %q is not a clean relative path inside the image dir: %w", p, ErrInvalid)
	}
	return nil
}

func validSHA256(d digest.Digest) error {
	// The form SPEC.md requires, checked byte by byte: go-digest's
	// Validate runs a regular expression, a fifth of the time a mount
	// spends loading v2 tables, which hold a digest per chunk.
	if s := string(d); len(s) == 7+64 && s[:7] == "sha256:" && lowerHex(s[7:]) {
		return nil
	}
	// Validate first: Algorithm panics on a digest without a separator.
	if err := d.Validate(); err != nil {
		return fmt.Errorf("digest %q: %v", d, err)
	}
	if d.Algorithm() != digest.SHA256 {
		return fmt.Errorf("digest %q is not sha256", d)
	}
	return fmt.Errorf("digest %q: want sha256: and 64 lowercase hex digits", d)
}

// lowerHex reports whether s is lowercase hex digits only.
func lowerHex(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// BlobDescriptor is the descriptor of the blob of non-zero chunk c.
func (c Chunk) BlobDescriptor() ocispec.Descriptor {
	if c.Packed() {
		return ocispec.Descriptor{MediaType: MediaTypePack, Digest: c.Blob, Size: c.PackSize}
	}
	return ocispec.Descriptor{MediaType: c.MediaType(), Digest: c.Blob, Size: c.BlobSize}
}
