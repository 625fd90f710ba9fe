package registry

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/cryo-oci/cryo/transfer"
)

// replica starts an in-process registry on root that re-reads the
// read-only marker every poll.
func replica(t *testing.T, root string, poll time.Duration) (*Server, *httptest.Server) {
	t.Helper()
	cfg, err := DefaultConfig(root, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(context.Background(), cfg, Options{ReadOnlyPoll: poll})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { hs.Close(); srv.Close() })
	return srv, hs
}

// startUpload asks for a blob upload and returns the status and body.
func startUpload(t *testing.T, base string) (int, string) {
	t.Helper()
	resp, err := http.Post(base+"/v2/app/blobs/uploads/", "", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// waitStatus polls startUpload until it answers want (bounded, so that a
// replica that never sees the marker fails the test rather than hangs).
func waitStatus(t *testing.T, base string, want int) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := startUpload(t, base)
		if code == want {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("upload on %s: %d %s, want %d", base, code, body, want)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestGCPutsEveryReplicaInReadOnlyMode(t *testing.T) {
	root := t.TempDir()
	_, a := replica(t, root, 20*time.Millisecond)
	_, b := replica(t, root, 20*time.Millisecond)
	gcSrv, _ := replica(t, root, -1)
	if code, body := startUpload(t, b.URL); code != http.StatusAccepted {
		t.Fatalf("upload before gc: %d %s", code, body)
	}

	done := make(chan error, 1)
	go func() {
		_, err := gcSrv.Maintenance().GC(context.Background(), maintenance.GCOptions{RemoveUntagged: true, ReadOnlyWait: time.Second, ReadOnlyLease: time.Minute})
		done <- err
	}()
	for _, base := range []string{a.URL, b.URL} {
		body := waitStatus(t, base, http.StatusServiceUnavailable)
		if !strings.Contains(body, "UNAVAILABLE") || !strings.Contains(body, "garbage collection") {
			t.Errorf("read-only answer does not say why: %s", body)
		}
		// Pulls go on.
		resp, err := http.Get(base + "/v2/")
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET /v2/ while read-only: %v %v", resp, err)
		}
		resp.Body.Close()
	}
	// A second gc may not take over the mode meanwhile.
	if _, err := gcSrv.Maintenance().EnterReadOnly(context.Background(), "other", time.Minute); !errors.Is(err, maintenance.ErrReadOnlyHeld) {
		t.Errorf("second EnterReadOnly: %v, want maintenance.ErrReadOnlyHeld", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	for _, base := range []string{a.URL, b.URL} {
		waitStatus(t, base, http.StatusAccepted)
	}
}

func TestExpiredReadOnlyMarkerIsIgnored(t *testing.T) {
	root := t.TempDir()
	srv, hs := replica(t, root, 20*time.Millisecond)
	if _, err := srv.Maintenance().EnterReadOnly(context.Background(), "crashed gc", 300*time.Millisecond); err != nil { // never renewed
		t.Fatal(err)
	}
	if code, _ := startUpload(t, hs.URL); code != http.StatusServiceUnavailable {
		t.Fatalf("upload under a fresh marker: %d", code)
	}
	// The marker stays in storage (its holder died) but expires.
	waitStatus(t, hs.URL, http.StatusAccepted)
	m, err := srv.Maintenance().ReadOnly(context.Background())
	if err != nil || m == nil {
		t.Fatalf("marker: %v %v", m, err)
	}
	if _, err := srv.Maintenance().EnterReadOnly(context.Background(), "next gc", time.Minute); err != nil {
		t.Fatalf("entering over an expired marker: %v", err)
	}
}

func TestReadOnlyLeaseIsRenewedAndOnlyItsHolderReleasesIt(t *testing.T) {
	root := t.TempDir()
	srv, hs := replica(t, root, 20*time.Millisecond)
	ctx := context.Background()
	l, err := srv.Maintenance().EnterReadOnly(ctx, "maintenance", 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	lost := make(chan error, 1)
	stop := l.Keep(ctx, func(err error) { lost <- err })
	// Renewed, the mode outlasts several leases.
	time.Sleep(time.Second)
	if code, _ := startUpload(t, hs.URL); code != http.StatusServiceUnavailable {
		t.Fatalf("upload under a renewed lease: %d", code)
	}
	// Someone else's marker replaces it (storage drivers have no
	// compare-and-swap, so a renewal racing with the takeover may win once;
	// the takeover is repeated until the lease notices).
	other := maintenance.ReadOnlyMarker{Holder: "other-host/1/ffff", Reason: "other job", Since: time.Now(), Expires: time.Now().Add(time.Minute)}
	takeOver := func() {
		data, _ := json.Marshal(other)
		if err := srv.driver.PutContent(ctx, maintenance.ReadOnlyPath, data); err != nil {
			t.Fatal(err)
		}
	}
	var lostErr error
	for deadline := time.Now().Add(5 * time.Second); lostErr == nil; {
		takeOver()
		select {
		case lostErr = <-lost:
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("the lease did not notice it was taken over")
		}
	}
	if !errors.Is(lostErr, maintenance.ErrReadOnlyLost) {
		t.Errorf("lost with %v, want maintenance.ErrReadOnlyLost", lostErr)
	}
	stop()
	takeOver()
	// The old holder's release leaves the new holder's marker alone.
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	m, err := srv.Maintenance().ReadOnly(ctx)
	if err != nil || m == nil || m.Holder != other.Holder {
		t.Fatalf("after the old holder's release the marker is %+v (%v); want the new holder's", m, err)
	}
}

// TestPushWaitsOutReadOnlyMode checks that cryo's client retries the 503
// a registry in read-only mode answers, and completes the push once the
// mode ends, rather than failing.
func TestPushWaitsOutReadOnlyMode(t *testing.T) {
	root := t.TempDir()
	srv, hs := replica(t, root, 20*time.Millisecond)
	ctx := context.Background()
	l, err := srv.Maintenance().EnterReadOnly(ctx, "garbage collection", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	img := testenv.ImageDir(t, synth.HalfZero, 4<<20, 1)
	repo, tag, err := transfer.Repository(strings.TrimPrefix(hs.URL, "http://")+"/app:v1", transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	released := make(chan time.Time, 1)
	go func() {
		time.Sleep(1500 * time.Millisecond)
		l.Release(ctx)
		released <- time.Now()
	}()
	if _, err := transfer.Push(ctx, img, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatalf("push across read-only mode: %v", err)
	}
	select {
	case <-released:
	default:
		t.Fatal("the push finished while the registry was read-only")
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, repo, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, img, out)
}
