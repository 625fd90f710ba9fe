package format

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"unicode/utf8"
)

// FuzzCheckKeys holds CheckKeys' scanner to what encoding/json's own
// tokenizer sees: on every valid JSON document, the scanner and a walk of
// encoding/json's tokens (the implementation the scanner replaced, kept
// here as the oracle) must agree on whether the keys pass.
func FuzzCheckKeys(f *testing.F) {
	for _, seed := range []string{
		`{"size":1,"chunks":[{"digest":"sha256:00","size":2}]}`,
		`{"size":1,"Size":2}`, `{"a":1,"a":2}`, `{"annotations":{"Size":"x","k":"v"}}`,
		`{"annotations":{"k":"v","k":"w"}}`, `{"s\u0069ze":1,"size":2}`, `[{"x":[{"y":{}}]}, 1, "s", null]`,
		`{"ſize":1}`, `{"a":{"b":{"c":[true,false,-1.5e3]}}}`, `  {"a" : "\"}{" , "b":[ ] } `,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		got := CheckKeys(data) // on any input: must not panic or hang
		if !json.Valid(data) {
			return
		}
		want := oracleCheckKeys(data)
		if (got == nil) != (want == nil) {
			t.Fatalf("CheckKeys(%q) = %v, encoding/json's tokens say %v", data, got, want)
		}
	})
}

// oracleCheckKeys is CheckKeys on encoding/json's tokens.
func oracleCheckKeys(data []byte) error {
	if !utf8.Valid(data) {
		return errors.New("not UTF-8")
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
		return errors.New("data after the JSON value")
	}
	return nil
}

// checkValue reads one value from dec and checks the keys of the objects
// in it with encoding/json's tokenizer; free says the keys of this object
// are free-form (annotations).
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
