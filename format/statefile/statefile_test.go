package statefile

import (
	"bytes"
	"errors"
	"io"
	"maps"
	"strings"
	"testing"
)

// TestHeaderRoundTrip checks Header's framing byte for byte (gVisor's:
// magic, big-endian length, JSON) and that ReadMetadata reads it back and
// stops at the state stream.
func TestHeaderRoundTrip(t *testing.T) {
	md := map[string]string{KeyRunscVersion: "release-1", KeyTimestamp: "2026-11-30 00:00:00 +0000 UTC"}
	hdr := Header(md)
	js := `{"_timestamp":"2026-11-30 00:00:00 +0000 UTC","runsc_version":"release-1"}`
	want := append([]byte("gVisorSF\x00\x00\x00\x00\x00\x00\x00"), byte(len(js)))
	if want = append(want, js...); !bytes.Equal(hdr, want) {
		t.Fatalf("Header = %q, want %q", hdr, want)
	}
	r := bytes.NewReader(append(hdr, "state stream"...))
	got, err := ReadMetadata(r)
	if err != nil {
		t.Fatal(err)
	}
	if !maps.Equal(got, md) {
		t.Fatalf("ReadMetadata = %v, want %v", got, md)
	}
	if rest, _ := io.ReadAll(r); string(rest) != "state stream" {
		t.Fatalf("after the header, the reader is at %q", rest)
	}
}

func TestReadMetadataRefusesBadHeaders(t *testing.T) {
	huge := []byte("gVisorSF\x00\x00\x00\x00\x01\x00\x00\x01")
	cases := []struct {
		name string
		in   []byte
		// sentinel, or else a substring of the error.
		is   error
		want string
	}{
		{"empty", nil, ErrNotStateFile, ""},
		{"short", []byte("gVisorSF\x00"), ErrNotStateFile, ""},
		{"bad magic", []byte("notGVisor\x00\x00\x00\x00\x00\x00\x02{}"), ErrNotStateFile, ""},
		{"huge length", huge, nil, "exceeds 16777216"},
		{"truncated metadata", []byte("gVisorSF\x00\x00\x00\x00\x00\x00\x00\x10{}"), io.ErrUnexpectedEOF, ""},
		{"not json", append([]byte("gVisorSF\x00\x00\x00\x00\x00\x00\x00\x02"), "]["...), nil, "decode state file metadata"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadMetadata(bytes.NewReader(c.in))
			if err == nil || (c.is != nil && !errors.Is(err, c.is)) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("ReadMetadata: %v, want %v %q", err, c.is, c.want)
			}
		})
	}
}
