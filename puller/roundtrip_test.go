package puller

import (
	"context"
	"crypto/rand"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/synth"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/opencontainers/go-digest"
)

// TestGoferMountSaysItsRoundTrip: by the time a gofer mount is ready it
// has fetched its small files, and its file API's HEAD answers say the
// shortest of those fetches (gofer.RoundTripHeader), which the gofer's
// client reads; the gofer sizes its reads of pages.img by it.
func TestGoferMountSaysItsRoundTrip(t *testing.T) {
	r := startReg(t)
	dir := filepath.Join(t.TempDir(), "img")
	if err := synth.ImageDir(dir, synth.Random, 8<<20, 3); err != nil {
		t.Fatal(err)
	}
	// A pages_meta.img of 4 MiB of random bytes: held in memory, fetched
	// from the registry before the mount is ready.
	meta := make([]byte, 4<<20)
	rand.Read(meta)
	if err := os.WriteFile(filepath.Join(dir, format.PagesMetaFile), meta, 0o600); err != nil {
		t.Fatal(err)
	}
	s := pushDir(t, r, "app", dir)
	ctx := context.Background()
	p := newPuller(t, Options{})
	m, err := p.MountFiles(ctx, s, filepath.Join(t.TempDir(), "mnt"), FilesOptions{MaterializeAfter: make(chan struct{})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	ready := m.LinkRoundTrip()
	if ready <= 0 {
		t.Fatalf("a mount that fetched 4 MiB before it was ready says its round trip is %v", ready)
	}

	sock := filepath.Join(t.TempDir(), "files.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	gofer.RegisterFiles(mux, func(id string) (gofer.Files, digest.Digest, bool) { return m, m.Digest(), id == "m" })
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	c := gofer.NewClient(sock, "m", m.Digest(), 0)
	defer c.Close()
	if got := c.LinkRoundTrip(); got != 0 {
		t.Errorf("before any HEAD the client says %v", got)
	}
	if _, err := c.Size(ctx, format.PagesFile); err != nil {
		t.Fatal(err)
	}
	// The round trip is the shortest fetch; the load goes on meanwhile,
	// so it may have shrunk, never grown, and the header carries whole
	// microseconds.
	if got := c.LinkRoundTrip(); got > ready.Truncate(time.Microsecond) || got < m.LinkRoundTrip().Truncate(time.Microsecond) {
		t.Errorf("the client read a round trip of %v; the mount had %v when ready and %v now", got, ready, m.LinkRoundTrip())
	}
}
