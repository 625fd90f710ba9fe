package testenv

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// Link is a shaped network link: bandwidth shared by all connections in
// each direction, and a round-trip time.
type Link struct {
	Name string
	// BitsPerSecond is the bandwidth of each direction (0: unlimited).
	BitsPerSecond int64
	// RTT is added to every round trip (half each way).
	RTT time.Duration
}

// Proxy forwards TCP connections to an upstream over a shaped Link. It is
// written here rather than taken from toxiproxy because toxiproxy's
// bandwidth toxic limits each connection on its own, while a link's
// bandwidth is shared by all the connections a puller opens.
type Proxy struct {
	ln       net.Listener
	upstream string
	link     Link
	up, down *rate.Limiter
	wg       sync.WaitGroup
	ctx      context.Context
	cancel   context.CancelFunc
	// conns are the connections open, both sides, closed by Close.
	mu    sync.Mutex
	conns map[net.Conn]struct{}
	// delivered counts the bytes delivered from upstream to clients.
	delivered atomic.Int64
}

// Delivered returns the bytes delivered from upstream to the proxy's
// clients so far (what crossed the link, not what upstream sent into it).
func (p *Proxy) Delivered() int64 { return p.delivered.Load() }

// StartProxy listens on a free loopback port and forwards to upstream.
func StartProxy(upstream string, link Link) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{ln: ln, upstream: upstream, link: link, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
	if link.BitsPerSecond > 0 {
		bps := float64(link.BitsPerSecond) / 8
		burst := 64 << 10
		p.up = rate.NewLimiter(rate.Limit(bps), burst)
		p.down = rate.NewLimiter(rate.Limit(bps), burst)
	}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Close stops the proxy and closes its connections, idle ones included.
func (p *Proxy) Close() {
	p.cancel()
	p.ln.Close()
	p.mu.Lock()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// track adds c to the connections Close closes, or closes it if the
// proxy is closed already.
func (p *Proxy) track(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		c.Close()
		return
	}
	p.conns[c] = struct{}{}
}

// untrack drops c, closed, from the connections Close closes.
func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		var d net.Dialer
		u, err := d.DialContext(p.ctx, "tcp", p.upstream)
		if err != nil {
			c.Close()
			continue
		}
		p.track(c)
		p.track(u)
		p.wg.Add(2)
		go p.pipe(u, c, p.up, nil)
		go p.pipe(c, u, p.down, &p.delivered)
	}
}

type segment struct {
	data []byte
	at   time.Time
}

// pipe copies src to dst, delaying every segment by RTT/2 and pacing it
// through the direction's shared limiter.
func (p *Proxy) pipe(dst, src net.Conn, lim *rate.Limiter, count *atomic.Int64) {
	defer p.wg.Done()
	q := make(chan segment, 1024)
	stopped := make(chan struct{})
	defer close(stopped)
	go func() {
		defer close(q)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				select {
				case q <- segment{buf[:n], time.Now().Add(p.link.RTT / 2)}:
				case <-stopped:
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	defer p.untrack(dst)
	defer dst.Close()
	defer p.untrack(src)
	defer src.Close()
	for s := range q {
		if d := time.Until(s.at); d > 0 {
			time.Sleep(d)
		}
		if lim != nil {
			for off := 0; off < len(s.data); off += lim.Burst() {
				n := min(lim.Burst(), len(s.data)-off)
				if lim.WaitN(p.ctx, n) != nil {
					return
				}
			}
		}
		if _, err := dst.Write(s.data); err != nil {
			io.Copy(io.Discard, src)
			return
		}
		if count != nil {
			count.Add(int64(len(s.data)))
		}
	}
}
