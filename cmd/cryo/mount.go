package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"
	"oras.land/oras-go/v2/registry/remote"
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
}

func (f *pullerFlags) register(cmd *cobra.Command) {
	f.ro.register(cmd)
	fl := cmd.Flags()
	fl.StringVar(&f.cacheDir, "cache", "/var/lib/cryo", "node cache directory, shared by every snapshot and mount on the node")
	fl.Int64Var(&f.cacheSize, "cache-size", 0, "node cache size cap in bytes (0: no cap); chunks of live mounts are never evicted")
	fl.StringSliceVar(&f.mirrors, "mirror", nil, "mirror registry host[:port] to try before the reference's own registry (repeatable, in order)")
	fl.BoolVar(&f.noFUSE, "no-fuse", false, "do not use FUSE: pull the whole snapshot before returning")
	fl.IntVar(&f.workers, "workers", 12, "chunks fetched at once")
	fl.DurationVar(&f.deadline, "deadline", 5*time.Minute, "how long a chunk is retried before its read fails")
}

func (f *pullerFlags) open() (*puller.Puller, error) {
	return puller.New(puller.Options{CacheDir: f.cacheDir, CacheCap: f.cacheSize, Workers: f.workers, Deadline: f.deadline, NoFUSE: f.noFUSE})
}

// source resolves ref on the mirrors, then on its own registry, and
// returns the snapshot and its endpoints in that order.
func (f *pullerFlags) source(ctx context.Context, ref string) (puller.Source, error) {
	return resolveSource(ctx, ref, f.mirrors, f.ro.clientOptions())
}

func resolveSource(ctx context.Context, ref string, mirrors []string, opts transfer.ClientOptions) (puller.Source, error) {
	repo, tag, err := transfer.Repository(ref, opts)
	if err != nil {
		return puller.Source{}, err
	}
	var eps []fetch.Endpoint
	for _, m := range mirrors {
		mref := m + "/" + repo.Reference.Repository + ":" + tag
		if strings.HasPrefix(tag, "sha256:") {
			mref = m + "/" + repo.Reference.Repository + "@" + tag
		}
		mrepo, _, err := transfer.Repository(mref, opts)
		if err != nil {
			return puller.Source{}, fmt.Errorf("mirror %s: %w", m, err)
		}
		eps = append(eps, fetch.Endpoint{Name: m, Store: mrepo})
	}
	eps = append(eps, fetch.Endpoint{Name: repo.Reference.Registry, Store: repo})
	var errs []string
	for _, ep := range eps {
		desc, err := ep.Store.(*remote.Repository).Resolve(ctx, tag)
		if err == nil {
			return puller.Source{Index: desc, Endpoints: eps}, nil
		}
		errs = append(errs, fmt.Sprintf("%s: %v", ep.Name, err))
	}
	return puller.Source{}, fmt.Errorf("resolve %s: %s", ref, strings.Join(errs, "; "))
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
	pf.register(cmd)
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
		Long: `Restore mounts the snapshot REF (or uses its materialized copy from an earlier
restore on this node), checks that it was taken by the same runsc version as
the local one (runsc refuses other versions; cryo says so before calling it),
then runs
  runsc [--runsc-flag...] restore --detach --background --image-path=MOUNT [runsc restore flags] CONTAINER_ID
and keeps serving the snapshot until "runsc wait --restore" says every page
is loaded, then unmounts. Flags after REF go to runsc restore unchanged.`,
		Example: `  cryo restore --runsc-flag=--root=/run/runsc --runsc-flag=--platform=systrap \
    localhost:5000/app:v1 --bundle=/srv/app app1`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			ref, restoreArgs := args[0], args[1:]
			p, err := pf.open()
			if err != nil {
				return err
			}
			src, err := pf.source(ctx, ref)
			if err != nil {
				return err
			}
			start := time.Now()
			localVersion, err := runscVersion(runsc)
			if err != nil {
				return err
			}
			dir := p.MaterializedDir(src.Index.Digest)
			var m *puller.Mount
			if _, err := os.Stat(dir); err != nil {
				if mountDir == "" {
					mountDir = filepath.Join(pf.cacheDir, "mounts", restoreArgs[len(restoreArgs)-1])
				}
				if m, err = p.Mount(ctx, src, mountDir); err != nil {
					return err
				}
				defer unmountQuietly(m)
				dir = mountDir
				if v := m.Snapshot().RunscVersion(); v != "" && v != localVersion {
					return fmt.Errorf("snapshot %s was checkpointed by runsc %q, local runsc is %q: runsc restores only its own version's checkpoints", ref, v, localVersion)
				}
			} else if err := checkMaterializedVersion(ctx, src, localVersion, ref); err != nil {
				return err
			}
			ready := time.Since(start)
			rargs := append(append(append([]string{}, runscFlags...), "restore", "--detach", "--background", "--image-path="+dir), restoreArgs...)
			rc := exec.CommandContext(ctx, runsc, rargs...)
			rc.Stdout, rc.Stderr = cmd.OutOrStdout(), cmd.ErrOrStderr()
			if err := rc.Run(); err != nil {
				return fmt.Errorf("runsc restore: %w", err)
			}
			restored := time.Since(start)
			fmt.Fprintf(cmd.OutOrStdout(), "restored %s from %s (image ready after %.0f ms, runsc restore returned after %.0f ms)\n",
				restoreArgs[len(restoreArgs)-1], src.Index.Digest, ready.Seconds()*1000, restored.Seconds()*1000)
			wargs := append(append([]string{}, runscFlags...), "wait", "--restore", restoreArgs[len(restoreArgs)-1])
			wc := exec.CommandContext(ctx, runsc, wargs...)
			wc.Stderr = cmd.ErrOrStderr()
			if out, err := wc.Output(); err != nil {
				return fmt.Errorf("runsc wait --restore: %w (%s)", err, strings.TrimSpace(string(out)))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "all pages loaded after %.2f s\n", time.Since(start).Seconds())
			return nil
		},
	}
	pf.register(cmd)
	cmd.Flags().StringVar(&runsc, "runsc", "runsc", "runsc binary")
	cmd.Flags().StringArrayVar(&runscFlags, "runsc-flag", nil, "global runsc flag, e.g. --runsc-flag=--root=/run/runsc (repeatable)")
	cmd.Flags().StringVar(&mountDir, "mount-dir", "", "where to mount the snapshot (default: <cache>/mounts/<container id>)")
	cmd.Flags().SetInterspersed(false)
	return cmd
}

func unmountQuietly(m *puller.Mount) {
	if err := m.Unmount(); err != nil {
		// The sandbox may still hold pages.img open: detach lazily.
		unix.Unmount(m.Dir(), unix.MNT_DETACH)
	}
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

func checkMaterializedVersion(ctx context.Context, src puller.Source, local, ref string) error {
	snap, err := format.LoadSnapshot(ctx, src.Endpoints[len(src.Endpoints)-1].Store, src.Index)
	if err != nil {
		return err
	}
	if v := snap.RunscVersion(); v != "" && v != local {
		return fmt.Errorf("snapshot %s was checkpointed by runsc %q, local runsc is %q: runsc restores only its own version's checkpoints", ref, v, local)
	}
	return nil
}
