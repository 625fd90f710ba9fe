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
