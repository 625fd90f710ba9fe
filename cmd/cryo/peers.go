package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/cryo-oci/cryo/puller/peer"
	"github.com/spf13/cobra"
)

// peerFlags say which pool of node pullers to share chunks with.
type peerFlags struct {
	peers      []string
	tokenFile  string
	ca         string
	serverName string
	// opened is the pool pool made, closed by close.
	opened *peer.Pool
}

// close closes the pool pool made, if any.
func (f *peerFlags) close() {
	if f.opened != nil {
		f.opened.Close()
		f.opened = nil
	}
}

func (f *peerFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringSliceVar(&f.peers, "peers", nil, "node pullers of this node's pool to ask for chunks before mirrors and the registry: host:port, or dns:NAME:PORT for every address NAME resolves to (re-resolved every 30s; a headless Service). Every member of a pool may read what any member may")
	fl.StringVar(&f.tokenFile, "peer-token-file", "", "file holding the pool's shared token (at least 16 bytes), sent to peers and required of them; pools of different tenants need different tokens")
	fl.StringVar(&f.ca, "peer-ca", "", "PEM CA bundle that peers' TLS certificates are checked against: peers are reached over https (their --peer-tls-cert)")
	fl.StringVar(&f.serverName, "peer-tls-server-name", "", "name peers' TLS certificates must carry (default: the host of each peer's address)")
}

// token reads the pool token from --peer-token-file.
func (f *peerFlags) token() (string, error) {
	if f.tokenFile == "" {
		return "", errors.New("--peer-token-file is required with --peers or --peer-listen: peers serve snapshot memory only to callers with the pool token")
	}
	t, err := peer.ReadToken(f.tokenFile)
	if err != nil {
		return "", fmt.Errorf("--peer-token-file: %w", err)
	}
	return t, nil
}

// pool returns the pool of --peers (nil without it); self is the address
// this node's peer server listens on ("" if none).
func (f *peerFlags) pool(ctx context.Context, self string, log *slog.Logger, m *peer.Metrics) (*peer.Pool, error) {
	if len(f.peers) == 0 {
		if f.ca != "" || f.serverName != "" {
			return nil, errors.New("--peer-ca and --peer-tls-server-name need --peers")
		}
		return nil, nil
	}
	token, err := f.token()
	if err != nil {
		return nil, err
	}
	opts := peer.PoolOptions{Peers: f.peers, Self: self, Token: token, Logger: log, Metrics: m}
	if f.ca != "" {
		if opts.TLS, err = peer.ClientTLS(f.ca, f.serverName); err != nil {
			return nil, fmt.Errorf("--peer-ca: %w", err)
		}
	} else if f.serverName != "" {
		return nil, errors.New("--peer-tls-server-name needs --peer-ca")
	}
	pool, err := peer.NewPool(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("--peers: %w", err)
	}
	f.opened = pool
	return pool, nil
}
