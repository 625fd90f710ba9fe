package format

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// knownKeys are the JSON keys of every document cryo reads (indexes,
// manifests, descriptors, chunk tables), by their lowercase form.
var knownKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range []string{
		// OCI index, manifest and descriptor
		"schemaVersion", "mediaType", "artifactType", "manifests", "config", "layers", "subject",
		"annotations", "digest", "size", "urls", "data", "platform",
		// chunk tables
		"path", "mode", "part", "parts", "offset", "length", "chunker", "chunks", "packs",
		"encoding", "blob", "blobSize", "pack", "packOffset", "packLength",
		"algorithm", "min", "avg", "max",
	} {
		m[strings.ToLower(k)] = k
	}
	return m
}()

// CheckKeys checks the keys of every object in the JSON document data as
// SPEC.md section 8 requires: no key twice in one object, and no key that
// is a known key spelt in another case. encoding/json alone would take the
// last of duplicates and match keys case-insensitively, so that two
// readers in different languages could see two different tables in one
// blob. Annotation keys are exempt from the case rule (they are any
// strings), not from the duplicate rule. The document must be UTF-8 too
// (RFC 8259): encoding/json would read invalid bytes in a string as
// U+FFFD, another path than the one written.
func CheckKeys(data []byte) error {
	if !utf8.Valid(data) {
		return fmt.Errorf("not UTF-8")
	}
	if err := checkSurrogates(data); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := checkValue(dec, false); err != nil {
		return err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("data after the JSON value")
	}
	return nil
}

// checkValue reads one value from dec and checks the keys of the objects
// in it; free says the keys of this object are free-form (annotations).
func checkValue(dec *json.Decoder, free bool) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch tok {
	case json.Delim('{'):
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return err
			}
			k := kt.(string)
			if seen[k] {
				return fmt.Errorf("key %q twice in one object", k)
			}
			seen[k] = true
			if !free && !isASCII(k) {
				// encoding/json folds case the Unicode way: "ſize"
				// (U+017F) would be read as "size".
				return fmt.Errorf("key %q: keys outside annotations are ASCII", k)
			}
			if want, ok := knownKeys[strings.ToLower(k)]; ok && !free && want != k {
				return fmt.Errorf("key %q: keys are case-sensitive, want %q", k, want)
			}
			if err := checkValue(dec, k == "annotations"); err != nil {
				return err
			}
		}
		_, err := dec.Token() // }
		return err
	case json.Delim('['):
		for dec.More() {
			if err := checkValue(dec, false); err != nil {
				return err
			}
		}
		_, err := dec.Token() // ]
		return err
	}
	return nil
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= 0x80 {
			return false
		}
	}
	return true
}

// checkSurrogates refuses a \u escape of a lone UTF-16 surrogate in a
// JSON string: encoding/json reads it as U+FFFD, other readers keep it or
// fail. data is UTF-8 JSON; only string contents are looked at.
func checkSurrogates(data []byte) error {
	inString := false
	for i := 0; i < len(data); i++ {
		c := data[i]
		if !inString {
			if c == '"' {
				inString = true
			}
			continue
		}
		switch c {
		case '"':
			inString = false
		case '\\':
			if i+1 < len(data) && data[i+1] == 'u' {
				r, ok := hex4(data, i+2)
				switch {
				case !ok:
				case r >= 0xD800 && r <= 0xDBFF:
					lo, ok := -1, false
					if i+7 < len(data) && data[i+6] == '\\' && data[i+7] == 'u' {
						var v int
						v, ok = hex4(data, i+8)
						lo = v
					}
					if !ok || lo < 0xDC00 || lo > 0xDFFF {
						return fmt.Errorf("a lone UTF-16 surrogate \\u%04x in a string", r)
					}
					i += 11
					continue
				case r >= 0xDC00 && r <= 0xDFFF:
					return fmt.Errorf("a lone UTF-16 surrogate \\u%04x in a string", r)
				}
			}
			i++ // the escaped character
		}
	}
	return nil
}

// hex4 parses the 4 hex digits at data[i:].
func hex4(data []byte, i int) (int, bool) {
	if i+4 > len(data) {
		return 0, false
	}
	v := 0
	for _, c := range data[i : i+4] {
		switch {
		case c >= '0' && c <= '9':
			v = v<<4 | int(c-'0')
		case c >= 'a' && c <= 'f':
			v = v<<4 | int(c-'a'+10)
		case c >= 'A' && c <= 'F':
			v = v<<4 | int(c-'A'+10)
		default:
			return 0, false
		}
	}
	return v, true
}
