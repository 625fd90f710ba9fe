package cache

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"slices"
	"strings"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
)

// ChunkList is the file a materialized image dir holds beside its files
// (written before its completion marker) naming where its chunks lie, so
// that after a restart the node store finds in it the chunks other
// snapshots share with it. It is the node's own disk, so nothing in it is
// trusted: every chunk found through it is verified (sha256) on its first
// use by a process, and entries outside the image's files are skipped.
//
// The format is cryo's own (no library writes a table this small and
// simple; JSON would be three times the size at 16,000 chunks per GiB):
// the line "cryo-chunks 1\n", then a little-endian uint32 count of files
// and, for each, a uint32 length and the slash-separated path, then a
// uint32 count of records, each a uint32 file index, a uint64 offset, a
// uint32 size and the 32 bytes of the chunk's sha256.
const ChunkList = ".cryo-chunks"

const chunkListMagic = "cryo-chunks 1\n"

// placement is a chunk at a place in a file of an image dir.
type placement struct {
	d    digest.Digest
	file int
	off  int64
	size int64
}

// chunkPlacements lists each chunk of chunks (indexed like paths) once,
// at its first offset; zero chunks are holes and are left out.
func chunkPlacements(chunks [][]format.Chunk) []placement {
	seen := map[digest.Digest]bool{}
	var out []placement
	for fi, fc := range chunks {
		for _, c := range fc {
			if c.Encoding == format.EncodingZero || seen[c.Digest] {
				continue
			}
			seen[c.Digest] = true
			out = append(out, placement{d: c.Digest, file: fi, off: c.Offset, size: c.Size})
		}
	}
	return out
}

// encodeChunkList returns the chunk list of an image dir holding the files
// paths with the chunks ps.
func encodeChunkList(paths []string, ps []placement) []byte {
	b := []byte(chunkListMagic)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(paths)))
	for _, p := range paths {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(p)))
		b = append(b, p...)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(ps)))
	for _, p := range ps {
		b = binary.LittleEndian.AppendUint32(b, uint32(p.file))
		b = binary.LittleEndian.AppendUint64(b, uint64(p.off))
		b = binary.LittleEndian.AppendUint32(b, uint32(p.size))
		raw, _ := digestBytes(p.d)
		b = append(b, raw...)
	}
	return b
}

// digestBytes returns the 32 bytes of a sha256 digest.
func digestBytes(d digest.Digest) ([]byte, error) {
	if d.Validate() != nil || d.Algorithm() != digest.SHA256 {
		return nil, fmt.Errorf("not a sha256 digest: %q", d)
	}
	return hex.DecodeString(d.Encoded())
}

// errBadChunkList is a chunk list that cannot be read; the image dir is
// used all the same, only not as a source of chunks.
var errBadChunkList = errors.New("unreadable chunk list")

// readChunkList reads the chunk list of image dir dir: its files' paths
// and sizes (as found on disk) and the placements that lie inside them.
// Paths that are not clean, relative and inside dir, and placements
// outside their file or larger than a chunk can be, are refused or
// skipped: the list is untrusted.
func readChunkList(dir string) (paths []string, sizes []int64, ps []placement, err error) {
	f, err := os.Open(dir + "/" + ChunkList)
	if err != nil {
		return nil, nil, nil, err
	}
	defer f.Close()
	r := bufio.NewReader(f)
	magic := make([]byte, len(chunkListMagic))
	if _, err := io.ReadFull(r, magic); err != nil || string(magic) != chunkListMagic {
		return nil, nil, nil, fmt.Errorf("%s: %w", dir, errBadChunkList)
	}
	u32 := func() (uint32, error) {
		var b [4]byte
		_, err := io.ReadFull(r, b[:])
		return binary.LittleEndian.Uint32(b[:]), err
	}
	n, err := u32()
	if err != nil || n > format.MaxFiles {
		return nil, nil, nil, fmt.Errorf("%s: %d files: %w", dir, n, errBadChunkList)
	}
	for range n {
		l, err := u32()
		if err != nil || l == 0 || l > 4096 {
			return nil, nil, nil, fmt.Errorf("%s: path of %d bytes: %w", dir, l, errBadChunkList)
		}
		p := make([]byte, l)
		if _, err := io.ReadFull(r, p); err != nil {
			return nil, nil, nil, fmt.Errorf("%s: %w", dir, errBadChunkList)
		}
		name := string(p)
		if !validRelPath(name) {
			return nil, nil, nil, fmt.Errorf("%s: path %q: %w", dir, name, errBadChunkList)
		}
		info, err := os.Lstat(dir + "/" + name)
		if err != nil || !info.Mode().IsRegular() {
			return nil, nil, nil, fmt.Errorf("%s: %s is not a file of it: %w", dir, name, errBadChunkList)
		}
		paths = append(paths, name)
		sizes = append(sizes, info.Size())
	}
	count, err := u32()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("%s: %w", dir, errBadChunkList)
	}
	rec := make([]byte, 4+8+4+32)
	for range count {
		if _, err := io.ReadFull(r, rec); err != nil {
			return nil, nil, nil, fmt.Errorf("%s: %w", dir, errBadChunkList)
		}
		fi := int(binary.LittleEndian.Uint32(rec))
		off := int64(binary.LittleEndian.Uint64(rec[4:]))
		size := int64(binary.LittleEndian.Uint32(rec[12:]))
		if fi >= len(paths) || off < 0 || size <= 0 || size > format.MaxChunkSize || off > sizes[fi]-size {
			continue
		}
		d := digest.NewDigestFromBytes(digest.SHA256, rec[16:])
		ps = append(ps, placement{d: d, file: fi, off: off, size: size})
	}
	return paths, sizes, ps, nil
}

// validRelPath reports whether p is a clean, relative, slash-separated
// path that stays inside its root.
func validRelPath(p string) bool {
	return p != "" && p != "." && path.Clean(p) == p && !path.IsAbs(p) && !slices.Contains(strings.Split(p, "/"), "..")
}
