package main

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode"
	"unicode/utf8"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/spf13/cobra"
	"oras.land/oras-go/v2/content"
)

func newInspectCmd() *cobra.Command {
	var (
		asJSON bool
		base   string
		ro     remoteOptions
	)
	cmd := &cobra.Command{
		Use:   "inspect LAYOUT[:TAG] | REF",
		Short: "Show a snapshot's files, chunk counts and sizes, and what it shares with a base",
		Long: `Inspect reads a snapshot's index and chunk tables (not its chunks) and
prints its metadata and, per file, the size, chunk counts by encoding
(zero/raw/zstd) and the bytes stored for it. The argument is an OCI layout
if one exists at that path, else a registry reference (host/repo:tag).

With --base, inspect also reads the base snapshot's index and tables (not
its chunks) and splits the snapshot's stored chunks into those the base
holds too (by chunk digest, whatever the two formats) and new ones: the
new ones are what a node holding the base still fetches. If both are
format v2, it also splits the packs the snapshot lists into those the base
lists too and new ones: the new packs are what the registry stored for the
snapshot beyond the base (what cryo push uploaded, unless the registry
composed packs). The base is an OCI layout or a registry reference, as the
argument; a bare TAG or @DIGEST names a snapshot of the same layout or
repository, as cryo push --base does. Credentials given with -u go to the
registry the argument names (or, if it is a layout, the base's); a base in
another registry is read with the credential store's only.`,
		Example: `  cryo inspect localhost:5000/myapp:pause-2 --base pause-1
  cryo inspect /tmp/layout:v2 --base localhost:5000/myapp:v1 --json`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			store, desc, err := openSource(ctx, args[0], &ro)
			if err != nil {
				return err
			}
			var sum *format.Summary
			if base != "" {
				baseStore, baseDesc, err := openBase(ctx, args[0], base, &ro)
				if err != nil {
					return fmt.Errorf("--base %s: %w", base, err)
				}
				sum, err = format.InspectBase(ctx, store, desc, baseStore, baseDesc)
				if err != nil {
					return err
				}
			} else if sum, err = format.Inspect(ctx, store, desc); err != nil {
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
				fmt.Fprintf(w, "stored    %s of chunks (%s of logical), in packs of %s (the rest: other snapshots' chunks in shared packs)\n", humanBytes(sum.StoredBytes), percent(sum.StoredBytes, sum.LogicalBytes), humanBytes(sum.PackBytes))
			} else {
				fmt.Fprintf(w, "stored    %s in %d blobs (%s of logical)\n", humanBytes(sum.StoredBytes), sum.Blobs, percent(sum.StoredBytes, sum.LogicalBytes))
			}
			if r := sum.Reuse; r != nil {
				printReuse(w, sum, r)
			}
			fmt.Fprintln(w)
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
	cmd.Flags().StringVar(&base, "base", "", "LAYOUT[:TAG] | REF | TAG | @DIGEST: also show the chunks (by digest) and, both v2, the packs this snapshot shares with the snapshot named, and what is new")
	ro.register(cmd)
	return cmd
}

// printReuse prints what sum's snapshot shares with its base, r.
func printReuse(w io.Writer, sum *format.Summary, r *format.Reuse) {
	fmt.Fprintf(w, "base      %s (%s)\n", r.Base, r.BaseVersion)
	fmt.Fprintf(w, "shared    %d chunks, %s stored (%s of stored): also in the base\n",
		r.SharedChunks, humanBytes(r.SharedBytes), percent(r.SharedBytes, sum.StoredBytes))
	fmt.Fprintf(w, "new       %d chunks, %s stored (%s of stored): what a node holding the base still fetches\n",
		r.NewChunks, humanBytes(r.NewBytes), percent(r.NewBytes, sum.StoredBytes))
	switch {
	case r.Packs != nil:
		fmt.Fprintf(w, "packs     %d shared with the base (%s), %d new (%s): stored for this snapshot beyond the base\n",
			r.Packs.Shared, humanBytes(r.Packs.SharedBytes), r.Packs.New, humanBytes(r.Packs.NewBytes))
	case sum.Version == format.V2:
		fmt.Fprintf(w, "packs     not compared: the base is %s (packs are compared only between v2 snapshots)\n", r.BaseVersion)
	}
}

// openBase opens and resolves the snapshot --base names: an OCI layout or
// a registry reference, as openSource takes, or a bare TAG (also :TAG) or
// [@]DIGEST of the layout or repository arg names. Credentials given on
// the command line go to the registry arg names (baseCredentials).
func openBase(ctx context.Context, arg, base string, ro *remoteOptions) (content.ReadOnlyStorage, ocispec.Descriptor, error) {
	if isLayout(base) {
		return openLayout(ctx, base)
	}
	if strings.Contains(base, "/") {
		return openSource(ctx, base, baseCredentials(arg, base, ro))
	}
	ref := strings.TrimPrefix(strings.TrimPrefix(base, ":"), "@")
	if ref == "" {
		return nil, ocispec.Descriptor{}, fmt.Errorf("names no tag or digest")
	}
	if isLayout(arg) {
		sep := ":"
		if _, err := digest.Parse(ref); err == nil {
			sep = "@"
		}
		return openLayout(ctx, parseLayoutRef(arg).dir+sep+ref)
	}
	repo, _, err := ro.repository(arg)
	if err != nil {
		return nil, ocispec.Descriptor{}, err
	}
	desc, err := repo.Resolve(ctx, ref)
	if err != nil {
		return nil, ocispec.Descriptor{}, fmt.Errorf("resolve %s in %s: %w", ref, repo.Reference.Registry+"/"+repo.Reference.Repository, err)
	}
	return transfer.Ranged{Repository: repo}, desc, nil
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

// baseCredentials returns the remote options for the base reference base:
// ro, if arg names the same registry or is a layout (then base names the
// only registry of the command), else ro without its explicit credentials,
// which are for arg's registry: the base's come from the credential store.
func baseCredentials(arg, base string, ro *remoteOptions) *remoteOptions {
	if isLayout(arg) {
		return ro
	}
	a, errA := transfer.ParseReference(arg)
	b, errB := transfer.ParseReference(base)
	if errA == nil && errB == nil && a.Registry == b.Registry {
		return ro
	}
	return &remoteOptions{plainHTTP: ro.plainHTTP, insecure: ro.insecure, caFile: ro.caFile, cmd: ro.cmd}
}
