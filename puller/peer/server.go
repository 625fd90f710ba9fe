package peer

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
)

// Chunks is what a Server serves from: the node's puller.
type Chunks interface {
	// ServeChunks gets each of chunks (frames of one blob of the
	// repository, "host[:port]/name") verified, from the node cache, a
	// fetch in flight on the node, or upstream (fetched once, however
	// many peers ask), and calls emit with its bytes, in order. It calls
	// ready once it can serve the repository (before the first emit):
	// an error before that refuses the request (503), after it ends the
	// answer. It stops at the first chunk it cannot get, or when emit
	// fails. The bytes passed to emit must not be kept.
	ServeChunks(ctx context.Context, repository string, chunks []format.Chunk, urgent bool, ready func(), emit func(data []byte) error) error
}

// ServerOptions configure a Server.
type ServerOptions struct {
	// Token is the pool's shared secret (at least MinTokenBytes): a
	// request without it is refused before anything is read.
	Token string
	// MaxRequests bounds the requests served at once (default 256);
	// requests beyond get 503 and the asking peer goes upstream.
	MaxRequests int
	// Logger receives refusals and failures. Default: slog.Default().
	Logger *slog.Logger
	// Metrics, if set, counts what is served.
	Metrics *Metrics
	// NodeID is this node's Pool.ID, if it has a pool: a request carrying
	// it (NodeHeader) is the node asking itself, answered StatusSelf.
	NodeID string
	// WriteTimeout bounds each chunk's write to the asking peer (default
	// 60 s): a peer that stops reading frees its request.
	WriteTimeout time.Duration
}

// Server serves a node's chunks to the other pullers of its pool
// (SPEC.md 17): POST ChunksPath, with the pool token. It is an
// http.Handler; serve it over TLS where the pool's network is not
// private.
type Server struct {
	chunks Chunks
	opts   ServerOptions
	token  [sha256.Size]byte
	slots  chan struct{}
}

// NewServer returns a Server of chunks.
func NewServer(chunks Chunks, opts ServerOptions) (*Server, error) {
	if len(opts.Token) < MinTokenBytes {
		return nil, fmt.Errorf("peer token of %d bytes: want at least %d", len(opts.Token), MinTokenBytes)
	}
	if opts.MaxRequests <= 0 {
		opts.MaxRequests = 256
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.WriteTimeout <= 0 {
		opts.WriteTimeout = 60 * time.Second
	}
	return &Server{chunks: chunks, opts: opts, token: sha256.Sum256([]byte(opts.Token)), slots: make(chan struct{}, opts.MaxRequests)}, nil
}

// authorized reports whether r carries the pool token, comparing in
// constant time (hashes, so that not even its length leaks).
func (s *Server) authorized(r *http.Request) bool {
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return false
	}
	h := sha256.Sum256([]byte(got))
	return subtle.ConstantTimeCompare(h[:], s.token[:]) == 1
}

// ServeHTTP serves one chunks request: the chunks' decoded bytes, one
// after the other in the order asked, streamed as each is ready; the
// body ends early at the first chunk the node cannot get.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != ChunksPath {
		http.NotFound(w, r)
		return
	}
	if !s.authorized(r) {
		s.opts.Metrics.refused()
		s.opts.Logger.Warn("peer request without the pool token refused", "remote", r.RemoteAddr)
		w.Header().Set("WWW-Authenticate", `Bearer realm="cryo-peer"`)
		http.Error(w, "pool token required", http.StatusUnauthorized)
		return
	}
	if s.opts.NodeID != "" && r.Header.Get(NodeHeader) == s.opts.NodeID {
		http.Error(w, "this is the asking node", StatusSelf)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	// The body, bounded in size and time, before a slot is taken.
	rc := http.NewResponseController(w)
	rc.SetReadDeadline(time.Now().Add(10 * time.Second))
	var req request
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxRequestBytes+1))
	if err != nil {
		http.Error(w, "read request: "+err.Error(), http.StatusBadRequest)
		return
	}
	rc.SetReadDeadline(time.Time{})
	if len(body) > MaxRequestBytes {
		http.Error(w, fmt.Sprintf("request over %d bytes", MaxRequestBytes), http.StatusRequestEntityTooLarge)
		return
	}
	// Unknown members are ignored: newer members of a pool may send more.
	if err := json.Unmarshal(body, &req); err != nil {
		http.Error(w, "request: "+err.Error(), http.StatusBadRequest)
		return
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	default:
		http.Error(w, "busy", http.StatusServiceUnavailable)
		return
	}
	chunks, err := req.check()
	if err != nil {
		http.Error(w, "request: "+err.Error(), http.StatusBadRequest)
		return
	}
	var total int64
	for _, c := range chunks {
		total += c.Size
	}
	answered := false
	ready := func() {
		if answered {
			return
		}
		answered = true
		w.Header().Set("Content-Type", "application/octet-stream")
		// The length, so that the connection is used again after a
		// whole answer; an answer cut short closes it.
		w.Header().Set("Content-Length", strconv.FormatInt(total, 10))
		w.WriteHeader(http.StatusOK)
		// The header tells the asking peer this one is alive before the
		// first chunk is ready: a slow chunk is then told from a dead
		// peer.
		rc.Flush()
	}
	served := 0
	err = s.chunks.ServeChunks(r.Context(), req.Repository, chunks, req.Urgent, ready, func(data []byte) error {
		ready()
		rc.SetWriteDeadline(time.Now().Add(s.opts.WriteTimeout))
		if _, err := w.Write(data); err != nil {
			return err
		}
		if err := rc.Flush(); err != nil {
			return err
		}
		s.opts.Metrics.servedBytes(int64(len(data)))
		served++
		return nil
	})
	if !answered {
		// Refused before anything was served: the asking peer goes
		// upstream without holding it against this one.
		msg := "cannot serve the repository now"
		if err != nil {
			msg += ": " + err.Error()
		}
		http.Error(w, msg, http.StatusServiceUnavailable)
		return
	}
	if err != nil && r.Context().Err() == nil && !errors.Is(err, context.Canceled) {
		s.opts.Logger.Warn("peer request: chunks not served", "remote", r.RemoteAddr, "repository", req.Repository, "blob", chunks[0].Blob, "served", served, "asked", len(chunks), "err", err)
	}
}
