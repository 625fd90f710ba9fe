package chunkindex

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/opencontainers/go-digest"
	"github.com/redis/go-redis/v9"
)

// anchor is a pack an anchor chunk's record names as holding a frame of
// it, and the repositories recorded as linking the pack (nil when the
// store records none: the pack's list then says).
type anchor struct {
	pack  digest.Digest
	repos []string
}

// anchorStore keeps the anchors of format v2 tables (SPEC.md 12.2.1).
// Anchors are hints: a composition reads the pack's list and checks every
// frame it copies, so a store may lose or confuse them at the cost of
// dedup only.
type anchorStore interface {
	// add records that anchor chunk c has a frame in pack c.Blob,
	// linked in repo.
	add(ctx context.Context, repo string, c format.Chunk) error
	// each calls fn with the anchors of chunk d, at most limit of them,
	// until fn answers false or an error.
	each(ctx context.Context, d digest.Digest, limit int, fn func(anchor) (bool, error)) error
}

// driverAnchors keeps each anchor as an entry of the index in the storage
// driver, beside v1 entries: /cryo/v1/chunks/sha256/<hh>/<chunk>/<pack>
// with "frame": true and the repositories that link the pack. gc prunes
// them with the v1 entries (Index.Prune).
type driverAnchors struct{ ci *Index }

func (a driverAnchors) add(ctx context.Context, repo string, c format.Chunk) error {
	ci := a.ci
	p := EntryPath(c.Digest, c.Blob)
	e := indexEntry{Frame: true, ChunkBlob: api.ChunkBlob{
		Encoding: string(c.Encoding), MediaType: format.MediaTypePack, Digest: c.Blob, Size: c.PackSize, ChunkSize: c.Size}}
	data, err := ci.driver.GetContent(ctx, p)
	if err != nil && !extstore.IsNotFound(err) {
		return fmt.Errorf("read anchor %s: %w", p, err)
	}
	if err == nil {
		var old indexEntry
		if json.Unmarshal(data, &old) == nil {
			if old.Verified {
				// A verified v1 entry at this path is a raw chunk blob
				// that is also a pack of one frame; compositions take
				// frames of packs only.
				return nil
			}
			if old.Frame {
				// An anchor says which repositories link its pack (the
				// pack's list locates the frame): no table can take the
				// other repositories out.
				e = old
			}
		}
	}
	repos, changed := withRepository(e.Repositories, repo)
	if !changed {
		return nil
	}
	e.Repositories = repos
	return ci.put(ctx, p, e)
}

func (a driverAnchors) each(ctx context.Context, d digest.Digest, limit int, fn func(anchor) (bool, error)) error {
	entries, err := a.ci.driver.List(ctx, chunkDir(d))
	if extstore.IsNotFound(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, p := range entries[:min(len(entries), limit)] {
		data, err := a.ci.driver.GetContent(ctx, p)
		if err != nil {
			continue
		}
		var e indexEntry
		if json.Unmarshal(data, &e) != nil || !e.Frame || e.Digest.Validate() != nil {
			continue
		}
		if more, err := fn(anchor{pack: e.Digest, repos: e.Repositories}); !more || err != nil {
			return err
		}
	}
	return nil
}

// redisAnchors keeps the anchors in redis, which replicas share: one hash
// per anchor chunk, keyed by the first 8 bytes of its digest (two chunks
// that share them share a hash: a composition then reads a list that does
// not hold the chunk it wants, and finds nothing there), with a field per
// pack (its digest's hex) whose value is the repositories recorded as
// linking it, one per line. As with entries in the storage driver, the
// repositories let a composition pass over packs the caller may not see
// without reading their lists, and nothing a push records pushes out what
// another recorded. A lookup is one HSCAN round trip (more for a hash of
// over 256 packs), where the storage driver costs a List and a GET per
// entry: on an object store, 20-50 ms each (docs/scale.md).
type redisAnchors struct {
	client redis.UniversalClient
}

// RedisAnchorPrefix starts the keys of the anchors kept in redis.
const RedisAnchorPrefix = "cryo:anchor:"

func redisAnchorKey(d digest.Digest) string { return RedisAnchorPrefix + d.Encoded()[:16] }

// add merges repo into the pack's field. Two pushes merging one field at
// once may lose one's repository, as with entries in the storage driver:
// the next push naming the pack records it again.
func (a redisAnchors) add(ctx context.Context, repo string, c format.Chunk) error {
	key, field := redisAnchorKey(c.Digest), c.Blob.Encoded()
	old, err := a.client.HGet(ctx, key, field).Result()
	if err != nil && err != redis.Nil {
		return fmt.Errorf("read anchor %s in redis: %w", c.Digest, err)
	}
	repos, changed := withRepository(splitRepos(old), repo)
	if !changed {
		return nil
	}
	if err := a.client.HSet(ctx, key, field, strings.Join(repos, "\n")).Err(); err != nil {
		return fmt.Errorf("record anchor %s in redis: %w", c.Digest, err)
	}
	return nil
}

func splitRepos(v string) []string {
	if v == "" {
		return nil
	}
	return strings.Split(v, "\n")
}

func (a redisAnchors) each(ctx context.Context, d digest.Digest, limit int, fn func(anchor) (bool, error)) error {
	key := redisAnchorKey(d)
	read := 0
	// HSCAN may answer a field twice (while redis rehashes the hash).
	given := map[string]bool{}
	var cursor uint64
	for {
		kv, next, err := a.client.HScan(ctx, key, cursor, "", int64(limit)).Result()
		if err != nil {
			return fmt.Errorf("anchors of %s in redis: %w", d, err)
		}
		for i := 0; i+1 < len(kv); i += 2 {
			if read == limit {
				return nil
			}
			if given[kv[i]] {
				continue
			}
			given[kv[i]] = true
			read++
			pack := digest.NewDigestFromEncoded(digest.SHA256, kv[i])
			if pack.Validate() != nil {
				continue
			}
			if more, err := fn(anchor{pack: pack, repos: splitRepos(kv[i+1])}); !more || err != nil {
				return err
			}
		}
		if cursor = next; cursor == 0 {
			return nil
		}
	}
}

// prune drops from every anchor's hash the repositories that no longer
// link the pack (keep answers which still do), the packs left with none,
// and the hashes left empty (redis deletes them); it returns how many
// packs it dropped. On a redis cluster it walks every master.
func (a redisAnchors) prune(ctx context.Context, keep func(pack digest.Digest, repos []string) ([]string, error)) (int, error) {
	var dropped atomic.Int64
	walk := func(ctx context.Context, c redis.UniversalClient) error {
		iter := c.Scan(ctx, 0, RedisAnchorPrefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			key := iter.Val()
			fields, err := c.HGetAll(ctx, key).Result()
			if err != nil {
				return err
			}
			for hex, v := range fields {
				pack := digest.NewDigestFromEncoded(digest.SHA256, hex)
				repos := splitRepos(v)
				var kept []string
				if pack.Validate() == nil {
					if kept, err = keep(pack, repos); err != nil {
						return err
					}
				}
				switch {
				case len(kept) == 0:
					n, err := c.HDel(ctx, key, hex).Result()
					if err != nil {
						return err
					}
					dropped.Add(n)
				case len(kept) != len(repos):
					if err := c.HSet(ctx, key, hex, strings.Join(kept, "\n")).Err(); err != nil {
						return err
					}
				}
			}
		}
		return iter.Err()
	}
	var err error
	if cc, ok := a.client.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return walk(ctx, c) })
	} else {
		err = walk(ctx, a.client)
	}
	if err != nil {
		return int(dropped.Load()), fmt.Errorf("prune anchors in redis: %w", err)
	}
	return int(dropped.Load()), nil
}
