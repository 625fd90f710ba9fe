package main

import (
	"fmt"

	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/spf13/cobra"
)

func newCheckpointCmd() *cobra.Command {
	var (
		ro           remoteOptions
		fo           formatOptions
		runsc        string
		runscFlags   []string
		leaveRunning bool
		filesystem   bool
		paths        []string
		goferDir     string
		goferLog     string
		concurrency  int
		noChunkIndex bool
		asJSON       bool
	)
	cmd := &cobra.Command{
		Use:   "checkpoint [flags] CONTAINER REF",
		Short: "Checkpoint a gVisor sandbox straight into a registry",
		Long: `Checkpoint runs
  runsc [--runsc-flag...] checkpoint --image-path=DIR --compression=none [--leave-running] CONTAINER
on an image dir that holds only cryo's gcs_opts.json: runsc starts cryo's
checkpoint gofer (from --gofer-dir, through GVISOR_SIDECAR_BINARIES_DIR),
which streams checkpoint.img, pages_meta.img and pages.img to this process
as the sentry writes them. They are chunked, hashed, checked against the
registry's chunk index and pushed while the sentry writes: no copy of the
sandbox's memory goes to local disk, and a second checkpoint of mostly the
same memory uploads little more than the pages that changed (format v2,
the default). The snapshot is tagged REF only once
runsc checkpoint succeeded and every blob and manifest is in the registry;
an interrupted checkpoint leaves no tag.

With --filesystem it runs runsc fscheckpoint instead: a filesystem
checkpoint of the sandbox's overlay upper layers (the files its processes
wrote; runsc --overlay2 must give them a backing file) of the mounts
--path names (default "/"). Its image (fscheckpoint.pb, multitar.img,
pages_meta.img, pages.img) goes to the registry the same way. A new
sandbox starts from it with runsc create --fs-restore-image-path=DIR, DIR
a cryo mount of REF (--backend gofer for no FUSE); cryo restore refuses it.

The gofer must be built from runsc's gVisor release (make gofer); cryo
checks before it starts runsc. Credentials: as cryo push.`,
		Example: `  cryo checkpoint --runsc-flag=--root=/run/runsc --leave-running app1 localhost:5000/app:v2

  # the files app1 wrote (its root's upper layer), for new sandboxes to start from
  cryo checkpoint --filesystem --leave-running --runsc-flag=--root=/run/runsc app1 localhost:5000/app-files:v1`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := noCoreDumps(); err != nil {
				return err
			}
			if len(paths) > 0 && !filesystem {
				return fmt.Errorf("--path is for a filesystem checkpoint (--filesystem)")
			}
			repo, tag, err := ro.repository(args[1])
			if err != nil {
				return err
			}
			popts, err := fo.push(concurrency, noChunkIndex)
			if err != nil {
				return err
			}
			res, err := checkpoint.Checkpoint(cmd.Context(), checkpoint.Options{
				Runsc:        runsc,
				RunscFlags:   runscFlags,
				ContainerID:  args[0],
				LeaveRunning: leaveRunning,
				Filesystem:   filesystem,
				Paths:        paths,
				GoferDir:     goferDir,
				GoferLog:     absPath(goferLog),
				Repo:         repo,
				Tag:          tag,
				Push:         popts,
				Stderr:       cmd.ErrOrStderr(),
			})
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			printPushed(cmd.OutOrStdout(), fmt.Sprintf("checkpointed %s to %s", args[0], args[1]), &res.PushResult,
				fmt.Sprintf("%.2fs (runsc %s returned after %.2fs)", res.Pushed.Seconds(), res.Command, res.Checkpointed.Seconds()))
			return nil
		},
	}
	ro.register(cmd)
	fo.register(cmd, true)
	cmd.Flags().StringVar(&runsc, "runsc", "runsc", "runsc binary")
	cmd.Flags().StringArrayVar(&runscFlags, "runsc-flag", nil, "global runsc flag, e.g. --runsc-flag=--root=/run/runsc (repeatable)")
	cmd.Flags().BoolVar(&leaveRunning, "leave-running", false, "keep the sandbox running after the checkpoint (runsc checkpoint --leave-running)")
	cmd.Flags().BoolVar(&filesystem, "filesystem", false, "take a filesystem checkpoint (runsc fscheckpoint: the sandbox's overlay upper layers, for runsc create --fs-restore-image-path) instead of a checkpoint of the whole sandbox")
	cmd.Flags().StringArrayVar(&paths, "path", nil, `with --filesystem: a mount point inside the sandbox whose upper layer to save, [CONTAINER:]PATH, or "all-tmpfs" for its disk-backed tmpfs mounts (repeatable; runsc fscheckpoint --path; default "/")`)
	cmd.Flags().StringVar(&goferDir, "gofer-dir", defaultGoferDir(), "dir holding cryo's checkpointgofer ($CRYO_GOFER_DIR, else cryo-gofer/ beside the cryo binary)")
	cmd.Flags().StringVar(&goferLog, "gofer-log", "", "file cryo's checkpoint gofer appends its log to (runsc gives it no stdio)")
	cmd.Flags().IntVar(&concurrency, "concurrency", 0, "chunks packed and uploaded at once (default 4 x GOMAXPROCS)")
	cmd.Flags().BoolVar(&noChunkIndex, "no-chunk-index", false, "do not use cryo's registry extensions: no chunk index lookups (v1), no pack composition and no latest-snapshot base (v2); HEAD each blob, upload what is missing")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}
