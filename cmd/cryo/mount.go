package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/restore"
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
	writeBuf  int64
	prefetch  string
	readLog   string
	// profile is --profile; recordFor bounds recording.
	profile   string
	recordFor time.Duration
	// recording is set by a command that writes or publishes the working
	// set (--record-profile, --publish-profile): the sweep is then held at
	// most at sweepRate (--record-sweep-rate).
	recording bool
	sweepRate int64
	// client is shared by every reference resolved (the daemon's too),
	// built on first use.
	client *transfer.Client
	peer   peerFlags
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
	fl.Int64Var(&f.writeBuf, "cache-write-buffer", 64<<20, "bytes of fetched chunks a mount queues in memory for the node cache's disk; fetching waits while it is full, so a disk slower than the link slows loading down (more buffer: more memory, less wait)")
	fl.StringVar(&f.readLog, "read-log", "", "write a line per read of the snapshot (FUSE or gofer: file, offset, length, start, duration) to this file, to see where a restore waits")
	fl.StringVar(&f.prefetch, "prefetch-list", "", "retired: use --profile FILE")
	fl.MarkHidden("prefetch-list")
	fl.StringVar(&f.profile, "profile", "auto", profileHelp)
	fl.DurationVar(&f.recordFor, "record-for", 0, "how long after the sandbox's first read of pages.img a mount records its working set (default 30s); it goes on until 10s after the app's last page fault, at most 4 times as long")
	f.peer.register(cmd)
}

// registerRecording adds --record-sweep-rate, for the commands that
// record a profile (recordFlags: --record-profile, and --publish-profile
// where there is one).
func (f *pullerFlags) registerRecording(cmd *cobra.Command, recordFlags string) {
	cmd.Flags().Int64Var(&f.sweepRate, "record-sweep-rate", puller.DefaultRecordSweepRate, fmt.Sprintf("with %s: most bytes a second gVisor's background load of pages.img is held to (an eighth of the link's measured rate if lower, not below 1 MiB/s) for its first %s and until %s after the app's last page fault, never past the recording (--record-for, or longer while the app faults), so that it does not load the app's memory before the app faults on it and the profile misses it (0: not held)", recordFlags, puller.RecordHoldFor, puller.RecordHoldFor))
}

// warnSweepRate says on stderr that --record-sweep-rate, given, does
// nothing without a recording (recordFlags).
func (f *pullerFlags) warnSweepRate(cmd *cobra.Command, recordFlags string) {
	if !f.recording && cmd.Flags().Changed("record-sweep-rate") {
		fmt.Fprintf(cmd.ErrOrStderr(), "cryo: warning: --record-sweep-rate does nothing without %s\n", recordFlags)
	}
}

// options are the puller's options from the flags.
func (f *pullerFlags) options() (puller.Options, error) {
	opts := puller.Options{CacheDir: f.cacheDir, CacheCap: f.cacheSize, Workers: f.workers, Deadline: f.deadline, WriteBuffer: f.writeBuf, NoFUSE: f.noFUSE, RecordFor: f.recordFor}
	if f.recording {
		if f.sweepRate < 0 {
			return opts, fmt.Errorf("--record-sweep-rate %d: want 0 or more bytes a second", f.sweepRate)
		}
		opts.RecordSweepRate = float64(f.sweepRate)
	}
	if f.readLog != "" {
		w, err := os.Create(f.readLog)
		if err != nil {
			return opts, fmt.Errorf("--read-log: %w", err)
		}
		opts.ReadLog = w
	}
	return opts, nil
}

// open opens the node's puller, asking --peers for chunks (it serves
// them none: that is the daemon's --peer-listen).
func (f *pullerFlags) open(ctx context.Context) (*puller.Puller, error) {
	opts, err := f.options()
	if err != nil {
		return nil, err
	}
	pool, err := f.peer.pool(ctx, "", nil, nil)
	if err != nil {
		return nil, err
	}
	if pool != nil {
		opts.Peers = pool
	}
	p, err := puller.New(opts)
	if err != nil {
		// The pool's resolver runs until closed.
		f.peer.close()
		return nil, err
	}
	return p, nil
}

// source resolves ref (a tag at its own registry only) and returns the
// snapshot with its endpoints (the mirrors, then ref's registry) and how
// its profile is found (--profile).
func (f *pullerFlags) source(ctx context.Context, ref string) (puller.Source, error) {
	return f.sourceWith(ctx, ref, f.profile)
}

// sourceWith is source with the profile choice given.
func (f *pullerFlags) sourceWith(ctx context.Context, ref, choice string) (puller.Source, error) {
	if f.prefetch != "" {
		return puller.Source{}, errPrefetchListRetired
	}
	if f.client == nil {
		c, err := f.ro.client(ref)
		if err != nil {
			return puller.Source{}, err
		}
		f.client = c
	}
	src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{Mirrors: f.mirrors, Client: f.client})
	if err != nil {
		return src, err
	}
	src.Profile, err = f.finder(ref, choice)
	return src, err
}

func newMountCmd() *cobra.Command {
	var (
		pf            pullerFlags
		recordProfile string
		backend       string
		runsc         string
		goferDir      string
		goferLog      string
	)
	cmd := &cobra.Command{
		Use:   "mount REF DIR",
		Short: "Mount a snapshot as an image dir that loads while it is used",
		Long: `Mount makes DIR an image dir of the snapshot REF for runsc restore --image-path
and stays in the foreground. It prints "ready" as soon as DIR is complete:
checkpoint.img and pages_meta.img fetched and verified, pages.img served
through FUSE, each read blocking only until the chunks it covers are fetched
and verified (demand reads go ahead of the background load). It prints
"loaded" once every chunk is in the node cache and the snapshot is written
out as a plain dir, which later mounts of it use without FUSE.
SIGINT or SIGTERM unmounts.

The snapshot's working-set profile (--profile) is fetched first, from
before DIR is ready. --record-profile FILE writes the working set the
sandbox restoring from DIR waited on, once the snapshot is loaded and again
at unmount.

Without /dev/fuse (or with --no-fuse) it pulls the whole snapshot first.

With --backend gofer, DIR holds only gcs_opts.json and no FUSE mount is
made: runsc reads the snapshot through cryo's checkpoint gofer (of the
release of --runsc, found in --gofer-dir) straight into the sandbox's
memory, and this process serves it. Run runsc restore with the
environment variable the "env:" line prints, which points runsc at cryo's
gofer for that command only (never install it as runsc's own).`,
		Example: `  cryo mount localhost:5000/app:v1 /run/cryo/app &
  runsc restore --background --image-path=/run/cryo/app ...

  cryo mount --backend gofer localhost:5000/app:v1 /run/cryo/app
  # ready: ... env: GVISOR_SIDECAR_BINARIES_DIR=/tmp/cryo-gofer-1234/sidecars
  GVISOR_SIDECAR_BINARIES_DIR=/tmp/cryo-gofer-1234/sidecars runsc restore --background --image-path=/run/cryo/app ...`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := noCoreDumps(); err != nil {
				return err
			}
			pf.recording = recordProfile != ""
			pf.warnSweepRate(cmd, "--record-profile")
			p, err := pf.open(ctx)
			if err != nil {
				return err
			}
			defer pf.peer.close()
			src, err := pf.source(ctx, args[0])
			if err != nil {
				return err
			}
			var m *puller.Mount
			var g *restore.GoferMount
			switch backend {
			case "fuse":
				if m, err = p.Mount(ctx, src, args[1]); err != nil {
					return err
				}
			case "gofer":
				g, err = restore.ServeGofer(ctx, p, src, args[1], restore.Options{Runsc: runsc, GoferDir: goferDir, GoferLog: absPath(goferLog), Name: args[0]})
				if err != nil {
					return err
				}
				m = g.Mount()
			default:
				return fmt.Errorf("--backend %q: want fuse or gofer", backend)
			}
			pr := m.Progress()
			if pr.Profile != nil {
				fmt.Fprintf(cmd.ErrOrStderr(), "cryo: %s\n", profileLine(pr.Profile))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ready: %s at %s (%s, %s, %.0f ms)\n", src.Index.Digest, args[1], pr.Mode, humanBytes(pr.TotalBytes), pr.ReadySeconds*1000)
			if g != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "env: %s\n", g.Env())
			}
			record := func() {
				if recordProfile == "" {
					return
				}
				if err := writeProfile(recordProfile, m.Profile()); err != nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "cryo: warning: %v\n", err)
				}
			}
			select {
			case <-m.Loaded():
				pr := m.Progress()
				if pr.Err != "" {
					fmt.Fprintf(cmd.ErrOrStderr(), "loading failed: %s\n", pr.Err)
				} else {
					fmt.Fprintf(cmd.OutOrStdout(), "loaded: all %s local after %.2f s (%d demand fetches)\n", humanBytes(pr.TotalBytes), pr.LoadedSeconds, pr.DemandChunks)
				}
				record()
				<-ctx.Done()
			case <-ctx.Done():
			}
			record()
			if g != nil {
				err = g.Close()
			} else {
				err = m.Unmount()
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "unmounted %s\n", args[1])
			return nil
		},
	}
	pf.register(cmd, withCredentials)
	cmd.Flags().StringVar(&recordProfile, "record-profile", "", "write the working set the restoring sandbox waited on to this file (once loaded, and at unmount), for --profile FILE or cryo profile push")
	pf.registerRecording(cmd, "--record-profile")
	cmd.Flags().StringVar(&backend, "backend", "fuse", "how runsc reads DIR: fuse (a lazy FUSE mount) or gofer (gcs_opts.json for cryo's checkpoint gofer: no FUSE; run runsc with the printed env)")
	cmd.Flags().StringVar(&runsc, "runsc", "runsc", "with --backend gofer: the runsc that will restore (its release must match the gofer's)")
	cmd.Flags().StringVar(&goferDir, "gofer-dir", defaultGoferDir(), "with --backend gofer: dir holding cryo's checkpointgofer ($CRYO_GOFER_DIR, else cryo-gofer/ beside the cryo binary)")
	cmd.Flags().StringVar(&goferLog, "gofer-log", "", "with --backend gofer: file the gofer appends its log to")
	return cmd
}

func newRestoreCmd() *cobra.Command {
	var (
		pf         pullerFlags
		runsc      string
		runscFlags []string
		mountDir   string
		backend    string
		goferDir   string
		goferLog   string
		recordProf string
		publish    bool
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
does), never to stdout. Its first message names the mode: "gofer" (cryo's
checkpoint gofer reads the snapshot into the sandbox's memory: no FUSE, no
image on disk), "fuse" (lazy, from the registry), "eager" (pulled whole
first: no FUSE on the node) or "materialized" (local copy, no FUSE).

--backend chooses between the gofer and FUSE for a snapshot the node has
not materialized: "auto" takes the gofer when --gofer-dir holds one built
from the local runsc's gVisor release, else FUSE; "gofer" refuses to run
without a matching one. runsc is pointed at the gofer with
GVISOR_SIDECAR_BINARIES_DIR=--gofer-dir: never install cryo's gofer as
gvisor-bin/checkpointgofer beside runsc, where every sandbox would use it.

--profile (default auto) fetches the snapshot's working set first: the
ranges its published profiles say a restored sandbox waits on, merged,
from before runsc opens pages.img; the line "profile: sha256:... (N ranges,
SIZE)" says which. --record-profile FILE writes the working set this
restore waited on once every page is loaded; --publish-profile attaches it
to the snapshot in its repository (the node needs push access).`,
		Example: `  cryo restore --runsc-flag=--root=/run/runsc --runsc-flag=--platform=systrap \
    localhost:5000/app:v1 --bundle=/srv/app app1`,
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := noCoreDumps(); err != nil {
				return err
			}
			start := time.Now()
			ref, id := args[0], args[len(args)-1]
			// Ask runsc its version while the snapshot resolves.
			type version struct {
				v   string
				err error
			}
			vc := make(chan version, 1)
			go func() { v, err := restore.RunscVersion(ctx, runsc); vc <- version{v, err} }()
			// And the gofer its release, unless FUSE is asked for.
			var goferCheck func(string) error
			if restore.Backend(backend) != restore.BackendFUSE {
				goferCheck = gofer.StartCheck(ctx, goferDir)
			}
			pf.recording = recordProf != "" || publish
			pf.warnSweepRate(cmd, "--record-profile or --publish-profile")
			p, err := pf.open(ctx)
			if err != nil {
				return err
			}
			defer pf.peer.close()
			src, err := pf.source(ctx, ref)
			if err != nil {
				return err
			}
			lv := <-vc
			if lv.err != nil {
				return lv.err
			}
			// stdout belongs to the container: cryo's messages go to stderr.
			msg := cmd.ErrOrStderr()
			res, err := restore.Restore(ctx, p, src, restore.Options{
				Runsc:        runsc,
				RunscFlags:   runscFlags,
				RunscVersion: lv.v,
				ContainerID:  id,
				RestoreFlags: args[1 : len(args)-1],
				MountDir:     mountDir,
				Name:         ref,
				Start:        start,
				Stdin:        cmd.InOrStdin(),
				Stdout:       cmd.OutOrStdout(),
				Stderr:       cmd.ErrOrStderr(),
				Progress:     func(e restore.Event) { printRestoreEvent(msg, id, e) },
				Backend:      restore.Backend(backend),
				GoferDir:     goferDir,
				GoferCheck:   goferCheck,
				GoferLog:     absPath(goferLog),
			})
			if err != nil {
				return err
			}
			if recordProf == "" && !publish {
				return nil
			}
			if res.Profile == nil {
				fmt.Fprintf(msg, "cryo: the snapshot was read from its materialized copy on this node: no working set recorded\n")
				return nil
			}
			// The container is restored and runs: what goes wrong with its
			// profile is a warning, not a failed restore.
			if recordProf != "" {
				if err := writeProfile(recordProf, res.Profile); err != nil {
					fmt.Fprintf(msg, "cryo: warning: %v\n", err)
				}
			}
			if publish {
				if len(res.Profile.Ranges) == 0 {
					fmt.Fprintf(msg, "cryo: the sandbox waited on nothing: no profile published\n")
					return nil
				}
				// To the snapshot restored, whatever its tag names now.
				desc, err := attachProfile(ctx, pf.client, ref, src.Index, res.Profile)
				if err != nil {
					fmt.Fprintf(msg, "cryo: warning: publish profile: %v\n", err)
					return nil
				}
				fmt.Fprintf(msg, "cryo: published profile %s (%d ranges, %s)\n", desc.Digest, len(res.Profile.Ranges), humanBytes(res.Profile.Bytes()))
			}
			return nil
		},
	}
	pf.register(cmd, noPasswordStdin)
	cmd.Flags().StringVar(&runsc, "runsc", "runsc", "runsc binary")
	cmd.Flags().StringArrayVar(&runscFlags, "runsc-flag", nil, "global runsc flag, e.g. --runsc-flag=--root=/run/runsc (repeatable)")
	cmd.Flags().StringVar(&mountDir, "mount-dir", "", "where to mount the snapshot (default: <cache>/mounts/<container id>)")
	cmd.Flags().StringVar(&backend, "backend", string(restore.BackendAuto), "how runsc reads a snapshot not materialized on the node: gofer, fuse or auto (the gofer if --gofer-dir has one of runsc's release)")
	cmd.Flags().StringVar(&goferDir, "gofer-dir", defaultGoferDir(), "dir holding cryo's checkpointgofer ($CRYO_GOFER_DIR, else cryo-gofer/ beside the cryo binary)")
	cmd.Flags().StringVar(&goferLog, "gofer-log", "", "file cryo's checkpoint gofer appends its log to (runsc gives it no stdio)")
	cmd.Flags().StringVar(&recordProf, "record-profile", "", "write the working set the restored sandbox waited on to this file once every page is loaded (nothing for a snapshot materialized on the node)")
	cmd.Flags().BoolVar(&publish, "publish-profile", false, "attach the recorded working set to the snapshot in its repository (needs push access)")
	pf.registerRecording(cmd, "--record-profile or --publish-profile")
	cmd.Flags().SetInterspersed(false)
	return cmd
}

// absPath makes p absolute ("" stays ""): the gofer runs in another dir.
func absPath(p string) string {
	if p == "" {
		return ""
	}
	if a, err := filepath.Abs(p); err == nil {
		return a
	}
	return p
}

// defaultGoferDir is $CRYO_GOFER_DIR, else cryo-gofer/ beside the cryo
// binary (where make gofer installs it), else empty.
func defaultGoferDir() string {
	if d := os.Getenv("CRYO_GOFER_DIR"); d != "" {
		return d
	}
	exe, err := os.Executable()
	if err != nil {
		return ""
	}
	if exe, err = filepath.EvalSymlinks(exe); err != nil {
		return ""
	}
	return filepath.Join(filepath.Dir(exe), "cryo-gofer")
}

// printRestoreEvent writes cryo restore's message for a step of restoring
// container id. bench/restore and the restore tests parse "mode X" and
// "all pages loaded after N s".
func printRestoreEvent(w io.Writer, id string, e restore.Event) {
	switch e.Step {
	case restore.Ready:
		why := ""
		if e.GoferUnused != nil {
			why = fmt.Sprintf(" (checkpoint gofer not used: %v)", e.GoferUnused)
		}
		fmt.Fprintf(w, "cryo: snapshot %s: mode %s%s, image dir %s ready after %.0f ms\n", e.Snapshot, e.Mode, why, e.Dir, e.After.Seconds()*1000)
		if e.Profile != nil {
			fmt.Fprintf(w, "cryo: %s\n", profileLine(e.Profile))
		}
	case restore.Restored:
		fmt.Fprintf(w, "cryo: restored %s from %s (mode %s, runsc restore returned after %.0f ms)\n", id, e.Snapshot, e.Mode, e.After.Seconds()*1000)
	case restore.PagesLoaded:
		fmt.Fprintf(w, "cryo: all pages loaded after %.2f s\n", e.After.Seconds())
	case restore.Materialized:
		if e.Err != nil {
			fmt.Fprintf(w, "cryo: warning: snapshot not materialized: %v\n", e.Err)
		} else {
			fmt.Fprintf(w, "cryo: materialized %s after %.2f s\n", e.Dir, e.After.Seconds())
		}
	case restore.Unmounted:
		if e.Err != nil {
			fmt.Fprintf(w, "cryo: warning: %v\n", e.Err)
		}
	}
}
