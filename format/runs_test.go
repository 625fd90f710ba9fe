package format

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/content"
)

// rangeCounter serves a content store by range (RangeFetcher), counting
// the range requests and the bytes they ask for; with corrupt set, it
// flips a byte of the first range it serves that is longer than a frame.
type rangeCounter struct {
	content.Fetcher
	corrupt bool
	// failPack, if set, fails every request for that pack.
	failPack digest.Digest

	mu       sync.Mutex
	requests int
	bytes    int64
	flipped  bool
}

func (f *rangeCounter) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	if f.failPack != "" && desc.Digest == f.failPack {
		return nil, errConnReset
	}
	rc, err := OpenRange(ctx, f.Fetcher, desc, off, n)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data := make([]byte, n)
	if _, err := io.ReadFull(rc, data); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests++
	f.bytes += n
	if f.corrupt && !f.flipped && n > 256<<10 {
		data[n/2] ^= 0xff
		f.flipped = true
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

func (f *rangeCounter) counts() (int, int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests, f.bytes
}

// TestUnpackReadsFramesInRuns unpacks a v2 snapshot from a source that
// serves ranges: its frames come in about one range request per pack,
// not one per chunk, and no byte is asked for that the snapshot's frames
// do not hold. A run whose bytes are corrupted in transit never reaches
// the unpacked files: its frames fail verification and are fetched again,
// one by one, and the files are the source's.
func TestUnpackReadsFramesInRuns(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{Format: V2})
	_, pts := loadTables(t, store, desc)
	frames, packs := 0, map[digest.Digest]bool{}
	var frameBytes int64
	for _, pt := range pts {
		for _, c := range pt.Table.Chunks {
			if c.Encoding != EncodingZero {
				frames++
				frameBytes += c.BlobSize
				packs[c.Blob] = true
			}
		}
	}
	if frames < 4*len(packs) {
		t.Fatalf("%d frames in %d packs: too few frames a pack for this test", frames, len(packs))
	}

	rf := &rangeCounter{Fetcher: store}
	out := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(ctx, rf, desc, out, UnpackOptions{Concurrency: 4}); err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	requests, asked := rf.counts()
	// A pack may split into two runs where a file's frames end and the
	// next file's begin in it.
	if requests > 2*len(packs) {
		t.Errorf("%d range requests for %d frames in %d packs, want at most %d", requests, frames, len(packs), 2*len(packs))
	}
	if asked > frameBytes+int64(requests)*maxRunGap {
		t.Errorf("asked for %d bytes, the frames hold %d", asked, frameBytes)
	}

	vf := &rangeCounter{Fetcher: store}
	if _, _, err := Verify(ctx, vf, desc, 4); err != nil {
		t.Fatal(err)
	}
	if n, _ := vf.counts(); n != requests {
		t.Errorf("verify made %d range requests, want the unpack's %d", n, requests)
	}

	bad := &rangeCounter{Fetcher: store, corrupt: true}
	out2 := filepath.Join(t.TempDir(), "out")
	if _, _, err := Unpack(ctx, bad, desc, out2, UnpackOptions{Concurrency: 4}); err != nil {
		t.Fatalf("unpack with one run corrupted in transit: %v", err)
	}
	compareDirs(t, src, out2)
	if n, _ := bad.counts(); !bad.flipped || n <= requests {
		t.Errorf("corrupted %v; %d range requests, want more than the %d of a clean unpack (the run's frames fetched again)", bad.flipped, n, requests)
	}
}

// packRanges serves byte ranges of in-memory packs (RangeFetcher),
// counting requests; with block set, every request waits for its ctx to
// end and records why it did.
type packRanges struct {
	packs map[digest.Digest][]byte
	block bool

	mu       sync.Mutex
	requests int
	ended    []error
}

func (f *packRanges) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	f.mu.Lock()
	f.requests++
	f.mu.Unlock()
	if f.block {
		<-ctx.Done()
		f.mu.Lock()
		f.ended = append(f.ended, ctx.Err())
		f.mu.Unlock()
		return nil, ctx.Err()
	}
	p := f.packs[desc.Digest]
	return io.NopCloser(bytes.NewReader(p[min(off, int64(len(p))):min(off+n, int64(len(p)))])), nil
}

// rawFrames lays out frames of the given sizes back to back in one pack of
// bytes that differ by seed and returns the pack's bytes and a chunk for each frame.
func rawFrames(t *testing.T, seed byte, sizes ...int64) ([]byte, []Chunk) {
	t.Helper()
	var total int64
	for _, n := range sizes {
		total += n
	}
	pack := make([]byte, total)
	for i := range pack {
		pack[i] = byte(i*7+i/251) ^ seed
	}
	blob := digest.FromBytes(pack)
	var chunks []Chunk
	var off int64
	for _, n := range sizes {
		d := digest.FromBytes(pack[off : off+n])
		chunks = append(chunks, Chunk{Offset: off, Size: n, Encoding: EncodingRaw, Digest: d, Blob: blob, BlobSize: n, PackOffset: off, PackSize: total})
		off += n
	}
	return pack, chunks
}

// TestRunPlanFramesAtOneOffset: a lying table names one pack offset with
// two lengths, the second longer than the run the first is planned in.
// Each is its own frame of the plan, and each read gets exactly its own
// length of the pack (a plan that keyed frames by offset alone sliced
// past its run and panicked).
func TestRunPlanFramesAtOneOffset(t *testing.T) {
	pack, cs := rawFrames(t, 0, 4096, 4096, 8192)
	long := cs[0]
	long.BlobSize, long.Size = int64(len(pack)), int64(len(pack))
	long.Digest = digest.FromBytes(pack)
	src := &packRanges{packs: map[digest.Digest][]byte{cs[0].Blob: pack}}
	p := planRuns(context.Background(), src, [][]Chunk{{cs[0]}, {long}}, 2)
	defer p.close()
	for _, c := range []Chunk{cs[0], long} {
		frame, ok := p.frame(context.Background(), c)
		if !ok {
			t.Fatalf("frame at %d (%d bytes): not in the plan", c.PackOffset, c.BlobSize)
		}
		if !bytes.Equal(frame, pack[c.PackOffset:c.PackOffset+c.BlobSize]) {
			t.Errorf("frame at %d (%d bytes): got %d bytes, not the pack's", c.PackOffset, c.BlobSize, len(frame))
		}
	}
}

// TestRunPlanRepeatsAcrossFiles: a chunk the first file holds, read again
// by the second file past other runs, does not keep its run's bytes: they
// go once the first file's reads are made, and the later read is the
// caller's to fetch alone. A chunk read twice within its run is served by
// it both times.
func TestRunPlanRepeatsAcrossFiles(t *testing.T) {
	packA, as := rawFrames(t, 1, 4096, 4096, 4096)
	packB, bs := rawFrames(t, 2, 8192, 8192)
	src := &packRanges{packs: map[digest.Digest][]byte{as[0].Blob: packA, bs[0].Blob: packB}}
	ctx := context.Background()
	files := [][]Chunk{{as[0], as[1], as[0], as[2]}, {bs[0], bs[1], as[0]}}
	p := planRuns(ctx, src, files, 1)
	defer p.close()
	if p.requests() != 2 {
		t.Fatalf("plan of %d runs, want 2 (one per pack)", p.requests())
	}
	for _, c := range files[0] {
		if _, ok := p.frame(ctx, c); !ok {
			t.Fatalf("frame %s of the first file not served by its run", c.Digest)
		}
	}
	p.mu.Lock()
	held, users := p.runs[0].data != nil, p.runs[0].users
	p.mu.Unlock()
	if held || users != 0 {
		t.Errorf("after the first file, its run holds %v bytes, %d reads to come; want none (a read of the second file must not keep it)", held, users)
	}
	for i, c := range files[1] {
		frame, ok := p.frame(ctx, c)
		if want := i < 2; ok != want {
			t.Errorf("second file, frame %d: served by a run %v, want %v", i, ok, want)
		}
		if ok && !bytes.Equal(frame, packB[c.PackOffset:c.PackOffset+c.BlobSize]) {
			t.Errorf("second file, frame %d: wrong bytes", i)
		}
	}
}

// TestRunPlanCancel: a read whose ctx ends while its run's fetch hangs
// returns at once (not served: the caller's fetch then fails on its ctx),
// and closing the plan cancels its fetches in flight, those fetched ahead
// included, and waits for them.
func TestRunPlanCancel(t *testing.T) {
	var files [][]Chunk
	packs := map[digest.Digest][]byte{}
	for i := range 4 {
		pack, cs := rawFrames(t, byte(i), 4096, 4096)
		packs[cs[0].Blob] = pack
		files = append(files, cs)
	}
	src := &packRanges{packs: packs, block: true}
	p := planRuns(context.Background(), src, files, 2)
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan bool)
	go func() {
		_, ok := p.frame(ctx, files[0][0])
		served <- ok
	}()
	cancel()
	select {
	case ok := <-served:
		if ok {
			t.Error("a read whose ctx ended was served")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a read whose ctx ended still waits for its run's fetch")
	}
	p.close()
	src.mu.Lock()
	defer src.mu.Unlock()
	if src.requests != 3 || len(src.ended) != 3 {
		t.Fatalf("%d fetches started, %d ended; want 3 (the run and 2 ahead), all ended by close", src.requests, len(src.ended))
	}
	for _, err := range src.ended {
		if !errors.Is(err, context.Canceled) {
			t.Errorf("a fetch ended with %v, want context.Canceled", err)
		}
	}
}

// TestRunPlanUncountedRead: a chunk read again files later, past another
// pack, is not counted by the plan; whichever of its two reads comes
// first is served, the other is the caller's, and the read of its run's
// other frame is still served (a plan counting reads per run, not per
// frame, let the uncounted read take that frame's count).
func TestRunPlanUncountedRead(t *testing.T) {
	packA, as := rawFrames(t, 1, 4096, 4096)
	packX, xs := rawFrames(t, 2, 4096)
	src := &packRanges{packs: map[digest.Digest][]byte{as[0].Blob: packA, xs[0].Blob: packX}}
	ctx := context.Background()
	p := planRuns(ctx, src, [][]Chunk{{as[0], as[1]}, {xs[0], as[0]}}, 2)
	defer p.close()
	var served []bool
	for _, c := range []Chunk{as[0], as[0], as[1], xs[0]} {
		_, ok := p.frame(ctx, c)
		served = append(served, ok)
	}
	if want := []bool{true, false, true, true}; !slices.Equal(served, want) {
		t.Errorf("served %v, want %v", served, want)
	}
}

// TestRunPlanBounds: the runs fetched ahead stop at maxRunsAhead and at
// maxHeldBytes, a frame larger than maxRunBytes is a run of its own, and
// runsAhead keeps an unpack's lookahead in 2 to maxRunsAhead.
func TestRunPlanBounds(t *testing.T) {
	for conc, want := range map[int]int{1: 2, 8: 4, 100: maxRunsAhead} {
		if got := runsAhead(conc); got != want {
			t.Errorf("runsAhead(%d) = %d, want %d", conc, got, want)
		}
	}
	// Packs of one frame of maxRunBytes each (never read: the source
	// blocks until the plan is closed).
	var files [][]Chunk
	for i := range 20 {
		d := digest.FromString(fmt.Sprint(i))
		files = append(files, []Chunk{{Size: maxRunBytes, Encoding: EncodingRaw, Digest: d, Blob: d, BlobSize: maxRunBytes, PackSize: maxRunBytes}})
	}
	big := digest.FromString("big")
	files = append(files, []Chunk{{Size: MaxChunkSize, Encoding: EncodingRaw, Digest: big, Blob: big, BlobSize: MaxChunkSize, PackSize: MaxChunkSize}})
	src := &packRanges{block: true}
	p := planRuns(context.Background(), src, files, 100)
	if p.ahead != maxRunsAhead || p.requests() != 21 || p.runs[20].n != MaxChunkSize {
		t.Errorf("plan: %d ahead, %d runs, the last of %d bytes; want %d, 21, %d", p.ahead, p.requests(), p.runs[20].n, maxRunsAhead, MaxChunkSize)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p.frame(ctx, files[0][0])
	p.close()
	if want := int(maxHeldBytes / maxRunBytes); src.requests != want {
		t.Errorf("%d runs of %d bytes fetched at once, want %d (maxHeldBytes)", src.requests, maxRunBytes, want)
	}
}

// TestUnpackResumeReadsFramesInRuns: an unpack interrupted halfway
// resumes with range requests for what it lacks,
// about one per pack as a clean unpack, not one per chunk, and asks for
// no more bytes than a clean unpack.
func TestUnpackResumeReadsFramesInRuns(t *testing.T) {
	ctx := context.Background()
	src := makeImageDir(t)
	store, desc, _ := packToLayout(t, src, PackOptions{Format: V2})
	_, pts := loadTables(t, store, desc)
	var order []digest.Digest // the packs of the frames, in read order
	packs := map[digest.Digest]bool{}
	for _, pt := range pts {
		for _, c := range pt.Table.Chunks {
			if c.Encoding != EncodingZero {
				order = append(order, c.Blob)
				packs[c.Blob] = true
			}
		}
	}
	frames := len(order)
	clean := &rangeCounter{Fetcher: store}
	if _, _, err := Unpack(ctx, clean, desc, filepath.Join(t.TempDir(), "out"), UnpackOptions{Concurrency: 4}); err != nil {
		t.Fatal(err)
	}
	cleanRequests, cleanBytes := clean.counts()

	out := filepath.Join(t.TempDir(), "out")
	// The pack of the middle frame is down: the frames before it are
	// written, the rest is left for the resume.
	cut := &rangeCounter{Fetcher: store, failPack: order[frames/2]}
	if _, _, err := Unpack(ctx, cut, desc, out, UnpackOptions{Concurrency: 1}); !errors.Is(err, errConnReset) {
		t.Fatalf("interrupted unpack: %v, want %v", err, errConnReset)
	}
	again := &rangeCounter{Fetcher: store}
	_, st, err := Unpack(ctx, again, desc, out, UnpackOptions{Concurrency: 4})
	if err != nil {
		t.Fatal(err)
	}
	compareDirs(t, src, out)
	requests, asked := again.counts()
	if st.ChunksReused == 0 {
		t.Fatalf("resume reused no chunk of the interrupted unpack's")
	}
	if requests > cleanRequests || asked > cleanBytes {
		t.Errorf("resume made %d range requests for %d bytes (%d frames fetched, %d reused); a clean unpack %d for %d", requests, asked, st.ChunksFetched, st.ChunksReused, cleanRequests, cleanBytes)
	}
	if frames < 4*len(packs) || st.ChunksFetched <= 2*len(packs) {
		t.Fatalf("%d frames in %d packs, %d fetched on resume: too few for this test", frames, len(packs), st.ChunksFetched)
	}
}

// TestRunPlanSkip: a run whose frames were all found on disk (skipped) is
// not fetched, even when it lies within the runs fetched ahead, and a run
// fetched is dropped once its last frame is read or skipped.
func TestRunPlanSkip(t *testing.T) {
	packs := map[digest.Digest][]byte{}
	var files [][]Chunk
	for i := range 3 {
		pack, cs := rawFrames(t, byte(i), 4096, 4096)
		packs[cs[0].Blob] = pack
		files = append(files, cs)
	}
	src := &packRanges{packs: packs}
	ctx := context.Background()
	p := planRuns(ctx, src, files, 2)
	defer p.close()
	p.skip(files[1][0])
	p.skip(files[1][1])
	if _, ok := p.frame(ctx, files[0][0]); !ok {
		t.Fatal("first frame not served")
	}
	p.skip(files[0][1])
	p.close() // let the fetch ahead end before counting
	if src.requests != 2 {
		t.Errorf("%d runs fetched, want 2 (the skipped one not)", src.requests)
	}
	if p.runs[0].data != nil || p.runs[1].started || p.held != p.runs[2].n {
		t.Errorf("run 0 holds %d bytes, run 1 started %v, %d bytes held; want 0, false, %d (run 2's)", len(p.runs[0].data), p.runs[1].started, p.held, p.runs[2].n)
	}
}
