package main

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/gofer"
	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/sentry/state/stateipc"
	"gvisor.dev/gvisor/pkg/unet"
	"gvisor.dev/gvisor/pkg/urpc"
)

// farFiles is a snapshot of zero-filled files whose registry is rtt away
// (gofer.LinkReporter).
type farFiles struct {
	multiFiles
	rtt time.Duration
}

// LinkRoundTrip implements gofer.LinkReporter.
func (f farFiles) LinkRoundTrip() time.Duration { return f.rtt }

// TestReadSizeFollowsTheRoundTrip: over gVisor's own file protocol (the
// sentry's client, the gofer's server), the gofer offers reads of
// pages.img of 1 MiB, 16 at a time, where its source measured a round
// trip under farRoundTrip or none, and of 256 KiB, 32 at a time, where it
// measured a longer one; the other files, which the whole restore waits
// on, are read 1 MiB and 16 at a time.
func TestReadSizeFollowsTheRoundTrip(t *testing.T) {
	ckpt := multiFiles{"checkpoint.img": 4096, "pages_meta.img": 100, "pages.img": 8 << 20}
	for _, tc := range []struct {
		name     string
		src      gofer.Source
		pages    uint64
		parallel int
	}{
		{"no round trip said", gofer.Local(ckpt), 1 << 20, 16},
		{"unmeasured", gofer.Local(farFiles{ckpt, 0}), 1 << 20, 16},
		{"loopback, 3 ms", gofer.Local(farFiles{ckpt, 3 * time.Millisecond}), 1 << 20, 16},
		{"just under, 5.9 ms", gofer.Local(farFiles{ckpt, 5900 * time.Microsecond}), 1 << 20, 16},
		{"6 ms", gofer.Local(farFiles{ckpt, 6 * time.Millisecond}), 256 << 10, 32},
		{"a 5 ms link, 7.5 ms", gofer.Local(farFiles{ckpt, 7500 * time.Microsecond}), 256 << 10, 32},
		{"another region, 60 ms", gofer.Local(farFiles{ckpt, 60 * time.Millisecond}), 256 << 10, 32},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			sizes, err := statFiles(ctx, tc.src, restoreMode)
			if err != nil {
				t.Fatal(err)
			}
			impl := &server{ctx: ctx, log: slog.New(slog.NewTextHandler(io.Discard, nil)), src: tc.src,
				allowReads: true, image: restoreMode, sizes: sizes, bufs: newBufPool()}
			impl.sizeReads(tc.src)
			afs, err := stateipc.NewAsyncFileServer(impl)
			if err != nil {
				t.Fatal(err)
			}
			sentrySide, goferSide, err := unet.SocketPair(false)
			if err != nil {
				t.Fatal(err)
			}
			srv := urpc.NewServer()
			srv.Register(afs)
			srv.StartHandling(goferSide)
			t.Cleanup(func() { srv.Stop(0) })
			c, err := stateipc.NewAsyncFileClient(urpc.NewClient(sentrySide))
			if err != nil {
				t.Fatal(err)
			}
			defer c.DecRef()
			for _, f := range []struct {
				path     string
				want     uint64
				parallel int
			}{{"checkpoint.img", 1 << 20, 16}, {"pages_meta.img", 1 << 20, 16}, {"pages.img", tc.pages, tc.parallel}} {
				r, err := c.OpenRead(f.path)
				if err != nil {
					t.Fatalf("open %s: %v", f.path, err)
				}
				if got := r.MaxReadBytes(); got != f.want {
					t.Errorf("%s: the sentry is offered reads of %d bytes, want %d", f.path, got, f.want)
				}
				if got, want := r.MaxRanges(), int(f.want)/unix.Getpagesize(); got != want {
					t.Errorf("%s: %d ranges a read, want %d (one a page)", f.path, got, want)
				}
				if got := r.MaxParallel(); got != f.parallel {
					t.Errorf("%s: %d reads at once, want %d", f.path, got, f.parallel)
				}
				r.Close()
			}
		})
	}
}
