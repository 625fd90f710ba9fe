package main

import (
	"fmt"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/format/chunker"
	"github.com/cryo-oci/cryo/format/layout"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
)

func newPackCmd() *cobra.Command {
	var (
		layoutDir, tag, created, chunking string
		avg, concurrency                  int
		asJSON                            bool
		fo                                formatOptions
	)
	cmd := &cobra.Command{
		Use:   "pack DIR --layout OUT [--tag TAG]",
		Short: "Pack a checkpoint image dir into an OCI image layout",
		Long: `Pack chunks, encodes and stores every file of the image dir DIR in the OCI
image layout OUT (created if missing; blobs it already holds are reused) and
tags the snapshot index. Packing the same dir twice gives the same digest.`,
		Example: `  runsc checkpoint --image-path=/tmp/img mycontainer
  cryo pack /tmp/img --layout /tmp/layout --tag v1`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if layoutDir == "" {
				return fmt.Errorf("--layout is required")
			}
			opts, err := fo.pack(concurrency)
			if err != nil {
				return err
			}
			if avg == 0 {
				avg = format.DefaultAvgChunkSize
				if opts.Format == format.V2 {
					avg = format.DefaultAvgChunkSizeV2
				}
			}
			switch chunking {
			case chunker.PageCDC:
				opts.Chunking = chunker.DefaultPageCDC(avg)
			case chunker.Fixed:
				opts.Chunking = chunker.FixedSize(avg)
			default:
				return fmt.Errorf("--chunking must be %q or %q", chunker.PageCDC, chunker.Fixed)
			}
			if created != "" {
				t, err := time.Parse(time.RFC3339, created)
				if err != nil {
					return fmt.Errorf("--created: %w", err)
				}
				opts.Created = t
			}
			ctx := cmd.Context()
			store, err := layout.New(layoutDir)
			if err != nil {
				return err
			}
			start := time.Now()
			desc, st, err := format.Pack(ctx, args[0], store, opts)
			if err != nil {
				return err
			}
			if err := store.Tag(ctx, desc, tag); err != nil {
				return fmt.Errorf("tag %s: %w", tag, err)
			}
			elapsed := time.Since(start)
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), map[string]any{"digest": desc.Digest, "layout": layoutDir, "tag": tag, "stats": st, "seconds": elapsed.Seconds()})
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "packed %s into %s:%s\n", args[0], layoutDir, tag)
			fmt.Fprintf(w, "  digest   %s\n", desc.Digest)
			fmt.Fprintf(w, "  files    %d, %s logical\n", st.Files, humanBytes(st.LogicalBytes))
			fmt.Fprintf(w, "  chunks   %d zero, %d raw, %d zstd\n", st.Chunks[format.EncodingZero], st.Chunks[format.EncodingRaw], st.Chunks[format.EncodingZstd])
			fmt.Fprintf(w, "  stored   %s (%s of logical), %s new in this layout\n", humanBytes(st.StoredBytes), percent(st.StoredBytes, st.LogicalBytes), humanBytes(st.UploadedBytes))
			fmt.Fprintf(w, "  took     %s (%.0f MB/s)\n", elapsed.Round(time.Millisecond), float64(st.LogicalBytes)/1e6/elapsed.Seconds())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&layoutDir, "layout", "", "OCI image layout directory to write (required)")
	f.StringVar(&tag, "tag", transfer.DefaultTag, "tag of the snapshot in the layout")
	f.StringVar(&created, "created", "", "creation time to record (RFC 3339); default: the checkpoint's own timestamp")
	f.StringVar(&chunking, "chunking", chunker.PageCDC, "chunking algorithm: page-cdc or fixed")
	f.IntVar(&avg, "chunk-size", 0, "mean chunk size in bytes (page-cdc: min size/4, max size*4; default 65536 for format v2, 1048576 for v1)")
	fo.register(cmd, false)
	f.IntVar(&concurrency, "concurrency", 0, "chunks encoded and stored at once (default 4 x GOMAXPROCS)")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}
