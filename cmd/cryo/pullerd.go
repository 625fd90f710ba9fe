package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/daemon"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
)

func newPullerCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "puller",
		Short: "Run the node puller daemon",
	}
	cmd.AddCommand(newPullerServeCmd())
	return cmd
}

func newPullerServeCmd() *cobra.Command {
	var (
		pf                pullerFlags
		socket, mountsDir string
		metricsAddr       string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the node puller API on a unix socket",
		Long: `Serve runs the node puller (one per node, as a Kubernetes DaemonSet runs it).
Clients ask it over a local HTTP API on --socket to mount snapshots; each
mount is an image dir under --mounts for runsc restore --image-path, served
lazily from the node cache and the registry (mirrors first):

  POST   /v1/mounts            {"ref": "host/repo:tag"}  -> {"id", "dir", ...}
  GET    /v1/mounts            list with progress (bytes local/total,
                               demand fetches, time to ready and to loaded)
  GET    /v1/mounts/{id}
  POST   /v1/mounts/{id}/wait  returns once every chunk is local
  DELETE /v1/mounts/{id}       unmount
  GET    /metrics              Prometheus metrics (also on --metrics-addr,
                               which serves only /metrics and /healthz)

Logs are structured (JSON) on stderr.`,
		Example: `  cryo puller serve --socket /run/cryo/puller.sock --cache /var/lib/cryo --mirror mirror.eu:5000
  curl --unix-socket /run/cryo/puller.sock -d '{"ref":"registry:5000/app:v1"}' http://puller/v1/mounts`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
			reg := prometheus.NewRegistry()
			reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
			p, err := puller.New(puller.Options{CacheDir: pf.cacheDir, CacheCap: pf.cacheSize, Workers: pf.workers, Deadline: pf.deadline,
				NoFUSE: pf.noFUSE, Logger: log, FetchMetrics: fetch.NewMetrics(reg)})
			if err != nil {
				return err
			}
			if !pf.noFUSE && !puller.FUSEAvailable() {
				log.Warn("no /dev/fuse: mounts will pull whole snapshots before they are ready")
			}
			if mountsDir == "" {
				mountsDir = filepath.Join(pf.cacheDir, "mounts")
			}
			resolve := func(ctx context.Context, ref string) (puller.Source, error) {
				return pf.source(ctx, ref)
			}
			if n, err := puller.CleanStaleMounts(mountsDir); err != nil {
				log.Warn("stale mounts of a previous puller", "dir", mountsDir, "detached", n, "err", err)
			} else if n > 0 {
				log.Info("detached stale mounts of a previous puller", "dir", mountsDir, "count", n)
			}
			d := daemon.New(p, resolve, mountsDir, log, reg, reg)
			defer d.Close()
			if err := os.MkdirAll(filepath.Dir(socket), 0o755); err != nil {
				return err
			}
			os.Remove(socket)
			ln, err := net.Listen("unix", socket)
			if err != nil {
				return fmt.Errorf("listen on %s: %w", socket, err)
			}
			defer os.Remove(socket)
			srv := &http.Server{Handler: d.Handler(), ReadHeaderTimeout: 10 * time.Second}
			errc := make(chan error, 2)
			go func() { errc <- srv.Serve(ln) }()
			var msrv *http.Server
			if metricsAddr != "" {
				mln, err := net.Listen("tcp", metricsAddr)
				if err != nil {
					return fmt.Errorf("listen for metrics: %w", err)
				}
				msrv = &http.Server{Handler: d.MetricsHandler(), ReadHeaderTimeout: 10 * time.Second}
				go func() { errc <- msrv.Serve(mln) }()
			}
			log.Info("puller serving", "socket", socket, "cache", pf.cacheDir, "mounts", mountsDir, "mirrors", pf.mirrors, "metrics", metricsAddr)
			fmt.Fprintf(cmd.OutOrStdout(), "cryo puller listening on %s\n", socket)
			select {
			case err := <-errc:
				if !errors.Is(err, http.ErrServerClosed) {
					return err
				}
			case <-ctx.Done():
			}
			shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if msrv != nil {
				msrv.Shutdown(shutdown)
			}
			return srv.Shutdown(shutdown)
		},
	}
	pf.register(cmd)
	cmd.Flags().StringVar(&socket, "socket", "/run/cryo/puller.sock", "unix socket of the API")
	cmd.Flags().StringVar(&mountsDir, "mounts", "", "where mounts are made (default <cache>/mounts); must be visible to runsc")
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "", "serve /metrics and /healthz (not the mount API, which stays on --socket) on this TCP address, e.g. :9102")
	return cmd
}
