package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cryo-oci/cryo/format"
	"oras.land/oras-go/v2/content/oci"
)

// TestInspectEscapesControlCharacters packs a snapshot whose file path and
// runsc version annotation hold a terminal escape ("\x1b[2J" clears the
// screen) and a newline that forges a line of output, and checks that
// `cryo inspect` prints them escaped, and ordinary paths as they are.
func TestInspectEscapesControlCharacters(t *testing.T) {
	ctx := context.Background()
	src := t.TempDir()
	evilPath := "evil\x1b[2J\nforged.img"
	evilVersion := "release-1\x1b[2J\nforged: annotation"
	md, _ := json.Marshal(map[string]string{"runsc_version": evilVersion})
	var ckpt bytes.Buffer
	ckpt.WriteString("gVisorSF")
	binary.Write(&ckpt, binary.BigEndian, uint64(len(md)))
	ckpt.Write(md)
	for name, data := range map[string][]byte{"checkpoint.img": ckpt.Bytes(), "pages.img": []byte("pages"), evilPath: []byte("x")} {
		if err := os.WriteFile(filepath.Join(src, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	layoutDir := t.TempDir()
	store, err := oci.New(layoutDir)
	if err != nil {
		t.Fatal(err)
	}
	desc, _, err := format.Pack(ctx, src, store, format.PackOptions{})
	if err != nil {
		t.Fatal(err)
	}

	cmd := newInspectCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs([]string{layoutDir + "@" + desc.Digest.String()})
	if err := cmd.ExecuteContext(ctx); err != nil {
		t.Fatal(err)
	}
	text := out.String()
	t.Logf("output:\n%s", text)
	if strings.Contains(text, "\x1b") {
		t.Error("output holds a raw escape character")
	}
	for _, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(line, "forged") {
			t.Errorf("a newline in the snapshot forged the output line %q", line)
		}
	}
	for _, want := range []string{`"evil\x1b[2J\nforged.img"`, `"release-1\x1b[2J\nforged: annotation"`, "\npages.img "} {
		if !strings.Contains(text, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"pages.img":         "pages.img",
		"fs/sub dir/x.img":  "fs/sub dir/x.img",
		"données/ünïcode":   "données/ünïcode",
		"a\tb":              `"a\tb"`,
		"a\x1b[2Jb":         `"a\x1b[2Jb"`,
		"line\nbreak":       `"line\nbreak"`,
		"bidi\u202etxt.img": `"bidi\u202etxt.img"`,
		"bad\xffutf8":       `"bad\xffutf8"`,
		`"quoted"`:          `"\"quoted\""`,
		"":                  "",
	} {
		if got := printable(in); got != want {
			t.Errorf("printable(%q) = %s, want %s", in, got, want)
		}
	}
}
