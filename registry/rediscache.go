package registry

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"

	"github.com/distribution/distribution/v3"
	rediscache "github.com/distribution/distribution/v3/registry/storage/cache/redis"
	"github.com/opencontainers/go-digest"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"
)

// Distribution's garbage collection deletes blobs from storage but not from
// the redis blob descriptor cache that serving replicas share. A replica
// then answers HEAD for a deleted blob with 200, a client skips uploading
// it, the registry accepts a manifest that references it, and every pull of
// that manifest fails. GC therefore clears the cache entries of every blob
// it deleted, through distribution's own cache API.

// usesRedisCache reports whether the configuration caches blob descriptors
// in redis.
func (s *Server) usesRedisCache() bool {
	c, ok := s.cfg.Storage["cache"]
	return ok && c["blobdescriptor"] == "redis" && len(s.cfg.Redis.Options.Addrs) > 0
}

// redisClient connects to the configured redis as distribution's app does
// (addresses, credentials, sentinel, TLS roots and client certificate).
func (s *Server) redisClient() (redis.UniversalClient, error) {
	o := s.cfg.Redis.Options
	opts := &redis.UniversalOptions{
		Addrs: o.Addrs, ClientName: o.ClientName, DB: o.DB, Protocol: o.Protocol,
		Username: o.Username, Password: o.Password,
		SentinelUsername: o.SentinelUsername, SentinelPassword: o.SentinelPassword, MasterName: o.MasterName,
		DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout, WriteTimeout: o.WriteTimeout,
		DisableIdentity: o.DisableIdentity,
	}
	t := s.cfg.Redis.TLS
	if t.Certificate != "" || len(t.RootCAs) > 0 {
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if t.Certificate != "" && t.Key != "" {
			cert, err := tls.LoadX509KeyPair(t.Certificate, t.Key)
			if err != nil {
				return nil, fmt.Errorf("redis client certificate: %w", err)
			}
			tc.Certificates = []tls.Certificate{cert}
		}
		if len(t.RootCAs) > 0 {
			pool := x509.NewCertPool()
			for _, ca := range t.RootCAs {
				pem, err := os.ReadFile(ca)
				if err != nil {
					return nil, fmt.Errorf("redis CA: %w", err)
				}
				pool.AppendCertsFromPEM(pem)
			}
			tc.RootCAs = pool
		}
		opts.TLSConfig = tc
	}
	return redis.NewUniversalClient(opts), nil
}

// blobSet enumerates every blob digest in the storage.
func (s *Server) blobSet(ctx context.Context) (map[digest.Digest]bool, error) {
	set := map[digest.Digest]bool{}
	err := s.ns.Blobs().Enumerate(ctx, func(d digest.Digest) error {
		set[d] = true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("enumerate blobs: %w", err)
	}
	return set, nil
}

// clearCachedDescriptors drops the deleted blobs from the redis cache,
// globally and in every repository's scope. It returns how many cache
// entries it removed.
func (s *Server) clearCachedDescriptors(ctx context.Context, deleted []digest.Digest) (int, error) {
	if len(deleted) == 0 {
		return 0, nil
	}
	client, err := s.redisClient()
	if err != nil {
		return 0, err
	}
	defer client.Close()
	provider := rediscache.NewRedisBlobDescriptorCacheProvider(client)
	var repos []string
	if en, ok := s.ns.(distribution.RepositoryEnumerator); ok {
		if err := en.Enumerate(ctx, func(repo string) error { repos = append(repos, repo); return nil }); err != nil {
			return 0, fmt.Errorf("enumerate repositories: %w", err)
		}
	}
	scoped := make([]distribution.BlobDescriptorService, 0, len(repos))
	for _, repo := range repos {
		bds, err := provider.RepositoryScoped(repo)
		if err != nil {
			return 0, fmt.Errorf("redis cache of %s: %w", repo, err)
		}
		scoped = append(scoped, bds)
	}
	counts := make([]int, len(deleted))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(16)
	for i, d := range deleted {
		g.Go(func() error {
			for _, bds := range scoped {
				switch err := bds.Clear(gctx, d); {
				case err == nil:
					counts[i]++
				case errors.Is(err, distribution.ErrBlobUnknown):
				default:
					return fmt.Errorf("clear cached descriptor of %s: %w", d, err)
				}
			}
			if err := provider.Clear(gctx, d); err != nil && !errors.Is(err, distribution.ErrBlobUnknown) {
				return fmt.Errorf("clear cached descriptor of %s: %w", d, err)
			}
			counts[i]++
			return nil
		})
	}
	err = g.Wait()
	n := 0
	for _, c := range counts {
		n += c
	}
	return n, err
}
