package puller

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/peer"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
)

const testToken = "pool-token-0123456789abcdef"

// node is one puller of a test pool, with its peer server on loopback.
type node struct {
	p    *Puller
	addr string
	srv  *http.Server
	pool *peer.Pool
	reg  *prometheus.Registry
}

// kill stops the node's peer server at once: its listener and every
// connection are closed, as if the node died.
func (n *node) kill() { n.srv.Close() }

// startPool starts n pullers, each serving its peers on its own loopback
// port and knowing all of them. wrap, if set, wraps a node's chunks as
// its server serves them (a lying peer).
func startPool(t *testing.T, n int, wrap func(i int, c peer.Chunks) peer.Chunks, others ...string) []*node {
	t.Helper()
	lns := make([]net.Listener, n)
	addrs := make([]string, n)
	for i := range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i], addrs[i] = ln, ln.Addr().String()
	}
	addrs = append(addrs, others...)
	nodes := make([]*node, n)
	for i := range n {
		reg := prometheus.NewRegistry()
		m := peer.NewMetrics(reg)
		pool, err := peer.NewPool(context.Background(), peer.PoolOptions{Peers: addrs, Self: addrs[i], Token: testToken, Metrics: m, AvoidFor: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		p := newPuller(t, Options{Peers: pool, KeepFetchLog: true, PeerUpstream: func(ctx context.Context, repo string) ([]fetch.Endpoint, error) {
			return Endpoints(repo, ResolveOptions{})
		}})
		var chunks peer.Chunks = p
		if wrap != nil {
			chunks = wrap(i, p)
		}
		h, err := peer.NewServer(chunks, peer.ServerOptions{Token: testToken, Metrics: m, NodeID: pool.ID()})
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: h}
		go srv.Serve(lns[i])
		t.Cleanup(func() { srv.Close() })
		nodes[i] = &node{p: p, addr: addrs[i], srv: srv, pool: pool, reg: reg}
	}
	return nodes
}

// storedBytes is what the snapshot's chunks take in the registry: each
// chunk blob, or each pack, once.
func storedBytes(t *testing.T, s Source) int64 {
	seen := map[string]bool{}
	var n int64
	for _, c := range snapshotChunks(t, s) {
		if seen[c.Blob.String()] {
			continue
		}
		seen[c.Blob.String()] = true
		if c.Packed() {
			n += c.PackSize
		} else {
			n += c.BlobSize
		}
	}
	return n
}

// loadAll loads s on every node at once and checks each node's
// materialized dir against src.
func loadAll(t *testing.T, nodes []*node, s Source, src string) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make([]error, len(nodes))
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			_, errs[i] = n.p.Load(ctx, s)
		}()
	}
	wg.Wait()
	for i, n := range nodes {
		if errs[i] != nil {
			t.Fatalf("node %d: %v", i, errs[i])
		}
		dir, ok := n.p.Materialized(s.Index.Digest)
		if !ok {
			t.Fatalf("node %d: not materialized", i)
		}
		for _, name := range []string{format.CheckpointFile, format.PagesMetaFile, format.PagesFile} {
			sameFile(t, dir+"/"+name, src+"/"+name)
		}
	}
}

// TestPoolFetchesEachChunkOnce loads one snapshot on 4 pullers of a pool
// at once: each has the snapshot's bytes, and the registry served its
// blobs about once in all (at most 1.25 times what it stores), not once
// per node.
func TestPoolFetchesEachChunkOnce(t *testing.T) {
	for _, v := range []string{"v1", "v2"} {
		t.Run(v, func(t *testing.T) {
			r := startReg(t)
			var src string
			var s Source
			if v == "v1" {
				src, s = push(t, r, "app", synth.HalfZero, 24<<20, 3)
			} else {
				// Compressible: a pack's frames decode to more than one
				// peer request may ask for.
				src, s = pushV2(t, r, "app", synth.Text, 24<<20, 3)
			}
			s.Repository = r.host + "/app"
			stored := storedBytes(t, s)
			nodes := startPool(t, 4, nil)
			before := r.blobBytes.Load()
			loadAll(t, nodes, s, src)
			moved := r.blobBytes.Load() - before
			var fromPeers float64
			for _, n := range nodes {
				fromPeers += metric(t, n.reg, "cryo_puller_peer_received_bytes_total")
			}
			t.Logf("stored %d bytes; the registry served %d (%.2fx) to 4 nodes; %.0f bytes went between peers", stored, moved, float64(moved)/float64(stored), fromPeers)
			if float64(moved) > 1.25*float64(stored) {
				t.Fatalf("the registry served %d blob bytes to 4 nodes for %d stored (%.2fx): chunks were not shared", moved, stored, float64(moved)/float64(stored))
			}
			if fromPeers == 0 {
				t.Fatal("no bytes went between peers")
			}
			for _, n := range nodes {
				if e := metric(t, n.reg, "cryo_puller_peer_errors_total"); e != 0 {
					t.Errorf("node %s: %v peer errors among live, honest peers", n.addr, e)
				}
			}
		})
	}
}

// TestPoolPeerKilledMidLoad kills one puller of 4 while they load a
// snapshot from a slow registry: the other 3 load it whole, each byte
// right, taking from upstream what the dead one owned.
func TestPoolPeerKilledMidLoad(t *testing.T) {
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 32<<20, 4)
	s.Repository = r.host + "/app"
	chunks := int64(len(snapshotChunks(t, s)))
	r.set(func(r *reg) { r.delay = 40 * time.Millisecond })
	nodes := startPool(t, 4, nil)
	dead := nodes[0]
	// The dead node loads too, until it dies: its peers ask it for what
	// it owns meanwhile.
	ctx, cancel := context.WithCancel(context.Background())
	go dead.p.Load(ctx, s)
	start := r.blobGets.Load()
	go func() {
		// A quarter of the way through the load.
		for r.blobGets.Load()-start < chunks/4 {
			time.Sleep(5 * time.Millisecond)
		}
		dead.kill()
		cancel()
	}()
	loadAll(t, nodes[1:], s, src)
	var errs float64
	for _, n := range nodes[1:] {
		errs += metric(t, n.reg, "cryo_puller_peer_errors_total")
		if live, _ := n.pool.Members(); len(live) != 3 {
			t.Errorf("node %s still counts %d live peers, want 3 (the dead one avoided): %v", n.addr, len(live), live)
		}
	}
	if errs == 0 {
		t.Fatal("no peer errors counted: the dead peer was never asked, the test proves nothing")
	}
}

// TestPoolBlackholePeer lists, among 3 pullers, a peer that accepts
// connections and never answers: the 3 load the snapshot whole, each byte
// right, the black hole costing a bounded wait before it is avoided.
func TestPoolBlackholePeer(t *testing.T) {
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 16<<20, 7)
	s.Repository = r.host + "/app"
	hole, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hole.Close()
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				return
			}
			defer c.Close() // held open, never read or answered
		}
	}()
	nodes := startPool(t, 3, nil, hole.Addr().String())
	loadAll(t, nodes, s, src)
	for _, n := range nodes {
		if got := metric(t, n.reg, "cryo_puller_peer_errors_total", "kind", "timeout"); got == 0 {
			t.Errorf("node %s counted no timeout of the black hole", n.addr)
		}
		live, _ := n.pool.Members()
		for _, a := range live {
			if a == hole.Addr().String() {
				t.Errorf("node %s still uses the black hole", n.addr)
			}
		}
	}
}

// lying serves every chunk with one byte flipped.
type lying struct{ peer.Chunks }

func (l lying) ServeChunks(ctx context.Context, repo string, chunks []format.Chunk, urgent bool, ready func(), emit func([]byte) error) error {
	return l.Chunks.ServeChunks(ctx, repo, chunks, urgent, ready, func(data []byte) error {
		bad := append([]byte(nil), data...)
		bad[len(bad)/2] ^= 0x40
		return emit(bad)
	})
}

// TestPoolCorruptPeer has one puller of 3 serve corrupt chunks: the
// others detect every one, avoid the liar, load from upstream, and serve
// no wrong byte.
func TestPoolCorruptPeer(t *testing.T) {
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 16<<20, 5)
	s.Repository = r.host + "/app"
	nodes := startPool(t, 3, func(i int, c peer.Chunks) peer.Chunks {
		if i == 0 {
			return lying{c}
		}
		return c
	})
	loadAll(t, nodes[1:], s, src)
	for _, n := range nodes[1:] {
		if got := metric(t, n.reg, "cryo_puller_peer_errors_total", "kind", "corrupt"); got == 0 {
			t.Errorf("node %s counted no corrupt chunk from the liar", n.addr)
		}
		live, _ := n.pool.Members()
		for _, a := range live {
			if a == nodes[0].addr {
				t.Errorf("node %s still uses the liar %s", n.addr, a)
			}
		}
	}
}

// TestPoolWrongTokenRefused: a puller whose pool token is not the
// server's is refused before anything is read, and still loads the
// snapshot, from upstream; a request without a token is refused too.
func TestPoolWrongTokenRefused(t *testing.T) {
	r := startReg(t)
	src, s := push(t, r, "app", synth.Random, 8<<20, 6)
	s.Repository = r.host + "/app"
	nodes := startPool(t, 1, func(_ int, c peer.Chunks) peer.Chunks { return mustNotServe{t} })
	reg := prometheus.NewRegistry()
	pool, err := peer.NewPool(context.Background(), peer.PoolOptions{Peers: []string{nodes[0].addr}, Token: "another-token-0123456789", Metrics: peer.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	p := newPuller(t, Options{Peers: pool})
	ctx := context.Background()
	if _, err := p.Load(ctx, s); err != nil {
		t.Fatal(err)
	}
	img, _ := p.Materialized(s.Index.Digest)
	sameFile(t, img+"/pages.img", src+"/pages.img")
	if got := metric(t, reg, "cryo_puller_peer_errors_total", "kind", "refused"); got == 0 {
		t.Fatal("the wrong token was not refused")
	}
	if got := metric(t, nodes[0].reg, "cryo_puller_peer_refused_requests_total"); got == 0 {
		t.Fatal("the server counted no refusal")
	}
	resp, err := http.Post("http://"+nodes[0].addr+peer.ChunksPath, "application/json", strings.NewReader(`{"repository":"x/y","chunks":[]}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a request without a token got %d, want 401", resp.StatusCode)
	}
}

// mustNotServe fails the test if a request reaches it.
type mustNotServe struct{ t *testing.T }

func (m mustNotServe) ServeChunks(context.Context, string, []format.Chunk, bool, func(), func([]byte) error) error {
	m.t.Error("a request without the pool token reached the chunks")
	return errors.New("refused")
}

// metric sums the values of metric name in reg whose labels include
// every label=value pair given.
func metric(t *testing.T, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				found := false
				for _, lp := range m.GetLabel() {
					found = found || lp.GetName() == labels[i] && lp.GetValue() == labels[i+1]
				}
				if !found {
					continue next
				}
			}
			switch {
			case m.Counter != nil:
				sum += m.Counter.GetValue()
			case m.Gauge != nil:
				sum += m.Gauge.GetValue()
			}
		}
	}
	return sum
}

// gatedOwner is an owner whose answers wait: a request for blob gate
// waits until open is closed; the first request for any other blob sends
// its chunk count on asked, answers its header (it is alive) and sends
// nothing until its asker gives up; later ones are served.
type gatedOwner struct {
	peer.Chunks
	gate      digest.Digest
	gateAsked chan struct{}
	open      chan struct{}
	asked     chan int
	held      atomic.Bool
}

func (g *gatedOwner) ServeChunks(ctx context.Context, repo string, chunks []format.Chunk, urgent bool, ready func(), emit func([]byte) error) error {
	switch {
	case chunks[0].Blob == g.gate:
		g.gateAsked <- struct{}{}
		select {
		case <-g.open:
		case <-ctx.Done():
			return ctx.Err()
		}
	case g.held.CompareAndSwap(false, true):
		ready()
		g.asked <- len(chunks)
		<-ctx.Done()
		return ctx.Err()
	}
	return g.Chunks.ServeChunks(ctx, repo, chunks, urgent, ready, emit)
}

// TestSlowOwnerCostsTheRegistryOnlyWhatReadsWaitOn: a pack's frames are
// asked of their owner, which answers and then sends nothing; a read
// comes to wait on a frame in the middle of them. The read waits the
// short wait, then gets that frame from the registry; the frames before
// and after it, which no read waits on, are asked of the owner again and
// come from it, not from the registry: on a busy pool, a slow owner
// costs the registry the chunks reads wait on, not whole packs (issue
// 14's egress at 32 nodes).
func TestSlowOwnerCostsTheRegistryOnlyWhatReadsWaitOn(t *testing.T) {
	r := startReg(t)
	src, s := pushV2(t, r, "app", synth.Random, 16<<20, 11)
	s.Repository = r.host + "/app"
	want, err := os.ReadFile(filepath.Join(src, format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	byPack := map[digest.Digest][]format.Chunk{}
	var packs []digest.Digest
	for _, c := range snapshotChunksOf(t, s, format.PagesFile) {
		if c.Encoding == format.EncodingZero {
			continue
		}
		if byPack[c.Blob] == nil {
			packs = append(packs, c.Blob)
		}
		byPack[c.Blob] = append(byPack[c.Blob], c)
	}
	if len(packs) < 2 || len(byPack[packs[0]]) < 16 {
		t.Fatalf("want 2 packs of 16 chunks or more, got %d packs", len(packs))
	}
	pack, gate := byPack[packs[0]], byPack[packs[1]][0]

	owner := &gatedOwner{gate: gate.Blob, gateAsked: make(chan struct{}, 1), open: make(chan struct{}), asked: make(chan int, 1)}
	nodes := startPool(t, 1, func(_ int, c peer.Chunks) peer.Chunks { owner.Chunks = c; return owner })
	reg := prometheus.NewRegistry()
	pool, err := peer.NewPool(context.Background(), peer.PoolOptions{Peers: []string{nodes[0].addr}, Token: testToken, UrgentWait: 300 * time.Millisecond, BackgroundWait: time.Minute, AnswerWait: time.Minute, Metrics: peer.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	c, codec := coldCache(t)
	// One worker: it is busy with the gate's chunk while the pack's are
	// queued, then takes them all in one batch.
	sched := fetch.New(s.Endpoints, c, codec, fetch.Options{Workers: 1, Peers: pool.For(s.Repository), Metrics: fetch.NewMetrics(reg)})
	defer sched.Close()
	gated := sched.Prefetch([]format.Chunk{gate})
	<-owner.gateAsked
	pending := sched.Prefetch(pack)
	close(owner.open)
	n := <-owner.asked
	if n < 8 {
		t.Fatalf("the owner was asked for %d of the pack's %d chunks at once, want the batch", n, len(pack))
	}
	k := n / 4
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	data, err := sched.Get(ctx, pack[k], nil, fetch.Read)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(data, want[pack[k].Offset:pack[k].Offset+pack[k].Size]) {
		t.Fatal("the read got wrong bytes")
	}
	for _, p := range append(gated, pending...) {
		if err := p.Wait(ctx); err != nil {
			t.Fatalf("chunk %s: %v", p.Chunk().Digest, err)
		}
	}
	var others int64
	for i, c := range pack[:n] {
		if i != k {
			others += c.BlobSize
		}
	}
	fromRegistry := metric(t, reg, "cryo_puller_fetched_bytes_total", "endpoint", "primary")
	fromPeers := metric(t, reg, "cryo_puller_fetched_bytes_total", "endpoint", "peers")
	t.Logf("read chunk %d of a batch of %d; %.0f bytes from the registry, %.0f from the owner", k, n, fromRegistry, fromPeers)
	if fromRegistry != float64(pack[k].BlobSize) {
		t.Fatalf("the registry served %.0f bytes, want the %d of the read's chunk alone: frames no read waited on went upstream", fromRegistry, pack[k].BlobSize)
	}
	if fromPeers < float64(others) {
		t.Fatalf("the owner served %.0f bytes, under the %d of the batch's other frames", fromPeers, others)
	}
}
