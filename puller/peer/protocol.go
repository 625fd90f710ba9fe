// Package peer shares verified chunks between the node pullers of a pool,
// so that a chunk leaves the registry about once per pool instead of once
// per node. A Server serves the chunks its node holds, or is fetching, or
// fetches from upstream once for every peer that asks (puller.Puller is
// its Chunks); a Pool picks, for each unit of transfer (a chunk's blob:
// a v1 chunk, or a v2 pack whose consecutive frames one request asks
// for), its owner among the live peers by rendezvous hashing, and asks it
// before any endpoint (fetch.Options.Peers).
//
// A pool is one trust domain: every member may read, through its owner,
// what any member may, because the owner fetches upstream with its own
// credentials for whoever holds the pool's token. Pools of different
// tenants need different tokens. Peers are not trusted with content:
// every chunk a peer serves is verified by the fetch scheduler against
// the chunk table, and a peer that is dead, slow or lying costs a bounded
// wait, is avoided for a while, and the chunk is fetched upstream.
//
// The wire protocol is SPEC.md section 17.
package peer

import (
	"fmt"

	"github.com/cryo-oci/cryo/format"
	"github.com/opencontainers/go-digest"
)

// ChunksPath is the path of the one request a peer serves.
const ChunksPath = "/cryo/peer/v1/chunks"

// NodeHeader carries the asking node's id (Pool.ID); a server that finds
// its own node's id there answers StatusSelf: the node asked itself.
const NodeHeader = "Cryo-Peer-Node"

// StatusSelf is the answer to a node asking itself (508 Loop Detected).
const StatusSelf = 508

// Limits of one request.
const (
	// MaxRequestBytes bounds a request's JSON body.
	MaxRequestBytes = 256 << 10
	// MaxChunks bounds the chunks one request asks for.
	MaxChunks = 512
	// MaxBytes bounds the decoded bytes one request asks for: a few packs.
	MaxBytes = 16 << 20
	// MinTokenBytes is the shortest pool token accepted.
	MinTokenBytes = 16
)

// request is the JSON body of a chunks request.
type request struct {
	// Repository is the registry and repository the chunks' snapshot
	// comes from ("host[:port]/name"), where the owner fetches what it
	// lacks.
	Repository string `json:"repository"`
	// Urgent: a sandbox is blocked on the first chunk.
	Urgent bool        `json:"urgent,omitempty"`
	Chunks []wireChunk `json:"chunks"`
}

// wireChunk is a chunk table entry, every field of the key fetches in
// flight are shared under (fetch), and its place in its pack.
type wireChunk struct {
	Digest     digest.Digest   `json:"digest"`
	Size       int64           `json:"size"`
	Encoding   format.Encoding `json:"encoding"`
	Blob       digest.Digest   `json:"blob"`
	BlobSize   int64           `json:"blobSize"`
	PackOffset int64           `json:"packOffset,omitempty"`
	PackSize   int64           `json:"packSize,omitempty"`
}

func toWire(c format.Chunk) wireChunk {
	return wireChunk{Digest: c.Digest, Size: c.Size, Encoding: c.Encoding, Blob: c.Blob, BlobSize: c.BlobSize, PackOffset: c.PackOffset, PackSize: c.PackSize}
}

func (w wireChunk) chunk() format.Chunk {
	return format.Chunk{Digest: w.Digest, Size: w.Size, Encoding: w.Encoding, Blob: w.Blob, BlobSize: w.BlobSize, PackOffset: w.PackOffset, PackSize: w.PackSize}
}

// check validates a request: a repository, 1..MaxChunks stored (not
// zero) chunks of one blob, valid as a chunk table's entries, MaxBytes
// at most in all.
func (r *request) check() ([]format.Chunk, error) {
	if r.Repository == "" {
		return nil, fmt.Errorf("no repository")
	}
	if len(r.Chunks) == 0 || len(r.Chunks) > MaxChunks {
		return nil, fmt.Errorf("%d chunks, want 1..%d", len(r.Chunks), MaxChunks)
	}
	out := make([]format.Chunk, len(r.Chunks))
	var total int64
	for i, w := range r.Chunks {
		c := w.chunk()
		if c.Encoding == format.EncodingZero {
			return nil, fmt.Errorf("chunk %d: a zero chunk needs no fetch", i)
		}
		if err := c.Check(); err != nil {
			return nil, fmt.Errorf("chunk %d: %w", i, err)
		}
		if c.Blob != out[0].Blob && i > 0 {
			return nil, fmt.Errorf("chunk %d is in blob %s, chunk 0 in %s: one request asks for one blob", i, c.Blob, out[0].Blob)
		}
		if total += c.Size; total > MaxBytes {
			return nil, fmt.Errorf("more than %d bytes asked for", MaxBytes)
		}
		out[i] = c
	}
	return out, nil
}
