package fetch

import (
	"bytes"
	"context"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// rangeLog is a gated pack store that records the byte ranges asked of it.
type rangeLog struct {
	*gate
	mu     sync.Mutex
	ranges [][2]int64 // offset, length
}

func (r *rangeLog) FetchRange(ctx context.Context, desc ocispec.Descriptor, off, n int64) (io.ReadCloser, error) {
	r.mu.Lock()
	r.ranges = append(r.ranges, [2]int64{off, n})
	r.mu.Unlock()
	rc, err := r.gate.Fetch(ctx, desc)
	if err != nil {
		return nil, err
	}
	data, _ := io.ReadAll(rc)
	return io.NopCloser(bytes.NewReader(data[off : off+n])), nil
}

// packedChunks returns n raw chunks of size bytes, the frames of one
// pack, in order, and the pack.
func packedChunks(seed uint64, n, size int) ([]format.Chunk, blobs) {
	var pack []byte
	var cs []format.Chunk
	for i := range n {
		data := randBytes(seed+uint64(i), size)
		cs = append(cs, format.Chunk{Offset: int64(i * size), Size: int64(size), Encoding: format.EncodingRaw, Digest: digest.FromBytes(data),
			PackOffset: int64(len(pack)), BlobSize: int64(size)})
		pack = append(pack, data...)
	}
	d := digest.FromBytes(pack)
	for i := range cs {
		cs[i].Blob, cs[i].PackSize = d, int64(len(pack))
	}
	return cs, blobs{d: pack}
}

// TestReadReadsAhead: a read (priority Read) of one frame of a pack whose
// following frames are queued as prefetches fetches them with it, in one
// range request of ReadAhead bytes: gVisor's loader reads 128 KiB at a
// time, and one request per read would cost the registry many times the
// requests.
func TestReadReadsAhead(t *testing.T) {
	c, codec := setup(t)
	const size = 32 << 10
	cs, b := packedChunks(1, 160, size) // 5 MiB: more than ReadAhead past the read
	store := &rangeLog{gate: newGate(b)}
	s := startScheduler(t, []Endpoint{{Name: "gated", Store: store}}, c, codec, Options{Workers: 1})
	ctx := context.Background()
	first := s.Prefetch(cs[:1])
	wait(t, store.entered, "the first fetch")
	rest := s.Prefetch(cs[1:])
	read := make(chan result, 1)
	go func() { data, err := s.Get(ctx, cs[10], nil, Read); read <- result{data, err} }()
	for deadline := time.Now().Add(hangLimit); ; time.Sleep(time.Millisecond) {
		s.mu.Lock()
		queued := len(s.queues[Read])
		s.mu.Unlock()
		if queued == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the read never queued")
		}
	}
	store.open()
	if r := wait(t, read, "read"); r.err != nil || !bytes.Equal(r.data, b[cs[0].Blob][cs[10].PackOffset:cs[10].PackOffset+size]) {
		t.Fatalf("read: %v", r.err)
	}
	for _, p := range append(first, rest...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	store.mu.Lock()
	defer store.mu.Unlock()
	var readRange [2]int64
	for _, r := range store.ranges {
		if r[0] == cs[10].PackOffset {
			readRange = r
		}
	}
	if readRange[1] != ReadAhead {
		t.Errorf("the read's range request: %d bytes at %d, want %d (ranges asked: %v)", readRange[1], readRange[0], ReadAhead, store.ranges)
	}
	if len(store.ranges) != 4 {
		t.Errorf("%d range requests, want 4 (the first frame, the read and its read-ahead, the prefetches before and after it): %v", len(store.ranges), store.ranges)
	}
}
