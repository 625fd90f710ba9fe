package maintenance

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/registry/extstore"
)

// Read-only mode for maintenance (SPEC.md 12.4). Distribution's garbage
// collection must not run while blobs are pushed (a blob uploaded before its
// manifest would be swept), and distribution's own read-only switch
// (storage.maintenance.readonly) is static configuration: flipping it means
// restarting every replica. cryo keeps a marker in the shared storage
// instead: while it exists and has not expired, every replica refuses writes
// with 503 UNAVAILABLE and a Retry-After header, and keeps serving pulls.
//
// The marker is a lease: its holder renews it every quarter of the lease and
// deletes it when done, and only if it still holds it. A holder that dies
// stops renewing, so the mode ends one lease later; a holder that cannot
// renew stops its work before the lease runs out.

// ReadOnlyPath is where the marker lives in the storage driver.
const ReadOnlyPath = "/cryo/v1/maintenance/readonly"

// DefaultReadOnlyPoll is how often a serving registry re-reads the marker.
const DefaultReadOnlyPoll = 5 * time.Second

// DefaultReadOnlyLease is how long a marker lives unless renewed.
const DefaultReadOnlyLease = 2 * time.Minute

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

// ErrReadOnlyLost is returned when a lease finds the marker gone or taken
// over: the work it protects must stop.
var ErrReadOnlyLost = errors.New("read-only lease lost")

// ReadOnly returns the marker in the storage, or nil if there is none.
func (m *Maintainer) ReadOnly(ctx context.Context) (*ReadOnlyMarker, error) {
	data, err := m.driver.GetContent(ctx, ReadOnlyPath)
	if err != nil {
		if extstore.IsNotFound(err) {
			return nil, nil
		}
		return nil, fmt.Errorf("read read-only marker: %w", err)
	}
	var mk ReadOnlyMarker
	if err := json.Unmarshal(data, &mk); err != nil {
		return nil, fmt.Errorf("read-only marker %s is not valid JSON: %w", ReadOnlyPath, err)
	}
	return &mk, nil
}

// ReadOnlyLease is a held read-only marker.
type ReadOnlyLease struct {
	m      *Maintainer
	marker ReadOnlyMarker
	lease  time.Duration
}

// Marker returns the marker as last written.
func (l *ReadOnlyLease) Marker() ReadOnlyMarker { return l.marker }

// EnterReadOnly writes a marker that lives for lease unless renewed: every
// replica sharing the storage refuses writes from its next poll on. It
// fails with ErrReadOnlyHeld if another marker is in force (or another
// holder wrote one at the same moment).
func (m *Maintainer) EnterReadOnly(ctx context.Context, reason string, lease time.Duration) (*ReadOnlyLease, error) {
	if lease <= 0 {
		return nil, fmt.Errorf("read-only lease must be positive, not %s", lease)
	}
	old, err := m.ReadOnly(ctx)
	if err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	if old.Active(now) {
		return nil, heldError(old)
	}
	host, _ := os.Hostname()
	l := &ReadOnlyLease{m: m, lease: lease, marker: ReadOnlyMarker{
		Holder: fmt.Sprintf("%s/%d/%s", host, os.Getpid(), newToken()),
		Reason: reason, Since: now, Expires: now.Add(lease),
	}}
	if err := l.write(ctx); err != nil {
		return nil, err
	}
	// Two holders that both found no marker both wrote one; the one whose
	// marker is read back holds the mode.
	got, err := m.ReadOnly(ctx)
	if err != nil {
		return nil, err
	}
	if got == nil || got.Holder != l.marker.Holder {
		return nil, heldError(got)
	}
	m.readOnly.Store(&l.marker)
	return l, nil
}

// newToken returns 12 random hex digits.
func newToken() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func heldError(m *ReadOnlyMarker) error {
	if m == nil {
		return ErrReadOnlyHeld
	}
	return fmt.Errorf("%w by %s since %s (%s), until %s unless renewed", ErrReadOnlyHeld, m.Holder, m.Since.Format(time.RFC3339), m.Reason, m.Expires.Format(time.RFC3339))
}

func (l *ReadOnlyLease) write(ctx context.Context) error {
	data, err := json.Marshal(l.marker)
	if err != nil {
		return err
	}
	if err := l.m.driver.PutContent(ctx, ReadOnlyPath, data); err != nil {
		return fmt.Errorf("write read-only marker: %w", err)
	}
	return nil
}

// check fails with ErrReadOnlyLost unless the marker in storage is this
// lease's.
func (l *ReadOnlyLease) check(ctx context.Context) error {
	got, err := l.m.ReadOnly(ctx)
	if err != nil {
		return err
	}
	if got == nil || got.Holder != l.marker.Holder {
		return fmt.Errorf("%w: the marker now says %v", ErrReadOnlyLost, got)
	}
	return nil
}

// Renew extends the lease by its length from now.
func (l *ReadOnlyLease) Renew(ctx context.Context) error {
	if err := l.check(ctx); err != nil {
		return err
	}
	l.marker.Expires = time.Now().UTC().Add(l.lease)
	return l.write(ctx)
}

// Keep renews the lease every quarter of its length until the returned stop
// function is called. If a renewal fails it calls lost with the error: the
// caller must stop the work the mode protects before the lease runs out.
// stop lets a renewal under way finish (a cancelled write could still land
// after Release and bring the marker back).
func (l *ReadOnlyLease) Keep(ctx context.Context, lost func(error)) (stop func()) {
	quit := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(l.lease / 4)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rctx, rcancel := context.WithTimeout(context.WithoutCancel(ctx), l.lease/4)
			err := l.Renew(rctx)
			rcancel()
			if err != nil {
				lost(fmt.Errorf("renew read-only lease: %w", err))
				return
			}
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(quit) }); <-done }
}

// Release removes the marker if this lease still holds it.
func (l *ReadOnlyLease) Release(ctx context.Context) error {
	if err := l.check(ctx); err != nil {
		if errors.Is(err, ErrReadOnlyLost) {
			return nil
		}
		return err
	}
	return l.m.clearMarker(ctx)
}

// LeaveReadOnly removes whatever marker is in storage: for an operator
// whose maintenance job died (`cryo registry read-only --leave`).
func (m *Maintainer) LeaveReadOnly(ctx context.Context) error {
	return m.clearMarker(ctx)
}

func (m *Maintainer) clearMarker(ctx context.Context) error {
	err := m.driver.Delete(ctx, ReadOnlyPath)
	if err != nil && !extstore.IsNotFound(err) {
		return fmt.Errorf("remove read-only marker: %w", err)
	}
	m.readOnly.Store(nil)
	return nil
}

// Watch re-reads the marker and the owed cache flushes every poll until ctx
// ends: a serving replica's part of maintenance.
func (m *Maintainer) Watch(ctx context.Context, poll time.Duration) {
	t := time.NewTicker(poll)
	defer t.Stop()
	for {
		m.Refresh(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Refresh re-reads the marker and the owed cache flushes (rediscache.go)
// now. A failed marker read keeps the last state: a store that cannot be
// read refuses writes anyway.
func (m *Maintainer) Refresh(ctx context.Context) {
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	mk, err := m.ReadOnly(rctx)
	if err != nil {
		if ctx.Err() == nil {
			m.log.Warn("read-only marker", "err", err)
		}
		return
	}
	active := mk.Active(time.Now())
	// Owed cache flushes first: writes stay refused from the moment the
	// marker is dropped if a flush is owed.
	m.checkOwedFlushes(rctx, active)
	if prev := m.readOnly.Swap(mk); prev.Active(time.Now()) != active {
		if active {
			m.log.Info("entering read-only mode", "holder", mk.Holder, "reason", mk.Reason, "expires", mk.Expires)
		} else {
			m.log.Info("leaving read-only mode")
		}
	}
}

// WritesRefused says why writes are refused now (a marker in force, or a
// cache flush owed), or "" if they are not.
func (m *Maintainer) WritesRefused() string {
	if mk := m.readOnly.Load(); mk.Active(time.Now()) {
		return fmt.Sprintf("registry is read-only for maintenance (%s, by %s since %s); retry later", mk.Reason, mk.Holder, mk.Since.Format(time.RFC3339))
	}
	if m.flushPending.Load() {
		return "registry is read-only until its blob descriptor cache is flushed after garbage collection; retry later"
	}
	return ""
}
