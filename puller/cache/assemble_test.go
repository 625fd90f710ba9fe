package cache

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// testSnapshot is a snapshot made of files given as chunks of bytes (nil:
// a zero chunk of zeroSize bytes), with its table entries.
type testSnapshot struct {
	snap   *format.Snapshot
	chunks [][]format.Chunk
	files  map[string][]byte
}

const zeroSize = 8192

func newTestSnapshot(name string, files map[string][][]byte) *testSnapshot {
	ts := &testSnapshot{snap: &format.Snapshot{Descriptor: ocispec.Descriptor{Digest: digest.FromString(name)}}, files: map[string][]byte{}}
	for _, path := range []string{"checkpoint.img", "pages.img"} {
		pieces, ok := files[path]
		if !ok {
			continue
		}
		var data []byte
		var cs []format.Chunk
		for _, p := range pieces {
			c := format.Chunk{Offset: int64(len(data)), Size: int64(len(p)), Encoding: format.EncodingRaw, Digest: digest.FromBytes(p)}
			if p == nil {
				p = make([]byte, zeroSize)
				c = format.Chunk{Offset: int64(len(data)), Size: zeroSize, Encoding: format.EncodingZero}
			}
			data = append(data, p...)
			cs = append(cs, c)
		}
		ts.snap.Files = append(ts.snap.Files, format.File{Path: path, Size: int64(len(data)), Mode: 0o644, Digest: digest.FromBytes(data)})
		ts.chunks = append(ts.chunks, cs)
		ts.files[path] = data
	}
	return ts
}

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// noSource fails the test if a chunk is asked for: everything should be
// in place.
type noSource struct{ t *testing.T }

func (s noSource) Chunk(_ context.Context, c format.Chunk, _ []byte) ([]byte, error) {
	s.t.Errorf("chunk %s at %d asked for: it should be in place", c.Digest, c.Offset)
	return nil, errors.New("not here")
}

// put hands every chunk of ts to the store, as the fetch scheduler does.
func (ts *testSnapshot) put(t *testing.T, s *Store) {
	t.Helper()
	for fi, cs := range ts.chunks {
		data := ts.files[ts.snap.Files[fi].Path]
		for _, c := range cs {
			if c.Encoding == format.EncodingZero {
				continue
			}
			if err := s.PutVerified(c.Digest, data[c.Offset:c.Offset+c.Size]); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func chunkFileCount(t *testing.T, root string) int {
	t.Helper()
	n := 0
	filepath.WalkDir(filepath.Join(root, "chunks"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			n++
		}
		return err
	})
	return n
}

// TestAssemblyWritesEachByteOnce assembles a snapshot whose pages.img
// holds a chunk twice and a zero chunk: every chunk handed to the store is
// written into the snapshot's files in place (no chunk file), readable by
// digest at once, and the commit needs nothing more (no chunk asked for)
// and gives the materialized dir with the right bytes and its chunk list.
// A new process (Open) finds the chunks in that dir by the list.
func TestAssemblyWritesEachByteOnce(t *testing.T) {
	root := t.TempDir()
	s, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	a1, a2 := randomBytes(1, 20000), randomBytes(2, 12288)
	ts := newTestSnapshot("a", map[string][][]byte{
		"checkpoint.img": {randomBytes(3, 5000)},
		"pages.img":      {a1, nil, a2, a1},
	})
	asm, err := s.Assemble(ts.snap, ts.chunks)
	if err != nil {
		t.Fatal(err)
	}
	ts.put(t, s)
	if n := chunkFileCount(t, root); n != 0 {
		t.Errorf("%d chunk files written: the chunks belong in the snapshot's files", n)
	}
	d1 := digest.FromBytes(a1)
	if got, err := s.Get(d1, nil, false); err != nil || !bytes.Equal(got, a1) {
		t.Fatalf("chunk placed in the assembly: Get %v", err)
	}
	part := make([]byte, 100)
	if _, err := s.ReadAt(d1, part, 500); err != nil || !bytes.Equal(part, a1[500:600]) {
		t.Fatalf("chunk placed in the assembly: ReadAt %v", err)
	}
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	asm.Release()
	dir, ok := s.Image(ts.snap.Descriptor.Digest)
	if !ok {
		t.Fatal("not materialized")
	}
	for path, want := range ts.files {
		got, err := os.ReadFile(filepath.Join(dir, path))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("%s in the materialized dir: %v, %d bytes", path, err, len(got))
		}
	}
	if _, err := os.Stat(filepath.Join(dir, ChunkList)); err != nil {
		t.Fatalf("no chunk list: %v", err)
	}
	if got, err := s.Get(d1, nil, false); err != nil || !bytes.Equal(got, a1) {
		t.Fatalf("chunk in the committed dir: Get %v", err)
	}
	s.Close()

	s2, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	d2 := digest.FromBytes(a2)
	if !s2.Has(d1) || !s2.Has(d2) {
		t.Fatal("after a restart, the chunks of the materialized dir are not found")
	}
	if got, err := s2.Get(d2, nil, false); err != nil || !bytes.Equal(got, a2) {
		t.Fatalf("after a restart: Get %v", err)
	}
}

// TestDamagedImageDirDropped damages a chunk of a materialized dir on disk:
// a new process finds it on the chunk's first use, reports the chunk not
// found (so it is fetched again) and drops the whole dir, which a later
// mount would otherwise bind-mount.
func TestDamagedImageDirDropped(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	c := randomBytes(4, 30000)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {randomBytes(5, 4096), c}})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	ts.put(t, s)
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	asm.Release()
	s.Close()
	dir, _ := s.Image(ts.snap.Descriptor.Digest)
	f, err := os.OpenFile(filepath.Join(dir, "pages.img"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{c[100] ^ 1}, 4096+100)
	f.Close()

	s2, _ := Open(root, 0)
	defer s2.Close()
	d := digest.FromBytes(c)
	if _, err := s2.ReadAt(d, make([]byte, 10), 0); !errors.Is(err, ErrNotFound) {
		t.Fatalf("damaged chunk read: %v, want ErrNotFound", err)
	}
	if s2.Has(d) {
		t.Error("damaged chunk still offered")
	}
	if _, ok := s2.Image(ts.snap.Descriptor.Digest); ok {
		t.Error("damaged materialized dir still offered")
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("damaged materialized dir still on disk: %v", err)
	}
}

// TestChunkWrittenIntoEveryAssembly assembles two snapshots sharing a
// chunk at once: one PutVerified writes it into both, and both commit with
// nothing asked for.
func TestChunkWrittenIntoEveryAssembly(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	defer s.Close()
	shared := randomBytes(6, 40000)
	a := newTestSnapshot("a", map[string][][]byte{"pages.img": {shared, randomBytes(7, 4096)}})
	b := newTestSnapshot("b", map[string][][]byte{"pages.img": {randomBytes(8, 4096), nil, shared}})
	asmA, _ := s.Assemble(a.snap, a.chunks)
	asmB, _ := s.Assemble(b.snap, b.chunks)
	defer asmA.Release()
	defer asmB.Release()
	s.PutVerified(digest.FromBytes(shared), shared)
	a.put(t, s) // the shared chunk again: no one wants it any more
	b.put(t, s)
	for _, ts := range []*testSnapshot{a, b} {
		if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
			t.Fatal(err)
		}
		dir, ok := s.Image(ts.snap.Descriptor.Digest)
		if !ok {
			t.Fatal("not materialized")
		}
		got, _ := os.ReadFile(filepath.Join(dir, "pages.img"))
		if !bytes.Equal(got, ts.files["pages.img"]) {
			t.Fatalf("%s: wrong bytes", ts.snap.Descriptor.Digest)
		}
	}
	if n := chunkFileCount(t, root); n != 0 {
		t.Errorf("%d chunk files written", n)
	}
}

// TestReleasedAssemblyKeepsItsChunks releases an assembly that was never
// committed (its mount went away half loaded): the chunk written into it
// stays, in a partial image dir, for later loads, also after a restart
// (verified on first use), where a new assembly of the snapshot takes it
// from there instead of fetching it; the partial dir is never offered as
// the snapshot's materialized dir. An assembly that holds nothing is
// removed.
func TestReleasedAssemblyKeepsItsChunks(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	c, other := randomBytes(9, 10000), randomBytes(16, 8192)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c, other}})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	again, _ := s.Assemble(ts.snap, ts.chunks) // a second load of it joins
	d := digest.FromBytes(c)
	s.PutVerified(d, c) // only the first chunk arrives
	if st := s.Stats(); st.Bytes != int64(len(c)) || st.Chunks != 1 {
		t.Fatalf("while assembling: %+v", st)
	}
	asm.Release()
	again.Release()
	if got, err := s.Get(d, nil, false); err != nil || !bytes.Equal(got, c) {
		t.Fatalf("chunk of a released assembly: %v", err)
	}
	if _, ok := s.Image(ts.snap.Descriptor.Digest); ok {
		t.Fatal("a half-loaded snapshot offered as materialized")
	}
	if st := s.Stats(); st.Bytes != int64(len(c)) || st.Partial != 1 || st.Images != 0 {
		t.Errorf("after the release: %+v", st)
	}
	s.Close()

	s2, _ := Open(root, 0)
	defer s2.Close()
	if !s2.Has(d) {
		t.Fatal("after a restart, the chunk of the partial dir is not found")
	}
	asm2, _ := s2.Assemble(ts.snap, ts.chunks)
	defer asm2.Release()
	if !s2.Localize(d) {
		t.Fatal("a new assembly could not take the chunk from the partial dir")
	}
	s2.PutVerified(digest.FromBytes(other), other)
	if err := s2.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}

	empty := newTestSnapshot("b", map[string][][]byte{"pages.img": {randomBytes(17, 4096)}})
	asm3, _ := s2.Assemble(empty.snap, empty.chunks)
	asm3.Release()
	left, _ := filepath.Glob(filepath.Join(root, "images", digest.FromString("b").Encoded()+"*"))
	if len(left) != 0 {
		t.Errorf("an assembly that held nothing left %v", left)
	}
}

// TestImageHoldingPinnedChunkKept: a materialized dir that holds the only
// copy of a chunk a live mount pinned is not evicted, however full the
// cache, until the pin goes.
func TestImageHoldingPinnedChunkKept(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 1) // everything is over the cap
	defer s.Close()
	c := randomBytes(10, 50000)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c}})
	d := digest.FromBytes(c)
	s.Pin([]digest.Digest{d})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	ts.put(t, s)
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	asm.Release()
	if _, ok := s.Image(ts.snap.Descriptor.Digest); !ok || !s.Has(d) {
		t.Fatal("the dir holding a pinned chunk was evicted")
	}
	s.Unpin([]digest.Digest{d})
	if _, ok := s.Image(ts.snap.Descriptor.Digest); ok || s.Has(d) {
		t.Error("unpinned and over the cap: not evicted")
	}
}

// mapSource serves chunks from a map of their bytes (a registry, in the
// tests), counting what it serves.
type mapSource struct {
	chunks map[digest.Digest][]byte
	served int
}

func (s *mapSource) Chunk(_ context.Context, c format.Chunk, _ []byte) ([]byte, error) {
	b, ok := s.chunks[c.Digest]
	if !ok {
		return nil, errors.New("no such chunk")
	}
	s.served++
	return b, nil
}

// TestAssemblyRemovedUnderItNeverCommitsZeros removes an assembly's dir
// from under it, as a second process opening the same cache dir does
// (Open clears temporary dirs): the commit must not make the files it then
// finds (created again, empty) the materialized dir on the strength of
// the bytes written into the removed ones.
func TestAssemblyRemovedUnderItNeverCommitsZeros(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	defer s.Close()
	c := randomBytes(11, 40000)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c}})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	defer asm.Release()
	ts.put(t, s)
	tmps, _ := filepath.Glob(filepath.Join(root, "images", "*.tmp-*"))
	if len(tmps) != 1 {
		t.Fatalf("%d assemblies on disk", len(tmps))
	}
	os.RemoveAll(tmps[0])
	err := s.WriteImage(context.Background(), ts.snap, ts.chunks, &mapSource{chunks: map[digest.Digest][]byte{digest.FromBytes(c): c}})
	if dir, ok := s.Image(ts.snap.Descriptor.Digest); ok {
		got, _ := os.ReadFile(filepath.Join(dir, "pages.img"))
		if !bytes.Equal(got, c) {
			t.Fatalf("committed a materialized dir with the wrong bytes (WriteImage: %v)", err)
		}
	}
}

// TestDamagedChunkInAssemblyRefetchedAtCommit damages a chunk written in
// place, on disk, before the commit: a verifying read finds it, and the
// commit verifies that file's chunks again and takes the chunk from its
// source instead of committing the damaged bytes.
func TestDamagedChunkInAssemblyRefetchedAtCommit(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	defer s.Close()
	c1, c2 := randomBytes(12, 20000), randomBytes(13, 20000)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c1, c2}})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	defer asm.Release()
	ts.put(t, s)
	tmps, _ := filepath.Glob(filepath.Join(root, "images", "*.tmp-*", "pages.img"))
	f, err := os.OpenFile(tmps[0], os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt([]byte{c2[7] ^ 1}, int64(len(c1))+7)
	f.Close()
	d2 := digest.FromBytes(c2)
	if _, err := s.Get(d2, nil, true); !errors.Is(err, ErrNotFound) {
		t.Fatalf("verifying read of the damaged chunk: %v, want ErrNotFound", err)
	}
	src := &mapSource{chunks: map[digest.Digest][]byte{d2: c2}}
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, src); err != nil {
		t.Fatal(err)
	}
	dir, _ := s.Image(ts.snap.Descriptor.Digest)
	got, _ := os.ReadFile(filepath.Join(dir, "pages.img"))
	if !bytes.Equal(got, ts.files["pages.img"]) {
		t.Fatal("the damaged chunk was committed")
	}
	if src.served != 1 {
		t.Errorf("%d chunks taken from the source, want the damaged one", src.served)
	}
}

// TestTwoDirsHoldingAPinnedChunk: when the only two copies of a pinned
// chunk are in two materialized dirs, eviction keeps one of them.
func TestTwoDirsHoldingAPinnedChunk(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 1)
	defer s.Close()
	shared := randomBytes(14, 30000)
	d := digest.FromBytes(shared)
	s.Pin([]digest.Digest{d})
	defer s.Unpin([]digest.Digest{d})
	for _, name := range []string{"a", "b"} {
		ts := newTestSnapshot(name, map[string][][]byte{"pages.img": {shared, randomBytes(15, 4096)}})
		asm, _ := s.Assemble(ts.snap, ts.chunks)
		ts.put(t, s)
		s.PutVerified(d, shared)
		if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, &mapSource{chunks: map[digest.Digest][]byte{d: shared}}); err != nil {
			t.Fatal(err)
		}
		asm.Release()
	}
	s.evict()
	if !s.Has(d) {
		t.Fatal("both dirs holding a pinned chunk were evicted")
	}
}

// TestPartialDirEvicted: a partial image dir counts against the cap and is
// removed from disk when evicted.
func TestPartialDirEvicted(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 1)
	defer s.Close()
	c := randomBytes(18, 20000)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c, randomBytes(19, 4096)}})
	asm, _ := s.Assemble(ts.snap, ts.chunks)
	s.PutVerified(digest.FromBytes(c), c)
	asm.Release()
	if s.Has(digest.FromBytes(c)) {
		t.Error("over the cap, the partial dir's chunk is still offered")
	}
	if left, _ := filepath.Glob(filepath.Join(root, "images", "*")); len(left) != 0 {
		t.Errorf("evicted, still on disk: %v", left)
	}
	if st := s.Stats(); st.Bytes != 0 || st.Partial != 0 {
		t.Errorf("after the eviction: %+v", st)
	}
}

// TestEvictedPartialLeftoverRemoved: a partial dir caught by a crash
// between its eviction's rename and its removal is removed at start, not
// taken for a partial dir.
func TestEvictedPartialLeftoverRemoved(t *testing.T) {
	root := t.TempDir()
	s, _ := Open(root, 0)
	s.Close()
	left := filepath.Join(root, "images", digest.FromString("a").Encoded()+".partial-1.tmp-evicted-2")
	os.MkdirAll(left, 0o700)
	s2, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if _, err := os.Stat(left); !os.IsNotExist(err) {
		t.Errorf("leftover of an evicted partial dir kept: %v", err)
	}
}

// TestChunksHeldBeforeAssemblyPlacedAtCommit: a chunk the store got
// before the snapshot's assembly existed (a chunk file: a mount's first
// reads come before its tables are loaded) and one held by another
// snapshot's image dir are written into the assembly at its commit from
// the store, verified, and the commit asks the source for nothing (before,
// it fetched the early one again); the materialized dir has the
// snapshot's bytes.
func TestChunksHeldBeforeAssemblyPlacedAtCommit(t *testing.T) {
	root := t.TempDir()
	s, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	shared := randomBytes(21, 16384)
	other := newTestSnapshot("other", map[string][][]byte{"pages.img": {shared}})
	oa, err := s.Assemble(other.snap, other.chunks)
	if err != nil {
		t.Fatal(err)
	}
	other.put(t, s)
	if err := s.WriteImage(context.Background(), other.snap, other.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	oa.Release()

	early, late := randomBytes(22, 20000), randomBytes(23, 12288)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {early, nil, shared, late}})
	if err := s.PutVerified(digest.FromBytes(early), early); err != nil {
		t.Fatal(err)
	}
	if n := chunkFileCount(t, root); n != 1 {
		t.Fatalf("%d chunk files before the assembly, want the early chunk's", n)
	}
	asm, err := s.Assemble(ts.snap, ts.chunks)
	if err != nil {
		t.Fatal(err)
	}
	defer asm.Release()
	if err := s.PutVerified(digest.FromBytes(late), late); err != nil {
		t.Fatal(err)
	}
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	dir, ok := s.Image(ts.snap.Descriptor.Digest)
	if !ok {
		t.Fatal("not materialized")
	}
	got, err := os.ReadFile(filepath.Join(dir, "pages.img"))
	if err != nil || !bytes.Equal(got, ts.files["pages.img"]) {
		t.Fatalf("pages.img in the materialized dir: %v, %d bytes", err, len(got))
	}
}

// TestPutVerifiedRunPlacesAndFallsBack hands the store one run of
// chunks: consecutive chunks of the assembly's pages.img (written with one
// pwritev), a chunk it holds twice, a chunk no assembly wants (a chunk
// file) and one whose size the table contradicts (refused, not placed).
// Each gets PutVerified's outcome, and the commit needs no source.
func TestPutVerifiedRunPlacesAndFallsBack(t *testing.T) {
	root := t.TempDir()
	s, err := Open(root, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c1, c2, c3 := randomBytes(31, 16384), randomBytes(32, 8192), randomBytes(33, 12288)
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {c1, c2, nil, c3, c1}})
	asm, err := s.Assemble(ts.snap, ts.chunks)
	if err != nil {
		t.Fatal(err)
	}
	defer asm.Release()
	loose := randomBytes(34, 4096)
	d1, d2, d3 := digest.FromBytes(c1), digest.FromBytes(c2), digest.FromBytes(c3)
	errs := s.PutVerifiedRun([]digest.Digest{d1, d2, d3, digest.FromBytes(loose)}, [][]byte{c1, c2, c3, loose})
	for i, err := range errs {
		if err != nil {
			t.Fatalf("chunk %d of the run: %v", i, err)
		}
	}
	if n := chunkFileCount(t, root); n != 1 {
		t.Errorf("%d chunk files, want the one no assembly wants", n)
	}
	if got, err := s.Get(digest.FromBytes(loose), nil, false); err != nil || !bytes.Equal(got, loose) {
		t.Fatalf("the loose chunk: %v", err)
	}
	if err := s.WriteImage(context.Background(), ts.snap, ts.chunks, noSource{t}); err != nil {
		t.Fatal(err)
	}
	dir, _ := s.Image(ts.snap.Descriptor.Digest)
	got, err := os.ReadFile(filepath.Join(dir, "pages.img"))
	if err != nil || !bytes.Equal(got, ts.files["pages.img"]) {
		t.Fatalf("pages.img in the materialized dir: %v, %d bytes", err, len(got))
	}

	// A chunk of the wrong size for the table that wants it.
	other := newTestSnapshot("b", map[string][][]byte{"pages.img": {randomBytes(35, 8192)}})
	oa, err := s.Assemble(other.snap, other.chunks)
	if err != nil {
		t.Fatal(err)
	}
	defer oa.Release()
	d := other.chunks[0][0].Digest
	if errs := s.PutVerifiedRun([]digest.Digest{d}, [][]byte{make([]byte, 100)}); errs[0] == nil {
		t.Fatal("a chunk of 100 bytes placed where the table says 8192")
	}
}

// TestWritebackEndsWithTheStore: an assembly's writeback goroutine, which
// hands its files to the kernel while it is written, runs while the
// assembly does and stops once the store is closed, even for an assembly
// never released; under -race, a Close during its work is no race.
func TestWritebackEndsWithTheStore(t *testing.T) {
	s, err := Open(t.TempDir(), 0)
	if err != nil {
		t.Fatal(err)
	}
	ts := newTestSnapshot("a", map[string][][]byte{"pages.img": {randomBytes(1, 1<<20), randomBytes(2, 1<<20)}})
	a, err := s.Assemble(ts.snap, ts.chunks)
	if err != nil {
		t.Fatal(err)
	}
	ts.put(t, s)
	time.Sleep(3 * writebackEvery) // a few rounds of it, then Close amid them
	select {
	case <-a.wroteBack:
		t.Fatal("the writeback ended while its assembly was written")
	default:
	}
	s.Close()
	select {
	case <-a.wroteBack:
	case <-time.After(10 * time.Second):
		t.Fatal("the writeback still runs 10 s after the store closed")
	}
}
