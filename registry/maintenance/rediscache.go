package maintenance

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path"
	"strings"
	"sync/atomic"
	"time"

	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3/configuration"
	"github.com/redis/go-redis/v9"
)

// Distribution's garbage collection deletes blobs from storage but not from
// the redis blob descriptor cache that serving replicas share. A replica
// then answers HEAD for a deleted blob with 200, a client skips uploading
// it, the registry accepts a manifest that references it, and every pull of
// that manifest fails. So GC flushes distribution's blob descriptor keys
// from redis after every sweep (a cache: replicas refill it as they go).
//
// Crash safety: before sweeping, GC writes a flag of its own into the shared
// storage, and deletes it only after a successful flush. Every replica
// refuses writes while any flag exists (it looks on every poll, whatever
// the read-only marker says), and a replica that finds flags while no
// maintainer holds read-only mode (the maintainer died, or could not reach
// redis) flushes the cache itself, then deletes the flags it saw before
// flushing.

// cacheFlushDir holds one flag per owed blob descriptor cache flush, named
// after the maintainer that owes it.
const cacheFlushDir = "/cryo/v1/maintenance/flush-blob-descriptor-cache"

// owedFlushTimeout bounds one flush of the cache (SCAN walks every key).
const owedFlushTimeout = 10 * time.Minute

// Key patterns of distribution v3's redis blob descriptor cache
// (registry/storage/cache/redis): global descriptors, and per repository a
// set of digests plus a descriptor hash per digest.
var blobDescriptorKeyPatterns = []string{"blobs::*", "repository::*::blobs*"}

// UsesRedisCache reports whether cfg caches blob descriptors in redis.
func UsesRedisCache(cfg *configuration.Configuration) bool {
	c, ok := cfg.Storage["cache"]
	return ok && c["blobdescriptor"] == "redis" && len(cfg.Redis.Options.Addrs) > 0
}

// redisClient connects to the configured redis.
func (m *Maintainer) redisClient() (redis.UniversalClient, error) { return RedisClient(m.redis) }

// RedisClient connects to the redis of a distribution configuration as
// distribution's app does (addresses, credentials, sentinel, TLS roots
// and client certificate).
func RedisClient(r *configuration.Redis) (redis.UniversalClient, error) {
	o := r.Options
	opts := &redis.UniversalOptions{
		Addrs: o.Addrs, ClientName: o.ClientName, DB: o.DB, Protocol: o.Protocol,
		Username: o.Username, Password: o.Password,
		SentinelUsername: o.SentinelUsername, SentinelPassword: o.SentinelPassword, MasterName: o.MasterName,
		DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout, WriteTimeout: o.WriteTimeout,
		DisableIdentity: o.DisableIdentity,
	}
	t := r.TLS
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

// FlushBlobDescriptorCache deletes every key of distribution's blob
// descriptor cache (on every master of a redis cluster) and returns how
// many it deleted. Other keys in the database are left alone.
func (m *Maintainer) FlushBlobDescriptorCache(ctx context.Context) (int, error) {
	client, err := m.redisClient()
	if err != nil {
		return 0, err
	}
	defer client.Close()
	var deleted atomic.Int64
	unlink := func(ctx context.Context, c redis.UniversalClient, keys []string) error {
		if len(keys) == 0 {
			return nil
		}
		n, err := c.Unlink(ctx, keys...).Result()
		deleted.Add(n)
		return err
	}
	flush := func(ctx context.Context, c redis.UniversalClient) error {
		for _, pattern := range blobDescriptorKeyPatterns {
			iter := c.Scan(ctx, 0, pattern, 1000).Iterator()
			var batch []string
			for iter.Next(ctx) {
				if batch = append(batch, iter.Val()); len(batch) == 1000 {
					if err := unlink(ctx, c, batch); err != nil {
						return err
					}
					batch = batch[:0]
				}
			}
			if err := iter.Err(); err != nil {
				return err
			}
			if err := unlink(ctx, c, batch); err != nil {
				return err
			}
		}
		return nil
	}
	if cluster, ok := client.(*redis.ClusterClient); ok {
		err = cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return flush(ctx, c) })
	} else {
		err = flush(ctx, client)
	}
	if err != nil {
		return int(deleted.Load()), fmt.Errorf("flush redis blob descriptor cache: %w", err)
	}
	return int(deleted.Load()), nil
}

// oweCacheFlush records, before a sweep, that the cache must be flushed;
// the flag is named after holder.
func (m *Maintainer) oweCacheFlush(ctx context.Context, holder string) (string, error) {
	flag := path.Join(cacheFlushDir, flagName(holder))
	if err := m.driver.PutContent(ctx, flag, []byte(time.Now().UTC().Format(time.RFC3339)+" "+holder+"\n")); err != nil {
		return "", fmt.Errorf("record owed cache flush: %w", err)
	}
	return flag, nil
}

// flagName makes a storage-safe file name of a holder string.
func flagName(holder string) string {
	return strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' {
			return r
		}
		return '_'
	}, holder)
}

// owedFlushes lists the flags of owed flushes.
func (m *Maintainer) owedFlushes(ctx context.Context) ([]string, error) {
	flags, err := m.driver.List(ctx, cacheFlushDir)
	if extstore.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list owed cache flushes: %w", err)
	}
	return flags, nil
}

// flushAndSettle flushes the cache and then deletes the given flags (owed
// flushes whose sweeps are over: this flush settles them).
func (m *Maintainer) flushAndSettle(ctx context.Context, flags []string) (int, error) {
	n, err := m.FlushBlobDescriptorCache(ctx)
	if err != nil {
		return n, err
	}
	var errs []error
	for _, f := range flags {
		if err := m.driver.Delete(ctx, f); err != nil {
			if !extstore.IsNotFound(err) {
				errs = append(errs, fmt.Errorf("clear owed cache flush %s: %w", f, err))
			}
		}
	}
	return n, errors.Join(errs...)
}

// checkOwedFlushes is a serving replica's part, on every poll: writes are
// refused while any flush is owed (or the flags cannot be read), and, when
// no maintainer holds read-only mode, the replica settles the owed flushes
// itself, in the background.
func (m *Maintainer) checkOwedFlushes(ctx context.Context, maintainerActive bool) {
	if m.redis == nil {
		return
	}
	flags, err := m.owedFlushes(ctx)
	if err != nil {
		m.flushPending.Store(true)
		m.log.Warn("cannot read owed cache flushes; refusing writes", "err", err)
		return
	}
	m.flushPending.Store(len(flags) > 0)
	if len(flags) == 0 || maintainerActive || !m.flushing.CompareAndSwap(false, true) {
		return
	}
	go func() {
		defer m.flushing.Store(false)
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), owedFlushTimeout)
		defer cancel()
		n, err := m.flushAndSettle(fctx, flags)
		if err != nil {
			m.log.Error("owed blob descriptor cache flush failed; refusing writes until it succeeds", "err", err)
			return
		}
		m.log.Info("flushed the blob descriptor cache a garbage collection left owed", "keys", n, "flags", len(flags))
		m.checkOwedFlushes(fctx, true)
	}()
}
