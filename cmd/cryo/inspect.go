package main

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode"
	"unicode/utf8"

	"github.com/cryo-oci/cryo/format"
	"github.com/spf13/cobra"
)

func newInspectCmd() *cobra.Command {
	var asJSON bool
	var ro remoteOptions
	cmd := &cobra.Command{
		Use:   "inspect LAYOUT[:TAG] | REF",
		Short: "Show a snapshot's files, chunk counts and sizes",
		Long: `Inspect reads a snapshot's index and chunk tables (not its chunks) and
prints its metadata and, per file, the size, chunk counts by encoding
(zero/raw/zstd) and the bytes stored for it. The argument is an OCI layout
if one exists at that path, else a registry reference (host/repo:tag).`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			store, desc, err := openSource(ctx, args[0], &ro)
			if err != nil {
				return err
			}
			sum, err := format.Inspect(ctx, store, desc)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), sum)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "snapshot  %s\n", sum.Digest)
			keys := make([]string, 0, len(sum.Annotations))
			for k := range sum.Annotations {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				fmt.Fprintf(w, "  %s: %s\n", printable(k), printable(sum.Annotations[k]))
			}
			c := sum.Chunks
			fmt.Fprintf(w, "files     %d, %s logical\n", len(sum.Files), humanBytes(sum.LogicalBytes))
			fmt.Fprintf(w, "chunks    %d: %d zero (%s), %d raw (%s), %d zstd (%s)\n", c.Total(),
				c.Zero, humanBytes(c.ZeroBytes), c.Raw, humanBytes(c.RawBytes), c.Zstd, humanBytes(c.ZstdBytes))
			if sum.Version == format.V2 {
				fmt.Fprintf(w, "format    v2: %d chunks in %d packs\n", sum.Chunks.Total(), sum.Blobs)
				fmt.Fprintf(w, "stored    %s of chunks (%s of logical), in packs of %s (the rest: other snapshots' chunks in shared packs)\n\n", humanBytes(sum.StoredBytes), percent(sum.StoredBytes, sum.LogicalBytes), humanBytes(sum.PackBytes))
			} else {
				fmt.Fprintf(w, "stored    %s in %d blobs (%s of logical)\n\n", humanBytes(sum.StoredBytes), sum.Blobs, percent(sum.StoredBytes, sum.LogicalBytes))
			}
			tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "PATH\tSIZE\tMODE\tPARTS\tCHUNKS\tZERO\tRAW\tZSTD\tSTORED")
			for _, f := range sum.Files {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\n", printable(f.Path), humanBytes(f.Size), f.Mode, f.Parts,
					f.Chunks.Total(), f.Chunks.Zero, f.Chunks.Raw, f.Chunks.Zstd, humanBytes(f.StoredBytes))
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the summary as JSON")
	ro.register(cmd)
	return cmd
}

// printable returns s as is if it is valid UTF-8 made of printable
// characters, else quoted with Go escapes (strconv.Quote). Paths and
// annotations come from whoever pushed the snapshot: printed raw, a control
// character could rewrite the terminal or a newline forge a line of output.
// A string that starts with a quote is quoted too, so that a quoted
// string always means an escaped one.
func printable(s string) string {
	if utf8.ValidString(s) && !strings.HasPrefix(s, `"`) && strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) }) < 0 {
		return s
	}
	return strconv.Quote(s)
}
