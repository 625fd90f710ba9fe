package registry

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/internal/testenv"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	"golang.org/x/crypto/bcrypt"
)

// startAuthRegistry runs a registry with htpasswd auth for user:password.
func startAuthRegistry(t *testing.T, user, password string) (*Server, *httptest.Server) {
	t.Helper()
	dir := t.TempDir()
	hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	htpasswd := filepath.Join(dir, "htpasswd")
	if err := os.WriteFile(htpasswd, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := parseConfig([]byte(fmt.Sprintf(`version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: %q
  delete:
    enabled: true
http:
  addr: 127.0.0.1:0
auth:
  htpasswd:
    realm: cryo-test
    path: %q
`, filepath.Join(dir, "storage"), htpasswd)), "test")
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(context.Background(), cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { hs.Close(); srv.Close() })
	return srv, hs
}

// countingBody is an endless request body that counts what was read of it.
type countingBody struct{ n atomic.Int64 }

func (b *countingBody) Read(p []byte) (int, error) {
	clear(p)
	copy(p, `{"digests":["`)
	b.n.Add(int64(len(p)))
	return len(p), nil
}

func (b *countingBody) Close() error { return nil }

// TestUnauthenticatedBodiesAreNotRead sends bodies the registry buffers
// (a manifest PUT, a batch chunk lookup) without credentials, or with
// wrong ones: the answer must be 401 with not one byte of the body read.
// With the right credentials, pushes and lookups work.
func TestUnauthenticatedBodiesAreNotRead(t *testing.T) {
	const user, password = "builder", "s3cret"
	srv, hs := startAuthRegistry(t, user, password)
	for _, tc := range []struct{ name, method, path, user, password string }{
		{"manifest PUT", http.MethodPut, "/v2/app/manifests/v1", "", ""},
		{"manifest PUT, wrong password", http.MethodPut, "/v2/app/manifests/v1", user, "wrong"},
		{"batch lookup", http.MethodPost, api.ChunksPath, "", ""},
		{"batch lookup, wrong password", http.MethodPost, api.ChunksPath, user, "wrong"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := &countingBody{}
			req := httptest.NewRequest(tc.method, tc.path, body)
			req.ContentLength = 1 << 30
			req.Header.Set("Content-Type", "application/vnd.oci.image.manifest.v1+json")
			if tc.user != "" {
				req.SetBasicAuth(tc.user, tc.password)
			}
			rec := httptest.NewRecorder()
			srv.Handler().ServeHTTP(rec, req)
			if rec.Code != http.StatusUnauthorized || rec.Header().Get("WWW-Authenticate") == "" {
				t.Fatalf("answer %d %v, want 401 with a challenge", rec.Code, rec.Header())
			}
			if n := body.n.Load(); n != 0 {
				t.Fatalf("the registry read %d bytes of an unauthenticated body", n)
			}
		})
	}

	ctx := context.Background()
	host := strings.TrimPrefix(hs.URL, "http://")
	src := testenv.ImageDir(t, synth.Text, 4<<20, 8)
	opts := transfer.ClientOptions{Username: user, Password: password}
	repo, tag, err := transfer.Repository(host+"/a:v1", opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := transfer.Push(ctx, src, repo, tag, transfer.PushOptions{}); err != nil {
		t.Fatalf("push with credentials: %v", err)
	}
	repoB, tag, _ := transfer.Repository(host+"/b:v1", opts)
	res, err := transfer.Push(ctx, src, repoB, tag, transfer.PushOptions{})
	if err != nil {
		t.Fatalf("push with credentials: %v", err)
	}
	if res.ChunkIndexHits == 0 {
		t.Errorf("an authenticated push found nothing in the chunk index")
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := transfer.Pull(ctx, repoB, tag, out, transfer.PullOptions{}); err != nil {
		t.Fatal(err)
	}
	testenv.SameImage(t, src, out)
}

// TestStalledClientsAreCut checks the stall timeouts: a client that stops
// sending its body, or stops taking a response, loses its connection, while
// a blob larger than a stall segment is served whole to a client that
// reads it.
func TestStalledClientsAreCut(t *testing.T) {
	const stall = 200 * time.Millisecond
	cfg, _ := DefaultConfig(t.TempDir(), "127.0.0.1:0")
	srv, err := New(context.Background(), cfg, Options{StallTimeout: stall})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv.Handler())
	t.Cleanup(func() { hs.Close(); srv.Close() })
	reg := &testRegistry{srv: srv, http: hs}
	addr := strings.TrimPrefix(hs.URL, "http://")

	t.Run("body", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"digests\":[", api.ChunksPath, addr)
		// Never more: the registry must give up on the body.
		conn.SetReadDeadline(time.Now().Add(100 * stall))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				t.Fatalf("the registry still waits for a stalled body after %s", 100*stall)
			}
			t.Logf("stalled body: connection closed (%v)", err)
			return
		}
		resp.Body.Close()
		t.Logf("stalled body: %s", resp.Status)
	})

	// More than the socket buffers hold, in many stall segments.
	data := bytes.Repeat([]byte("0123456789abcdef"), 48*stallSegment/16)
	d := digest.FromBytes(data)
	if resp := uploadBlob(t, reg, "a", d, data); resp.StatusCode != http.StatusCreated {
		t.Fatalf("upload: %s", resp.Status)
	}
	t.Run("response", func(t *testing.T) {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "GET /v2/a/blobs/%s HTTP/1.1\r\nHost: %s\r\n\r\n", d, addr)
		time.Sleep(10 * stall) // taking nothing
		conn.SetReadDeadline(time.Now().Add(100 * stall))
		n, _ := io.Copy(io.Discard, conn)
		if n >= int64(len(data)) {
			t.Fatalf("a client that took nothing for %s got the whole %d byte blob", 10*stall, len(data))
		}
	})
	t.Run("steady reader", func(t *testing.T) {
		// The same storage, at the default stall timeout: a test machine
		// under load may well pause a reader for 200ms.
		steady, err := New(context.Background(), cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		shs := httptest.NewServer(steady.Handler())
		defer func() { shs.Close(); steady.Close() }()
		resp, err := http.Get(shs.URL + "/v2/a/blobs/" + d.String())
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		v := d.Verifier()
		n, err := io.Copy(v, resp.Body)
		if err != nil || n != int64(len(data)) || !v.Verified() {
			t.Fatalf("blob of %d bytes read back as %d bytes (%v), verified %v", len(data), n, err, v.Verified())
		}
	})
}
