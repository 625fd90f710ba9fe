package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/peer"
	"github.com/cryo-oci/cryo/transfer"
)

// openStandalone serves the snapshot from a puller in the gofer's own
// process, for nodes without a cryo daemon: it resolves the config's
// reference's repository at the config's index digest (its tag may have
// moved since) with the node's credentials (Docker's credential store, as
// `cryo pull` does; a config never carries any), and fetches into a
// private node cache of its own under cfg.CacheDir, removed when the gofer
// exits. A private cache, because a node cache serves one process: run
// the puller daemon to share one between sandboxes.
func openStandalone(ctx context.Context, cfg gofer.Config, log *slog.Logger) (gofer.Source, func(), error) {
	parent := cfg.CacheDir
	if parent == "" {
		parent = os.TempDir()
	}
	if err := os.MkdirAll(parent, 0o700); err != nil {
		return nil, nil, fmt.Errorf("gofer cache: %w", err)
	}
	dir, err := os.MkdirTemp(parent, "cryo-gofer-")
	if err != nil {
		return nil, nil, fmt.Errorf("gofer cache: %w", err)
	}
	fail := func(err error) (gofer.Source, func(), error) {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	// By digest: the config names the snapshot; its tag may have moved
	// on since (a new pause pushed).
	ref, err := transfer.ParseReference(cfg.Reference)
	if err != nil {
		return fail(err)
	}
	ref.Reference = cfg.Index.String()
	src, err := puller.Resolve(ctx, ref.String(), puller.ResolveOptions{})
	if err != nil {
		return fail(err) // it names the reference
	}
	if src.Index.Digest != cfg.Index {
		return fail(fmt.Errorf("%s resolved to snapshot %s, the gofer's config names %s: refusing to serve another snapshot", ref, src.Index.Digest, cfg.Index))
	}
	// The gofer runs in the sandbox's cgroup: hold little in memory.
	opts := puller.Options{CacheDir: filepath.Join(dir, "cache"), Logger: log, SmallFilesCap: 16 << 20, WriteBuffer: 16 << 20}
	var pool *peer.Pool
	if len(cfg.Peers) > 0 {
		if pool, err = openPeers(ctx, cfg, log); err != nil {
			return fail(err)
		}
		opts.Peers = pool
	}
	closePool := func() {
		if pool != nil {
			pool.Close()
		}
	}
	p, err := puller.New(opts)
	if err != nil {
		closePool()
		return fail(err)
	}
	// A private cache is removed at exit: nothing to materialize for.
	m, err := p.MountFiles(ctx, src, filepath.Join(dir, "mount"), puller.FilesOptions{MaterializeAfter: make(chan struct{}), AwaitSandbox: puller.AwaitRestore})
	if err != nil {
		p.Close()
		closePool()
		return fail(err)
	}
	log.Info("standalone", "cache", dir, "peers", len(cfg.Peers))
	return gofer.Local(m), func() {
		m.Unmount()
		p.Close()
		closePool()
		os.RemoveAll(dir)
	}, nil
}

// openPeers opens the pool of node pullers the config names: this gofer
// asks them for chunks and serves them none (it is no member of the pool,
// so it owns no chunk: every one is asked of its owner first).
func openPeers(ctx context.Context, cfg gofer.Config, log *slog.Logger) (*peer.Pool, error) {
	token, err := peer.ReadToken(cfg.PeerTokenFile)
	if err != nil {
		return nil, fmt.Errorf("%s: peerTokenFile: %w", gofer.ConfigFile, err)
	}
	opts := peer.PoolOptions{Peers: cfg.Peers, Token: token, Logger: log}
	if cfg.PeerCA != "" {
		if opts.TLS, err = peer.ClientTLS(cfg.PeerCA, cfg.PeerServerName); err != nil {
			return nil, fmt.Errorf("%s: peerCA: %w", gofer.ConfigFile, err)
		}
	}
	pool, err := peer.NewPool(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("%s: peers: %w", gofer.ConfigFile, err)
	}
	return pool, nil
}
