package puller_test

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/transfer"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/sirupsen/logrus"
)

// resolveReg is an in-process cryo registry behind a testenv.AuthGate
// (which can demand basic credentials and records the Authorization
// headers it receives) and a handler that, while corrupt is set, flips a
// byte of every manifest and blob body it serves.
type resolveReg struct {
	*testenv.AuthGate
	host    string
	hs      *httptest.Server
	corrupt atomic.Bool
}

func startResolveReg(t *testing.T) *resolveReg {
	t.Helper()
	logrus.SetLevel(logrus.ErrorLevel)
	cfg, err := registry.DefaultConfig(t.TempDir(), "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := registry.New(context.Background(), cfg, registry.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := srv.Handler()
	r := &resolveReg{}
	r.AuthGate = testenv.NewAuthGate(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		isContent := req.Method == http.MethodGet && (strings.Contains(req.URL.Path, "/manifests/") || strings.Contains(req.URL.Path, "/blobs/"))
		if !isContent || !r.corrupt.Load() {
			h.ServeHTTP(w, req)
			return
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		body := rec.Body.Bytes()
		if len(body) > 0 {
			body[len(body)/2] ^= 0x01
		}
		for k, v := range rec.Header() {
			w.Header()[k] = v
		}
		w.WriteHeader(rec.Code)
		w.Write(body)
	}))
	r.hs = httptest.NewServer(r.AuthGate)
	t.Cleanup(func() { r.hs.Close(); srv.Close() })
	r.host = strings.TrimPrefix(r.hs.URL, "http://")
	return r
}

// pushImage pushes a synthetic image dir (seed picks its bytes) to ref and
// returns the dir and the snapshot's descriptor.
func pushImage(t *testing.T, ref string, seed uint64) (string, ocispec.Descriptor) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.HalfZero, 4<<20, seed); err != nil {
		t.Fatal(err)
	}
	repo, tag, err := transfer.Repository(ref, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	res, err := transfer.Push(context.Background(), dir, repo, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return dir, res.Descriptor
}

// copySnapshot copies src's snapshot to dst by digest (a mirror's copy).
func copySnapshot(t *testing.T, src, srcRef, dst, dstRef string) {
	t.Helper()
	s, _, err := transfer.Repository(src, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d, _, err := transfer.Repository(dst, transfer.ClientOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := transfer.Copy(context.Background(), s, srcRef, d, dstRef, 4); err != nil {
		t.Fatal(err)
	}
}

// mountAndCompare mounts src with a fresh puller and node cache and
// checks that pages.img holds want's bytes.
func mountAndCompare(t *testing.T, src puller.Source, want string) {
	t.Helper()
	testenv.NeedFUSE(t, "mounting")
	p, err := puller.New(puller.Options{CacheDir: t.TempDir(), Deadline: 20 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	m, err := p.Mount(ctx, src, filepath.Join(t.TempDir(), "mnt"))
	if err != nil {
		t.Fatalf("mount: %v", err)
	}
	defer m.Unmount()
	got, err := os.ReadFile(filepath.Join(m.Dir(), format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	exp, err := os.ReadFile(filepath.Join(want, format.PagesFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, exp) {
		t.Fatalf("the mount serves another snapshot's pages.img")
	}
	// Let the background load and materialize finish before the node
	// cache is removed.
	select {
	case <-m.Loaded():
	case <-ctx.Done():
		t.Fatal("the background load did not finish")
	}
	if err := m.Err(); err != nil {
		t.Fatalf("background load: %v", err)
	}
}

// TestResolveTagAtPrimaryOnly: a mirror that holds the primary's snapshot
// by digest and another snapshot under the same tag is not believed about
// the tag: the tag resolves at the primary, the mirror still serves the
// content, and the mount serves the primary's snapshot.
func TestResolveTagAtPrimaryOnly(t *testing.T) {
	primary, mirror := startResolveReg(t), startResolveReg(t)
	want, desc := pushImage(t, primary.host+"/app:v1", 1)
	copySnapshot(t, primary.host+"/app:v1", "v1", mirror.host+"/app:a", "a")
	_, other := pushImage(t, mirror.host+"/app:v1", 2)
	if other.Digest == desc.Digest {
		t.Fatal("the two snapshots are one")
	}

	src, err := puller.Resolve(context.Background(), primary.host+"/app:v1", puller.ResolveOptions{Mirrors: []string{mirror.host}})
	if err != nil {
		t.Fatal(err)
	}
	if src.Index.Digest != desc.Digest {
		t.Fatalf("resolved %s (the mirror's tag), want the primary's %s", src.Index.Digest, desc.Digest)
	}
	if len(src.Endpoints) != 2 || src.Endpoints[0].Name != mirror.host || src.Endpoints[1].Name != primary.host {
		t.Fatalf("endpoints %v, want the mirror, then the primary", src.Endpoints)
	}
	mountAndCompare(t, src, want)
}

// TestResolveTagNeedsPrimary: with the primary down, a tag does not
// resolve, even though the mirror holds that tag; the error names the
// primary.
func TestResolveTagNeedsPrimary(t *testing.T) {
	primary, mirror := startResolveReg(t), startResolveReg(t)
	pushImage(t, primary.host+"/app:v1", 1)
	copySnapshot(t, primary.host+"/app:v1", "v1", mirror.host+"/app:v1", "v1")
	primary.hs.Close()

	_, err := puller.Resolve(context.Background(), primary.host+"/app:v1", puller.ResolveOptions{Mirrors: []string{mirror.host}})
	if err == nil {
		t.Fatal("a tag resolved without its registry, at a mirror")
	}
	if !strings.Contains(err.Error(), primary.host) || !strings.Contains(err.Error(), `tag "v1"`) {
		t.Errorf("error does not name the tag and the primary %s: %v", primary.host, err)
	}
}

// TestResolveDigestThroughMirrorAlone: a reference by digest needs no
// primary: with it down, the snapshot resolves and mounts from the mirror.
func TestResolveDigestThroughMirrorAlone(t *testing.T) {
	primary, mirror := startResolveReg(t), startResolveReg(t)
	want, desc := pushImage(t, primary.host+"/app:v1", 1)
	copySnapshot(t, primary.host+"/app:v1", "v1", mirror.host+"/app:v1", "v1")
	primary.hs.Close()

	src, err := puller.Resolve(context.Background(), primary.host+"/app@"+desc.Digest.String(), puller.ResolveOptions{Mirrors: []string{mirror.host}})
	if err != nil {
		t.Fatal(err)
	}
	if src.Index.Digest != desc.Digest || src.Index.Size != desc.Size || src.Index.MediaType != ocispec.MediaTypeImageIndex {
		t.Fatalf("resolved %+v, want %+v", src.Index, desc)
	}
	mountAndCompare(t, src, want)
}

// TestCorruptMirrorManifestFailsOver: a mirror that serves every manifest, index,
// chunk table and blob with a byte flipped costs round trips, not the
// mount: it is served from the primary, by tag and by digest.
func TestCorruptMirrorManifestFailsOver(t *testing.T) {
	primary, mirror := startResolveReg(t), startResolveReg(t)
	want, desc := pushImage(t, primary.host+"/app:v1", 1)
	copySnapshot(t, primary.host+"/app:v1", "v1", mirror.host+"/app:v1", "v1")
	mirror.corrupt.Store(true)
	ctx := context.Background()
	for _, ref := range []string{primary.host + "/app:v1", primary.host + "/app@" + desc.Digest.String()} {
		src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{Mirrors: []string{mirror.host}})
		if err != nil {
			t.Fatalf("%s: %v", ref, err)
		}
		if src.Index.Digest != desc.Digest || src.Index.Size != desc.Size {
			t.Fatalf("%s: resolved %+v, want %+v", ref, src.Index, desc)
		}
		// The index, every manifest and table, through the failover fetcher.
		snap, err := format.LoadSnapshot(ctx, puller.Failover(src.Endpoints), src.Index)
		if err != nil {
			t.Fatalf("%s: load the snapshot with a corrupt mirror first: %v", ref, err)
		}
		for i := range snap.Files {
			for part := range snap.Files[i].Parts {
				if _, err := format.LoadPart(ctx, puller.Failover(src.Endpoints), &snap.Files[i], part); err != nil {
					t.Fatalf("%s: load %s part %d: %v", ref, snap.Files[i].Path, part, err)
				}
			}
		}
		mountAndCompare(t, src, want)
	}
}

// TestMirrorGetsNoPrimaryCredentials: credentials given for the primary
// (-u/-p) are never sent to a mirror, even when the mirror asks for
// credentials; the mirror gets only what Docker's credential store holds
// for it (here nothing, so the primary serves).
func TestMirrorGetsNoPrimaryCredentials(t *testing.T) {
	primary, mirror := startResolveReg(t), startResolveReg(t)
	_, desc := pushImage(t, primary.host+"/app:v1", 1)
	copySnapshot(t, primary.host+"/app:v1", "v1", mirror.host+"/app:v1", "v1")
	primary.Require("alice", "s3cret")
	mirror.Require("bob", "mirror-pw")
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // an empty credential store

	c, err := transfer.NewClient(transfer.ClientOptions{Username: "alice", Password: "s3cret", CredentialHost: primary.host})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, ref := range []string{primary.host + "/app:v1", primary.host + "/app@" + desc.Digest.String()} {
		src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{Mirrors: []string{mirror.host}, Client: c})
		if err != nil {
			t.Fatalf("%s: %v", ref, err)
		}
		snap, err := format.LoadSnapshot(ctx, puller.Failover(src.Endpoints), src.Index)
		if err != nil {
			t.Fatalf("%s: %v", ref, err)
		}
		if _, err := format.LoadPart(ctx, puller.Failover(src.Endpoints), &snap.Files[0], 0); err != nil {
			t.Fatalf("%s: %v", ref, err)
		}
	}
	for _, h := range mirror.Seen() {
		if h == testenv.BasicAuth("alice", "s3cret") {
			t.Fatal("the mirror received the primary's credentials")
		}
	}
	if !contains(primary.Seen(), testenv.BasicAuth("alice", "s3cret")) {
		t.Fatal("the primary never received its credentials: the test tested nothing")
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}
