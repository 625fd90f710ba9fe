package fetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/errdef"
	"oras.land/oras-go/v2/registry/remote"
)

// hangLimit bounds how long a test waits for something that must happen
// without waiting on a fetch deadline (which the tests set to 10 minutes).
// It is a hang check, not a timing assertion.
const hangLimit = 30 * time.Second

// blobs is a content.Fetcher that serves blobs by digest alone, as a
// registry does (whatever the media type and size in the descriptor).
type blobs map[digest.Digest][]byte

func (b blobs) Fetch(_ context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	data, ok := b[desc.Digest]
	if !ok {
		return nil, fmt.Errorf("%s: %w", desc.Digest, errdef.ErrNotFound)
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

// gate wraps a fetcher: every fetch reports itself on entered, then waits
// until release is closed (or its context ends).
type gate struct {
	blobs
	entered chan struct{}
	release chan struct{}
	once    sync.Once
}

func newGate(b blobs) *gate {
	return &gate{blobs: b, entered: make(chan struct{}), release: make(chan struct{})}
}

func (g *gate) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	g.once.Do(func() { close(g.entered) })
	select {
	case <-g.release:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return g.blobs.Fetch(ctx, desc)
}

func (g *gate) open() {
	select {
	case <-g.release:
	default:
		close(g.release)
	}
}

// setup returns a node cache and a codec, as a puller shares them between
// its mounts.
func setup(t *testing.T) (*cache.Store, *format.Codec) {
	t.Helper()
	return setupIn(t, t.TempDir())
}

// setupIn is setup with the node cache in dir.
func setupIn(t *testing.T, dir string) (*cache.Store, *format.Codec) {
	t.Helper()
	c, err := cache.Open(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	codec, err := format.NewCodec(1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(codec.Close)
	return c, codec
}

// newScheduler starts a scheduler fetching from store alone (startScheduler).
func newScheduler(t *testing.T, name string, store interface {
	Fetch(context.Context, ocispec.Descriptor) (io.ReadCloser, error)
}, c *cache.Store, codec *format.Codec, inFlight *Flights) *Scheduler {
	t.Helper()
	return startScheduler(t, []Endpoint{{Name: name, Store: store}}, c, codec, Options{InFlight: inFlight})
}

func randBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

type result struct {
	data []byte
	err  error
}

func get(s *Scheduler, ctx context.Context, c format.Chunk) <-chan result {
	ch := make(chan result, 1)
	go func() {
		data, err := s.Get(ctx, c, nil, Fault)
		ch <- result{bytes.Clone(data), err}
	}()
	return ch
}

func wait[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangLimit):
		t.Fatalf("%s: still waiting after %s", what, hangLimit)
		panic("unreachable")
	}
}

// waitStarted waits until s's worker has taken the fetch of c (it is about
// to join or start the node-wide fetch), then lets it get there.
func waitStarted(t *testing.T, s *Scheduler, c format.Chunk) {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for time.Now().Before(deadline) {
		for _, e := range s.Log() {
			if e.Digest == c.Digest {
				// From taking the call to joining the group is a few
				// instructions; give the worker ample time for them.
				time.Sleep(200 * time.Millisecond)
				return
			}
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("fetch of %s never started", c.Digest)
}

// TestLyingTableDoesNotBreakAnotherMount runs two mounts' schedulers on
// one node (one cache, one in-flight group). The liar's chunk table (or
// its registry) lies about chunk D; its fetch of D is in flight, held at
// its endpoint, when the honest mount reads D. The honest read must
// neither wait for the liar's fetch nor take its failure: it returns D's
// right bytes. The liar gets an error, never bytes of the wrong length.
func TestLyingTableDoesNotBreakAnotherMount(t *testing.T) {
	data := randBytes(1, 64<<10)
	d := digest.FromBytes(data)
	honest := format.Chunk{Size: int64(len(data)), Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: int64(len(data))}
	junk := randBytes(2, 1000)
	j := digest.FromBytes(junk)
	cases := map[string]struct {
		liar      format.Chunk
		liarBlobs blobs
		// sameKey: the liar's entry is honest, its registry is not, so
		// the honest read joins the liar's fetch; it must not keep its
		// failure.
		sameKey bool
	}{
		"chunk named in a junk blob": {
			liar:      format.Chunk{Size: honest.Size, Encoding: format.EncodingZstd, Digest: d, Blob: j, BlobSize: int64(len(junk))},
			liarBlobs: blobs{j: junk, d: data},
		},
		"chunk with a wrong size": {
			liar:      format.Chunk{Size: honest.Size - 1, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: honest.Size - 1},
			liarBlobs: blobs{d: data},
		},
		"chunk with a larger size": {
			liar:      format.Chunk{Size: honest.Size + 4096, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: honest.Size + 4096},
			liarBlobs: blobs{d: append(bytes.Clone(data), make([]byte, 4096)...)},
		},
		"registry serving junk for the blob": {
			liar:      honest,
			liarBlobs: blobs{d: randBytes(3, len(data))},
			sameKey:   true,
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			c, codec := setup(t)
			var inFlight Flights
			liarStore := newGate(tc.liarBlobs)
			defer liarStore.open()
			liar := newScheduler(t, "liar", liarStore, c, codec, &inFlight)
			good := newScheduler(t, "honest", blobs{d: data}, c, codec, &inFlight)

			liarRead := get(liar, context.Background(), tc.liar)
			wait(t, liarStore.entered, "liar's fetch")
			ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
			defer cancel()
			goodRead := get(good, ctx, honest)
			if tc.sameKey {
				// Let the honest read join the liar's fetch, then let
				// that fetch fail.
				waitStarted(t, good, honest)
				liarStore.open()
			}
			res := wait(t, goodRead, "honest read")
			if res.err != nil || !bytes.Equal(res.data, data) {
				t.Fatalf("honest read of %s: %d bytes, %v", d, len(res.data), res.err)
			}
			liarStore.open()
			if res := wait(t, liarRead, "liar's read"); res.err == nil && !bytes.Equal(res.data, data) {
				t.Fatalf("liar's read returned %d bytes, not the chunk's", len(res.data))
			} else {
				t.Logf("liar's read: %v", res.err)
			}
			// D is in the cache now; a table that gives it another size
			// gets an error, not D's bytes.
			if tc.liar.Size != honest.Size {
				if data, err := liar.Get(ctx, tc.liar, nil, Read); !errors.Is(err, format.ErrDigestMismatch) {
					t.Fatalf("liar's read from the cache: %d bytes, %v; want ErrDigestMismatch", len(data), err)
				}
			}
		})
	}
}

// TestLyingSizesAreRefused checks that a chunk entry whose sizes no table
// validation would pass (handed to the scheduler directly) fails its read
// with an error instead of allocating or panicking, and is not retried.
func TestLyingSizesAreRefused(t *testing.T) {
	data := randBytes(1, 4096)
	d := digest.FromBytes(data)
	for name, ch := range map[string]format.Chunk{
		"1 TB blob":       {Size: 4096, Encoding: format.EncodingZstd, Digest: d, Blob: d, BlobSize: 1 << 40},
		"negative blob":   {Size: 4096, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: -1},
		"1 TB chunk":      {Size: 1 << 40, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: 4096},
		"negative chunk":  {Size: -5, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: 4096},
		"zero-size chunk": {Size: 0, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: 4096},
		"negative zero":   {Size: -1, Encoding: format.EncodingZero},
	} {
		t.Run(name, func(t *testing.T) {
			c, codec := setup(t)
			s := newScheduler(t, "primary", blobs{d: data}, c, codec, nil)
			res := wait(t, get(s, context.Background(), ch), "read")
			if !errors.Is(res.err, format.ErrTooLarge) && !errors.Is(res.err, format.ErrInvalid) {
				t.Fatalf("got %d bytes, %v; want ErrTooLarge or ErrInvalid", len(res.data), res.err)
			}
			t.Log(res.err)
		})
	}
}

// countingFetcher counts fetches.
type countingFetcher struct {
	inner interface {
		Fetch(context.Context, ocispec.Descriptor) (io.ReadCloser, error)
	}
	n atomic.Int64
}

func (f *countingFetcher) Fetch(ctx context.Context, desc ocispec.Descriptor) (io.ReadCloser, error) {
	f.n.Add(1)
	return f.inner.Fetch(ctx, desc)
}

// deadRepository is a registry client for an address where nothing
// listens: every fetch fails at once with a connection error.
func deadRepository(t *testing.T) *remote.Repository {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	repo, err := remote.NewRepository(addr + "/app")
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	return repo
}

// TestCloseStopsRetries closes a scheduler while it retries a chunk
// against an endpoint that is down, with a 10-minute fetch deadline:
// Close returns without waiting for the deadline, and the read waiting for
// the chunk, a prefetch and any later read fail with ErrClosed.
func TestCloseStopsRetries(t *testing.T) {
	for _, inFlight := range []*Flights{nil, new(Flights)} {
		t.Run(fmt.Sprintf("in-flight group %v", inFlight != nil), func(t *testing.T) {
			c, codec := setup(t)
			dead := &countingFetcher{inner: deadRepository(t)}
			s := newScheduler(t, "dead", dead, c, codec, inFlight)
			data := randBytes(1, 4096)
			d := digest.FromBytes(data)
			ch := format.Chunk{Size: 4096, Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: 4096}
			read := get(s, context.Background(), ch)
			other := randBytes(2, 4096)
			od := digest.FromBytes(other)
			pending := s.Prefetch([]format.Chunk{{Size: 4096, Encoding: format.EncodingRaw, Digest: od, Blob: od, BlobSize: 4096}})
			for dead.n.Load() < 3 { // retrying
				time.Sleep(time.Millisecond)
			}
			closed := make(chan struct{})
			go func() { s.Close(); close(closed) }()
			wait(t, closed, "Close")
			if res := wait(t, read, "read"); !errors.Is(res.err, ErrClosed) {
				t.Fatalf("read during Close: %d bytes, %v; want ErrClosed", len(res.data), res.err)
			}
			for _, p := range pending {
				if err := p.Wait(context.Background()); !errors.Is(err, ErrClosed) {
					t.Fatalf("prefetch during Close: %v; want ErrClosed", err)
				}
			}
			if _, err := s.Get(context.Background(), ch, nil, Read); !errors.Is(err, ErrClosed) {
				t.Fatalf("read after Close: %v; want ErrClosed", err)
			}
		})
	}
}

// TestCloseDoesNotFailAnotherMountsRead closes a mount's scheduler while
// its fetch of a chunk, stuck at its endpoint, is the one that another
// mount's read of the same chunk waits for. Close returns, and the other
// mount's read gets the chunk from its own endpoint.
func TestCloseDoesNotFailAnotherMountsRead(t *testing.T) {
	c, codec := setup(t)
	var inFlight Flights
	data := randBytes(1, 64<<10)
	d := digest.FromBytes(data)
	ch := format.Chunk{Size: int64(len(data)), Encoding: format.EncodingRaw, Digest: d, Blob: d, BlobSize: int64(len(data))}
	stuck := newGate(blobs{d: data}) // never opened: the endpoint hangs
	a := newScheduler(t, "stuck", stuck, c, codec, &inFlight)
	b := newScheduler(t, "primary", blobs{d: data}, c, codec, &inFlight)

	readA := get(a, context.Background(), ch)
	wait(t, stuck.entered, "mount A's fetch")
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	readB := get(b, ctx, ch)
	waitStarted(t, b, ch)
	closed := make(chan struct{})
	go func() { a.Close(); close(closed) }()
	wait(t, closed, "Close of mount A")
	if res := wait(t, readA, "mount A's read"); !errors.Is(res.err, ErrClosed) {
		t.Fatalf("mount A's read: %v; want ErrClosed", res.err)
	}
	if res := wait(t, readB, "mount B's read"); res.err != nil || !bytes.Equal(res.data, data) {
		t.Fatalf("mount B's read: %d bytes, %v", len(res.data), res.err)
	}
}

// TestRoundTripIsOwnRequests: a mount's round trip is measured on the
// requests it made itself. Mount A fetches a chunk from an endpoint held
// for 30 ms; mount B, asking for the same chunk meanwhile, follows A's
// fetch and gets the bytes at once when it ends: B made no request and
// measured nothing (counting its wait, however long, would say nothing of
// the link: joined late, it tells a far registry's mount that it is
// near), and A measured at least the 30 ms its request
// was held.
func TestRoundTripIsOwnRequests(t *testing.T) {
	c, codec := setup(t)
	var inFlight Flights
	chs, stored := rawChunks(2, 1, 64<<10)
	ch, data := chs[0], stored[chs[0].Digest]
	held := newGate(stored)
	a := newScheduler(t, "far", held, c, codec, &inFlight)
	b := newScheduler(t, "far too", held, c, codec, &inFlight)
	readA := get(a, context.Background(), ch)
	wait(t, held.entered, "mount A's fetch")
	readB := get(b, context.Background(), ch)
	waitStarted(t, b, ch)
	const hold = 30 * time.Millisecond
	time.Sleep(hold)
	held.open()
	for _, r := range []<-chan result{readA, readB} {
		if res := wait(t, r, "a read"); res.err != nil || !bytes.Equal(res.data, data) {
			t.Fatalf("read: %d bytes, %v", len(res.data), res.err)
		}
	}
	if rt := a.RoundTrip(); rt < hold {
		t.Errorf("mount A's round trip %v, want at least the %v its request was held", rt, hold)
	}
	if rt := b.RoundTrip(); rt != 0 {
		t.Errorf("mount B, which followed A's fetch, measured a round trip of %v; want none", rt)
	}
}
