package main

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/cryo-oci/cryo/puller/gofer"
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

func (f farFiles) LinkRoundTrip() time.Duration { return f.rtt }

// TestReadSizeFollowsTheRoundTrip: over gVisor's own file protocol (the
// sentry's client, the gofer's server), the gofer offers reads of
// pages.img of 1 MiB where its source measured a round trip under
// farRoundTrip or none, and of 256 KiB where it measured a longer one;
// the other files, which the whole restore waits on, are read 1 MiB at a
// time.
func TestReadSizeFollowsTheRoundTrip(t *testing.T) {
	ckpt := multiFiles{"checkpoint.img": 4096, "pages_meta.img": 100, "pages.img": 8 << 20}
	for _, tc := range []struct {
		name  string
		src   gofer.Source
		pages uint64
	}{
		{"no rate said", gofer.Local(ckpt), 1 << 20},
		{"unmeasured", gofer.Local(farFiles{ckpt, 0}), 1 << 20},
		{"loopback, 3 ms", gofer.Local(farFiles{ckpt, 3 * time.Millisecond}), 1 << 20},
		{"a 5 ms link, 12 ms", gofer.Local(farFiles{ckpt, 12 * time.Millisecond}), 1 << 20},
		{"20 ms", gofer.Local(farFiles{ckpt, 20 * time.Millisecond}), 256 << 10},
		{"another region, 60 ms", gofer.Local(farFiles{ckpt, 60 * time.Millisecond}), 256 << 10},
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
				path string
				want uint64
			}{{"checkpoint.img", 1 << 20}, {"pages_meta.img", 1 << 20}, {"pages.img", tc.pages}} {
				r, err := c.OpenRead(f.path)
				if err != nil {
					t.Fatalf("open %s: %v", f.path, err)
				}
				if got := r.MaxReadBytes(); got != f.want {
					t.Errorf("%s: the sentry is offered reads of %d bytes, want %d", f.path, got, f.want)
				}
				if got, want := r.MaxRanges(), int(f.want/4096); got != want {
					t.Errorf("%s: %d ranges a read, want %d (one a page)", f.path, got, want)
				}
				r.Close()
			}
		})
	}
}
