package peer

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

const token = "pool-token-0123456789abcdef"

// now is an urgency that holds from the start: a read waits.
var now = func() <-chan struct{} { c := make(chan struct{}); close(c); return c }()

func newPool(t *testing.T, opts PoolOptions) *Pool {
	t.Helper()
	if opts.Token == "" {
		opts.Token = token
	}
	p, err := NewPool(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func units(n int) []digest.Digest {
	out := make([]digest.Digest, n)
	for i := range out {
		out[i] = digest.FromString(fmt.Sprint(i))
	}
	return out
}

// TestOwnersSpreadAndMoveLittle: every member owns about its share of
// the units, every node computes the same owners, and a member that goes
// away moves only the units it owned.
func TestOwnersSpreadAndMoveLittle(t *testing.T) {
	peers := []string{"10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.3:7070", "10.0.0.4:7070"}
	a := newPool(t, PoolOptions{Peers: peers, Self: "10.0.0.1:7070"})
	b := newPool(t, PoolOptions{Peers: []string{peers[3], peers[2], peers[1], peers[0]}})
	us := units(4000)
	count := map[string]int{}
	before := map[digest.Digest]string{}
	for _, u := range us {
		oa, _ := a.owner(u)
		ob, _ := b.owner(u)
		if oa.addr != ob.addr {
			t.Fatalf("unit %s: owner %s on one node, %s on another", u, oa.addr, ob.addr)
		}
		count[oa.addr]++
		before[u] = oa.addr
	}
	for _, p := range peers {
		if count[p] < 800 || count[p] > 1200 {
			t.Errorf("%s owns %d of 4000 units, want about 1000: %v", p, count[p], count)
		}
	}
	if o, _ := a.owner(us[0]); o.self != (o.addr == peers[0]) {
		t.Errorf("owner %+v: self wrong", o)
	}
	b.avoid(peers[2], fmt.Errorf("test"))
	for _, u := range us {
		o, _ := b.owner(u)
		if o.addr == peers[2] {
			t.Fatalf("unit %s still owned by the avoided peer", u)
		}
		if before[u] != peers[2] && o.addr != before[u] {
			t.Fatalf("unit %s moved from %s to %s though its owner stayed", u, before[u], o.addr)
		}
	}
	if live, _ := b.Members(); len(live) != 3 {
		t.Errorf("live members %v, want 3", live)
	}
}

// TestSelfAndDNS: dns: entries resolve to every address of the name, and
// a listen address without a host matches this node's own addresses.
func TestSelfAndDNS(t *testing.T) {
	p := newPool(t, PoolOptions{Peers: []string{"dns:localhost:7070", "10.9.9.9:7070"}, Self: ":7070"})
	live, self := p.Members()
	host, port, err := net.SplitHostPort(self)
	if err != nil || port != "7070" || !net.ParseIP(host).IsLoopback() {
		t.Fatalf("self %q, want localhost's address (members %v)", self, live)
	}
	if len(live) < 2 {
		t.Fatalf("members %v, want localhost's and 10.9.9.9", live)
	}
	if !strings.Contains(strings.Join(live, " "), "10.9.9.9:7070") {
		t.Fatalf("members %v lack 10.9.9.9:7070", live)
	}
	q := newPool(t, PoolOptions{Peers: []string{"127.0.0.1:7070"}, Self: "127.0.0.1:7071"})
	if _, self := q.Members(); self != "" {
		t.Fatalf("another port is self: %q", self)
	}
}

func TestBadPools(t *testing.T) {
	for _, o := range []PoolOptions{
		{Token: token},
		{Peers: []string{"a:1"}, Token: "short"},
		{Peers: []string{"nohostport"}, Token: token},
		{Peers: []string{"dns:name"}, Token: token},
		{Peers: []string{":7070"}, Token: token},
		{Peers: []string{"a:1"}, Token: token, Self: "noport"},
	} {
		if _, err := NewPool(context.Background(), o); err == nil {
			t.Errorf("NewPool(%+v) took it", o)
		}
	}
}

// TestRequestChecks: the server refuses requests it must not act on.
func TestRequestChecks(t *testing.T) {
	good := format.Chunk{Digest: digest.FromString("a"), Blob: digest.FromString("a"), Encoding: format.EncodingRaw, Size: 4096, BlobSize: 4096}
	other := good
	other.Digest, other.Blob = digest.FromString("b"), digest.FromString("b")
	big := good
	big.Size, big.BlobSize = format.MaxChunkSize+1, format.MaxChunkSize+1
	zero := format.Chunk{Encoding: format.EncodingZero, Size: 4096}
	lying := good
	lying.BlobSize = 1
	many := make([]wireChunk, MaxChunks+1)
	for i := range many {
		many[i] = toWire(good)
	}
	for name, r := range map[string]request{
		"no repository": {Chunks: []wireChunk{toWire(good)}},
		"no chunks":     {Repository: "r/x"},
		"two blobs":     {Repository: "r/x", Chunks: []wireChunk{toWire(good), toWire(other)}},
		"too large":     {Repository: "r/x", Chunks: []wireChunk{toWire(big)}},
		"zero":          {Repository: "r/x", Chunks: []wireChunk{toWire(zero)}},
		"lying sizes":   {Repository: "r/x", Chunks: []wireChunk{toWire(lying)}},
		"too many":      {Repository: "r/x", Chunks: many},
	} {
		if _, err := r.check(); err == nil {
			t.Errorf("%s: request taken", name)
		}
	}
	if _, err := (&request{Repository: "r/x", Chunks: []wireChunk{toWire(good), toWire(good)}}).check(); err != nil {
		t.Errorf("good request refused: %v", err)
	}
}

// stallingPeer starts a peer that never sends a chunk: it answers (200)
// first if answer is set, and holds every request until the test ends.
// It returns the peer's address.
func stallingPeer(t *testing.T, answer bool) string {
	addr, _ := countedStallingPeer(t, answer)
	return addr
}

// countedStallingPeer is stallingPeer, and counts the requests it holds.
func countedStallingPeer(t *testing.T, answer bool) (string, *atomic.Int32) {
	var held atomic.Int32
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		held.Add(1)
		if answer {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) })
	return strings.TrimPrefix(srv.URL, "http://"), &held
}

// holdEveryConnection has MaxConnsPerPeer background fetches of p take
// every connection to its one peer (which counts the requests it holds in
// inFlight) until the test ends.
func holdEveryConnection(t *testing.T, p *Pool, inFlight *atomic.Int32) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var holders sync.WaitGroup
	t.Cleanup(func() { cancel(); holders.Wait() })
	for range MaxConnsPerPeer {
		holders.Add(1)
		go func() {
			defer holders.Done()
			p.For("r/x").Fetch(ctx, []format.Chunk{oneByte}, false, nil, func(int, []byte) error { return nil })
		}()
	}
	for deadline := time.Now().Add(30 * time.Second); inFlight.Load() < MaxConnsPerPeer; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d requests reached the peer, want %d", inFlight.Load(), MaxConnsPerPeer)
		}
	}
}

// oneByte is a chunk to ask peers for.
var oneByte = format.Chunk{Digest: digest.FromString("a"), Blob: digest.FromString("a"), Encoding: format.EncodingRaw, Size: 1, BlobSize: 1}

// TestStalledPeerGivesUp: a peer that accepts a request and sends nothing
// costs the wait, counted as a timeout; the chunk is not taken from it,
// and at the third timeout in a row it is avoided.
func TestStalledPeerGivesUp(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{stallingPeer(t, false)}, UrgentWait: 100 * time.Millisecond, Metrics: NewMetrics(reg)})
	c := oneByte
	for i := 1; i <= timeoutsToAvoid; i++ {
		n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{c}, true, now, func(int, []byte) error {
			t.Error("a chunk was taken from a peer that sent none")
			return nil
		})
		if n != 0 {
			t.Fatalf("took %d chunks", n)
		}
		if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("timeout")); got != float64(i) {
			t.Fatalf("timeouts counted: %v, want %d", got, i)
		}
		live, _ := p.Members()
		if avoided := len(live) == 0; avoided != (i == timeoutsToAvoid) {
			t.Fatalf("after %d timeouts in a row, avoided %v", i, avoided)
		}
	}
}

// held serves chunks from a map, as a node holding them would.
type held map[digest.Digest][]byte

func (h held) ServeChunks(_ context.Context, _ string, chunks []format.Chunk, _ bool, ready func(), emit func([]byte) error) error {
	ready()
	for _, c := range chunks {
		data, ok := h[c.Digest]
		if !ok {
			return fmt.Errorf("no %s", c.Digest)
		}
		if err := emit(data); err != nil {
			return err
		}
	}
	return nil
}

// TestTLSAndShortAnswers: over TLS, with the server's CA, a pool takes the
// chunks its peer holds, in order; the answer ends where the peer lacks
// one, which is not the peer's fault (no avoidance).
func TestTLSAndShortAnswers(t *testing.T) {
	a, b := []byte("first chunk"), []byte("second chunk")
	// Two frames of one pack.
	pack, packSize := digest.FromString("pack"), int64(len(a)+len(b))
	c1 := format.Chunk{Digest: digest.FromBytes(a), Blob: pack, PackSize: packSize, Encoding: format.EncodingRaw, Size: int64(len(a)), BlobSize: int64(len(a))}
	c2 := format.Chunk{Digest: digest.FromBytes(b), Blob: pack, PackSize: packSize, PackOffset: int64(len(a)), Encoding: format.EncodingRaw, Size: int64(len(b)), BlobSize: int64(len(b))}
	h, err := NewServer(held{c1.Digest: a}, ServerOptions{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewTLSServer(h)
	defer srv.Close()
	roots := x509.NewCertPool()
	roots.AddCert(srv.Certificate())
	p := newPool(t, PoolOptions{Peers: []string{strings.TrimPrefix(srv.URL, "https://")}, TLS: &tls.Config{RootCAs: roots}})
	var got [][]byte
	take := func(i int, data []byte) error { got = append(got, data); return nil }
	if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{c1}, false, nil, take); n != 1 || string(got[0]) != string(a) {
		t.Fatalf("took %d chunks: %q", n, got)
	}
	// c2 is not held: the answer stops after c1, and c2 goes upstream.
	got = nil
	if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{c1, c2}, false, nil, take); n != 1 {
		t.Fatalf("took %d chunks, want 1 (the peer lacks the second)", n)
	}
	if live, _ := p.Members(); len(live) != 1 {
		t.Fatalf("a peer that lacked a chunk was avoided")
	}
	// Without the CA, the peer's certificate is refused.
	q := newPool(t, PoolOptions{Peers: []string{strings.TrimPrefix(srv.URL, "https://")}, TLS: &tls.Config{}})
	if n, _, _ := q.For("r/x").Fetch(context.Background(), []format.Chunk{c1}, false, nil, take); n != 0 {
		t.Fatal("took a chunk from a peer whose certificate it cannot check")
	}
}

// TestSlowOwnerKeptForFaults: a peer that answers a page fault's request
// but is late with the chunk (fetching it upstream for everyone) costs
// the fault the wait, but stays in the pool longer than one that does not
// answer: until slowToAvoid late answers in a row.
func TestSlowOwnerKeptForFaults(t *testing.T) {
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{stallingPeer(t, true)}, UrgentWait: 100 * time.Millisecond, Metrics: NewMetrics(reg)})
	c := oneByte
	for i := 1; i <= slowToAvoid; i++ {
		if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{c}, true, now, func(int, []byte) error { return nil }); n != 0 {
			t.Fatalf("took %d chunks", n)
		}
		if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("timeout")); got != float64(i) {
			t.Fatalf("timeouts counted: %v, want %d", got, i)
		}
		live, _ := p.Members()
		if avoided := len(live) == 0; avoided != (i == slowToAvoid) {
			t.Fatalf("after %d late answers in a row (timeouts avoid at %d), avoided %v", i, timeoutsToAvoid, avoided)
		}
	}
}

// TestReadMakesWaitShort: a background request waits long for a slow
// chunk, until a read comes to wait on it: then the wait is the short one.
func TestReadMakesWaitShort(t *testing.T) {
	p := newPool(t, PoolOptions{Peers: []string{stallingPeer(t, true)}, UrgentWait: 50 * time.Millisecond, BackgroundWait: time.Hour})
	c := oneByte
	urgent := make(chan struct{})
	done := make(chan int)
	go func() {
		n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{c}, false, urgent, func(int, []byte) error { return nil })
		done <- n
	}()
	select {
	case <-done:
		t.Fatal("a background request gave up on a live peer before an hour")
	case <-time.After(200 * time.Millisecond):
	}
	close(urgent)
	// Without the short wait this would wait an hour; a minute is far
	// beyond the 50 ms the read asks for, however slow the machine.
	select {
	case n := <-done:
		if n != 0 {
			t.Fatalf("took %d chunks", n)
		}
	case <-time.After(time.Minute):
		t.Fatal("a read waiting on the chunk did not shorten the background wait")
	}
}

// TestServerRefusals: the server answers a request it will not serve
// with the status that says why, and a node asking itself with
// StatusSelf, which makes the pool treat that member as itself.
func TestServerRefusals(t *testing.T) {
	c := oneByte
	hold, entered := make(chan struct{}), make(chan struct{})
	var once sync.Once
	blocking := chunksFunc(func() {
		once.Do(func() { close(entered) })
		<-hold
	})
	h, err := NewServer(blocking, ServerOptions{Token: token, MaxRequests: 1})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	post := func(body string) int {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+ChunksPath, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return -1
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	good, _ := json.Marshal(request{Repository: "r/x", Chunks: []wireChunk{toWire(c)}})
	if code := post(strings.Repeat(" ", MaxRequestBytes+1)); code != http.StatusRequestEntityTooLarge {
		t.Errorf("an oversized request got %d", code)
	}
	if code := post(`{"repository":"r/x","chunks":[{"digest":"nope"}]}`); code != http.StatusBadRequest {
		t.Errorf("a bad chunk got %d", code)
	}
	// One request holds the only slot; the next is busy.
	go post(string(good))
	<-entered
	if code := post(string(good)); code != http.StatusServiceUnavailable {
		t.Errorf("a request over MaxRequests got %d", code)
	}
	close(hold)

	// A node listed under an address it does not know for its own.
	var own http.Handler
	srv2 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { own.ServeHTTP(w, r) }))
	defer srv2.Close()
	self := newPool(t, PoolOptions{Peers: []string{strings.TrimPrefix(srv2.URL, "http://")}})
	own, _ = NewServer(held{}, ServerOptions{Token: token, NodeID: self.ID()})
	if n, _, err := self.For("r/x").Fetch(context.Background(), []format.Chunk{c}, false, nil, func(int, []byte) error { return nil }); n != 0 || !errors.Is(err, fetch.ErrNoPeer) {
		t.Fatalf("asking itself: took %d chunks (%v), want none and fetch.ErrNoPeer: the chunks are its own to fetch upstream", n, err)
	}
	if _, me := self.Members(); me != strings.TrimPrefix(srv2.URL, "http://") {
		t.Fatalf("the member that is this node is not known as self: %q", me)
	}
}

// chunksFunc serves nothing: it calls f, then fails.
type chunksFunc func()

func (f chunksFunc) ServeChunks(_ context.Context, _ string, _ []format.Chunk, _ bool, ready func(), _ func([]byte) error) error {
	ready()
	f()
	return fmt.Errorf("nothing here")
}

// refusing cannot serve any repository (too many served at once, say).
type refusing struct{}

func (refusing) ServeChunks(context.Context, string, []format.Chunk, bool, func(), func([]byte) error) error {
	return fmt.Errorf("serving too many repositories")
}

// TestRefusedRepositoryIsBusy: a node that cannot serve a repository
// answers 503 before anything else, and the asking pool goes upstream
// without avoiding it.
func TestRefusedRepositoryIsBusy(t *testing.T) {
	h, err := NewServer(refusing{}, ServerOptions{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{strings.TrimPrefix(srv.URL, "http://")}, Metrics: NewMetrics(reg)})
	if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{oneByte}, false, nil, func(int, []byte) error { return nil }); n != 0 {
		t.Fatalf("took %d chunks", n)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("busy")); got != 1 {
		t.Fatalf("busy answers counted: %v, want 1", got)
	}
	if live, _ := p.Members(); len(live) != 1 {
		t.Fatal("a peer that refused one repository was avoided")
	}
}

// TestLocalConnectionWaitIsNotThePeers: with all MaxConnsPerPeer of this
// node's connections to a peer held by requests it is answering, page
// faults that wait for a connection go upstream when their wait ends, but
// the peer is not blamed (kind "local", not "timeout") and never avoided.
func TestLocalConnectionWaitIsNotThePeers(t *testing.T) {
	addr, inFlight := countedStallingPeer(t, true)
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{addr}, UrgentWait: 100 * time.Millisecond,
		BackgroundWait: time.Hour, AnswerWait: time.Hour, Metrics: NewMetrics(reg)})
	holdEveryConnection(t, p, inFlight)
	for i := 1; i <= 2*timeoutsToAvoid; i++ {
		if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{oneByte}, true, now, func(int, []byte) error { return nil }); n != 0 {
			t.Fatalf("took %d chunks", n)
		}
		if live, _ := p.Members(); len(live) == 0 {
			t.Fatalf("peer avoided after %d page faults waited for this node's own connections", i)
		}
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("local")); got != 2*timeoutsToAvoid {
		t.Errorf("local waits counted: %v, want %d", got, 2*timeoutsToAvoid)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("timeout")); got != 0 {
		t.Errorf("timeouts counted against the peer: %v", got)
	}
	if n := inFlight.Load(); n != MaxConnsPerPeer {
		t.Errorf("%d requests reached the peer, want %d (the faults must not)", n, MaxConnsPerPeer)
	}
}

// TestPeerHoldingEveryConnectionIsBlamed: a peer that takes this node's
// MaxConnsPerPeer requests and answers none (not even the header, which a
// server sends at once) holds every connection to it. Page faults queued
// behind those connections then wait for the peer, not for this node:
// each counts as a timeout, and the peer is avoided at the
// timeoutsToAvoid-th, long before the holders' own (background) wait for
// an answer ends.
func TestPeerHoldingEveryConnectionIsBlamed(t *testing.T) {
	addr, inFlight := countedStallingPeer(t, false)
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{addr}, UrgentWait: 100 * time.Millisecond,
		BackgroundWait: time.Hour, AnswerWait: time.Hour, Metrics: NewMetrics(reg)})
	holdEveryConnection(t, p, inFlight)
	for i := 1; i <= timeoutsToAvoid; i++ {
		if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{oneByte}, true, now, func(int, []byte) error { return nil }); n != 0 {
			t.Fatalf("took %d chunks", n)
		}
	}
	if live, _ := p.Members(); len(live) != 0 {
		t.Errorf("peer still live after %d page faults waited behind its %d unanswered connections", timeoutsToAvoid, MaxConnsPerPeer)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("timeout")); got != timeoutsToAvoid {
		t.Errorf("timeouts counted: %v, want %d", got, timeoutsToAvoid)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("local")); got != 0 {
		t.Errorf("local waits counted: %v, want 0", got)
	}
}

// TestUnresolvablePeerIsBlamed: a member named by a host name whose
// lookup hangs is as unreachable as one that does not answer: each page
// fault's wait counts as a timeout (not as a wait for this node's own
// connections), and the member is avoided at the timeoutsToAvoid-th.
func TestUnresolvablePeerIsBlamed(t *testing.T) {
	var stall atomic.Bool
	resolver := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		if stall.Load() {
			<-ctx.Done()
			return nil, ctx.Err()
		}
		return nil, errors.New("no name server in this test")
	}}
	reg := prometheus.NewRegistry()
	p := newPool(t, PoolOptions{Peers: []string{"peer.invalid:7070"}, UrgentWait: 100 * time.Millisecond, Resolver: resolver, Metrics: NewMetrics(reg)})
	stall.Store(true)
	for i := 1; i <= timeoutsToAvoid; i++ {
		if n, _, _ := p.For("r/x").Fetch(context.Background(), []format.Chunk{oneByte}, true, now, func(int, []byte) error { return nil }); n != 0 {
			t.Fatalf("took %d chunks", n)
		}
	}
	if live, _ := p.Members(); len(live) != 0 {
		t.Errorf("peer still live after %d page faults waited for its name to resolve", timeoutsToAvoid)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("timeout")); got != timeoutsToAvoid {
		t.Errorf("timeouts counted: %v, want %d", got, timeoutsToAvoid)
	}
	if got := testutil.ToFloat64(p.opts.Metrics.errors.WithLabelValues("local")); got != 0 {
		t.Errorf("local waits counted: %v, want 0", got)
	}
}
