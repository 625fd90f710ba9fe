package chunker

import (
	"bytes"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
)

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		v := r.Uint64()
		for j := 0; j < 8; j++ {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return b
}

func chunkAll(t *testing.T, data []byte, p Params) [][]byte {
	t.Helper()
	// A reader that returns short reads exercises the buffer refill logic.
	c, err := New(iotestHalfReader{bytes.NewReader(data)}, p)
	if err != nil {
		t.Fatal(err)
	}
	var chunks [][]byte
	var next int64
	for {
		b, off, err := c.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if off != next {
			t.Fatalf("chunk at offset %d, want %d", off, next)
		}
		next += int64(len(b))
		chunks = append(chunks, bytes.Clone(b))
	}
	if next != int64(len(data)) {
		t.Fatalf("chunks cover %d bytes, want %d", next, len(data))
	}
	return chunks
}

type iotestHalfReader struct{ r io.Reader }

func (h iotestHalfReader) Read(p []byte) (int, error) {
	if len(p) > 1 {
		p = p[:(len(p)+1)/2]
	}
	return h.r.Read(p)
}

func TestPageCDCBoundsAndAlignment(t *testing.T) {
	p := DefaultPageCDC(64 << 10)
	data := randomBytes(1, 8<<20+123)
	chunks := chunkAll(t, data, p)
	var total int
	for i, c := range chunks {
		last := i == len(chunks)-1
		if !last && (len(c) < p.Min || len(c) > p.Max || len(c)%PageSize != 0) {
			t.Fatalf("chunk %d has size %d, outside [%d,%d] or not page-aligned", i, len(c), p.Min, p.Max)
		}
		total += len(c)
	}
	mean := total / len(chunks)
	if mean < p.Avg/2 || mean > p.Avg*2 {
		t.Errorf("mean chunk size %d far from avg %d", mean, p.Avg)
	}
}

func TestPageCDCResyncsAfterPageShift(t *testing.T) {
	p := DefaultPageCDC(64 << 10)
	data := randomBytes(2, 4<<20)
	// Insert 3 pages near the start: the chunks after the next cut must be shared.
	shifted := append(append(bytes.Clone(data[:100*PageSize]), randomBytes(3, 3*PageSize)...), data[100*PageSize:]...)
	a := chunkAll(t, data, p)
	b := chunkAll(t, shifted, p)
	seen := map[string]bool{}
	for _, c := range a {
		seen[string(c)] = true
	}
	shared := 0
	for _, c := range b {
		if seen[string(c)] {
			shared += len(c)
		}
	}
	if shared < len(data)*8/10 {
		t.Errorf("only %d of %d bytes shared after a 3-page insertion", shared, len(data))
	}
}

func TestFixed(t *testing.T) {
	data := randomBytes(4, 10000)
	chunks := chunkAll(t, data, FixedSize(4096))
	if len(chunks) != 3 || len(chunks[2]) != 10000-8192 {
		t.Fatalf("got %d chunks, last %d bytes", len(chunks), len(chunks[len(chunks)-1]))
	}
}

func TestEmpty(t *testing.T) {
	if got := chunkAll(t, nil, DefaultPageCDC(1<<20)); len(got) != 0 {
		t.Fatalf("empty input gave %d chunks", len(got))
	}
}

func TestValidate(t *testing.T) {
	bad := []struct {
		p Params
		// want is a substring of the error naming what is wrong.
		want string
	}{
		{Params{Algorithm: "rabin", Min: 1, Avg: 2, Max: 3}, `unknown chunking algorithm "rabin"`},
		{Params{Algorithm: PageCDC, Min: 1000, Avg: 4096, Max: 8192}, "page-cdc sizes must be positive multiples of 4096"},
		{Params{Algorithm: PageCDC, Min: 8192, Avg: 8192, Max: 16384}, "page-cdc needs min < avg < max"},
		{Params{Algorithm: PageCDC, Min: 4096, Avg: 8192, Max: 32 << 20}, "page-cdc needs min < avg < max"},
		{Params{Algorithm: Fixed, Min: 0, Avg: 0, Max: 0}, "fixed chunking needs 0 < min = avg = max"},
		{Params{Algorithm: Fixed, Min: 1, Avg: 2, Max: 2}, "fixed chunking needs 0 < min = avg = max"},
	}
	for _, c := range bad {
		if err := c.p.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error containing %q", c.p, err, c.want)
		}
		if _, err := New(bytes.NewReader(nil), c.p); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("New(%+v): %v, want an error containing %q", c.p, err, c.want)
		}
	}
	if err := DefaultPageCDC(1 << 20).Validate(); err != nil {
		t.Error(err)
	}
}

func TestPageCDCCutsAroundZeroRuns(t *testing.T) {
	p := DefaultPageCDC(64 << 10)
	zeros := make([]byte, 300<<10)
	data := append(append(randomBytes(5, 200<<10), zeros...), randomBytes(6, 200<<10)...)
	chunks := chunkAll(t, data, p)
	zeroBytes := 0
	for _, c := range chunks {
		if bytes.Equal(c, make([]byte, len(c))) {
			zeroBytes += len(c)
		}
	}
	// All but at most Min bytes of the zero run end up in all-zero chunks.
	if zeroBytes < len(zeros)-p.Min {
		t.Fatalf("only %d of %d zero bytes in zero chunks", zeroBytes, len(zeros))
	}
}
