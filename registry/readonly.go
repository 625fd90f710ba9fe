package registry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
)

// Read-only mode for maintenance. Distribution's garbage collection must not
// run while blobs are pushed (a blob uploaded before its manifest would be
// swept), and distribution's own read-only switch
// (storage.maintenance.readonly) is static configuration: flipping it means
// restarting every replica. cryo keeps a marker in the shared storage
// instead: while it exists and has not expired, every replica refuses writes
// with 503 UNAVAILABLE and a Retry-After header (clients retry), and keeps
// serving pulls. `cryo registry gc --read-only-wait` writes the marker, waits
// for the replicas to see it, sweeps, and removes it; the expiry bounds what
// a crashed gc leaves behind.

// readOnlyPath is where the marker lives in the storage driver.
const readOnlyPath = "/cryo/v1/maintenance/readonly"

// DefaultReadOnlyPoll is how often a serving registry re-reads the marker.
const DefaultReadOnlyPoll = 5 * time.Second

// ReadOnlyMarker says who put the registry in read-only mode, why and until
// when at the latest.
type ReadOnlyMarker struct {
	Holder  string    `json:"holder"`
	Reason  string    `json:"reason"`
	Since   time.Time `json:"since"`
	Expires time.Time `json:"expires"`
}

// Active reports whether the marker is in force at now.
func (m *ReadOnlyMarker) Active(now time.Time) bool { return m != nil && now.Before(m.Expires) }

// ErrReadOnlyHeld is returned by EnterReadOnly when another holder's marker
// is in force.
var ErrReadOnlyHeld = errors.New("registry is already in read-only mode")

// ReadOnly returns the marker in the storage, or nil if there is none.
func (s *Server) ReadOnly(ctx context.Context) (*ReadOnlyMarker, error) {
	data, err := s.driver.GetContent(ctx, readOnlyPath)
	if err != nil {
		var nf storagedriver.PathNotFoundError
		if errors.As(err, &nf) {
			return nil, nil
		}
		return nil, fmt.Errorf("read read-only marker: %w", err)
	}
	var m ReadOnlyMarker
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("read-only marker %s is not valid JSON: %w", readOnlyPath, err)
	}
	return &m, nil
}

// EnterReadOnly writes the marker: every replica sharing the storage refuses
// writes from its next poll on, until LeaveReadOnly or ttl. It fails with
// ErrReadOnlyHeld if another marker is in force.
func (s *Server) EnterReadOnly(ctx context.Context, reason string, ttl time.Duration) (*ReadOnlyMarker, error) {
	if ttl <= 0 {
		return nil, fmt.Errorf("read-only timeout must be positive, not %s", ttl)
	}
	old, err := s.ReadOnly(ctx)
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	if old.Active(now) {
		return nil, fmt.Errorf("%w by %s since %s (%s), until %s at the latest", ErrReadOnlyHeld, old.Holder, old.Since.Format(time.RFC3339), old.Reason, old.Expires.Format(time.RFC3339))
	}
	host, _ := os.Hostname()
	m := &ReadOnlyMarker{Holder: fmt.Sprintf("%s/%d", host, os.Getpid()), Reason: reason, Since: now, Expires: now.Add(ttl)}
	data, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	if err := s.driver.PutContent(ctx, readOnlyPath, data); err != nil {
		return nil, fmt.Errorf("write read-only marker: %w", err)
	}
	s.readOnly.Store(m)
	return m, nil
}

// LeaveReadOnly removes the marker.
func (s *Server) LeaveReadOnly(ctx context.Context) error {
	err := s.driver.Delete(ctx, readOnlyPath)
	var nf storagedriver.PathNotFoundError
	if err != nil && !errors.As(err, &nf) {
		return fmt.Errorf("remove read-only marker: %w", err)
	}
	s.readOnly.Store(nil)
	return nil
}

// watchReadOnly re-reads the marker every poll until ctx ends. A failed
// read keeps the last state (an unreachable store refuses writes anyway).
func (s *Server) watchReadOnly(ctx context.Context, poll time.Duration) {
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		s.refreshReadOnly(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Server) refreshReadOnly(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	m, err := s.ReadOnly(rctx)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("read-only marker", "err", err)
		}
		return
	}
	if prev := s.readOnly.Swap(m); prev.Active(time.Now()) != m.Active(time.Now()) {
		if m.Active(time.Now()) {
			s.log.Info("entering read-only mode", "holder", m.Holder, "reason", m.Reason, "expires", m.Expires)
		} else {
			s.log.Info("leaving read-only mode")
		}
	}
}

// refuseWritesWhileReadOnly answers writes with 503 while a marker is in
// force. Reads, and the chunk index's batch lookup (a POST that writes
// nothing), pass.
func (s *Server) refuseWritesWhileReadOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.Method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			next.ServeHTTP(w, r)
			return
		}
		m := s.readOnly.Load()
		if !m.Active(time.Now()) || !strings.HasPrefix(r.URL.Path, "/v2/") || r.URL.Path == "/v2/_cryo/chunks" {
			next.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Retry-After", "30")
		writeRegistryError(w, http.StatusServiceUnavailable, "UNAVAILABLE",
			fmt.Sprintf("registry is read-only for maintenance (%s, by %s since %s); retry later", m.Reason, m.Holder, m.Since.Format(time.RFC3339)))
	})
}

// readOnlyState is the marker a Server last saw.
type readOnlyState = atomic.Pointer[ReadOnlyMarker]
