// Package profile records, stores and replays a snapshot's working set:
// the byte ranges of its files a restored sandbox waited on (gVisor's
// priority reads, whole fault windows, in first-access order), so that
// the next restore of the snapshot, on any node, fetches them first
// (SPEC.md section 16).
//
// A profile is a hint, never content: every byte still comes from the
// snapshot's own verified chunks. A profile names its subject, the
// snapshot's index digest, and one of another snapshot is never used;
// ranges outside the snapshot's files are dropped with a warning; a
// profile over the size or range limits is refused whole.
//
// In a registry a profile is an OCI artifact (ArtifactType) whose subject
// is the snapshot's index, found with the referrers API (or the referrers
// tag schema where the API is missing, as oras-go falls back to).
package profile

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"sort"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
)

// MediaType is a profile document's media type; ArtifactType the
// artifactType of the manifest that carries one in a registry.
const (
	MediaType    = "application/vnd.cryo.profile.v1+json"
	ArtifactType = MediaType
)

// Limits a profile must keep; readers refuse one past them.
const (
	// MaxSize bounds a profile document's bytes.
	MaxSize = 4 << 20
	// MaxRanges bounds its ranges.
	MaxRanges = 65536
)

// ErrInvalid is wrapped by every error for a profile that breaks SPEC.md
// section 16.
var ErrInvalid = errors.New("invalid profile")

// Profile is a snapshot's working set.
type Profile struct {
	// MediaType is always MediaType.
	MediaType string `json:"mediaType"`
	// Subject is the index digest of the snapshot the profile is of.
	Subject digest.Digest `json:"subject"`
	// Ranges are the ranges to fetch first, in the order to fetch them:
	// first-access order, disjoint.
	Ranges []Range `json:"ranges"`
}

// Range is a byte range of a file of the snapshot, with when it was first
// asked for.
type Range struct {
	Path   string `json:"path"`
	Offset int64  `json:"offset"`
	Length int64  `json:"length"`
	// AtMillis is when the range was first asked for, in milliseconds
	// since the sandbox's first read of pages.img.
	AtMillis int64 `json:"atMillis"`
}

// Bytes is the sum of the ranges' lengths.
func (p *Profile) Bytes() int64 {
	var n int64
	for _, r := range p.Ranges {
		n += r.Length
	}
	return n
}

// Encode returns the profile document: compact JSON, fields in the order
// of the Go types (SPEC.md 16.1).
func (p *Profile) Encode() ([]byte, error) {
	q := *p
	q.MediaType = MediaType
	if q.Ranges == nil {
		q.Ranges = []Range{}
	}
	data, err := json.Marshal(q)
	if err != nil {
		return nil, err
	}
	if len(data) > MaxSize {
		return nil, fmt.Errorf("profile of %d ranges is %d bytes, over %d: %w", len(p.Ranges), len(data), MaxSize, ErrInvalid)
	}
	return data, nil
}

// Parse reads a profile document, refusing one past the limits, with a
// key given twice or in another case, an unknown field, a bad subject, or
// a range that is empty, negative or overlaps another of its file.
func Parse(data []byte) (*Profile, error) {
	if len(data) > MaxSize {
		return nil, fmt.Errorf("profile is %d bytes, over %d: %w", len(data), MaxSize, ErrInvalid)
	}
	if err := format.CheckKeys(data); err != nil {
		return nil, fmt.Errorf("profile: %v: %w", err, ErrInvalid)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var doc document
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("profile: %v: %w", err, ErrInvalid)
	}
	if dec.More() {
		return nil, fmt.Errorf("profile: data after the JSON object: %w", ErrInvalid)
	}
	p, err := doc.profile()
	if err != nil {
		return nil, err
	}
	if p.MediaType != MediaType {
		return nil, fmt.Errorf("profile: mediaType %q, want %q: %w", p.MediaType, MediaType, ErrInvalid)
	}
	if err := p.Subject.Validate(); err != nil {
		return nil, fmt.Errorf("profile: subject %q: %v: %w", p.Subject, err, ErrInvalid)
	}
	if len(p.Ranges) > MaxRanges {
		return nil, fmt.Errorf("profile: %d ranges, over %d: %w", len(p.Ranges), MaxRanges, ErrInvalid)
	}
	if err := checkDisjoint(p.Ranges); err != nil {
		return nil, err
	}
	return p, nil
}

// document is a profile as read: every member must be there (SPEC 16.1).
type document struct {
	MediaType *string     `json:"mediaType"`
	Subject   *string     `json:"subject"`
	Ranges    *[]rawRange `json:"ranges"`
}

type rawRange struct {
	Path     *string `json:"path"`
	Offset   *int64  `json:"offset"`
	Length   *int64  `json:"length"`
	AtMillis *int64  `json:"atMillis"`
}

// profile returns the profile d holds, refusing one without a member.
func (d document) profile() (*Profile, error) {
	if d.MediaType == nil || d.Subject == nil || d.Ranges == nil {
		return nil, fmt.Errorf("profile: want mediaType, subject and ranges: %w", ErrInvalid)
	}
	p := &Profile{MediaType: *d.MediaType, Subject: digest.Digest(*d.Subject), Ranges: make([]Range, len(*d.Ranges))}
	for i, r := range *d.Ranges {
		if r.Path == nil || r.Offset == nil || r.Length == nil || r.AtMillis == nil {
			return nil, fmt.Errorf("profile: range %d: want path, offset, length and atMillis: %w", i, ErrInvalid)
		}
		p.Ranges[i] = Range{Path: *r.Path, Offset: *r.Offset, Length: *r.Length, AtMillis: *r.AtMillis}
	}
	return p, nil
}

// checkDisjoint refuses empty or negative ranges and ranges of one file
// that overlap.
func checkDisjoint(rs []Range) error {
	byPath := map[string][]Range{}
	for i, r := range rs {
		if r.Offset < 0 || r.Length <= 0 || r.Offset > (1<<62)-r.Length || r.AtMillis < 0 {
			return fmt.Errorf("profile: range %d (%s, offset %d, length %d, at %d ms): %w", i, r.Path, r.Offset, r.Length, r.AtMillis, ErrInvalid)
		}
		if err := format.ValidatePath(r.Path); err != nil {
			return fmt.Errorf("profile: range %d: %v: %w", i, err, ErrInvalid)
		}
		byPath[r.Path] = append(byPath[r.Path], r)
	}
	for path, rs := range byPath {
		sort.Slice(rs, func(i, j int) bool { return rs[i].Offset < rs[j].Offset })
		for i := 1; i < len(rs); i++ {
			if rs[i].Offset < rs[i-1].Offset+rs[i-1].Length {
				return fmt.Errorf("profile: ranges of %s at %d and %d overlap: %w", path, rs[i-1].Offset, rs[i].Offset, ErrInvalid)
			}
		}
	}
	return nil
}

// For returns the ranges of p that lie within snapshot snap's files, and
// a warning for what it dropped. It refuses a profile of another
// snapshot: a profile is used only for its subject.
func (p *Profile) For(snap *format.Snapshot) ([]Range, []string, error) {
	if p.Subject != snap.Descriptor.Digest {
		return nil, nil, fmt.Errorf("profile is of snapshot %s, not %s: %w", p.Subject, snap.Descriptor.Digest, ErrInvalid)
	}
	var out []Range
	var warnings []string
	dropped := map[string]int{}
	for _, r := range p.Ranges {
		f := snap.File(r.Path)
		if f == nil || r.Offset+r.Length > f.Size {
			dropped[r.Path]++
			continue
		}
		out = append(out, r)
	}
	paths := make([]string, 0, len(dropped))
	for path := range dropped {
		paths = append(paths, path)
	}
	sort.Strings(paths)
	for _, path := range paths {
		warnings = append(warnings, fmt.Sprintf("profile: %d ranges of %q lie outside the snapshot's files: ignored", dropped[path], path))
	}
	return out, warnings, nil
}

// Merge merges profiles of one snapshot into one: every byte any of them
// names, each at the earliest time one of them first asked for it, in
// that order (ties by path and offset), adjacent pieces of one file asked
// for at the same time joined, at most MaxRanges ranges and MaxSize
// encoded (the latest dropped). Profiles of other subjects than the first's are skipped. It
// returns nil for no profiles.
func Merge(ps ...*Profile) *Profile {
	if len(ps) == 0 {
		return nil
	}
	subject := ps[0].Subject
	var all []Range
	for _, p := range ps {
		if p.Subject == subject {
			all = append(all, p.Ranges...)
		}
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if a.AtMillis != b.AtMillis {
			return a.AtMillis < b.AtMillis
		}
		if a.Path != b.Path {
			return a.Path < b.Path
		}
		return a.Offset < b.Offset
	})
	var cov coverage
	out := &Profile{MediaType: MediaType, Subject: subject}
	size := 0
	for _, r := range all {
		for _, piece := range cov.add(r.Path, r.Offset, r.Offset+r.Length) {
			if size += encodedSize(r); len(out.Ranges) == MaxRanges || size > encodedBudget {
				return out
			}
			out.append(Range{Path: r.Path, Offset: piece.start, Length: piece.end - piece.start, AtMillis: r.AtMillis})
		}
	}
	return out
}

// encodedBudget is the bytes of ranges a profile grows to at most: its
// limit, less room for the rest of the document and for joined ranges'
// longer lengths.
const encodedBudget = MaxSize - 64<<10

// encodedSize is about the bytes r adds to an encoded profile.
func encodedSize(r Range) int {
	path, _ := json.Marshal(r.Path)
	return len(path) + 48 + 3*20
}

// append adds r, joined to the last range if it continues it.
func (p *Profile) append(r Range) {
	if n := len(p.Ranges); n > 0 {
		last := &p.Ranges[n-1]
		if last.Path == r.Path && last.Offset+last.Length == r.Offset && last.AtMillis == r.AtMillis {
			last.Length += r.Length
			return
		}
	}
	p.Ranges = append(p.Ranges, r)
}
