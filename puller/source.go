package puller

import (
	"context"
	"errors"
	"fmt"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/imagefs"
)

// The puller's format.ChunkSources: the fetch scheduler, and the node
// cache in front of it.
var (
	_ format.ChunkSource = scheduled{}
	_ format.ChunkSource = cached{}
	_ imagefs.NearWanter = scheduled{}
	_ imagefs.NearWanter = cached{}
)

// scheduled reads chunks through a fetch scheduler: from the node cache,
// or fetched now at priority prio, ahead of every prefetch. Bytes just
// fetched are shared with the chunk's other readers (see
// fetch.Scheduler.Get).
type scheduled struct {
	s    *fetch.Scheduler
	prio fetch.Priority
}

// Want queues the fetches of the chunks a read needs, at once.
func (s scheduled) Want(chunks []format.Chunk) { s.s.Want(chunks, s.prio) }

// WantNear queues a page fault's chunks and those near it
// (fetch.Scheduler.WantNear); at another priority, the read's chunks
// only, as Want.
func (s scheduled) WantNear(read []format.Chunk, near func() []format.Chunk) {
	switch {
	case s.prio == fetch.Fault:
		s.s.WantNear(read, near())
	case len(read) > 1:
		s.s.Want(read, s.prio)
	}
}

// Chunk returns chunk c's verified bytes.
func (s scheduled) Chunk(ctx context.Context, c format.Chunk, buf []byte) ([]byte, error) {
	return s.s.Get(ctx, c, buf, s.prio)
}

// cached reads chunks from the node cache (a chunk not yet used by this
// process is verified first) and, when the cache lacks a chunk or dropped
// it as damaged, from next.
type cached struct {
	cache *cache.Store
	next  format.ChunkSource
}

// Want passes on the chunks a read needs, if next takes them.
func (s cached) Want(chunks []format.Chunk) {
	if w, ok := s.next.(imagefs.Wanter); ok {
		w.Want(chunks)
	}
}

// WantNear passes on a page fault's chunks and those near it, if next
// takes them.
func (s cached) WantNear(read []format.Chunk, near func() []format.Chunk) {
	if w, ok := s.next.(imagefs.NearWanter); ok {
		w.WantNear(read, near)
	} else if w, ok := s.next.(imagefs.Wanter); ok && len(read) > 1 {
		w.Want(read)
	}
}

// Chunk returns chunk c's verified bytes.
func (s cached) Chunk(ctx context.Context, c format.Chunk, buf []byte) ([]byte, error) {
	if c.Encoding == format.EncodingZero {
		return s.next.Chunk(ctx, c, buf)
	}
	data, err := s.cache.Get(c.Digest, buf, false)
	if errors.Is(err, cache.ErrNotFound) {
		return s.next.Chunk(ctx, c, buf)
	}
	if err != nil {
		return nil, err
	}
	// Bytes that hash to the digest have one length: a table entry giving
	// another lies.
	if int64(len(data)) != c.Size {
		return nil, fmt.Errorf("chunk %s: table says %d bytes, the chunk has %d: %w", c.Digest, c.Size, len(data), format.ErrDigestMismatch)
	}
	return data, nil
}
