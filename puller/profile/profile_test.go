package profile

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

var subject = digest.FromString("snapshot index")

func TestEncodeParseRoundTrip(t *testing.T) {
	p := &Profile{Subject: subject, Ranges: []Range{
		{Path: "pages.img", Offset: 4096, Length: 8192, AtMillis: 3},
		{Path: "pages.img", Offset: 0, Length: 4096, AtMillis: 7},
		{Path: "checkpoint.img", Offset: 0, Length: 10, AtMillis: 0},
	}}
	data, err := p.Encode()
	if err != nil {
		t.Fatal(err)
	}
	want := `{"mediaType":"application/vnd.cryo.profile.v1+json","subject":"` + subject.String() + `","ranges":[{"path":"pages.img","offset":4096,"length":8192,"atMillis":3},`
	if !strings.HasPrefix(string(data), want) {
		t.Errorf("encoded as\n%s\nwant it to start with\n%s", data, want)
	}
	got, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	p.MediaType = MediaType
	if !reflect.DeepEqual(got, p) {
		t.Errorf("parsed %+v, want %+v", got, p)
	}
	if got.Bytes() != 8192+4096+10 {
		t.Errorf("Bytes %d", got.Bytes())
	}
}

// TestParseRefuses: every kind of bad profile is refused with ErrInvalid.
func TestParseRefuses(t *testing.T) {
	head := `{"mediaType":"application/vnd.cryo.profile.v1+json","subject":"` + subject.String() + `","ranges":`
	many := make([]string, MaxRanges+1)
	for i := range many {
		many[i] = fmt.Sprintf(`{"path":"pages.img","offset":%d,"length":1,"atMillis":0}`, i)
	}
	for name, doc := range map[string]string{
		"another media type":       strings.Replace(head, "profile.v1", "profile.v9", 1) + `[]}`,
		"bad subject":              strings.Replace(head, subject.String(), "sha256:1234", 1) + `[]}`,
		"unknown field":            head + `[], "extra": 1}`,
		"key twice":                head + `[{"path":"pages.img","offset":0,"offset":8192,"length":1,"atMillis":0}]}`,
		"key in another case":      head + `[{"Path":"pages.img","offset":0,"length":1,"atMillis":0}]}`,
		"empty range":              head + `[{"path":"pages.img","offset":0,"length":0,"atMillis":0}]}`,
		"negative offset":          head + `[{"path":"pages.img","offset":-1,"length":1,"atMillis":0}]}`,
		"negative time":            head + `[{"path":"pages.img","offset":0,"length":1,"atMillis":-5}]}`,
		"huge range":               head + `[{"path":"pages.img","offset":9223372036854775000,"length":9000,"atMillis":0}]}`,
		"overlap":                  head + `[{"path":"pages.img","offset":0,"length":8192,"atMillis":0},{"path":"pages.img","offset":4096,"length":1,"atMillis":1}]}`,
		"path traversal":           head + `[{"path":"../etc/shadow","offset":0,"length":1,"atMillis":0}]}`,
		"trailing data":            head + `[]} {}`,
		"too many ranges":          head + `[` + strings.Join(many, ",") + `]}`,
		"oversize":                 head + `[]}` + strings.Repeat(" ", MaxSize),
		"no ranges":                strings.TrimSuffix(head, `,"ranges":`) + `}`,
		"a range without its time": head + `[{"path":"pages.img","offset":0,"length":1}]}`,
	} {
		if _, err := Parse([]byte(doc)); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: Parse: %v, want ErrInvalid", name, err)
		}
	}
}

// TestForDropsOutsideAndRefusesOtherSubject: a profile is used only for
// its own snapshot, and only its ranges within the snapshot's files.
func TestForDropsOutsideAndRefusesOtherSubject(t *testing.T) {
	snap := &format.Snapshot{Descriptor: ocispec.Descriptor{Digest: subject}, Files: []format.File{{Path: "checkpoint.img", Size: 100}, {Path: "pages.img", Size: 1 << 20}}}
	p := &Profile{Subject: subject, Ranges: []Range{
		{Path: "pages.img", Offset: 0, Length: 4096},
		{Path: "pages.img", Offset: 1<<20 - 4096, Length: 8192}, // past the end
		{Path: "nothere.img", Offset: 0, Length: 1},
		{Path: "checkpoint.img", Offset: 0, Length: 100},
	}}
	got, warnings, err := p.For(snap)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Range{p.Ranges[0], p.Ranges[3]}; !reflect.DeepEqual(got, want) {
		t.Errorf("For kept %+v, want %+v", got, want)
	}
	if len(warnings) != 2 {
		t.Errorf("warnings %q, want one per file with ranges dropped", warnings)
	}
	other := *p
	other.Subject = digest.FromString("another snapshot")
	if _, _, err := other.For(snap); !errors.Is(err, ErrInvalid) {
		t.Errorf("a profile of another snapshot: %v, want ErrInvalid", err)
	}
}

// TestMerge: the union of the profiles, each byte at the earliest time
// any of them asked for it, in that order, without overlaps; profiles of
// another subject are left out.
func TestMerge(t *testing.T) {
	a := &Profile{Subject: subject, Ranges: []Range{
		{Path: "pages.img", Offset: 0, Length: 8192, AtMillis: 10},
		{Path: "pages.img", Offset: 1 << 20, Length: 4096, AtMillis: 20},
	}}
	b := &Profile{Subject: subject, Ranges: []Range{
		{Path: "pages.img", Offset: 4096, Length: 8192, AtMillis: 5},
		{Path: "pages.img", Offset: 2 << 20, Length: 4096, AtMillis: 30},
	}}
	c := &Profile{Subject: digest.FromString("other"), Ranges: []Range{{Path: "pages.img", Offset: 8 << 20, Length: 4096}}}
	got := Merge(a, b, c)
	want := []Range{
		{Path: "pages.img", Offset: 4096, Length: 8192, AtMillis: 5},
		{Path: "pages.img", Offset: 0, Length: 4096, AtMillis: 10},
		{Path: "pages.img", Offset: 1 << 20, Length: 4096, AtMillis: 20},
		{Path: "pages.img", Offset: 2 << 20, Length: 4096, AtMillis: 30},
	}
	if !reflect.DeepEqual(got.Ranges, want) || got.Subject != subject {
		t.Errorf("merged %+v, want %+v", got.Ranges, want)
	}
	if data, err := got.Encode(); err != nil {
		t.Error(err)
	} else if _, err := Parse(data); err != nil {
		t.Errorf("merged profile does not parse: %v", err)
	}
}

// TestRecorder: waited reads are recorded in first-access order with
// their times, bytes already recorded add nothing, adjacent reads asked
// for together join, FUSE reads are told apart by the classifier, a page
// fault extends the bound, and nothing is recorded after the longest
// recording (MaxRecording).
func TestRecorder(t *testing.T) {
	start := time.Unix(1000, 0)
	now := start
	r := NewRecorder(subject, time.Second)
	r.now = func() time.Time { return now }
	const mib = 1 << 20
	now = start.Add(100 * time.Millisecond)
	r.Waited("pages.img", 40*mib, mib)
	r.Waited("pages.img", 41*mib, mib)  // continues it: joined
	r.Waited("pages.img", 40*mib, 4096) // recorded already
	r.Read("pages.img", 0, mib)         // the sweep: not recorded
	r.Read("pages.img", mib, mib)       // the sweep
	now = start.Add(300 * time.Millisecond)
	r.Read("pages.img", 90*mib, 4096)        // a fault far ahead
	r.Waited("checkpoint.img", 0, 100)       // other files: waited on
	now = start.Add(1200 * time.Millisecond) // past a second after the first read, but the faults extended it
	r.Waited("pages.img", 70*mib, mib)
	now = start.Add(4200 * time.Millisecond) // past MaxRecording (4 s) after the first read
	r.Waited("pages.img", 60*mib, mib)
	got := r.Profile()
	want := []Range{
		{Path: "pages.img", Offset: 40 * mib, Length: 2 * mib, AtMillis: 0},
		{Path: "pages.img", Offset: 90 * mib, Length: 4096, AtMillis: 200},
		{Path: "checkpoint.img", Offset: 0, Length: 100, AtMillis: 200},
		{Path: "pages.img", Offset: 70 * mib, Length: mib, AtMillis: 1100},
	}
	if !reflect.DeepEqual(got.Ranges, want) || got.Subject != subject {
		t.Errorf("recorded %+v, want %+v", got.Ranges, want)
	}
	r.Stop()
	now = start.Add(200 * time.Millisecond)
	r.Waited("pages.img", 80*mib, mib)
	if n := len(r.Profile().Ranges); n != 4 {
		t.Errorf("%d ranges after Stop, want 4", n)
	}
}

// TestRecorderGoesOnWhileTheAppFaults: past its bound, a recording goes
// on until RecordQuiet after the last page fault it recorded, not after
// a read of another file, and stops once the app has not faulted for
// that long.
func TestRecorderGoesOnWhileTheAppFaults(t *testing.T) {
	start := time.Unix(1000, 0)
	now := start
	r := NewRecorder(subject, 20*time.Second)
	r.now = func() time.Time { return now }
	const mib = 1 << 20
	at := func(d time.Duration, path string, off int64) {
		now = start.Add(d)
		r.Waited(path, off, mib)
	}
	at(0, "pages.img", 0)
	at(15*time.Second, "pages.img", 10*mib) // extends the bound to 25 s
	at(24*time.Second, "pages.img", 20*mib) // recorded; extends it to 34 s
	at(30*time.Second, "checkpoint.img", 0) // recorded; extends nothing
	at(35*time.Second, "pages.img", 30*mib) // 11 s after the last fault: not recorded
	var offs []int64
	for _, rg := range r.Profile().Ranges {
		offs = append(offs, rg.Offset)
	}
	if want := []int64{0, 10 * mib, 20 * mib, 0}; !reflect.DeepEqual(offs, want) {
		t.Errorf("recorded offsets %v, want %v", offs, want)
	}
	if want := start.Add(34 * time.Second); !r.Until().Equal(want) {
		t.Errorf("Until %v, want %v", r.Until(), want)
	}
	r.Stop()
	if !r.Until().Equal(start) {
		t.Errorf("Until after Stop %v, want the first read, %v", r.Until(), start)
	}
}

// TestRecorderStaysEncodable: however many reads it sees, a recording
// encodes within MaxSize (65,536 ranges with a long path would not).
func TestRecorderStaysEncodable(t *testing.T) {
	r := NewRecorder(subject, time.Hour)
	long := strings.Repeat("d/", 60) + "pages-of-a-long-name.img"
	for i := range int64(MaxRanges + 10) {
		r.Waited(long, 1<<40+i*8192, 4096) // never adjacent: one range each
	}
	p := r.Profile()
	data, err := p.Encode()
	if err != nil {
		t.Fatalf("a full recording of %d ranges does not encode: %v", len(p.Ranges), err)
	}
	if _, err := Parse(data); err != nil {
		t.Fatal(err)
	}
	if len(p.Ranges) < 1000 {
		t.Errorf("only %d ranges recorded", len(p.Ranges))
	}
}
