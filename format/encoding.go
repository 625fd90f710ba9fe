package format

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"

	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// ZstdLevel is the zstd level cryo writes chunks with. It is part of the
// encoder options that must stay fixed for blob digests to be reproducible.
const ZstdLevel = zstd.SpeedFastest

// ZstdLevelV2 is the zstd level of format v2's frames, written with
// entropy coding of blocks that are all literals (klauspost's
// WithAllLitEntropyCompression, off by default at this level). Without it
// the fastest level finds few matches in a 64 KiB chunk of text-like
// memory and stores its literals as they are (1.03x); with it, 1.54x at
// 308 MB/s per core, where the default level gives 1.72x at 59 MB/s
// (docs/benchmarks.md): v2 packs as fast as v1, whose 1 MiB chunks are at
// the fastest level too.
const ZstdLevelV2 = zstd.SpeedFastest

// ZstdLevelV2Tables is the zstd level of format v2's compressed chunk
// tables: small, written once per part, read by every node before a read
// of the part.
const ZstdLevelV2Tables = zstd.SpeedDefault

// Codec encodes chunks for storage and decodes and verifies them. A Codec is
// safe for concurrent use; make one and share it.
type Codec struct {
	enc *zstd.Encoder
	// tables compresses chunk tables (CompressTable), if not enc.
	tables *zstd.Encoder
	dec    *zstd.Decoder
}

// NewCodec returns a Codec that runs at most concurrency zstd encoders and
// decoders at once (GOMAXPROCS if concurrency <= 0), compressing at
// ZstdLevel.
func NewCodec(concurrency int) (*Codec, error) {
	return newCodec(concurrency, zstd.WithEncoderLevel(ZstdLevel))
}

// NewCodecV2 is NewCodec for format v2's frames and tables: it compresses
// frames at ZstdLevelV2, tables at ZstdLevelV2Tables.
func NewCodecV2(concurrency int) (*Codec, error) {
	c, err := newCodec(concurrency, zstd.WithEncoderLevel(ZstdLevelV2), zstd.WithAllLitEntropyCompression(true))
	if err != nil {
		return nil, err
	}
	if c.tables, err = newEncoder(1, zstd.WithEncoderLevel(ZstdLevelV2Tables)); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// newEncoder returns a zstd encoder with the fixed options and opts, at
// most concurrency encodes at once. Fixed options: the same input gives
// the same bytes with the same library version. No padding (it is
// random), no CRC (the sha256 of the uncompressed bytes is checked
// instead).
func newEncoder(concurrency int, opts ...zstd.EOption) (*zstd.Encoder, error) {
	enc, err := zstd.NewWriter(nil, append([]zstd.EOption{
		zstd.WithEncoderConcurrency(concurrency),
		zstd.WithEncoderCRC(false),
		zstd.WithZeroFrames(true),
	}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("zstd encoder: %w", err)
	}
	return enc, nil
}

// newCodec returns a Codec whose encoder has the fixed options and opts.
func newCodec(concurrency int, opts ...zstd.EOption) (*Codec, error) {
	if concurrency <= 0 {
		concurrency = runtime.GOMAXPROCS(0)
	}
	enc, err := newEncoder(concurrency, opts...)
	if err != nil {
		return nil, err
	}
	// WithDecoderMaxMemory bounds what one blob may decode to: a blob that
	// claims to be a chunk cannot expand beyond the largest chunk (bomb).
	// WithDecodeAllCapLimit bounds it further to the capacity of the output
	// buffer, which Decode sets to the chunk's size.
	dec, err := zstd.NewReader(nil,
		zstd.WithDecoderConcurrency(concurrency),
		zstd.WithDecoderMaxMemory(MaxChunkSize),
		zstd.WithDecoderMaxWindow(MaxChunkSize),
		zstd.WithDecodeAllCapLimit(true),
	)
	if err != nil {
		enc.Close()
		return nil, fmt.Errorf("zstd decoder: %w", err)
	}
	return &Codec{enc: enc, dec: dec}, nil
}

// Close releases the codec's encoders and decoders.
func (c *Codec) Close() {
	c.enc.Close()
	if c.tables != nil {
		c.tables.Close()
	}
	c.dec.Close()
}

// Identify returns the table entry (without Offset) of an all-zero chunk,
// or a raw entry with the chunk's digest.
func (c *Codec) Identify(data []byte) Chunk {
	if chunker.IsZero(data) {
		return Chunk{Size: int64(len(data)), Encoding: EncodingZero}
	}
	d := digest.FromBytes(data)
	return Chunk{Size: int64(len(data)), Encoding: EncodingRaw, Digest: d, Blob: d, BlobSize: int64(len(data))}
}

// Compress takes the raw entry Identify returned for data and chooses
// between raw and zstd. It returns the final entry and the blob to store:
// data itself for raw chunks, else the compressed form, written into dst
// when it is large enough.
func (c *Codec) Compress(raw Chunk, data, dst []byte) (Chunk, []byte) {
	z := c.enc.EncodeAll(data, dst[:0])
	// Keep the compressed form only if it saves more than 1/8 (12.5%), as
	// CRIU does: below that, decompression costs more than the bytes saved.
	if len(z) >= len(data)-len(data)/8 {
		return raw, data
	}
	bd := digest.FromBytes(z)
	return Chunk{Size: raw.Size, Encoding: EncodingZstd, Digest: raw.Digest, Blob: bd, BlobSize: int64(len(z))}, z
}

// CompressFrame is Compress for a frame of a format v2 pack: the entry
// it returns has no blob (the pack is the frame's blob, set when it is
// sealed), and data whose bytes are spread so evenly that zstd cannot
// save an eighth of them (spreadEvenly) is not given to zstd at all: on
// random memory an attempt costs about as long as the chunk's sha256
// (measured at klauspost's SpeedDefault, v2's level before ZstdLevelV2).
func (c *Codec) CompressFrame(raw Chunk, data, dst []byte) (Chunk, []byte) {
	raw.Blob, raw.BlobSize = "", int64(len(data))
	if spreadEvenly(data) {
		return raw, data
	}
	z := c.enc.EncodeAll(data, dst[:0])
	if len(z) >= len(data)-len(data)/8 {
		return raw, data
	}
	return Chunk{Size: raw.Size, Encoding: EncodingZstd, Digest: raw.Digest, BlobSize: int64(len(z))}, z
}

// spreadEvenly reports whether the bytes of data, sampled every third
// byte from a start that moves by one every 4 KiB page (so that fields of
// 2, 3, 4 or 8 bytes are seen whole), have an order-0 entropy of at least
// 7.9 bits per byte. Entropy coding then saves at most 1.25%, and a chunk
// holding enough text or zeros to save an eighth has a lower entropy (a
// quarter of text-like bytes among random ones: about 7.85 bits, saving
// about 10%). What it misses: data that only long repeats within the
// chunk would shrink, such as a random page repeated. Below 16 KiB it
// says no: the estimate runs low by about 255 / (2 ln 2 samples) bits.
// Hand-written: neither klauspost/compress nor the standard library
// estimates entropy alone.
func spreadEvenly(data []byte) bool {
	const stride, page = 3, 4096
	if len(data) < 16<<10 {
		return false
	}
	var counts [256]int
	n := 0
	for p := 0; p*page < len(data); p++ {
		end := min((p+1)*page, len(data))
		for i := p*page + p%stride; i < end; i += stride {
			counts[data[i]]++
			n++
		}
	}
	var sum float64
	for _, k := range counts {
		if k > 0 {
			sum += float64(k) * math.Log2(float64(k))
		}
	}
	return math.Log2(float64(n))-sum/float64(n) >= 7.9
}

// Encode chooses the encoding of data and returns its table entry (without
// Offset) and the blob to store, which is nil for zero chunks and data itself
// for raw chunks. dst is reused for the compressed form when large enough.
func (c *Codec) Encode(data, dst []byte) (Chunk, []byte) {
	ch := c.Identify(data)
	if ch.Encoding == EncodingZero {
		return ch, nil
	}
	return c.Compress(ch, data, dst)
}

// Verify checks that data holds exactly chunk c's bytes: its size and
// sha256 (or all zeros for a zero chunk).
func (c *Codec) Verify(ch Chunk, data []byte) error {
	if int64(len(data)) != ch.Size {
		return fmt.Errorf("chunk %s: %d bytes, want %d: %w", ch.Digest, len(data), ch.Size, ErrDigestMismatch)
	}
	if ch.Encoding == EncodingZero {
		if !chunker.IsZero(data) {
			return fmt.Errorf("zero chunk at offset %d holds non-zero bytes: %w", ch.Offset, ErrDigestMismatch)
		}
		return nil
	}
	if got := digest.FromBytes(data); got != ch.Digest {
		return fmt.Errorf("chunk %s: content hashes to %s: %w", ch.Digest, got, ErrDigestMismatch)
	}
	return nil
}

// FromFrame returns chunk ch's verified bytes from its stored frame (as
// FetchFrame reads it): a raw frame is the chunk, verified in place and
// returned as it is (dst unused); any other is decoded into dst[:0]
// (Decode).
func (c *Codec) FromFrame(ch Chunk, frame, dst []byte) ([]byte, error) {
	if ch.Encoding == EncodingRaw {
		return frame, c.Verify(ch, frame)
	}
	return c.Decode(ch, frame, dst)
}

// Decode turns a chunk's blob back into its bytes, appended to dst[:0], and
// verifies their size and sha256 against the table entry. A zero chunk needs
// no blob. Nothing is returned that was not verified: the output has exactly
// ch.Size bytes, or Decode fails. A chunk whose size is not 1..MaxChunkSize
// is refused before anything is allocated, and a zstd blob is decompressed
// into at most ch.Size bytes (plus one zstd block the decoder may write
// before it stops): a blob that expands further fails with ErrTooLarge.
func (c *Codec) Decode(ch Chunk, blob, dst []byte) ([]byte, error) {
	if ch.Size <= 0 {
		return nil, fmt.Errorf("chunk at offset %d: size %d: %w", ch.Offset, ch.Size, ErrInvalid)
	}
	if ch.Size > MaxChunkSize {
		return nil, fmt.Errorf("chunk at offset %d: size %d: %w (limit %d)", ch.Offset, ch.Size, ErrTooLarge, MaxChunkSize)
	}
	var out []byte
	switch ch.Encoding {
	case EncodingZero:
		out = slices.Grow(dst[:0], int(ch.Size))[:ch.Size]
		clear(out)
		return out, nil
	case EncodingRaw:
		if int64(len(blob)) != ch.Size {
			return nil, fmt.Errorf("chunk %s: raw blob has %d bytes, want %d: %w", ch.Digest, len(blob), ch.Size, ErrDigestMismatch)
		}
		out = append(dst[:0], blob...)
	case EncodingZstd:
		if int64(len(blob)) != ch.BlobSize {
			return nil, fmt.Errorf("chunk %s: zstd blob %s has %d bytes, want %d: %w", ch.Digest, ch.Blob, len(blob), ch.BlobSize, ErrDigestMismatch)
		}
		// The decoder may not write past the capacity it is given.
		full := slices.Grow(dst[:0], int(ch.Size))
		var err error
		out, err = c.dec.DecodeAll(blob, full[:0:ch.Size])
		if errors.Is(err, zstd.ErrDecoderSizeExceeded) || int64(len(out)) > ch.Size {
			return nil, fmt.Errorf("chunk %s: zstd blob %s decompresses to more than its %d bytes: %w", ch.Digest, ch.Blob, ch.Size, ErrTooLarge)
		}
		if err != nil {
			return nil, fmt.Errorf("chunk %s: decompress blob %s: %v: %w", ch.Digest, ch.Blob, err, ErrDigestMismatch)
		}
		if int64(len(out)) != ch.Size {
			return nil, fmt.Errorf("chunk %s: blob %s decompresses to %d bytes, want %d: %w", ch.Digest, ch.Blob, len(out), ch.Size, ErrDigestMismatch)
		}
		// Hand back the caller's whole buffer, so that it keeps its capacity
		// for larger chunks.
		if &out[0] == &full[:1][0] {
			out = full[:len(out)]
		}
	default:
		return nil, fmt.Errorf("chunk at offset %d: unknown encoding %q: %w", ch.Offset, ch.Encoding, ErrInvalid)
	}
	if err := c.Verify(ch, out); err != nil {
		return nil, err
	}
	return out, nil
}

// SingleZstdFrame checks that b is exactly one zstd frame: not a
// skippable frame, and no bytes after the frame's last block (and its
// checksum). A decoder skips skippable frames and decodes concatenated
// frames one after the other, so bytes that decode to a chunk may still
// carry other data; a registry copying frames into another repository's
// packs (SPEC.md 12.2.1) copies only frames that hold nothing else.
// klauspost/compress decodes frame headers but does not say where a
// frame ends, so the block headers are walked here (RFC 8878 3.1.1.2).
func SingleZstdFrame(b []byte) error {
	var h zstd.Header
	if err := h.Decode(b); err != nil {
		return fmt.Errorf("zstd frame header: %v: %w", err, ErrInvalid)
	}
	if h.Skippable {
		return fmt.Errorf("a skippable zstd frame: %w", ErrInvalid)
	}
	pos := h.HeaderSize
	for {
		if pos+3 > len(b) {
			return fmt.Errorf("zstd frame ends inside a block header at %d of %d bytes: %w", pos, len(b), ErrInvalid)
		}
		bh := uint32(b[pos]) | uint32(b[pos+1])<<8 | uint32(b[pos+2])<<16
		last, typ, size := bh&1 == 1, (bh>>1)&3, int(bh>>3)
		pos += 3
		switch typ {
		case 0, 2: // raw, compressed: size bytes of content
			pos += size
		case 1: // RLE: one byte, repeated size times
			pos++
		default:
			return fmt.Errorf("zstd block of reserved type at %d: %w", pos-3, ErrInvalid)
		}
		if pos > len(b) {
			return fmt.Errorf("zstd block runs past the frame's %d bytes: %w", len(b), ErrInvalid)
		}
		if last {
			break
		}
	}
	if h.HasCheckSum {
		pos += 4
	}
	if pos != len(b) {
		return fmt.Errorf("%d bytes after the zstd frame's %d: %w", len(b)-pos, pos, ErrInvalid)
	}
	return nil
}
