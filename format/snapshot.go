package format

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"sort"
	"strconv"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// Snapshot is a parsed and validated snapshot index: the snapshot's metadata
// and, for each file, where its parts are. Chunk tables are loaded per part,
// on demand, with LoadPart.
type Snapshot struct {
	// Descriptor is the descriptor of the index.
	Descriptor ocispec.Descriptor
	// Annotations are the index's annotations (creation time, runsc header).
	Annotations map[string]string
	// Files are the snapshot's regular files, sorted by path.
	Files []File
	// Version is the snapshot's format version.
	Version Version
}

// File is one regular file of a snapshot.
type File struct {
	// Path is the slash-separated path in the image dir.
	Path string
	// Size is the file's size.
	Size int64
	// Mode holds the file's permission bits.
	Mode fs.FileMode
	// Digest is the sha256 of the whole file.
	Digest digest.Digest
	// Parts cover the file in order, each described by its own manifest.
	Parts []Part
	// Version is the format version of the snapshot holding the file.
	Version Version
}

// Part is a contiguous range of a file whose chunks one manifest holds.
type Part struct {
	// Offset is where the part starts in the file.
	Offset int64
	// Length is how many bytes of the file the part covers.
	Length int64
	// Manifest is the descriptor of the part's manifest in the index.
	Manifest ocispec.Descriptor
}

// PartAt returns the index of the part holding byte off of the file, or -1 if
// off is outside the file. It takes O(log parts).
func (f *File) PartAt(off int64) int {
	if off < 0 || off >= f.Size {
		return -1
	}
	return sort.Search(len(f.Parts), func(i int) bool { return f.Parts[i].Offset+f.Parts[i].Length > off })
}

// Created returns the snapshot's creation time annotation, or "".
func (s *Snapshot) Created() string { return s.Annotations[AnnotationCreated] }

// RunscVersion returns the runsc version the checkpoint was taken with, or "".
func (s *Snapshot) RunscVersion() string { return s.Annotations[AnnotationRunscVersion] }

// LogicalSize is the sum of the sizes of all files.
func (s *Snapshot) LogicalSize() int64 {
	var n int64
	for _, f := range s.Files {
		n += f.Size
	}
	return n
}

// File returns the file with the given path, or nil.
func (s *Snapshot) File(path string) *File {
	i := sort.Search(len(s.Files), func(i int) bool { return s.Files[i].Path >= path })
	if i < len(s.Files) && s.Files[i].Path == path {
		return &s.Files[i]
	}
	return nil
}

// ParseIndex validates a snapshot index and returns the snapshot it describes.
// desc is the index's descriptor; data its verified bytes.
func ParseIndex(desc ocispec.Descriptor, data []byte) (*Snapshot, error) {
	if len(data) > MaxManifestSize {
		return nil, fmt.Errorf("snapshot index of %d bytes: %w (limit %d)", len(data), ErrTooLarge, MaxManifestSize)
	}
	var idx ocispec.Index
	if err := strictUnmarshal(data, &idx); err != nil {
		return nil, fmt.Errorf("decode snapshot index %s: %v: %w", desc.Digest, err, ErrInvalid)
	}
	bad := func(format string, args ...any) error {
		return fmt.Errorf("snapshot index %s: %s: %w", desc.Digest, fmt.Sprintf(format, args...), ErrInvalid)
	}
	if idx.SchemaVersion != 2 || idx.MediaType != ocispec.MediaTypeImageIndex {
		return nil, bad("schemaVersion %d mediaType %q, want 2 and %q", idx.SchemaVersion, idx.MediaType, ocispec.MediaTypeImageIndex)
	}
	var version Version
	switch idx.ArtifactType {
	case ArtifactTypeSnapshot:
		version = V1
	case ArtifactTypeSnapshotV2:
		version = V2
	default:
		return nil, bad("artifactType %q, want %q or %q: not a cryo snapshot this version of cryo reads", idx.ArtifactType, ArtifactTypeSnapshot, ArtifactTypeSnapshotV2)
	}
	s := &Snapshot{Descriptor: desc, Annotations: idx.Annotations, Version: version}
	for i, m := range idx.Manifests {
		if m.MediaType != ocispec.MediaTypeImageManifest || m.ArtifactType != version.fileArtifactType() {
			return nil, bad("manifest %d: mediaType %q artifactType %q, want %q and %q", i, m.MediaType, m.ArtifactType, ocispec.MediaTypeImageManifest, version.fileArtifactType())
		}
		if err := validSHA256(m.Digest); err != nil || m.Size <= 0 || m.Size > MaxManifestSize {
			return nil, bad("manifest %d: digest %q size %d", i, m.Digest, m.Size)
		}
		f, p, err := parseFileAnnotations(m)
		if err != nil {
			return nil, bad("manifest %d: %v", i, err)
		}
		last := len(s.Files) - 1
		if last >= 0 && s.Files[last].Path == f.Path {
			cur := &s.Files[last]
			if cur.Size != f.Size || cur.Mode != f.Mode || cur.Digest != f.Digest {
				return nil, bad("parts of %q disagree on the file's size, mode or digest", f.Path)
			}
			prev := cur.Parts[len(cur.Parts)-1]
			if p.Offset != prev.Offset+prev.Length {
				return nil, bad("part at offset %d of %q does not follow the part ending at %d", p.Offset, f.Path, prev.Offset+prev.Length)
			}
			if len(cur.Parts) >= MaxParts {
				return nil, fmt.Errorf("%q has more than %d parts: %w", f.Path, MaxParts, ErrTooLarge)
			}
			cur.Parts = append(cur.Parts, p)
			continue
		}
		if last >= 0 {
			if err := checkComplete(&s.Files[last]); err != nil {
				return nil, bad("%v", err)
			}
			if f.Path <= s.Files[last].Path {
				return nil, bad("file %q is out of order or repeated after %q", f.Path, s.Files[last].Path)
			}
		}
		if p.Offset != 0 {
			return nil, bad("first part of %q starts at %d", f.Path, p.Offset)
		}
		if len(s.Files) >= MaxFiles {
			return nil, fmt.Errorf("more than %d files: %w", MaxFiles, ErrTooLarge)
		}
		f.Parts = []Part{p}
		f.Version = version
		s.Files = append(s.Files, f)
	}
	if len(s.Files) == 0 {
		return nil, bad("no files")
	}
	if err := checkComplete(&s.Files[len(s.Files)-1]); err != nil {
		return nil, bad("%v", err)
	}
	if err := checkNoFileIsADir(s.Files); err != nil {
		return nil, bad("%v", err)
	}
	return s, nil
}

// checkNoFileIsADir refuses a path that is both a file and a directory
// ("a" and "a/b"). Sorting does not put the two side by side ("a-x" sorts
// between them), so every parent directory of every path is looked up.
func checkNoFileIsADir(files []File) error {
	paths := make(map[string]bool, len(files))
	for _, f := range files {
		paths[f.Path] = true
	}
	for _, f := range files {
		for i := 0; i < len(f.Path); i++ {
			if f.Path[i] == '/' && paths[f.Path[:i]] {
				return fmt.Errorf("%q is a file and also a directory holding %q", f.Path[:i], f.Path)
			}
		}
	}
	return nil
}

func checkComplete(f *File) error {
	last := f.Parts[len(f.Parts)-1]
	if last.Offset+last.Length != f.Size {
		return fmt.Errorf("parts of %q end at %d, file has %d bytes", f.Path, last.Offset+last.Length, f.Size)
	}
	return nil
}

func parseFileAnnotations(m ocispec.Descriptor) (File, Part, error) {
	a := m.Annotations
	f := File{Path: a[AnnotationFilePath], Digest: digest.Digest(a[AnnotationFileDigest])}
	if err := ValidatePath(f.Path); err != nil {
		return f, Part{}, err
	}
	if err := validSHA256(f.Digest); err != nil {
		return f, Part{}, fmt.Errorf("%q: file digest: %v", f.Path, err)
	}
	var err error
	num := func(key string) int64 {
		if err != nil {
			return 0
		}
		var v int64
		if !canonicalDecimal(a[key]) {
			err = fmt.Errorf("%q is not a decimal number without sign or leading zeros", a[key])
		} else {
			v, err = strconv.ParseInt(a[key], 10, 64)
		}
		if err != nil {
			err = fmt.Errorf("%q: annotation %s: %v", f.Path, key, err)
		}
		return v
	}
	f.Size = num(AnnotationFileSize)
	p := Part{Offset: num(AnnotationPartOffset), Length: num(AnnotationPartLength), Manifest: m}
	if err != nil {
		return f, p, err
	}
	ms := a[AnnotationFileMode]
	mode, perr := strconv.ParseUint(ms, 8, 32)
	if perr != nil || len(ms) != 4 || ms[0] != '0' || mode&^uint64(fs.ModePerm) != 0 {
		return f, p, fmt.Errorf("%q: annotation %s %q is not 4 octal digits of permission bits (\"0644\")", f.Path, AnnotationFileMode, ms)
	}
	f.Mode = fs.FileMode(mode)
	if p.Offset > f.Size || p.Length > f.Size-p.Offset {
		return f, p, fmt.Errorf("%q: part [%d,+%d) outside file of %d bytes", f.Path, p.Offset, p.Length, f.Size)
	}
	return f, p, nil
}

// PartTable is a file part's manifest and chunk table, validated against
// each other and against the snapshot index.
type PartTable struct {
	// Manifest is the part's manifest.
	Manifest ocispec.Manifest
	// Table is the part's chunk table.
	Table *Table
}

// LoadPart fetches, verifies and validates the manifest and chunk table of
// one part of f. Nothing of other files or parts is read.
func LoadPart(ctx context.Context, src content.Fetcher, f *File, part int) (*PartTable, error) {
	fp, err := FetchPart(ctx, src, f, part)
	if err != nil {
		return nil, err
	}
	return fp.Decode()
}

// FetchedPart is one part's manifest, decoded and checked, and its chunk
// table as fetched and verified by digest, not yet decoded: LoadPart in
// two steps, the fetch (the link's) and the decoding (the CPU's), for a
// reader that bounds them apart.
type FetchedPart struct {
	f        *File
	part     int
	v        Version
	manifest ocispec.Manifest
	table    []byte
}

// FetchPart fetches part part of f's manifest and chunk table, verified
// by digest (FetchedPart.Decode decodes and validates the table).
func FetchPart(ctx context.Context, src content.Fetcher, f *File, part int) (*FetchedPart, error) {
	v := f.Version
	if v == 0 {
		v = V1
	}
	p := f.Parts[part]
	mdata, err := FetchVerified(ctx, src, p.Manifest, MaxManifestSize)
	if err != nil {
		return nil, fmt.Errorf("fetch manifest of %q part %d: %w", f.Path, part, err)
	}
	var m ocispec.Manifest
	if err := strictUnmarshal(mdata, &m); err != nil {
		return nil, fmt.Errorf("decode manifest %s of %q: %v: %w", p.Manifest.Digest, f.Path, err, ErrInvalid)
	}
	bad := func(format string, args ...any) error { return invalidPart(f, part, format, args...) }
	if m.SchemaVersion != 2 || m.MediaType != ocispec.MediaTypeImageManifest || m.ArtifactType != v.fileArtifactType() {
		return nil, bad("schemaVersion %d mediaType %q artifactType %q", m.SchemaVersion, m.MediaType, m.ArtifactType)
	}
	if !IsTableMediaType(v, m.Config.MediaType) {
		return nil, bad("config mediaType %q, want %q", m.Config.MediaType, v.tableMediaType())
	}
	tdata, err := FetchVerified(ctx, src, m.Config, MaxTableSize)
	if err != nil {
		return nil, fmt.Errorf("fetch chunk table of %q part %d: %w", f.Path, part, err)
	}
	return &FetchedPart{f: f, part: part, v: v, manifest: m, table: tdata}, nil
}

// invalidPart is an ErrInvalid error about part part of f's manifest.
func invalidPart(f *File, part int, format string, args ...any) error {
	return fmt.Errorf("manifest %s of %q part %d: %s: %w", f.Parts[part].Manifest.Digest, f.Path, part, fmt.Sprintf(format, args...), ErrInvalid)
}

// Decode decodes the part's chunk table and validates it against its
// manifest and the snapshot index.
func (fp *FetchedPart) Decode() (*PartTable, error) {
	f, part, v, m := fp.f, fp.part, fp.v, fp.manifest
	p := f.Parts[part]
	bad := func(format string, args ...any) error { return invalidPart(f, part, format, args...) }
	tdata, err := DecodeTableBlob(m.Config.MediaType, fp.table)
	if err != nil {
		return nil, fmt.Errorf("chunk table of %q part %d: %w", f.Path, part, err)
	}
	parse := ParseTable
	if v == V2 {
		parse = ParseTableV2
	}
	t, err := parse(tdata)
	if err != nil {
		return nil, err
	}
	if t.Path != f.Path || t.Size != f.Size || fs.FileMode(t.Mode) != f.Mode || t.Digest != f.Digest ||
		t.Part != part || t.Parts != len(f.Parts) || t.Offset != p.Offset || t.Length != p.Length {
		return nil, bad("chunk table (%q part %d/%d [%d,+%d)) disagrees with the snapshot index", t.Path, t.Part, t.Parts, t.Offset, t.Length)
	}
	// The layers must be exactly the distinct blobs of the table, so that
	// what a registry keeps for this manifest is what the table needs.
	layers := make(map[digest.Digest]ocispec.Descriptor, len(m.Layers))
	for _, l := range m.Layers {
		if l.Digest == ocispec.DescriptorEmptyJSON.Digest {
			continue
		}
		layers[l.Digest] = l
	}
	used := make(map[digest.Digest]bool, len(layers))
	for i, c := range t.Chunks {
		if c.Encoding == EncodingZero {
			continue
		}
		l, ok := layers[c.Blob]
		if !ok {
			return nil, bad("chunk %d's blob %s is not a layer", i, c.Blob)
		}
		if want := c.BlobDescriptor(); l.Size != want.Size || l.MediaType != want.MediaType {
			return nil, bad("layer %s is %s of %d bytes, chunk %d needs %s of %d", l.Digest, l.MediaType, l.Size, i, want.MediaType, want.Size)
		}
		used[c.Blob] = true
	}
	if len(used) != len(layers) {
		return nil, bad("%d layers are not used by the chunk table", len(layers)-len(used))
	}
	if v == V2 {
		// A v2 manifest lists its table's packs, in the table's order.
		got := m.Layers
		if len(got) == 1 && got[0].Digest == ocispec.DescriptorEmptyJSON.Digest {
			got = nil
		}
		if len(got) != len(t.Packs) {
			return nil, bad("%d layers for the table's %d packs", len(got), len(t.Packs))
		}
		for i := range got {
			if got[i].Digest != t.Packs[i].Digest {
				return nil, bad("layer %d is %s, the table's pack %d is %s", i, got[i].Digest, i, t.Packs[i].Digest)
			}
		}
	}
	return &PartTable{Manifest: m, Table: t}, nil
}

// LoadTables loads the chunk table of every part of every file of snap,
// in order.
func LoadTables(ctx context.Context, src content.Fetcher, snap *Snapshot) ([]*Table, error) {
	var out []*Table
	for i := range snap.Files {
		f := &snap.Files[i]
		for part := range f.Parts {
			pt, err := LoadPart(ctx, src, f, part)
			if err != nil {
				return nil, err
			}
			out = append(out, pt.Table)
		}
	}
	return out, nil
}

// LoadSnapshot fetches, verifies and parses the snapshot index desc.
func LoadSnapshot(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor) (*Snapshot, error) {
	if desc.MediaType != ocispec.MediaTypeImageIndex {
		return nil, fmt.Errorf("%s has media type %q, not an image index: %w", desc.Digest, desc.MediaType, ErrInvalid)
	}
	data, err := FetchVerified(ctx, src, desc, MaxManifestSize)
	if err != nil {
		return nil, fmt.Errorf("fetch snapshot index: %w", err)
	}
	return ParseIndex(desc, data)
}

// FetchVerified fetches desc from src, refusing descriptors larger than limit,
// and verifies the content's size and digest.
func FetchVerified(ctx context.Context, src content.Fetcher, desc ocispec.Descriptor, limit int64) ([]byte, error) {
	if desc.Size < 0 || desc.Size > limit {
		return nil, fmt.Errorf("%s: %d bytes: %w (limit %d)", desc.Digest, desc.Size, ErrTooLarge, limit)
	}
	if err := desc.Digest.Validate(); err != nil {
		return nil, fmt.Errorf("descriptor digest %q: %v: %w", desc.Digest, err, ErrInvalid)
	}
	rc, err := src.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data := make([]byte, desc.Size)
	if _, err := io.ReadFull(rc, data); err != nil {
		return nil, fmt.Errorf("%s: read %d bytes: %w", desc.Digest, desc.Size, err)
	}
	if n, _ := rc.Read(make([]byte, 1)); n > 0 {
		return nil, fmt.Errorf("%s: more than %d bytes: %w", desc.Digest, desc.Size, ErrDigestMismatch)
	}
	if got := desc.Digest.Algorithm().FromBytes(data); got != desc.Digest {
		return nil, fmt.Errorf("%s: content hashes to %s: %w", desc.Digest, got, ErrDigestMismatch)
	}
	return data, nil
}

// canonicalDecimal reports whether s is a non-negative decimal integer as
// cryo writes it: digits only, no sign, no leading zero (but "0").
func canonicalDecimal(s string) bool {
	if s == "" || len(s) > 1 && s[0] == '0' {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

// strictUnmarshal decodes the JSON document data into v after CheckKeys;
// json.Unmarshal refuses data after the value, as CheckKeys does.
func strictUnmarshal(data []byte, v any) error {
	if err := CheckKeys(data); err != nil {
		return err
	}
	return json.Unmarshal(data, v)
}
