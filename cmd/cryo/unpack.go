package main

import (
	"fmt"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/spf13/cobra"
)

func newUnpackCmd() *cobra.Command {
	var concurrency int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "unpack LAYOUT[:TAG] DIR",
		Short: "Restore a snapshot from an OCI image layout into an image dir",
		Long: `Unpack writes the snapshot's files into DIR, which must not exist or be
empty, verifying every chunk's and every file's sha256. It writes into a
temporary dir next to DIR and renames it into place only when everything
verified, so DIR never holds a partial or corrupt snapshot.`,
		Example: `  cryo unpack /tmp/layout:v1 /tmp/img2
  runsc restore --image-path=/tmp/img2 ...`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			store, desc, err := openLayout(ctx, args[0])
			if err != nil {
				return err
			}
			start := time.Now()
			snap, _, err := format.Unpack(ctx, store, desc, args[1], format.UnpackOptions{Concurrency: concurrency})
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), map[string]any{"digest": desc.Digest, "dir": args[1], "files": len(snap.Files), "logicalBytes": snap.LogicalSize(), "seconds": time.Since(start).Seconds()})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "unpacked %s (%d files, %s) into %s in %s\n", desc.Digest, len(snap.Files), humanBytes(snap.LogicalSize()), args[1], time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	cmd.Flags().IntVar(&concurrency, "concurrency", 0, "chunks fetched and decoded at once (default GOMAXPROCS)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func newVerifyCmd() *cobra.Command {
	var concurrency int
	var asJSON bool
	var ro remoteOptions
	cmd := &cobra.Command{
		Use:   "verify LAYOUT[:TAG] | REF",
		Short: "Check every manifest, chunk table, chunk and file digest of a snapshot",
		Long: `Verify reads the whole snapshot, decodes every chunk and checks every digest
and every rule of SPEC.md, writing nothing. It exits non-zero and names the
first bad file, chunk or blob it finds. The argument is an OCI layout if one
exists at that path, else a registry reference.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			store, desc, err := openSource(ctx, args[0], &ro)
			if err != nil {
				return err
			}
			start := time.Now()
			_, st, err := format.Verify(ctx, store, desc, concurrency)
			if err != nil {
				return fmt.Errorf("verify %s: %w", desc.Digest, err)
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), map[string]any{"digest": desc.Digest, "ok": true, "stats": st})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ok: %s: %d files, %d chunks, %s verified in %s\n", desc.Digest, st.Files, st.Chunks, humanBytes(st.LogicalBytes), time.Since(start).Round(time.Millisecond))
			return nil
		},
	}
	cmd.Flags().IntVar(&concurrency, "concurrency", 0, "chunks fetched and decoded at once (default GOMAXPROCS)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	ro.register(cmd)
	return cmd
}
