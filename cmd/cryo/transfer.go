package main

import (
	"fmt"
	"io"
	"os"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/internal/progress"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/spf13/cobra"
)

func newPushCmd() *cobra.Command {
	var (
		ro           remoteOptions
		fo           formatOptions
		concurrency  int
		asJSON       bool
		noChunkIndex bool
	)
	cmd := &cobra.Command{
		Use:   "push DIR REF",
		Short: "Pack a checkpoint image dir straight into a registry",
		Long: `Push chunks and encodes the image dir DIR on the fly (no copy of the image on
disk) and uploads, in parallel, only what the registry does not have yet.
The snapshot index is pushed last and tagged, so an interrupted push leaves
no visible snapshot; pushing again uploads only what is still missing.

In format v2 (the default), chunks are small (64 KiB mean) and new ones go
into 4 MiB packs; chunks an earlier v2 snapshot of the same repository
holds are referenced where they lie, so a second checkpoint of the same app
uploads little more than what changed, under the same tag or a new one.
That earlier snapshot, the base, is --base, else the snapshot the tag names
now, else, on cryo's registry, the v2 snapshot pushed last to the
repository, else, on other registries, the newest v2 snapshot among the
repository's last 16 tags (in natural order: pause-9 before pause-10).
Packs are never shared across repositories: a pack holds other chunks of
the snapshot it was made for. Instead, before uploading a new pack, cryo
asks a cryo registry to compose it from chunks it already holds in
repositories you may pull from; the registry copies, verified, only the
frames of the chunks named, into a new pack of this repository.

In format v1 (--format v1, for pullers older than format v2), each 1 MiB
chunk is a blob: cryo asks a cryo registry's chunk index first (a chunk
stored there in another encoding or repository is reused), then checks
each blob with HEAD.

REF is host[:port]/repository[:tag] (default tag "latest"). Credentials come
from Docker's config and credential helpers (see cryo login), or -u with
--password-stdin, --password-file or -p.`,
		Example: `  cryo push /tmp/img localhost:5000/myapp:v1`,
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			repo, tag, err := ro.repository(args[1])
			if err != nil {
				return err
			}
			total, err := transfer.DirSize(args[0])
			if err != nil {
				return fmt.Errorf("image dir: %w", err)
			}
			popts, err := fo.push(concurrency, noChunkIndex)
			if err != nil {
				return err
			}
			bar := progress.New(os.Stderr, "push", total)
			popts.OnBytes = bar.Add
			res, err := transfer.Push(ctx, args[0], repo, tag, popts)
			bar.Finish()
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			printPushed(cmd.OutOrStdout(), fmt.Sprintf("pushed %s to %s", args[0], args[1]), res,
				fmt.Sprintf("%.2fs (%.0f MB/s logical)", res.Seconds, float64(res.Stats.LogicalBytes)/1e6/res.Seconds))
			return nil
		},
	}
	ro.register(cmd)
	fo.register(cmd, true)
	cmd.Flags().IntVar(&concurrency, "concurrency", 0, "chunks packed and uploaded at once (default 4 x GOMAXPROCS)")
	cmd.Flags().BoolVar(&noChunkIndex, "no-chunk-index", false, "do not use cryo's registry extensions: no chunk index lookups (v1), no pack composition, and a base found among the tags instead of asked for (v2); HEAD each blob, upload what is missing")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

// printPushed prints what a push (or a checkpoint) stored: a title line,
// the snapshot's digest, its bytes, what was uploaded and skipped, and how
// long it took.
func printPushed(w io.Writer, title string, res *transfer.PushResult, took string) {
	st := res.Stats
	fmt.Fprintln(w, title)
	fmt.Fprintf(w, "  digest     %s\n", res.Descriptor.Digest)
	fmt.Fprintf(w, "  logical    %s in %d files\n", humanBytes(st.LogicalBytes), st.Files)
	fmt.Fprintf(w, "  uploaded   %s in %d blobs (%s of logical)\n", humanBytes(st.UploadedBytes), st.BlobsUploaded, percent(st.UploadedBytes, st.LogicalBytes))
	if res.Base != nil || st.ReusedBytes > 0 || st.ComposedBytes > 0 {
		base := "none"
		if res.Base != nil {
			base = res.Base.Digest.String()
		}
		fmt.Fprintf(w, "  reused     %s of %s stored in earlier packs (base %s), %d zero chunks\n", humanBytes(st.ReusedBytes), humanBytes(st.StoredBytes), base, st.Chunks[format.EncodingZero])
		if st.ComposedBytes > 0 {
			fmt.Fprintf(w, "  composed   %s in %d packs the registry made from chunks it holds elsewhere\n", humanBytes(st.ComposedBytes), st.PacksComposed)
		}
	} else {
		fmt.Fprintf(w, "  skipped    %d chunk blobs the registry had (%d via its chunk index), %d zero chunks\n", st.BlobsSkipped, res.ChunkIndexHits, st.Chunks[format.EncodingZero])
	}
	fmt.Fprintf(w, "  took       %s\n", took)
}

func newPullCmd() *cobra.Command {
	var (
		ro          remoteOptions
		concurrency int
		asJSON      bool
	)
	cmd := &cobra.Command{
		Use:   "pull REF DIR",
		Short: "Download a snapshot into an image dir, verified and resumable",
		Long: `Pull downloads the snapshot REF into DIR (which must not exist or be empty),
fetching chunks in parallel and verifying every chunk and file digest. Files
are written into a hidden .DIR.cryo-partial next to DIR and moved into place
only when complete: after an interruption, run the same pull again and the
chunks already on disk (re-verified) are not fetched again.

REF may also be a plain artifact of whole files, as written by
  oras push REF checkpoint.img pages_meta.img pages.img
so builders can start without cryo.`,
		Example: `  cryo pull localhost:5000/myapp:v1 /tmp/img
  runsc restore --image-path=/tmp/img ...`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			repo, ref, err := ro.repository(args[0])
			if err != nil {
				return err
			}
			bar := progress.New(os.Stderr, "pull", 0)
			res, err := transfer.Pull(ctx, repo, ref, args[1], transfer.PullOptions{Concurrency: concurrency, OnBytes: bar.Add})
			bar.Finish()
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "pulled %s (%s) into %s\n", args[0], res.Descriptor.Digest, args[1])
			fmt.Fprintf(w, "  logical    %s\n", humanBytes(res.LogicalBytes))
			fmt.Fprintf(w, "  fetched    %s (%s of logical)", humanBytes(res.FetchedBytes), percent(res.FetchedBytes, res.LogicalBytes))
			if res.ReusedBytes > 0 {
				fmt.Fprintf(w, ", %s already on disk from an interrupted pull", humanBytes(res.ReusedBytes))
			}
			fmt.Fprintf(w, "\n  took       %.2fs (%.0f MB/s logical)\n", res.Seconds, float64(res.LogicalBytes)/1e6/res.Seconds)
			return nil
		},
	}
	ro.register(cmd)
	cmd.Flags().IntVar(&concurrency, "concurrency", 8, "chunks fetched at once")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func newCopyCmd() *cobra.Command {
	var (
		ro          remoteOptions
		concurrency int
		asJSON      bool
	)
	cmd := &cobra.Command{
		Use:   "copy SRC DST",
		Short: "Replicate a snapshot between registries",
		Long: `Copy copies the snapshot SRC (index, manifests, chunk tables, chunk blobs) to
DST, skipping everything DST already has. Within one registry, blobs are
cross-repository mounted instead of transferred. The index is written last,
so DST never shows a partial snapshot. Both registries use the same
--plain-http setting; -u and a password, if given, go to both.`,
		Example: `  cryo copy registry-eu.example.com/app:v1 registry-us.example.com/app:v1`,
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			src, srcRef, err := ro.repository(args[0])
			if err != nil {
				return err
			}
			dst, dstRef, err := ro.repository(args[1])
			if err != nil {
				return err
			}
			res, err := transfer.Copy(cmd.Context(), src, srcRef, dst, dstRef, concurrency)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "copied %s to %s (%s): %d objects copied (%s), %d mounted, %d already there, in %.2fs\n",
				args[0], args[1], res.Descriptor.Digest, res.Copied, humanBytes(res.CopiedBytes), res.Mounted, res.Skipped, res.Seconds)
			return nil
		},
	}
	ro.register(cmd)
	cmd.Flags().IntVar(&concurrency, "concurrency", 8, "objects copied at once")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func newLoginCmd() *cobra.Command {
	var ro remoteOptions
	cmd := &cobra.Command{
		Use:   "login REGISTRY",
		Short: "Log in to a registry and store the credentials for cryo, docker and oras",
		Long: `Login checks the credentials against REGISTRY and saves them in Docker's
config (~/.docker/config.json, or its credential helper), where cryo, docker
and oras all find them.`,
		Example: `  echo "$TOKEN" | cryo login registry.example.com -u ci --password-stdin`,
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			password, err := ro.secretPassword()
			if err != nil {
				return err
			}
			if ro.username == "" || password == "" {
				return fmt.Errorf("need --username and --password-stdin, --password-file or --password")
			}
			if err := transfer.Login(cmd.Context(), args[0], ro.username, password, ro.connOptions()); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "logged in to %s\n", args[0])
			return nil
		},
	}
	ro.register(cmd)
	return cmd
}
