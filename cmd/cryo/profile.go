package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/cryo-oci/cryo/internal/atomicfile"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/spf13/cobra"
)

// profileHelp explains --profile in every command that takes it.
const profileHelp = `working-set profile to fetch first: "auto" (the snapshot's newest profiles in its repository, merged; a repository without any costs a request or two, made while the tables load), "none", a profile's manifest digest (sha256:...), or a profile file (cryo restore --record-profile)`

// finder returns how the profile choice finds a profile of a snapshot in
// repository repo of ref.
func (f *pullerFlags) finder(ref, choice string) (profile.Finder, error) {
	d, derr := digest.Parse(choice)
	switch {
	case choice == "none":
		return nil, nil
	case choice == "" || choice == "auto" || derr == nil:
		repo, _, err := f.client.Repository(ref)
		if err != nil {
			return nil, err
		}
		if derr == nil {
			return profile.ByDigest{Repo: repo, Digest: d}, nil
		}
		return profile.Auto{Repo: repo}, nil
	case strings.HasPrefix(choice, "sha256:"):
		return nil, fmt.Errorf("--profile %q: %w", choice, derr)
	default:
		if _, err := os.Stat(choice); err != nil {
			return nil, fmt.Errorf("--profile: %w (want auto, none, a profile's manifest digest or a profile file)", err)
		}
		return profile.File(choice), nil
	}
}

// writeProfile writes p to path: written in full and flushed before it
// replaces what path held, 0600 (a profile tells what an app touches).
func writeProfile(path string, p *profile.Profile) error {
	data, err := p.Encode()
	if err != nil {
		return err
	}
	if err := atomicfile.Replace(path, data, 0o600); err != nil {
		return fmt.Errorf("write profile %s: %w", path, err)
	}
	return nil
}

// profileLine describes a profile used, as cryo restore and mount print
// it: "profile: sha256:... (12 ranges, 48.0 MiB)".
func profileLine(i *profile.Info) string {
	s := fmt.Sprintf("profile: %s (%d ranges, %s)", i.Digest, i.Ranges, humanBytes(i.Bytes))
	if i.Merged > 1 {
		s += fmt.Sprintf(", merged from %d profiles", i.Merged)
	}
	return s
}

func newProfileCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "profile",
		Short: "Working-set profiles: what a restored app waits on first, fetched first next time",
		Long: `A profile lists the byte ranges of a snapshot a restored sandbox waited on
(gVisor's page-fault windows), in the order it first asked for them. cryo
restore and cryo mount record one (--record-profile FILE) and, by default
(--profile auto), fetch the ranges of the snapshot's published profiles
first, before runsc asks for them.

In a registry a profile is an OCI artifact (artifactType
application/vnd.cryo.profile.v1+json) whose subject is the snapshot's
index, listed with the referrers API (or the referrers tag schema on
registries without it). A profile is a hint: every byte still comes from
the snapshot's verified chunks, and one of another snapshot is never used.`,
	}
	cmd.AddCommand(newProfilePushCmd(), newProfileListCmd())
	return cmd
}

func newProfilePushCmd() *cobra.Command {
	var ro remoteOptions
	cmd := &cobra.Command{
		Use:   "push REF FILE",
		Short: "Attach a recorded profile to the snapshot REF in its repository",
		Long: `Push attaches the profile FILE (cryo restore --record-profile) to the snapshot
REF: REF is resolved at its registry, and the profile must be of that
snapshot (its subject is the index digest REF names). It prints the
profile's manifest digest.`,
		Example: `  cryo restore --record-profile /tmp/app.profile localhost:5000/app:v1 --bundle=/srv/app app1
  cryo profile push localhost:5000/app:v1 /tmp/app.profile`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			data, err := profile.ReadFile(args[1])
			if err != nil {
				return err
			}
			p, err := profile.Parse(data)
			if err != nil {
				return fmt.Errorf("%s: %w", args[1], err)
			}
			desc, err := pushProfile(ctx, ro, args[0], p)
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "pushed profile %s (%d ranges, %s) for %s\n", desc.Digest, len(p.Ranges), humanBytes(p.Bytes()), p.Subject)
			return nil
		},
	}
	ro.registerWith(cmd, withCredentials)
	return cmd
}

// pushProfile resolves ref at its registry and attaches p to it.
func pushProfile(ctx context.Context, ro remoteOptions, ref string, p *profile.Profile) (ocispec.Descriptor, error) {
	client, err := ro.client(ref)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	src, err := puller.Resolve(ctx, ref, puller.ResolveOptions{Client: client})
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	if p.Subject != src.Index.Digest {
		return ocispec.Descriptor{}, fmt.Errorf("the profile is of snapshot %s, %s is %s: %w", p.Subject, ref, src.Index.Digest, profile.ErrInvalid)
	}
	return attachProfile(ctx, client, ref, src.Index, p)
}

// attachProfile attaches p to the snapshot index subject in the
// repository of ref.
func attachProfile(ctx context.Context, client *transfer.Client, ref string, subject ocispec.Descriptor, p *profile.Profile) (ocispec.Descriptor, error) {
	repo, _, err := client.Repository(ref)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	return profile.Push(ctx, repo, subject, p, time.Now())
}

func newProfileListCmd() *cobra.Command {
	var (
		ro     remoteOptions
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "list REF",
		Short: "List the profiles attached to the snapshot REF, newest first",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			client, err := ro.client(args[0])
			if err != nil {
				return err
			}
			src, err := puller.Resolve(ctx, args[0], puller.ResolveOptions{Client: client})
			if err != nil {
				return err
			}
			repo, _, err := client.Repository(args[0])
			if err != nil {
				return err
			}
			descs, err := profile.List(ctx, repo, src.Index)
			if err != nil {
				return err
			}
			return printProfiles(cmd.OutOrStdout(), descs, asJSON)
		},
	}
	ro.registerWith(cmd, withCredentials)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the profiles' descriptors as JSON")
	return cmd
}

// profileEntry is a profile as cryo profile list --json prints it.
type profileEntry struct {
	Digest  digest.Digest `json:"digest"`
	Size    int64         `json:"size"`
	Created string        `json:"created,omitempty"`
	Ranges  int64         `json:"ranges"`
	Bytes   int64         `json:"bytes"`
}

func printProfiles(w io.Writer, descs []ocispec.Descriptor, asJSON bool) error {
	entries := make([]profileEntry, 0, len(descs))
	for _, d := range descs {
		e := profileEntry{Digest: d.Digest, Size: d.Size, Created: d.Annotations[ocispec.AnnotationCreated]}
		e.Ranges, _ = strconv.ParseInt(d.Annotations[profile.AnnotationRanges], 10, 64)
		e.Bytes, _ = strconv.ParseInt(d.Annotations[profile.AnnotationBytes], 10, 64)
		entries = append(entries, e)
	}
	if asJSON {
		return writeJSON(w, entries)
	}
	if len(entries) == 0 {
		_, err := fmt.Fprintln(w, "no profiles")
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "DIGEST\tCREATED\tRANGES\tBYTES")
	for _, e := range entries {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\n", e.Digest, e.Created, e.Ranges, humanBytes(e.Bytes))
	}
	return tw.Flush()
}

// errPrefetchListRetired is what --prefetch-list says now.
var errPrefetchListRetired = errors.New("--prefetch-list is retired: record a profile (--record-profile FILE) and use it with --profile FILE, or publish it (cryo profile push) for --profile auto")
