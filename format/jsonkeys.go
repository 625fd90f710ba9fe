package format

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"
)

// knownKeys are the JSON keys of every document cryo reads (indexes,
// manifests, descriptors, chunk tables), by their lowercase form.
var knownKeys = func() map[string]string {
	m := map[string]string{}
	for _, k := range knownList {
		m[strings.ToLower(k)] = k
	}
	return m
}()

// knownExact holds the known keys as spelt.
var knownExact = func() map[string]struct{} {
	m := map[string]struct{}{}
	for _, k := range knownList {
		m[k] = struct{}{}
	}
	return m
}()

var knownList = []string{
	// OCI index, manifest and descriptor
	"schemaVersion", "mediaType", "artifactType", "manifests", "config", "layers", "subject",
	"annotations", "digest", "size", "urls", "data", "platform",
	// chunk tables
	"path", "mode", "part", "parts", "offset", "length", "chunker", "chunks", "packs",
	"encoding", "blob", "blobSize", "pack", "packOffset", "packLength",
	"algorithm", "min", "avg", "max",
}

// CheckKeys checks the keys of every object in the JSON document data as
// SPEC.md section 8 requires: no key twice in one object, and no key that
// is a known key spelt in another case. encoding/json alone would take the
// last of duplicates and match keys case-insensitively, so that two
// readers in different languages could see two different tables in one
// blob. Annotation keys are exempt from the case rule (they are any
// strings), not from the duplicate rule. The document must be UTF-8 too
// (RFC 8259): encoding/json would read invalid bytes in a string as
// U+FFFD, another path than the one written.
//
// The keys are found by a scanner of its own (keyScanner): walking the
// document with encoding/json's Token allocates per token and took half
// the time a mount spends loading v2 chunk tables. CheckKeys does not
// check the JSON syntax: callers decode the document with encoding/json
// afterwards, which does. The scanner only has to be right about keys in
// valid JSON, and fails (never panics) on what it does not understand.
func CheckKeys(data []byte) error {
	if !utf8.Valid(data) {
		return fmt.Errorf("not UTF-8")
	}
	if err := checkSurrogates(data); err != nil {
		return err
	}
	s := keyScanner{data: data}
	if err := s.value(false, 0); err != nil {
		return err
	}
	if s.ws(); s.i != len(data) {
		return fmt.Errorf("data after the JSON value")
	}
	return nil
}

// maxDepth bounds the nesting of a document, as encoding/json does.
const maxDepth = 10000

// keyScanner walks a JSON document and checks the keys of its objects.
type keyScanner struct {
	data []byte
	i    int
}

func (s *keyScanner) ws() {
	for s.i < len(s.data) {
		switch s.data[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *keyScanner) syntax(what string) error {
	return fmt.Errorf("JSON syntax: %s at offset %d", what, s.i)
}

// value reads one value; free says the keys of an object here are
// free-form (annotations).
func (s *keyScanner) value(free bool, depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("JSON nested deeper than %d", maxDepth)
	}
	if s.ws(); s.i >= len(s.data) {
		return s.syntax("unexpected end")
	}
	switch s.data[s.i] {
	case '{':
		s.i++
		return s.object(free, depth+1)
	case '[':
		s.i++
		if s.ws(); s.i < len(s.data) && s.data[s.i] == ']' {
			s.i++
			return nil
		}
		for {
			if err := s.value(false, depth+1); err != nil {
				return err
			}
			if s.ws(); s.i >= len(s.data) {
				return s.syntax("unexpected end in an array")
			}
			switch s.data[s.i] {
			case ',':
				s.i++
			case ']':
				s.i++
				return nil
			default:
				return s.syntax("want , or ]")
			}
		}
	case '"':
		_, _, err := s.str()
		return err
	default: // a number, true, false or null
		start := s.i
		for s.i < len(s.data) && !strings.ContainsRune(",]} \t\n\r", rune(s.data[s.i])) {
			s.i++
		}
		if s.i == start {
			return s.syntax("want a value")
		}
		return nil
	}
}

// str reads a string at s.i and returns its raw bytes (between the
// quotes) and whether it holds escapes.
func (s *keyScanner) str() ([]byte, bool, error) {
	escaped := false
	for j := s.i + 1; j < len(s.data); j++ {
		switch s.data[j] {
		case '\\':
			escaped = true
			j++
		case '"':
			raw := s.data[s.i+1 : j]
			s.i = j + 1
			return raw, escaped, nil
		}
	}
	return nil, false, s.syntax("unterminated string")
}

// object reads the members of an object whose { was read.
func (s *keyScanner) object(free bool, depth int) error {
	if s.ws(); s.i < len(s.data) && s.data[s.i] == '}' {
		s.i++
		return nil
	}
	var seen []string // objects of cryo's documents have few keys
	var seenMap map[string]bool
	for {
		if s.ws(); s.i >= len(s.data) || s.data[s.i] != '"' {
			return s.syntax("want a key")
		}
		start := s.i
		raw, escaped, err := s.str()
		if err != nil {
			return err
		}
		k := string(raw)
		if escaped {
			if err := json.Unmarshal(s.data[start:s.i], &k); err != nil {
				return fmt.Errorf("key at offset %d: %v", start, err)
			}
		}
		if seenMap == nil && len(seen) < 16 {
			if slices.Contains(seen, k) {
				return fmt.Errorf("key %q twice in one object", k)
			}
			seen = append(seen, k)
		} else {
			if seenMap == nil {
				seenMap = make(map[string]bool, 2*len(seen))
				for _, x := range seen {
					seenMap[x] = true
				}
			}
			if seenMap[k] {
				return fmt.Errorf("key %q twice in one object", k)
			}
			seenMap[k] = true
		}
		if !free {
			if !isASCII(k) {
				// encoding/json folds case the Unicode way: "ſize"
				// (U+017F) would be read as "size".
				return fmt.Errorf("key %q: keys outside annotations are ASCII", k)
			}
			if _, exact := knownExact[k]; !exact {
				if want, ok := knownKeys[strings.ToLower(k)]; ok && want != k {
					return fmt.Errorf("key %q: keys are case-sensitive, want %q", k, want)
				}
			}
		}
		if s.ws(); s.i >= len(s.data) || s.data[s.i] != ':' {
			return s.syntax("want :")
		}
		s.i++
		if err := s.value(k == "annotations", depth); err != nil {
			return err
		}
		if s.ws(); s.i >= len(s.data) {
			return s.syntax("unexpected end in an object")
		}
		switch s.data[s.i] {
		case ',':
			s.i++
		case '}':
			s.i++
			return nil
		default:
			return s.syntax("want , or }")
		}
	}
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
