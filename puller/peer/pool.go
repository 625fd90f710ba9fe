package peer

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/opencontainers/go-digest"
)

// PoolOptions configure a Pool.
type PoolOptions struct {
	// Peers are the pool's members: "host:port", or "dns:NAME:PORT" for
	// every address NAME resolves to (a headless Service of the pullers'
	// DaemonSet), resolved again every Refresh. Every member must list
	// the same peers: a member's identity in the hashing is its entry
	// ("host:port" as given, or the resolved "ip:port").
	Peers []string
	// Self is the address this node's peer server listens on ("" if it
	// serves none): the member at that address is this node, which
	// fetches the units it owns upstream itself. A listen address without
	// a host (":7070") or with an unspecified one matches every address
	// of the node's interfaces on its port.
	Self string
	// Token is the pool's shared secret, sent with every request.
	Token string
	// TLS, if set, is used to reach peers (https); else plain HTTP.
	TLS *tls.Config
	// Refresh is how often dns: members are resolved again (default
	// 30 s).
	Refresh time.Duration
	// AvoidFor is how long a peer that failed is left out of the pool
	// (default 30 s, doubled for each failure in a row, up to 8 times as
	// long).
	AvoidFor time.Duration
	// UrgentWait and BackgroundWait bound how long a peer may go without
	// sending a byte while a sandbox is blocked on a chunk (default 2 s)
	// or not (default 30 s), before the chunk is fetched upstream;
	// AnswerWait bounds how long a peer may take to connect and answer
	// (the header, which a server sends at once) a request no read waits
	// on (default 10 s; UrgentWait for the others).
	// A whole request is bounded by 5 times as much. A peer that stalls
	// 3 times in a row is avoided, unless it answered an urgent request
	// and only the chunk was late (it may be fetching it upstream for
	// everyone).
	UrgentWait, BackgroundWait, AnswerWait time.Duration
	// Logger receives failures. Default: slog.Default().
	Logger *slog.Logger
	// Metrics, if set, counts peer traffic and errors.
	Metrics *Metrics
	// Resolver resolves dns: members and host names (default
	// net.DefaultResolver).
	Resolver *net.Resolver
}

// Pool is this node's view of its peers: which are live, and which owns a
// unit of transfer. It implements fetch.Peers for each repository (For).
type Pool struct {
	opts   PoolOptions
	client *http.Client
	scheme string

	// id names this pool's node in its requests (NodeHeader), so that a
	// node that asks itself under an address it did not know for its own
	// is told so (StatusSelf).
	id string

	mu      sync.Mutex
	members []member
	avoided map[string]avoidance
	// selves are members found to be this node (StatusSelf).
	selves map[string]bool
	// unanswered holds, per peer, when each request that has a
	// connection to it and no answer yet got its connection.
	unanswered map[string]map[*int]time.Time

	stop chan struct{}
	wg   sync.WaitGroup
}

// member is one peer of the pool.
type member struct {
	addr string // host:port, the identity hashed
	self bool
	// name is the dns: name it was resolved from ("" for host:port).
	name string
}

// avoidance is a peer left out after failures.
type avoidance struct {
	until    time.Time
	failures int
	// timeouts counts the timeouts in a row since its last success or
	// avoidance: a peer is avoided at the timeoutsToAvoid-th; slow counts
	// the answers late only with the chunk, avoided at the
	// slowToAvoid-th.
	timeouts, slow int
}

// timeoutsToAvoid is how many timeouts in a row make a peer avoided: on a
// busy node a connection or an answer may be late once without the peer
// being gone, and avoiding it moves its units (their fetches upstream) to
// other peers.
const timeoutsToAvoid = 3

// slowToAvoid is how many urgent answers in a row late only with the
// chunk make a peer avoided: the owner fetches upstream for the whole
// pool and may be late on a busy link, but one that is always late (its
// upstream is broken) costs every fault it owns the wait.
const slowToAvoid = 8

// MaxConnsPerPeer bounds the connections a node opens to each peer.
const MaxConnsPerPeer = 32

// NewPool resolves the peers once and returns the pool; dns: members are
// resolved again every Refresh until Close. A peer list that names no one
// is an error; names that do not resolve yet are logged and tried again.
func NewPool(ctx context.Context, opts PoolOptions) (*Pool, error) {
	if len(opts.Peers) == 0 {
		return nil, errors.New("peer pool: no peers")
	}
	if len(opts.Token) < MinTokenBytes {
		return nil, fmt.Errorf("peer pool: token of %d bytes, want at least %d", len(opts.Token), MinTokenBytes)
	}
	for _, e := range opts.Peers {
		if _, _, err := parseEntry(e); err != nil {
			return nil, err
		}
	}
	if opts.Self != "" {
		if _, _, err := net.SplitHostPort(opts.Self); err != nil {
			return nil, fmt.Errorf("peer pool: own address %q: %w", opts.Self, err)
		}
	}
	if opts.Refresh <= 0 {
		opts.Refresh = 30 * time.Second
	}
	if opts.AvoidFor <= 0 {
		opts.AvoidFor = 30 * time.Second
	}
	if opts.UrgentWait <= 0 {
		opts.UrgentWait = 2 * time.Second
	}
	if opts.BackgroundWait <= 0 {
		opts.BackgroundWait = 30 * time.Second
	}
	if opts.AnswerWait <= 0 {
		opts.AnswerWait = min(10*time.Second, opts.BackgroundWait)
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Resolver == nil {
		opts.Resolver = net.DefaultResolver
	}
	id := make([]byte, 16)
	if _, err := rand.Read(id); err != nil {
		return nil, err
	}
	p := &Pool{opts: opts, scheme: "http", id: hex.EncodeToString(id), avoided: map[string]avoidance{}, selves: map[string]bool{},
		unanswered: map[string]map[*int]time.Time{}, stop: make(chan struct{})}
	tr := &http.Transport{
		// Requests bound their own waits (ask), connecting included.
		DialContext:         (&net.Dialer{Timeout: opts.BackgroundWait, KeepAlive: 30 * time.Second, Resolver: opts.Resolver}).DialContext,
		TLSClientConfig:     opts.TLS,
		TLSHandshakeTimeout: opts.BackgroundWait,
		MaxIdleConnsPerHost: MaxConnsPerPeer,
		// A node's share of each peer's connections (its server takes
		// a few thousand): requests beyond wait for one, within their
		// wait.
		MaxConnsPerHost: MaxConnsPerPeer,
		IdleConnTimeout: 90 * time.Second,
	}
	if opts.TLS != nil {
		p.scheme = "https"
	}
	// A peer is asked for chunks, not told where to get them: no
	// redirects.
	p.client = &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	p.resolve(rctx)
	cancel()
	p.wg.Add(1)
	go p.refresh()
	return p, nil
}

// Close stops re-resolving the peers and closes idle connections.
func (p *Pool) Close() {
	close(p.stop)
	p.wg.Wait()
	p.client.CloseIdleConnections()
}

func (p *Pool) refresh() {
	defer p.wg.Done()
	t := time.NewTicker(p.opts.Refresh)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			p.resolve(ctx)
			cancel()
		}
	}
}

// parseEntry splits a --peers entry into a DNS name (dns:NAME:PORT; host
// empty) or a host, and its port.
func parseEntry(e string) (name, hostport string, err error) {
	if rest, ok := strings.CutPrefix(e, "dns:"); ok {
		n, port, err := net.SplitHostPort(rest)
		if err != nil || n == "" || port == "" {
			return "", "", fmt.Errorf("peer %q: want dns:NAME:PORT", e)
		}
		return n, port, nil
	}
	host, port, err := net.SplitHostPort(e)
	if err != nil || host == "" || port == "" {
		return "", "", fmt.Errorf("peer %q: want host:port or dns:NAME:PORT", e)
	}
	return "", net.JoinHostPort(host, port), nil
}

// resolve computes the members from the entries; a name that does not
// resolve keeps the members it had.
func (p *Pool) resolve(ctx context.Context) {
	self := p.selfIPs(ctx)
	isSelf := func(ip net.IP, port string) bool {
		if self == nil || port != self.port {
			return false
		}
		return slices.ContainsFunc(self.ips, ip.Equal)
	}
	p.mu.Lock()
	old := p.members
	p.mu.Unlock()
	seen := map[string]bool{}
	var ms []member
	add := func(m member) {
		if !seen[m.addr] {
			seen[m.addr] = true
			ms = append(ms, m)
		}
	}
	for _, e := range p.opts.Peers {
		name, hp, _ := parseEntry(e)
		if name != "" {
			port := hp
			ips, err := p.opts.Resolver.LookupIP(ctx, "ip", name)
			if err != nil {
				p.opts.Logger.Warn("resolve peers", "name", name, "err", err)
				for _, m := range old {
					if m.name == name {
						add(m)
					}
				}
				continue
			}
			for _, ip := range ips {
				add(member{addr: net.JoinHostPort(ip.String(), port), self: isSelf(ip, port), name: name})
			}
			continue
		}
		host, port, _ := net.SplitHostPort(hp)
		ips := []net.IP{net.ParseIP(host)}
		if ips[0] == nil {
			ips, _ = p.opts.Resolver.LookupIP(ctx, "ip", host)
		}
		add(member{addr: hp, self: slices.ContainsFunc(ips, func(ip net.IP) bool { return isSelf(ip, port) })})
	}
	slices.SortFunc(ms, func(a, b member) int { return strings.Compare(a.addr, b.addr) })
	p.mu.Lock()
	for i := range ms {
		ms[i].self = ms[i].self || p.selves[ms[i].addr]
	}
	p.members = ms
	p.setLive()
	p.mu.Unlock()
}

// selfAddr is the addresses and port of this node's own peer server.
type selfAddr struct {
	ips  []net.IP
	port string
}

// selfIPs returns the addresses that are this node's peer server, nil if
// it serves none.
func (p *Pool) selfIPs(ctx context.Context) *selfAddr {
	if p.opts.Self == "" {
		return nil
	}
	host, port, _ := net.SplitHostPort(p.opts.Self)
	ip := net.ParseIP(host)
	switch {
	case host == "" || ip != nil && ip.IsUnspecified():
		addrs, err := net.InterfaceAddrs()
		if err != nil {
			p.opts.Logger.Warn("list the node's addresses", "err", err)
		}
		s := &selfAddr{port: port}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok {
				s.ips = append(s.ips, n.IP)
			}
		}
		return s
	case ip != nil:
		return &selfAddr{ips: []net.IP{ip}, port: port}
	default:
		ips, err := p.opts.Resolver.LookupIP(ctx, "ip", host)
		if err != nil {
			p.opts.Logger.Warn("resolve the node's own peer address", "host", host, "err", err)
		}
		return &selfAddr{ips: ips, port: port}
	}
}

// Members returns the peers not being avoided, and which of them is this
// node ("" if none).
func (p *Pool) Members() (live []string, self string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	for _, m := range p.members {
		if m.self {
			self = m.addr
		}
		if p.live(m, now) {
			live = append(live, m.addr)
		}
	}
	return live, self
}

// live reports whether member m is in the live set at now: this node, or
// a peer not being avoided. p.mu is held.
func (p *Pool) live(m member, now time.Time) bool {
	return m.self || !now.Before(p.avoided[m.addr].until)
}

// setLive updates the live gauge; p.mu is held.
func (p *Pool) setLive() {
	now := time.Now()
	n := 0
	for _, m := range p.members {
		if p.live(m, now) {
			n++
		}
	}
	p.opts.Metrics.setLive(n)
}

// owner returns the live member that owns unit u by rendezvous hashing:
// the highest score of sha256(member, u) wins, so that a peer joining or
// leaving moves only the units it owns.
func (p *Pool) owner(u digest.Digest) (member, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	var best member
	var bestScore uint64
	found, live := false, 0
	for _, m := range p.members {
		if !p.live(m, now) {
			continue
		}
		live++
		if s := score(m.addr, u); !found || s > bestScore {
			best, bestScore, found = m, s, true
		}
	}
	p.opts.Metrics.setLive(live)
	return best, found
}

// score is member addr's rendezvous weight for unit u.
func score(addr string, u digest.Digest) uint64 {
	h := sha256.New()
	h.Write([]byte(addr))
	h.Write([]byte{0})
	h.Write([]byte(u))
	return binary.BigEndian.Uint64(h.Sum(nil))
}

// ID is the pool's node id, which its requests carry (NodeHeader): give
// it to this node's Server (ServerOptions.NodeID).
func (p *Pool) ID() string { return p.id }

// markSelf records that member addr is this node.
func (p *Pool) markSelf(addr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.selves[addr] = true
	for i := range p.members {
		if p.members[i].addr == addr {
			p.members[i].self = true
		}
	}
	p.opts.Logger.Info("peer is this node", "peer", addr)
}

// succeeded clears peer addr's timeouts in a row.
func (p *Pool) succeeded(addr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if a, ok := p.avoided[addr]; ok && (a.timeouts > 0 || a.slow > 0) {
		a.timeouts, a.slow = 0, 0
		p.avoided[addr] = a
	}
}

// timedOut counts a timeout of peer addr (slow: an urgent answer late
// only with the chunk) and reports whether the peer is now to be
// avoided: at the timeoutsToAvoid-th timeout in a row, or the
// slowToAvoid-th slow answer.
func (p *Pool) timedOut(addr string, slow bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.avoided[addr]
	if time.Now().Before(a.until) {
		return false // a request from before it was avoided
	}
	if slow {
		a.slow++
	} else {
		a.timeouts++
	}
	p.avoided[addr] = a
	return a.timeouts >= timeoutsToAvoid || a.slow >= slowToAvoid
}

// avoid leaves peer addr out for a while after a failure: AvoidFor,
// doubled for each failure in a row after it was let back in, up to 8
// times. Failures of requests that were in flight when it was first
// avoided do not count again.
func (p *Pool) avoid(addr string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	a := p.avoided[addr]
	if now.Before(a.until) {
		return
	}
	if now.After(a.until.Add(p.opts.AvoidFor)) {
		a.failures = 0 // it had recovered
	}
	a.failures = min(a.failures+1, 4)
	a.timeouts, a.slow = 0, 0
	d := p.opts.AvoidFor << (a.failures - 1)
	a.until = now.Add(d)
	p.avoided[addr] = a
	p.setLive()
	p.opts.Logger.Warn("peer avoided", "peer", addr, "for", d, "err", err)
}

// awaitAnswer notes that request id has a connection to peer addr and
// waits for its answer; the func it returns ends that.
func (p *Pool) awaitAnswer(addr string, id *int) func() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.unanswered[addr] == nil {
		p.unanswered[addr] = map[*int]time.Time{}
	}
	p.unanswered[addr][id] = time.Now()
	return func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		delete(p.unanswered[addr], id)
		if len(p.unanswered[addr]) == 0 {
			delete(p.unanswered, addr)
		}
	}
}

// holdsUnanswered reports whether a request has held a connection to peer
// addr for longer than wait without an answer. A server answers (the
// header) at once, so such a request is the peer's fault, and so is the
// wait of a request queued behind the connections it holds.
func (p *Pool) holdsUnanswered(addr string, wait time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, since := range p.unanswered[addr] {
		if time.Since(since) > wait {
			return true
		}
	}
	return false
}

// For returns the pool as the fetch.Peers of snapshots of repository
// ("host[:port]/name"), where owners fetch what they lack.
func (p *Pool) For(repository string) fetch.Peers { return repoPeers{p, repository} }

type repoPeers struct {
	p    *Pool
	repo string
}

// Fetch implements fetch.Peers.
func (r repoPeers) Fetch(ctx context.Context, chunks []format.Chunk, fault bool, urgent <-chan struct{}, got func(int, []byte) error) (served, asked int, err error) {
	return r.p.fetch(ctx, r.repo, chunks, fault, urgent, got)
}

// Errors of a peer request, as counted.
var (
	errStalled = errors.New("peer sent nothing for too long")
	errSlow    = errors.New("peer answered but had not the chunk in time")
	errShort   = errors.New("peer ended its answer early (it could not get the chunk)")
	// errLocalWait: the request waited for one of this node's
	// connections to the peer (MaxConnsPerPeer) and never reached it: not
	// the peer's fault.
	errLocalWait = errors.New("no connection to the peer free on this node in time")
)

// corruptError is a chunk a peer served that did not verify.
type corruptError struct{ err error }

func (e corruptError) Error() string { return "served a chunk that does not verify: " + e.err.Error() }
func (e corruptError) Unwrap() error { return e.err }

// statusError is a peer's answer other than 200.
type statusError struct {
	code int
	msg  string
}

func (e statusError) Error() string { return fmt.Sprintf("peer answered %d: %s", e.code, e.msg) }

func (p *Pool) fetch(ctx context.Context, repo string, chunks []format.Chunk, fault bool, urgent <-chan struct{}, got func(int, []byte) error) (served, asked int, err error) {
	chunks = withinLimits(chunks)
	if len(chunks) == 0 {
		return 0, 0, fmt.Errorf("%w: the first chunk alone is over a request's limits", fetch.ErrNoPeer)
	}
	owner, ok := p.owner(chunks[0].Blob)
	if !ok || owner.self {
		return 0, 0, fetch.ErrNoPeer
	}
	asked = len(chunks)
	n, err := p.ask(ctx, owner.addr, repo, chunks, fault, urgent, got)
	if err == nil {
		p.succeeded(owner.addr)
		return n, asked, nil
	}
	if ctx.Err() != nil {
		return n, asked, err
	}
	kind := errorKind(err)
	p.opts.Metrics.failed(kind)
	var se statusError
	switch {
	case errors.As(err, &se) && se.code == StatusSelf:
		// The member is this very node, under an address it did not
		// know for its own: it owns what that member owns.
		p.markSelf(owner.addr)
		return n, 0, fmt.Errorf("%w: %s is this node", fetch.ErrNoPeer, owner.addr)
	case kind == "busy" || kind == "short" || kind == "local":
		// Alive, but without the chunk now: no avoidance.
		p.opts.Logger.Debug("peer could not serve", "peer", owner.addr, "blob", chunks[0].Blob, "served", n, "err", err)
	case errors.Is(err, errSlow) && !fault:
		// Late with a chunk a read (not a fault) waits on: it may be
		// fetching it for everyone; not counted against it.
		p.opts.Logger.Debug("peer late", "peer", owner.addr, "blob", chunks[0].Blob, "err", err)
	case kind == "timeout" && !p.timedOut(owner.addr, errors.Is(err, errSlow)):
		p.opts.Logger.Debug("peer timed out", "peer", owner.addr, "blob", chunks[0].Blob, "err", err)
	default:
		p.avoid(owner.addr, err)
	}
	return n, asked, err
}

// withinLimits returns the longest prefix of chunks one request may ask
// for (MaxChunks, MaxBytes); the rest are for another request.
func withinLimits(chunks []format.Chunk) []format.Chunk {
	var total int64
	for i, c := range chunks {
		if total += c.Size; i == MaxChunks || total > MaxBytes {
			return chunks[:i]
		}
	}
	return chunks
}

// errorKind names err's kind for the metrics.
func errorKind(err error) string {
	var se statusError
	var ce corruptError
	var ne net.Error
	switch {
	case errors.As(err, &ce):
		return "corrupt"
	case errors.Is(err, errStalled), errors.Is(err, errSlow):
		return "timeout"
	case errors.Is(err, errShort):
		return "short"
	case errors.Is(err, errLocalWait):
		return "local"
	case errors.As(err, &se) && (se.code == http.StatusUnauthorized || se.code == http.StatusForbidden):
		return "refused"
	case errors.As(err, &se) && se.code == http.StatusServiceUnavailable:
		return "busy"
	case errors.As(err, &ne) && ne.Timeout():
		return "timeout"
	case errors.As(err, new(*net.OpError)):
		return "unreachable"
	}
	return "other"
}

// ask requests chunks of peer addr and hands each to got as it arrives.
// The peer must connect and answer (the header, which a server sends at
// once) within AnswerWait, then send each byte within BackgroundWait;
// from when urgent is closed, UrgentWait for both. The whole answer must
// come within 5 times BackgroundWait, and within 5 times UrgentWait from
// when urgent is closed, not counting the time got takes (the local
// disk's back-pressure is not the peer's). fault is sent: the owner then
// fetches the first chunk first.
func (p *Pool) ask(ctx context.Context, addr, repo string, chunks []format.Chunk, fault bool, urgent <-chan struct{}, got func(int, []byte) error) (int, error) {
	isUrgent := func() bool {
		select {
		case <-urgent:
			return true
		default:
			return false
		}
	}
	req := request{Repository: repo, Urgent: fault, Chunks: make([]wireChunk, len(chunks))}
	for i, c := range chunks {
		req.Chunks[i] = toWire(c)
	}
	body, err := json.Marshal(req)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var stalled, answered, dialing, connected, wrote atomic.Bool
	timer := &stallTimer{wait: func() time.Duration {
		switch {
		case isUrgent():
			return p.opts.UrgentWait
		case !answered.Load():
			return p.opts.AnswerWait
		}
		return p.opts.BackgroundWait
	}}
	timer.start(func() { stalled.Store(true); cancel() })
	defer timer.stop()
	// A read that comes to wait on these chunks shortens the wait, and
	// starts the short bound of the whole answer.
	var urgentAt atomic.Int64
	if isUrgent() {
		urgentAt.Store(time.Now().UnixNano())
	} else {
		done := make(chan struct{})
		defer close(done)
		go func() {
			select {
			case <-urgent:
				urgentAt.Store(time.Now().UnixNano())
				timer.arm()
			case <-done:
			}
		}()
	}
	stallErr := func(err error) error {
		switch {
		case !stalled.Load():
			return err
		case answered.Load() && isUrgent():
			// It answered: alive, but the chunk is not there yet.
			return fmt.Errorf("%w (%s): %v", errSlow, p.opts.UrgentWait, err)
		}
		if !dialing.Load() && !connected.Load() {
			if p.holdsUnanswered(addr, timer.wait()) {
				// The connections are busy because the peer does not
				// answer on them.
				return fmt.Errorf("%w (%s, waiting for one of the %d connections to it, which it does not answer): %v", errStalled, timer.wait(), MaxConnsPerPeer, err)
			}
			return fmt.Errorf("%w (%s, %d connections to it busy): %v", errLocalWait, timer.wait(), MaxConnsPerPeer, err)
		}
		phase := "connecting"
		switch {
		case answered.Load():
			phase = "reading the answer"
		case wrote.Load():
			phase = "waiting for the answer"
		case connected.Load():
			phase = "sending the request"
		}
		return fmt.Errorf("%w (%s, %s): %v", errStalled, timer.wait(), phase, err)
	}
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, p.scheme+"://"+addr+ChunksPath, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	hr.Header.Set("Authorization", "Bearer "+p.opts.Token)
	hr.Header.Set("Content-Type", "application/json")
	hr.Header.Set(NodeHeader, p.id)
	// The request only reads: the transport may send it again on a fresh
	// connection when a kept-alive one turns out closed (the key itself
	// is not sent).
	hr.Header["Idempotency-Key"] = nil
	var id int
	var answerMu sync.Mutex
	endWait := func() {}
	hr = hr.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		// Resolving a member's host name is part of reaching it: a name
		// that does not resolve in time makes the peer unreachable, not
		// this node's connections busy.
		DNSStart:     func(httptrace.DNSStartInfo) { dialing.Store(true) },
		ConnectStart: func(string, string) { dialing.Store(true) },
		GotConn: func(httptrace.GotConnInfo) {
			connected.Store(true)
			answerMu.Lock()
			endWait()
			endWait = p.awaitAnswer(addr, &id)
			answerMu.Unlock()
		},
		WroteRequest: func(httptrace.WroteRequestInfo) { wrote.Store(true) },
	}))
	resp, err := p.client.Do(hr)
	answerMu.Lock()
	endWait()
	endWait = func() {}
	answerMu.Unlock()
	if err != nil {
		return 0, stallErr(err)
	}
	defer resp.Body.Close()
	answered.Store(true)
	timer.arm()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return 0, statusError{resp.StatusCode, strings.TrimSpace(string(msg))}
	}
	start := time.Now()
	var inGot time.Duration // since start
	var inGotUrgent time.Duration
	r := &progressReader{r: resp.Body, progress: func() error {
		if time.Since(start)-inGot > 5*p.opts.BackgroundWait {
			return fmt.Errorf("%w: the answer took over %s", errStalled, 5*p.opts.BackgroundWait)
		}
		if at := urgentAt.Load(); at != 0 && time.Since(time.Unix(0, at))-inGotUrgent > 5*p.opts.UrgentWait {
			return fmt.Errorf("%w: a read has waited on the answer over %s", errSlow, 5*p.opts.UrgentWait)
		}
		timer.arm()
		return nil
	}}
	for i, c := range chunks {
		buf := make([]byte, c.Size)
		if _, err := io.ReadFull(r, buf); err != nil {
			if !stalled.Load() && (errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF)) {
				return i, errShort
			}
			return i, stallErr(err)
		}
		timer.pause()
		t := time.Now()
		err := got(i, buf)
		d := time.Since(t)
		inGot += d
		if urgentAt.Load() != 0 {
			inGotUrgent += d
		}
		timer.resume()
		if err != nil {
			return i, corruptError{err}
		}
		p.opts.Metrics.receivedBytes(c.Size)
	}
	// The end of the body, so that the connection is used again; bytes
	// beyond what was asked are the peer's error, but what verified stands.
	if n, _ := io.Copy(io.Discard, io.LimitReader(r, 1)); n > 0 {
		return len(chunks), fmt.Errorf("peer sent more than the %d chunks asked for", len(chunks))
	}
	return len(chunks), nil
}

// stallTimer fires when a peer has sent nothing for its current wait.
// It is paused while the member stores what it received, and armed
// (again from now, for the wait of the moment) at every byte and at every
// change of the wait; a pause holds against an arming meanwhile.
type stallTimer struct {
	wait   func() time.Duration
	mu     sync.Mutex
	t      *time.Timer
	paused bool
}

func (s *stallTimer) start(fire func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.t = time.AfterFunc(s.wait(), fire)
}

func (s *stallTimer) arm() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.paused {
		s.t.Reset(s.wait())
	}
}

func (s *stallTimer) pause() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = true
	s.t.Stop()
}

func (s *stallTimer) resume() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = false
	s.t.Reset(s.wait())
}

func (s *stallTimer) stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.paused = true
	s.t.Stop()
}

// progressReader calls progress after every read that returned bytes,
// and fails with its error.
type progressReader struct {
	r        io.Reader
	progress func() error
}

func (r *progressReader) Read(b []byte) (int, error) {
	n, err := r.r.Read(b)
	if n > 0 {
		if perr := r.progress(); perr != nil {
			return n, perr
		}
	}
	return n, err
}
