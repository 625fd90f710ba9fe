package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/cryo-oci/cryo/registry"
	"github.com/cryo-oci/cryo/registry/maintenance"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/spf13/cobra"
)

// storeFlags select a registry's storage: the embedded default under --root,
// or a distribution YAML config.
type storeFlags struct {
	root, config, addr string
	anchors            string
	cmd                *cobra.Command
}

func (f *storeFlags) register(cmd *cobra.Command, withAddr bool) {
	f.cmd = cmd
	cmd.Flags().StringVar(&f.root, "root", registry.DefaultRoot, "filesystem storage root of the embedded default configuration")
	cmd.Flags().StringVar(&f.config, "config", "", "distribution YAML configuration (storage drivers such as s3, redis cache, auth, TLS, notifications); REGISTRY_* environment variables override it")
	if withAddr {
		cmd.Flags().StringVar(&f.addr, "addr", registry.DefaultAddr, "listen address")
	}
}

// registerAnchors adds --chunk-index-anchors, for the commands that
// write or prune the chunk index (serve, gc, reindex).
func (f *storeFlags) registerAnchors(cmd *cobra.Command) {
	cmd.Flags().StringVar(&f.anchors, "chunk-index-anchors", registry.AnchorsStorage,
		`where the chunk index keeps the anchors of format v2 snapshots: "storage" (beside the rest of the index, in the storage driver) or "redis" (the configuration's redis, which replicas share: one round trip per lookup instead of a LIST and a GET on an object store); every replica, gc and reindex must use the same`)
}

func (f *storeFlags) load() (*configuration.Configuration, error) {
	if f.config == "" {
		return registry.DefaultConfig(f.root, f.addr)
	}
	cfg, err := registry.LoadConfig(f.config)
	if err != nil {
		return nil, err
	}
	if f.cmd.Flags().Changed("addr") {
		cfg.HTTP.Addr = f.addr
	}
	if f.cmd.Flags().Changed("root") {
		return nil, fmt.Errorf("--root applies to the embedded default only; set storage in %s", f.config)
	}
	return cfg, nil
}

func (f *storeFlags) open(ctx context.Context) (*registry.Server, error) {
	if f.addr == "" {
		f.addr = registry.DefaultAddr
	}
	cfg, err := f.load()
	if err != nil {
		return nil, err
	}
	cfg.Log.Level = "error" // offline maintenance: no request logs, no warnings meant for a server
	if err := registry.ConfigureLogging(cfg); err != nil {
		return nil, err
	}
	return registry.New(ctx, cfg, registry.Options{ReadOnlyPoll: -1, Anchors: f.anchors})
}

func newRegistryCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "registry",
		Short: "Run and maintain cryo's OCI registry",
		Long: `cryo's registry is distribution's (the CNCF registry, v3) with cryo's additions:
the OCI 1.1 referrers API, a chunk index that lets pushers skip chunks the
registry already holds in another encoding or repository, and Prometheus
metrics of stored bytes and the dedup ratio. Any OCI client can use it.`,
	}
	cmd.AddCommand(newRegistryServeCmd(), newRegistryGCCmd(), newRegistryReindexCmd(), newRegistryStatsCmd(), newRegistryReadOnlyCmd())
	return cmd
}

func newRegistryServeCmd() *cobra.Command {
	var (
		sf                    storeFlags
		mirrorOf, metricsAddr string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the registry",
		Long: `Serve runs the registry. Without --config it uses the embedded default:
filesystem storage under --root, deletes enabled, listening on --addr (plain
HTTP). With --config it takes a distribution YAML configuration for storage
(filesystem, s3, ...), redis, auth (htpasswd, token), TLS and notifications,
exactly as the stock registry does.

--mirror-of URL makes it a pull-through cache of another registry (a regional
mirror): pulls are served from local storage, fetched from URL on a miss;
pushes are refused. Prometheus metrics are served on --metrics-addr.`,
		Example: `  cryo registry serve
  cryo registry serve --addr 0.0.0.0:5000 --root /var/lib/cryo-registry
  cryo registry serve --config /etc/cryo/registry.yaml
  cryo registry serve --mirror-of https://registry-eu.example.com --root /var/cache/cryo-mirror`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			cfg, err := sf.load()
			if err != nil {
				return err
			}
			if mirrorOf != "" {
				if err := registry.SetMirrorOf(cfg, mirrorOf); err != nil {
					return err
				}
			}
			if err := registry.ConfigureLogging(cfg); err != nil {
				return err
			}
			srv, err := registry.New(ctx, cfg, registry.Options{DistributionMetrics: true, Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)), Anchors: sf.anchors})
			if err != nil {
				return err
			}
			defer srv.Close()
			ln, err := net.Listen("tcp", cfg.HTTP.Addr)
			if err != nil {
				return fmt.Errorf("listen: %w", err)
			}
			var mln net.Listener
			if metricsAddr != "" {
				if mln, err = net.Listen("tcp", metricsAddr); err != nil {
					return fmt.Errorf("listen for metrics: %w", err)
				}
			}
			scheme := "http"
			if cfg.HTTP.TLS.Certificate != "" {
				scheme = "https"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "cryo registry listening on %s://%s (storage: %s)", scheme, ln.Addr(), cfg.Storage.Type())
			if mirrorOf != "" || cfg.Proxy.RemoteURL != "" {
				fmt.Fprintf(cmd.OutOrStdout(), ", mirror of %s", cfg.Proxy.RemoteURL)
			}
			if mln != nil {
				fmt.Fprintf(cmd.OutOrStdout(), ", metrics on http://%s/metrics", mln.Addr())
			}
			fmt.Fprintln(cmd.OutOrStdout())
			return srv.Serve(ctx, ln, mln)
		},
	}
	sf.register(cmd, true)
	sf.registerAnchors(cmd)
	cmd.Flags().StringVar(&mirrorOf, "mirror-of", "", "run as a pull-through cache (mirror) of the registry at this URL")
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "127.0.0.1:5001", "listen address of the Prometheus /metrics endpoint (empty: none)")
	return cmd
}

func newRegistryGCCmd() *cobra.Command {
	var (
		sf                     storeFlags
		dryRun, deleteUntagged bool
		asJSON                 bool
		roWait, roLease, grace time.Duration
	)
	cmd := &cobra.Command{
		Use:   "gc",
		Short: "Delete blobs no manifest references (mark and sweep)",
		Long: `GC runs distribution's mark-and-sweep garbage collection over the registry's
storage: every blob not referenced by a manifest is deleted, then chunk index
and referrers entries that point at deleted content are dropped. Chunks
shared with snapshots that remain are kept.

To delete a snapshot, delete its tag (or its index by digest) through the
registry API, then run gc with --delete-untagged, which also removes
manifests no tag reaches, with everything only they reference.

Like distribution's, cryo's gc must not run while pushes happen. With
--read-only-wait D it puts every registry serving the same storage in
read-only mode (a marker in the storage that they re-read every 5s; pushes
get 503 UNAVAILABLE with Retry-After, pulls go on), waits D, sweeps, and ends
read-only mode. The marker is a lease of --read-only-lease, renewed while gc
runs: a gc that dies leaves the mode for one lease at most, and a gc that
cannot renew it stops. Without --read-only-wait, stop the registries (or set
storage.maintenance.readonly) first.

With a redis blob descriptor cache in the configuration, gc flushes it after
the sweep, before leaving read-only mode; should that fail, the registries
flush it themselves and refuse pushes until they could.

gc also prunes cryo's chunk index of what it deleted. Run it with the same
--chunk-index-anchors as the registries: with "redis", the anchors of v2
snapshots are pruned in redis.

A push uploads its chunks before the manifests and the tagged index that
reference them. So that a push under way when gc starts (or one read-only
mode held up) still completes intact, gc keeps what is younger than --grace
(default 1h), by the storage's modification times: blobs uploaded or
mounted into any repository since then (a reused blob counts from its
newest mount), manifests pushed since then, and, with --delete-untagged,
everything those manifests reference. --grace 0 sweeps them too, as
distribution does.

--delete-untagged also deletes snapshots whose tag moved to a newer one:
nodes still loading such a snapshot lose its chunks.`,
		Example: `  cryo registry gc --root /var/lib/cryo-registry --delete-untagged
  cryo registry gc --config /etc/cryo/registry.yaml --delete-untagged --read-only-wait 15s
  cryo registry gc --root /var/lib/cryo-registry --delete-untagged --grace 0   # registry stopped, nothing in flight`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			srv, err := sf.open(cmd.Context())
			if err != nil {
				return err
			}
			defer srv.Close()
			res, err := srv.Maintenance().GC(cmd.Context(), maintenance.GCOptions{DryRun: dryRun, RemoveUntagged: deleteUntagged, ReadOnlyWait: roWait, ReadOnlyLease: roLease, Grace: grace})
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), res)
			}
			if dryRun {
				fmt.Fprintf(cmd.OutOrStdout(), "dry run: nothing deleted (%d blobs, %s stored)\n", res.BlobsBefore, humanBytes(res.BlobBytesBefore))
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "gc: %d of %d blobs deleted, %s freed, %s remain; %d unreferenced blobs kept, younger than --grace %s; %d chunk index, %d referrer and %d redis cache entries dropped\n",
				res.BlobsBefore-res.BlobsAfter, res.BlobsBefore, humanBytes(res.BlobBytesBefore-res.BlobBytesAfter), humanBytes(res.BlobBytesAfter),
				res.BlobsKeptForGrace, grace, res.ChunkIndexPruned, res.ReferrersPruned, res.CacheEntriesCleared)
			return nil
		},
	}
	sf.register(cmd, false)
	sf.registerAnchors(cmd)
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "print what would be deleted, delete nothing")
	cmd.Flags().BoolVar(&deleteUntagged, "delete-untagged", false, "also delete manifests that no tag reaches (and untagged referrers)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	cmd.Flags().DurationVar(&roWait, "read-only-wait", 0, "put the serving registries in read-only mode and wait this long before sweeping (0: they must be stopped)")
	cmd.Flags().DurationVar(&grace, "grace", maintenance.DefaultGCGrace, "keep blobs and manifests pushed or mounted less than this long ago, with what those manifests reference (0: sweep them too)")
	cmd.Flags().DurationVar(&roLease, "read-only-lease", maintenance.DefaultReadOnlyLease, "read-only mode lease, renewed every quarter of it while gc runs; it ends this long after a gc that died")
	return cmd
}

func newRegistryReindexCmd() *cobra.Command {
	var (
		sf     storeFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "reindex",
		Short: "Rebuild the chunk index and the referrers from the stored manifests",
		Long: `Reindex records every manifest of every repository in the storage again, as
a push of it does: its referrer entry if it has a subject (what the
referrers API lists, e.g. working-set profiles), and for a cryo file
manifest its chunks in the chunk index: v1 entries, each only after
reading its blob and finding that it holds the chunk, and v2 frame lists
and anchors, hints checked when a composition uses them. What is recorded
already stays.

Run it when the index is lost or incomplete: the redis holding the anchors
(--chunk-index-anchors redis) was flushed or replaced, the index's prefix in
the storage (/cryo/v1) was deleted, or the storage was filled by other means
than pushes to a cryo registry. Without an index nothing is wrong, only
pushes dedup less. It reads every v1 chunk blob once, and records one
manifest at a time. Registries may serve meanwhile (it writes only what
their pushes would), but not gc: it refuses to start in read-only mode.
Run it with the same --chunk-index-anchors as the registries.

The latest v2 snapshot of each repository (the default --base of pushes)
is not rebuilt: pushes fall back to the repository's newest tags.`,
		Example: `  cryo registry reindex --root /var/lib/cryo-registry
  cryo registry reindex --config /etc/cryo/registry.yaml --chunk-index-anchors redis`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			srv, err := sf.open(cmd.Context())
			if err != nil {
				return err
			}
			defer srv.Close()
			res, err := srv.Reindex(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				if err := writeJSON(cmd.OutOrStdout(), res); err != nil {
					return err
				}
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "reindex: %d manifests of %d repositories recorded\n", res.Manifests-res.Failed, res.Repositories)
			}
			if res.Failed > 0 {
				return fmt.Errorf("%d of %d manifests could not be recorded (see the log); run reindex again once the storage answers", res.Failed, res.Manifests)
			}
			return nil
		},
	}
	sf.register(cmd, false)
	sf.registerAnchors(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func newRegistryStatsCmd() *cobra.Command {
	var (
		sf     storeFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "stats",
		Short: "Show what the registry stores and how much dedup saves",
		Long: `Stats walks the registry's storage (the same figures the running registry
exports as cryo_registry_* metrics) and prints the blobs and bytes stored, the
snapshots and their logical size, and the dedup ratio: logical bytes of all
snapshots per byte of stored chunk blobs.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			srv, err := sf.open(cmd.Context())
			if err != nil {
				return err
			}
			defer srv.Close()
			st, err := srv.Stats(cmd.Context())
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(cmd.OutOrStdout(), map[string]any{"stats": st, "dedupRatio": st.DedupRatio()})
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "repositories  %d\n", st.Repositories)
			fmt.Fprintf(w, "blobs         %d, %s\n", st.Blobs, humanBytes(st.BlobBytes))
			fmt.Fprintf(w, "snapshots     %d, %s logical\n", st.Snapshots, humanBytes(st.LogicalBytes))
			fmt.Fprintf(w, "chunk blobs   %d, %s\n", st.ChunkBlobs, humanBytes(st.ChunkBlobBytes))
			fmt.Fprintf(w, "dedup ratio   %.2fx (logical / stored chunk bytes)\n", st.DedupRatio())
			return nil
		},
	}
	sf.register(cmd, false)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the result as JSON")
	return cmd
}

func newRegistryReadOnlyCmd() *cobra.Command {
	var (
		sf    storeFlags
		leave bool
	)
	cmd := &cobra.Command{
		Use:   "read-only",
		Short: "Show (or end) the read-only mode of the registries on a storage",
		Long: `Read-only shows whether the registries serving a storage are in read-only
mode for maintenance (the marker gc --read-only-wait writes: who holds it,
why, until when unless renewed). --leave removes the marker, for an
operator whose maintenance job is known to be dead and who will not wait
for its lease to run out.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			srv, err := sf.open(cmd.Context())
			if err != nil {
				return err
			}
			defer srv.Close()
			w := cmd.OutOrStdout()
			if leave {
				if err := srv.Maintenance().LeaveReadOnly(cmd.Context()); err != nil {
					return err
				}
				fmt.Fprintln(w, "read-only marker removed: the registries accept pushes from their next poll (5s)")
				return nil
			}
			m, err := srv.Maintenance().ReadOnly(cmd.Context())
			if err != nil {
				return err
			}
			switch {
			case m == nil:
				fmt.Fprintln(w, "read-write: no read-only marker")
			case !m.Active(time.Now()):
				fmt.Fprintf(w, "read-write: an expired marker of %s (%s) lapsed at %s\n", m.Holder, m.Reason, m.Expires.Format(time.RFC3339))
			default:
				fmt.Fprintf(w, "read-only since %s: %s, held by %s, until %s unless renewed\n", m.Since.Format(time.RFC3339), m.Reason, m.Holder, m.Expires.Format(time.RFC3339))
			}
			return nil
		},
	}
	sf.register(cmd, false)
	cmd.Flags().BoolVar(&leave, "leave", false, "remove the read-only marker, whoever holds it")
	return cmd
}
