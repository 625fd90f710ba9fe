// Command cryo moves gVisor checkpoints as chunked, deduplicated OCI
// artifacts. It packs an image dir into an OCI layout and unpacks, verifies
// and inspects snapshots (package format); pushes, pulls and copies them
// between layouts and registries (transfer); serves and maintains a
// registry with cryo's extensions (registry); and, on a node, mounts a
// snapshot as an image dir that loads while it is used, runs the node
// puller daemon, and restores a sandbox straight from a registry (puller,
// puller/daemon, puller/restore).
//
// The command only wires: it parses flags, builds the packages' options
// and prints what they report. What it does is in the packages, which a
// program embedding cryo calls the same way.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "cryo:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "cryo",
		Short: "Ship gVisor checkpoints as chunked, deduplicated OCI artifacts",
		Long: `cryo turns a gVisor checkpoint image dir (runsc checkpoint --image-path)
into an OCI artifact: each file is cut into page-aligned, content-defined
chunks, all-zero chunks are stored as nothing, the rest zstd-compressed when
that pays, all content-addressed so that snapshots share what they have in
common. See SPEC.md for the format.

A LAYOUT argument is an OCI image layout directory, optionally followed by
:TAG (default "latest") or @DIGEST.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	var cpuProfile string
	var profileFile *os.File
	root.PersistentFlags().StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the command to this file")
	root.PersistentFlags().MarkHidden("cpuprofile")
	root.PersistentPreRunE = func(cmd *cobra.Command, args []string) error {
		if cpuProfile == "" {
			return nil
		}
		f, err := os.Create(cpuProfile)
		if err != nil {
			return err
		}
		profileFile = f
		return pprof.StartCPUProfile(f)
	}
	root.PersistentPostRun = func(cmd *cobra.Command, args []string) {
		if profileFile != nil {
			pprof.StopCPUProfile()
			profileFile.Close()
		}
	}
	root.AddCommand(newPackCmd(), newUnpackCmd(), newVerifyCmd(), newInspectCmd(),
		newPushCmd(), newPullCmd(), newCopyCmd(), newLoginCmd(), newRegistryCmd(),
		newMountCmd(), newRestoreCmd(), newCheckpointCmd(), newPullerCmd(), newProfileCmd())
	return root
}
