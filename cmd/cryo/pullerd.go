package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/checkpoint"
	"github.com/cryo-oci/cryo/puller/daemon"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/peer"
	"github.com/cryo-oci/cryo/transfer"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"
	"golang.org/x/net/netutil"
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
		installGofer      string
		metricsAddr       string
		socketGroup       string
		checkpointRepos   []string
		maxMounts         int
		peerListen        string
		peerCert, peerKey string
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "Serve the node puller API on a unix socket",
		Long: `Serve runs the node puller (one per node, as a Kubernetes DaemonSet runs it).
Clients ask it over a local HTTP API on --socket to mount snapshots; each
mount is an image dir under --mounts for runsc restore --image-path, served
lazily from the node cache and the registry (mirrors first):

  POST   /v1/mounts            {"ref": "host/repo:tag"}  -> {"id", "dir", ...}
                               (503 at --max-mounts live mounts)
                               {"ref": ..., "backend": "gofer"}: "dir" holds
                               only gcs_opts.json; runsc restore reads the
                               snapshot through cryo's checkpoint gofer (run
                               runsc with GVISOR_SIDECAR_BINARIES_DIR set to
                               the --install-gofer dir): no FUSE
  GET    /v1/mounts            list with progress (bytes local/total,
                               demand fetches, time to ready and to loaded)
  GET    /v1/mounts/{id}
  POST   /v1/mounts/{id}/wait  returns once every chunk is local
  DELETE /v1/mounts/{id}       unmount
  GET    /v1/mounts/{id}/files/{path}  the gofer's reads (SPEC.md 14.2)
  POST   /v1/checkpoints       {"ref": "host/repo:tag", "filesystem": true}
                               -> {"id", "dir", "state", ...}: a checkpoint
                               the sandbox's workload triggers through
                               /proc/gvisor. Create the sandbox with the
                               annotation dev.gvisor.internal.fscheckpoint.path
                               (or, without "filesystem",
                               dev.gvisor.internal.checkpoint.path, with
                               .compression=none) set to "dir", and
                               GVISOR_SIDECAR_BINARIES_DIR as for gofer
                               mounts: the files stream to the registry and
                               are tagged once all are in (SPEC.md 14.4)
  GET    /v1/checkpoints[/{id}] state: waiting, writing, finishing, pushed
                               or failed; POST .../wait returns once pushed
                               or failed; DELETE ends one (no tag if not
                               pushed yet; 409 while its tag is pushed).
                               A session no file came to yet survives a
                               restart on the same --socket and --mounts
  GET    /metrics              Prometheus metrics (also on --metrics-addr,
                               which serves only /metrics and /healthz)

The socket is 0600 (root's): whoever can connect can mount and read any
snapshot the puller's credentials reach. --socket-group opens it (0660) to
one group; whoever can connect can also have the puller push a checkpoint
with its credentials, to any repository they reach unless --checkpoint-repo
names the ones allowed (host/name, or host/prefix/ for all under it;
others get 403). The node cache and --mounts are made 0700. Registry credentials
come from Docker's credential store only (DOCKER_CONFIG), never from flags:
a reference posted to the API may name any registry. At most --max-mounts
mounts are live at once, and as many checkpoints not yet ended; a request
over it gets 503.

Peers: the pullers of a pool (the nodes of a DaemonSet) share chunks, so
that a chunk leaves the registry about once per pool. --peers lists them
(host:port, or dns:NAME:PORT for a headless Service); each chunk (each
pack, in format v2) has an owner among the live ones, by rendezvous
hashing, which this node asks first; the owner serves it from its cache,
joins its own fetch in flight, or fetches it upstream once for everyone.
--peer-listen serves this node's share. Peers are asked before mirrors and
the registry; what they serve is verified like a registry's answer, and a
dead, slow or lying peer costs a bounded wait (an answer within 2s and a
byte every 2s when a read waits; 10s and 30s in the background), is
avoided for 30s or more (at once if it refuses connections or lies, at the
third timeout in a row), and the chunk is fetched upstream. Every request carries the pool token (--peer-token-file): a pool
is one trust domain, whose members may read, through the owner's
credentials, what any member may.

Logs are structured (JSON) on stderr.`,
		Example: `  cryo puller serve --socket /run/cryo/puller.sock --cache /var/lib/cryo --mirror mirror.eu:5000
  cryo puller serve --peer-listen :7070 --peers dns:cryo-puller-peers.cryo.svc:7070 --peer-token-file /etc/cryo/peer/token
  curl --unix-socket /run/cryo/puller.sock -d '{"ref":"registry:5000/app:v1"}' http://puller/v1/mounts`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if err := noCoreDumps(); err != nil {
				return err
			}
			gid := -1
			if socketGroup != "" {
				g, err := daemon.LookupGroup(socketGroup)
				if err != nil {
					return fmt.Errorf("--socket-group: %w", err)
				}
				gid = g
			}
			log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
			reg := prometheus.NewRegistry()
			reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
			opts, err := pf.options()
			if err != nil {
				return err
			}
			opts.Logger, opts.FetchMetrics = log, fetch.NewMetrics(reg)
			var pm *peer.Metrics
			if len(pf.peer.peers) > 0 || peerListen != "" {
				pm = peer.NewMetrics(reg)
			}
			pool, err := pf.peer.pool(ctx, peerListen, log, pm)
			if err != nil {
				return err
			}
			if pool != nil {
				defer pf.peer.close()
				opts.Peers = pool
			}
			// What this node serves its peers and lacks, it fetches from
			// the repository's mirrors and registry, with its own
			// credentials.
			opts.PeerUpstream = func(ctx context.Context, repository string) ([]fetch.Endpoint, error) {
				return puller.Endpoints(repository, puller.ResolveOptions{Mirrors: pf.mirrors, Client: pf.client})
			}
			p, err := puller.New(opts)
			if err != nil {
				return err
			}
			if pf.client, err = transfer.NewClient(pf.ro.connOptions()); err != nil {
				return err
			}
			if !pf.noFUSE && !puller.FUSEAvailable() {
				log.Warn("no /dev/fuse: mounts will pull whole snapshots before they are ready")
			}
			if mountsDir == "" {
				mountsDir = filepath.Join(pf.cacheDir, "mounts")
			}
			if n, err := puller.CleanStaleMounts(mountsDir); err != nil {
				log.Warn("stale mounts of a previous puller", "dir", mountsDir, "detached", n, "err", err)
			} else if n > 0 {
				log.Info("detached stale mounts of a previous puller", "dir", mountsDir, "count", n)
			}
			if installGofer != "" {
				if err := gofer.Install(filepath.Join(defaultGoferDir(), gofer.Binary), installGofer); err != nil {
					return err
				}
				log.Info("installed the checkpoint gofer", "dir", installGofer)
			}
			if socket, err = filepath.Abs(socket); err != nil {
				return err
			}
			// A mount request without "profile" gets --profile's choice.
			resolve := func(ctx context.Context, ref, choice string) (puller.Source, error) {
				if choice == "" {
					choice = pf.profile
				}
				return pf.sourceWith(ctx, ref, choice)
			}
			// Checkpoints the workload triggers go where their request says,
			// with the node's credentials, in the default format.
			prepare := func(ctx context.Context, req daemon.CheckpointRequest) (*checkpoint.Triggered, error) {
				repo, tag, err := pf.client.Repository(req.Ref)
				if err != nil {
					return nil, fmt.Errorf("%w: %w", daemon.ErrInvalidRequest, err)
				}
				if _, err := digest.Parse(tag); err == nil { // a tag-less ref names "latest"
					return nil, fmt.Errorf("%w: checkpoint to %q: a checkpoint needs a tag to push to", daemon.ErrInvalidRequest, req.Ref)
				}
				return checkpoint.NewTriggered(ctx, checkpoint.TriggeredOptions{Repo: repo, Tag: tag, Filesystem: req.Filesystem, Deferred: req.Adopted, Push: transfer.PushOptions{Pack: format.PackOptions{Format: format.V2}}})
			}
			d, err := daemon.New(p, resolve, daemon.Options{MountsDir: mountsDir, Socket: socket, MaxMounts: maxMounts, Logger: log, Registerer: reg, Gatherer: reg, Checkpoint: prepare, CheckpointRepos: checkpointRepos})
			if err != nil {
				return err
			}
			defer d.Close()
			ln, err := daemon.Listen(socket, gid)
			if err != nil {
				return err
			}
			defer ln.Close()
			srv := &http.Server{Handler: d.Handler(), ReadHeaderTimeout: 10 * time.Second}
			errc := make(chan error, 3)
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
			if peerListen != "" {
				nodeID := ""
				if pool != nil {
					nodeID = pool.ID()
				}
				psrv, err := servePeers(p, peerListen, peerCert, peerKey, nodeID, pf.peer, log, pm, errc)
				if err != nil {
					return err
				}
				defer psrv.Close()
			} else if peerCert != "" || peerKey != "" {
				return errors.New("--peer-tls-cert and --peer-tls-key need --peer-listen")
			}
			log.Info("puller serving", "socket", socket, "socket_group", gid, "cache", pf.cacheDir, "mounts", mountsDir, "mirrors", pf.mirrors, "max_mounts", maxMounts, "metrics", metricsAddr, "peers", pf.peer.peers, "peer_listen", peerListen)
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
	pf.register(cmd, noCredentials)
	cmd.Flags().StringVar(&socket, "socket", "/run/cryo/puller.sock", "unix socket of the API (0600)")
	cmd.Flags().StringArrayVar(&checkpointRepos, "checkpoint-repo", nil, "a repository checkpoint sessions may push to (host/name, or host/prefix/ for every one under it; repeatable); default: any the node's credentials reach")
	cmd.Flags().StringVar(&socketGroup, "socket-group", "", "group (name or id) that may use the API socket too (0660); default: root only")
	cmd.Flags().IntVar(&maxMounts, "max-mounts", daemon.DefaultMaxMounts, "live mounts at most; a mount request over it gets 503")
	cmd.Flags().StringVar(&mountsDir, "mounts", "", "where mounts are made (default <cache>/mounts); must be visible to runsc")
	cmd.Flags().StringVar(&installGofer, "install-gofer", "", "copy cryo's checkpoint gofer into this host dir at start, for runsc to use with GVISOR_SIDECAR_BINARIES_DIR=DIR (never gVisor's gvisor-bin dir)")
	cmd.Flags().StringVar(&peerListen, "peer-listen", "", "serve this node's chunks to the other pullers of its pool on this TCP address (e.g. :7070), to callers with the pool token (--peer-token-file) only; chunks it lacks it fetches upstream once, with its own credentials, for whoever asks")
	cmd.Flags().StringVar(&peerCert, "peer-tls-cert", "", "PEM certificate to serve --peer-listen over TLS with (peers then need --peer-ca)")
	cmd.Flags().StringVar(&peerKey, "peer-tls-key", "", "PEM key of --peer-tls-cert")
	cmd.Flags().StringVar(&metricsAddr, "metrics-addr", "", "serve /metrics and /healthz (not the mount API, which stays on --socket) on this TCP address, e.g. :9102")
	return cmd
}

// maxPeerConns bounds the connections of the peer server: a pool of 128
// nodes, each with its most connections to this one.
const maxPeerConns = 128 * peer.MaxConnsPerPeer

// servePeers serves p's chunks to its pool on addr (TLS if cert is set)
// until the returned server is closed; a serving error goes to errc.
func servePeers(p *puller.Puller, addr, cert, key, nodeID string, pf peerFlags, log *slog.Logger, m *peer.Metrics, errc chan<- error) (*http.Server, error) {
	token, err := pf.token()
	if err != nil {
		return nil, err
	}
	h, err := peer.NewServer(p, peer.ServerOptions{Token: token, Logger: log, Metrics: m, NodeID: nodeID})
	if err != nil {
		return nil, err
	}
	if (cert == "") != (key == "") {
		return nil, errors.New("--peer-tls-cert and --peer-tls-key go together")
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--peer-listen: %w", err)
	}
	// Connections are bounded in number and in idle time: a caller
	// without the token cannot hold them open.
	ln = netutil.LimitListener(ln, maxPeerConns)
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			ln.Close()
			return nil, fmt.Errorf("--peer-tls-cert/--peer-tls-key: %w", err)
		}
		srv.TLSConfig = &tls.Config{Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
		ln = tls.NewListener(ln, srv.TLSConfig)
	}
	go func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			errc <- fmt.Errorf("peer server: %w", err)
		}
	}()
	log.Info("serving peers", "addr", ln.Addr().String(), "tls", cert != "")
	return srv, nil
}
