package puller

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/fetch"
)

// servedRepo is the fetch scheduler of the chunks of one repository that
// the node serves to its peers: its upstream endpoints, the node cache and
// the node's fetches in flight (shared with its own mounts), no peers (an
// owner never asks another peer, so requests cannot loop).
type servedRepo struct {
	sched  *fetch.Scheduler
	active int
	used   time.Time
}

// servedIdle is how long a repository's scheduler for peers is kept
// without requests; maxServed bounds the repositories served at once
// (each scheduler has its workers and write buffer); servedDeadline
// bounds how long a chunk for peers is retried upstream (the asking peer
// goes upstream itself long before).
const (
	servedIdle     = 5 * time.Minute
	maxServed      = 64
	servedDeadline = 2 * time.Minute
)

// ErrTooManyRepositories refuses a peer's request for one more
// repository than the node serves at once.
var ErrTooManyRepositories = errors.New("serving peers the chunks of too many repositories at once")

// ServeChunks gets chunks, frames of one blob of repository, for a peer
// (peer.Chunks): each from the node cache, or by joining the node's fetch
// of it in flight (same chunk stored the same way), or fetched from
// Options.PeerUpstream's endpoints once however many peers ask, verified
// before it is stored or passed to emit, in order. urgent fetches the
// first at fetch.Fault priority (a sandbox waits on it), the rest at
// fetch.Read. It does not wait on this node's own asking of a peer (see
// fetch.Options.ServesPeers), so two nodes that disagree on who owns a
// chunk do not wait on each other. It stops at the first chunk it cannot
// get or when emit fails; more than maxServed repositories at once are
// refused (ErrTooManyRepositories).
func (p *Puller) ServeChunks(ctx context.Context, repository string, chunks []format.Chunk, urgent bool, ready func(), emit func(data []byte) error) error {
	if p.opts.PeerUpstream == nil {
		ready()
		return p.serveHeld(chunks, emit)
	}
	s, release, err := p.servedScheduler(ctx, repository)
	if err != nil {
		return err
	}
	defer release()
	ready()
	// Every chunk queued at once (one range request for a run of
	// frames), the first at fetch.Fault if a sandbox waits on it.
	s.Want(chunks, fetch.Read)
	var buf []byte
	for i, c := range chunks {
		prio := fetch.Read
		if urgent && i == 0 {
			prio = fetch.Fault
		}
		if cap(buf) < int(c.Size) {
			buf = make([]byte, 0, c.Size)
		}
		// From the node cache the bytes are in buf, else they are the
		// fetch's own: either way emit is done with them before the next.
		data, err := s.Get(ctx, c, buf[:0], prio)
		if err != nil {
			return err
		}
		if err := emit(data); err != nil {
			return err
		}
	}
	return nil
}

// serveHeld serves chunks from the node cache only.
func (p *Puller) serveHeld(chunks []format.Chunk, emit func(data []byte) error) error {
	var buf []byte
	for _, c := range chunks {
		data, err := p.cache.Get(c.Digest, buf, false)
		if err != nil {
			return fmt.Errorf("chunk %s: %w", c.Digest, err)
		}
		if int64(len(data)) != c.Size {
			return fmt.Errorf("chunk %s: asked for %d bytes, the chunk has %d: %w", c.Digest, c.Size, len(data), format.ErrDigestMismatch)
		}
		if err := emit(data); err != nil {
			return err
		}
		buf = data
	}
	return nil
}

// servedScheduler returns repository's scheduler for peers, made on first
// use, and a release to call when done with it. Schedulers left idle
// for servedIdle are closed when another is made.
func (p *Puller) servedScheduler(ctx context.Context, repository string) (*fetch.Scheduler, func(), error) {
	p.servedMu.Lock()
	defer p.servedMu.Unlock()
	if p.served == nil {
		return nil, nil, errors.New("puller closed")
	}
	r, ok := p.served[repository]
	if !ok {
		now := time.Now()
		for name, old := range p.served {
			if old.active == 0 && now.Sub(old.used) > servedIdle {
				old.sched.Close()
				delete(p.served, name)
			}
		}
		if len(p.served) >= maxServed {
			return nil, nil, ErrTooManyRepositories
		}
		eps, err := p.opts.PeerUpstream(ctx, repository)
		if err != nil {
			return nil, nil, fmt.Errorf("endpoints of %s: %w", repository, err)
		}
		o := p.opts
		deadline := servedDeadline
		if o.Deadline > 0 {
			deadline = min(o.Deadline, deadline)
		}
		r = &servedRepo{sched: fetch.New(eps, p.cache, p.codec, fetch.Options{Workers: o.Workers, Deadline: deadline, WriteBuffer: o.WriteBuffer, Logger: o.Logger, Metrics: o.FetchMetrics, InFlight: &p.fetching, ServesPeers: true})}
		p.served[repository] = r
	}
	r.active++
	return r.sched, func() {
		p.servedMu.Lock()
		defer p.servedMu.Unlock()
		r.active--
		r.used = time.Now()
	}, nil
}

// closeServed closes the schedulers for peers; later requests fail.
func (p *Puller) closeServed() {
	p.servedMu.Lock()
	served := p.served
	p.served = nil
	p.servedMu.Unlock()
	for _, r := range served {
		r.sched.Close()
	}
}
