package format

import (
	"bytes"
	"context"
	"io"
	"path/filepath"
	"sync"
	"testing"

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

	mu       sync.Mutex
	requests int
	bytes    int64
	flipped  bool
}

func (f *rangeCounter) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
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
