package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
)

// pullerFlags are the flags of every command that runs a puller.
type pullerFlags struct {
	ro        remoteOptions
	cacheDir  string
	cacheSize int64
	mirrors   []string
	noFUSE    bool
	workers   int
	deadline  time.Duration
	prefetch  string
	readLog   string
	// client is shared by every reference resolved (the daemon's too),
	// built on first use.
	client *transfer.Client
}

func (f *pullerFlags) register(cmd *cobra.Command, creds credentialFlags) {
	f.ro.registerWith(cmd, creds)
	fl := cmd.Flags()
	fl.StringVar(&f.cacheDir, "cache", "/var/lib/cryo", "node cache directory, shared by every snapshot and mount on the node")
	fl.Int64Var(&f.cacheSize, "cache-size", 0, "node cache size cap in bytes (0: no cap); chunks of live mounts are never evicted")
	fl.StringSliceVar(&f.mirrors, "mirror", nil, "mirror registry host[:port], asked for content by digest before the reference's own registry (repeatable, in order); tags resolve at the reference's registry only")
	fl.BoolVar(&f.noFUSE, "no-fuse", false, "do not use FUSE: pull the whole snapshot before returning")
	fl.IntVar(&f.workers, "workers", 12, "chunks fetched at once")
	fl.DurationVar(&f.deadline, "deadline", 5*time.Minute, "how long a chunk is retried before its read fails")
	fl.StringVar(&f.readLog, "read-log", "", "write a line per FUSE read (file, offset, length, start, duration) to this file, to see where a restore waits")
	fl.StringVar(&f.prefetch, "prefetch-list", "", `JSON file of byte ranges to load first, in order: [{"path": "pages.img", "offset": 0, "length": 1048576}, ...]`)
}

// options are the puller's options from the flags.
func (f *pullerFlags) options() (puller.Options, error) {
	opts := puller.Options{CacheDir: f.cacheDir, CacheCap: f.cacheSize, Workers: f.workers, Deadline: f.deadline, NoFUSE: f.noFUSE}
	if f.readLog != "" {
		w, err := os.Create(f.readLog)
		if err != nil {
			return opts, fmt.Errorf("--read-log: %w", err)
		}
		opts.ReadLog = w
	}
	return opts, nil
}

func (f *pullerFlags) open() (*puller.Puller, error) {
	opts, err := f.options()
	if err != nil {
		return nil, err
	}
	return puller.New(opts)
}

// source resolves ref (a tag at its own registry only) and returns the
// snapshot with its endpoints: the mirrors, then ref's registry.
func (f *pullerFlags) source(ctx context.Context, ref string) (puller.Source, error) {
	if f.client == nil {
		c, err := f.ro.client(ref)
		if err != nil {
			return puller.Source{}, err
		}
		f.client = c
	}
	src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{Mirrors: f.mirrors, Client: f.client})
	if err != nil || f.prefetch == "" {
		return src, err
	}
	data, err := os.ReadFile(f.prefetch)
	if err != nil {
		return src, fmt.Errorf("prefetch list: %w", err)
	}
	if err := json.Unmarshal(data, &src.Prefetch); err != nil {
		return src, fmt.Errorf("prefetch list %s: %w", f.prefetch, err)
	}
	return src, nil
}

func newMountCmd() *cobra.Command {
	var pf pullerFlags
	cmd := &cobra.Command{
		Use:   "mount REF DIR",
		Short: "Mount a snapshot as an image dir that loads while it is used",
		Long: `Mount makes DIR an image dir of the snapshot REF for runsc restore --image-path
and stays in the foreground. It prints "ready" as soon as DIR is complete:
checkpoint.img and pages_meta.img fetched and verified, pages.img served
through FUSE, each read blocking only until the chunks it covers are fetched
and verified (demand reads go ahead of the background load). It prints
"loaded" when every chunk is in the node cache; the snapshot is then also
written out once as a plain dir, which later mounts of it use without FUSE.
SIGINT or SIGTERM unmounts.

Without /dev/fuse (or with --no-fuse) it pulls the whole snapshot first.`,
		Example: `  cryo mount localhost:5000/app:v1 /run/cryo/app &
  runsc restore --background --image-path=/run/cryo/app ...`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := noCoreDumps(); err != nil {
				return err
			}
			p, err := pf.open()
			if err != nil {
				return err
			}
			src, err := pf.source(ctx, args[0])
			if err != nil {
				return err
			}
			m, err := p.Mount(ctx, src, args[1])
			if err != nil {
				return err
			}
			pr := m.Progress()
			fmt.Fprintf(cmd.OutOrStdout(), "ready: %s at %s (%s, %s, %.0f ms)\n", src.Index.Digest, args[1], pr.Mode, humanBytes(pr.TotalBytes), pr.ReadyAfter*1000)
			select {
			case <-m.Loaded():
				pr := m.Progress()
				if pr.Err != "" {
					fmt.Fprintf(cmd.ErrOrStderr(), "loading failed: %s\n", pr.Err)
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "loaded: all %s local after %.2f s (%d demand fetches)\n", humanBytes(pr.TotalBytes), pr.LoadedAfter, pr.DemandChunks)
				}
				<-ctx.Done()
			case <-ctx.Done():
			}
			if err := m.Unmount(); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "unmounted %s\n", args[1])
			return nil
		},
	}
	pf.register(cmd, withCredentials)
	return cmd
}

func newRestoreCmd() *cobra.Command {
	var (
		pf         pullerFlags
		runsc      string
		runscFlags []string
		mountDir   string
	)
	cmd := &cobra.Command{
		Use:   "restore [flags] REF [runsc restore flags] CONTAINER_ID",
		Short: "Restore a gVisor sandbox straight from a registry snapshot",
		Long: `Restore checks that the snapshot REF was taken by the same runsc version as
the local one (runsc refuses other versions; cryo says so before calling it),
mounts it (or uses its materialized copy from an earlier restore on this
node), then runs
  runsc [--runsc-flag...] restore --detach --background --image-path=DIR [runsc restore flags] CONTAINER_ID
and keeps serving the snapshot until "runsc wait --restore" says every page
is loaded and the snapshot is materialized in the node cache, then unmounts.
Flags after REF go to runsc restore unchanged.

runsc restore gets cryo's stdin, stdout and stderr, which become the
restored container's: cryo writes its own messages to stderr only (as runsc
does), never to stdout. Its first message names the mode: "fuse" (lazy,
from the registry) or "materialized" (local copy, no FUSE).`,
		Example: `  cryo restore --runsc-flag=--root=/run/runsc --runsc-flag=--platform=systrap \
    localhost:5000/app:v1 --bundle=/srv/app app1`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := noCoreDumps(); err != nil {
				return err
			}
			ref, restoreArgs := args[0], args[1:]
			id := restoreArgs[len(restoreArgs)-1]
			// stdout belongs to the container: cryo's messages go to stderr.
			msg := cmd.ErrOrStderr()
			start := time.Now()
			// Ask runsc its version while the snapshot is resolved.
			type version struct {
				v   string
				err error
			}
			vc := make(chan version, 1)
			go func() { v, err := runscVersion(runsc); vc <- version{v, err} }()
			p, err := pf.open()
			if err != nil {
				return err
			}
			src, err := pf.source(ctx, ref)
			if err != nil {
				return err
			}
			lv := <-vc
			if lv.err != nil {
				return lv.err
			}
			localVersion := lv.v
			// Check before mounting: a refused snapshot fetches no chunk.
			if err := checkSnapshotVersion(ctx, src, localVersion, ref); err != nil {
				return err
			}
			dir, materialized := p.Materialized(src.Index.Digest)
			mode := "materialized"
			var m *puller.Mount
			if !materialized {
				var err error
				if mountDir == "" {
					mountDir = filepath.Join(pf.cacheDir, "mounts", id)
				}
				if m, err = p.Mount(ctx, src, mountDir); err != nil {
					return err
				}
				defer releaseMount(m, msg)
				dir = mountDir
				mode = m.Progress().Mode
			}
			ready := time.Since(start)
			fmt.Fprintf(msg, "cryo: snapshot %s: mode %s, image dir %s ready after %.0f ms\n", src.Index.Digest, mode, dir, ready.Seconds()*1000)
			rargs := append(append(append([]string{}, runscFlags...), "restore", "--detach", "--background", "--image-path="+dir), restoreArgs...)
			rc := exec.CommandContext(ctx, runsc, rargs...)
			rc.Stdin, rc.Stdout, rc.Stderr = cmd.InOrStdin(), cmd.OutOrStdout(), cmd.ErrOrStderr()
			if err := rc.Run(); err != nil {
				return fmt.Errorf("runsc restore: %w", err)
			}
			fmt.Fprintf(msg, "cryo: restored %s from %s (mode %s, runsc restore returned after %.0f ms)\n",
				id, src.Index.Digest, mode, time.Since(start).Seconds()*1000)
			wargs := append(append([]string{}, runscFlags...), "wait", "--restore", id)
			wc := exec.CommandContext(ctx, runsc, wargs...)
			wc.Stderr = cmd.ErrOrStderr()
			if out, err := wc.Output(); err != nil {
				return fmt.Errorf("runsc wait --restore: %w (%s)", err, strings.TrimSpace(string(out)))
			}
			fmt.Fprintf(msg, "cryo: all pages loaded after %.2f s\n", time.Since(start).Seconds())
			if m == nil {
				return nil
			}
			// Every chunk runsc read is in the node cache; the background
			// load writes the materialized copy that later restores use
			// without FUSE. Unmounting before it is done would lose it.
			select {
			case <-m.Loaded():
			case <-ctx.Done():
				return ctx.Err()
			}
			if err := m.Err(); err != nil {
				fmt.Fprintf(msg, "cryo: warning: snapshot not materialized: %v\n", err)
			} else {
				fmt.Fprintf(msg, "cryo: materialized %s after %.2f s\n", p.MaterializedDir(src.Index.Digest), time.Since(start).Seconds())
			}
			return nil
		},
	}
	pf.register(cmd, noPasswordStdin)
	cmd.Flags().StringVar(&runsc, "runsc", "runsc", "runsc binary")
	cmd.Flags().StringArrayVar(&runscFlags, "runsc-flag", nil, "global runsc flag, e.g. --runsc-flag=--root=/run/runsc (repeatable)")
	cmd.Flags().StringVar(&mountDir, "mount-dir", "", "where to mount the snapshot (default: <cache>/mounts/<container id>)")
	cmd.Flags().SetInterspersed(false)
	return cmd
}

// releaseMount unmounts a restore's mount without hanging.
//
// The restored sandbox's processes live in mount namespaces created while
// the mount existed, and may keep a copy of it for the container's life
// (runsc's gofer does when the container's root is a bind of a tree that
// holds the mount point). The kernel then keeps the FUSE connection alive
// after our unmount, and go-fuse's Server.Unmount, which waits for its
// request loops to see the connection end, never returns. So: detach our
// view first (never blocks; the sandbox has loaded every page and reads
// pages.img no more), then let Mount.Unmount release the cache pins and
// stop the fetcher; its own unmount then fails (after go-fuse's few short
// retries, about 0.3 s) instead of waiting forever. When cryo exits,
// closing /dev/fuse aborts the connection for any copy left elsewhere.
func releaseMount(m *puller.Mount, msg io.Writer) {
	if err := m.Unmount(); err != nil {
		fmt.Fprintf(msg, "cryo: warning: %v\n", err)
	}
	os.Remove(m.Dir())
}

// runscVersion returns what `runsc --version` reports ("runsc version X").
func runscVersion(runsc string) (string, error) {
	out, err := exec.Command(runsc, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("%s --version: %w", runsc, err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), "runsc version ")
	if !ok {
		return "", fmt.Errorf("%s --version printed %q", runsc, first)
	}
	return strings.TrimSpace(v), nil
}

// checkSnapshotVersion refuses a snapshot whose checkpoint was taken by
// another runsc version than local (runsc would refuse it after the mount).
// It reads only the snapshot's index.
func checkSnapshotVersion(ctx context.Context, src puller.Source, local, ref string) error {
	snap, err := format.LoadSnapshot(ctx, puller.Failover(src.Endpoints), src.Index)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", ref, err)
	}
	if v := snap.RunscVersion(); v != "" && v != local {
		return fmt.Errorf("snapshot %s was checkpointed by runsc %q, local runsc is %q: runsc restores only its own version's checkpoints", ref, v, local)
	}
	return nil
}
