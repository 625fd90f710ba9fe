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
// without requests.
const servedIdle = 5 * time.Minute

// ServeChunks gets chunks, frames of one blob of repository, for a peer
// (peer.Chunks): each from the node cache, or by joining the node's fetch
// of it in flight (same chunk stored the same way), or fetched from
// Options.PeerUpstream's endpoints once however many peers ask, verified
// before it is stored or passed to emit, in order. urgent fetches them at
// fetch.Fault priority, else at fetch.Read. It stops at the first chunk
// it cannot get or when emit fails.
func (p *Puller) ServeChunks(ctx context.Context, repository string, chunks []format.Chunk, urgent bool, emit func(data []byte) error) error {
	if p.opts.PeerUpstream == nil {
		return p.serveHeld(chunks, emit)
	}
	s, release, err := p.servedScheduler(ctx, repository)
	if err != nil {
		return err
	}
	defer release()
	prio := fetch.Read
	if urgent {
		prio = fetch.Fault
	}
	s.Want(chunks, prio)
	for _, c := range chunks {
		data, err := s.Get(ctx, c, nil, prio)
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
		eps, err := p.opts.PeerUpstream(ctx, repository)
		if err != nil {
			return nil, nil, fmt.Errorf("endpoints of %s: %w", repository, err)
		}
		now := time.Now()
		for name, old := range p.served {
			if old.active == 0 && now.Sub(old.used) > servedIdle {
				old.sched.Close()
				delete(p.served, name)
			}
		}
		o := p.opts
		r = &servedRepo{sched: fetch.New(eps, p.cache, p.codec, fetch.Options{Workers: o.Workers, Deadline: o.Deadline, WriteBuffer: o.WriteBuffer, Logger: o.Logger, Metrics: o.FetchMetrics, InFlight: &p.fetching})}
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
