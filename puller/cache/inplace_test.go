package cache

import (
	"bytes"
	"context"
	"os"
	"syscall"
	"testing"
)

// TestAssemblyInPlace asks an assembly where ranges of its pages.img lie
// in place as its chunks arrive: a range is in place only once every
// chunk it overlaps was written from verified bytes (a zero chunk is in
// place from the start: the file's hole), the file named holds the
// range's bytes at the same offsets and has the device and inode numbers
// given, and nothing is in place once the assembly is committed (its
// dir renamed) or for a range past the file's end.
func TestAssemblyInPlace(t *testing.T) {
	s, err := Open(t.TempDir(), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	a, b, c := randomBytes(1, 20000), randomBytes(2, 12288), randomBytes(3, 4096)
	ts := newTestSnapshot("in place", map[string][][]byte{
		"checkpoint.img": {randomBytes(4, 3000)},
		"pages.img":      {a, nil, b, c},
	})
	const pages = 1 // newTestSnapshot's order: checkpoint.img, pages.img
	zeroAt, bAt, cAt := int64(len(a)), int64(len(a)+zeroSize), int64(len(a)+zeroSize+len(b))
	size := cAt + int64(len(c))
	asm, err := s.Assemble(ts.snap, ts.chunks)
	if err != nil {
		t.Fatal(err)
	}
	defer asm.Release()
	inPlace := func(off, n int64) bool {
		_, ok := asm.InPlace(pages, off, n)
		return ok
	}
	if inPlace(0, 100) {
		t.Error("a range of a chunk not yet written is in place")
	}
	if !inPlace(zeroAt+100, 1000) {
		t.Error("a range of a zero chunk is not in place: the file's hole holds it")
	}
	if err := s.PutVerified(ts.chunks[pages][2].Digest, b); err != nil {
		t.Fatal(err)
	}
	if !inPlace(zeroAt, bAt+int64(len(b))-zeroAt) {
		t.Error("a zero chunk and a chunk written are not in place")
	}
	if inPlace(bAt+10, cAt+1-(bAt+10)) {
		t.Error("a range ending one byte into a chunk not written is in place")
	}
	if inPlace(0, size) {
		t.Error("the whole file is in place before its first chunk is written")
	}
	ts.put(t, s)
	in, ok := asm.InPlace(pages, 0, size)
	if !ok {
		t.Fatal("the whole file is not in place once every chunk is written")
	}
	got, err := os.ReadFile(in.Path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, ts.files["pages.img"]) {
		t.Errorf("the file in place holds other bytes than pages.img")
	}
	info, err := os.Stat(in.Path)
	if err != nil {
		t.Fatal(err)
	}
	if st := info.Sys().(*syscall.Stat_t); uint64(st.Dev) != in.Dev || st.Ino != in.Ino {
		t.Errorf("device and inode %d:%d given, the file's are %d:%d", in.Dev, in.Ino, st.Dev, st.Ino)
	}
	if inPlace(size-10, 11) {
		t.Error("a range past the file's end is in place")
	}
	if inPlace(0, -1) || inPlace(0, 0) {
		t.Error("an empty range is in place")
	}
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	if inPlace(0, 100) {
		t.Error("in place after the commit renamed the assembly's dir")
	}
}
