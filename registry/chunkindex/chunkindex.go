// Package chunkindex maps a chunk's uncompressed sha256 to the registry
// blobs that carry it, so that a pusher can skip a chunk the registry holds
// in another encoding or repository (SPEC.md 12.2). It is kept in the
// registry's storage driver; entries are recorded only for blobs the
// registry has read and verified.
package chunkindex

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"path"
	"slices"
	"sync"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/registry/api"
	"github.com/cryo-oci/cryo/registry/distlayout"
	"github.com/cryo-oci/cryo/registry/extstore"
	"github.com/distribution/distribution/v3"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"github.com/redis/go-redis/v9"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/semaphore"
)

// Index maps a chunk's uncompressed sha256 to the blobs that carry it.
// It is filled when a cryo file manifest is pushed, from the manifest's
// chunk table, and stored in the registry's storage driver, one small entry
// per (chunk, blob): /cryo/v1/chunks/sha256/<hh>/<chunk hex>/<blob hex>.
//
// A chunk table is the pusher's word, and the index serves other users: an
// entry is written only after the registry has read the blob from its
// storage and found that it decodes to the chunk (size and sha256), and
// only entries so marked are answered (SPEC.md 12.2). A lookup checks that
// each blob still exists and is linked in the recorded repository, and
// drops entries whose blob is gone, so the index stays true after deletes
// and garbage collection.
type Index struct {
	driver extstore.Driver
	ns     distribution.Namespace
	codec  *format.Codec
	opts   Options
	// mem bounds the bytes of blobs and decoded chunks held by
	// verifications under way, across all manifest PUTs; composeMem
	// those of compositions (compose.go), so that compositions never hold
	// up indexing.
	mem        *semaphore.Weighted
	composeMem *semaphore.Weighted
	bufs       sync.Pool
	// anchors keeps the anchors of v2 tables: in the storage driver, or
	// in redis (Options.Redis).
	anchors anchorStore
}

// Root is where the index lives in the storage driver.
const Root = "/cryo/v1/chunks"

// Verification bounds. indexParallelism is how many chunks of one manifest
// are checked at once (storage round trips overlap; decoding is bounded by
// the codec's decoders); verifyMemory is the most bytes (blob plus decoded
// chunk) all verifications hold at once, at least one largest chunk.
const (
	indexParallelism = 8
	verifyMemory     = 64 << 20
)

// Options tune an Index.
type Options struct {
	// Logger receives what verification refuses. Default: slog.Default().
	Logger *slog.Logger
	// OnVerify, if set, is called after each chunk verification with
	// whether the blob held the chunk (for metrics).
	OnVerify func(ok bool)
	// Redis, if set, keeps the anchors of format v2 tables (SPEC.md
	// 12.2.1) instead of the storage driver. Frame lists and v1 entries
	// stay in the driver.
	Redis redis.UniversalClient
}

// New returns the index kept in driver, which verifies blobs through ns
// (the registry's namespace over the same storage) and decodes them with
// codec.
func New(driver extstore.Driver, ns distribution.Namespace, codec *format.Codec, opts Options) *Index {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.OnVerify == nil {
		opts.OnVerify = func(bool) {}
	}
	ci := &Index{driver: driver, ns: ns, opts: opts, codec: codec,
		mem:        semaphore.NewWeighted(max(verifyMemory, 2*format.MaxChunkSize)),
		composeMem: semaphore.NewWeighted(composeMemory)}
	ci.bufs.New = func() any { return new([]byte) }
	ci.anchors = driverAnchors{ci}
	if opts.Redis != nil {
		ci.anchors = redisAnchors{client: opts.Redis}
	}
	return ci
}

// indexEntry is a stored chunk index entry. Verified marks entries whose
// blob the registry decoded and checked; entries written before
// verification existed lack it and are never answered.
type indexEntry struct {
	api.ChunkBlob
	Verified bool `json:"verified,omitempty"`
	// Frame marks an anchor of a format v2 table: the pack
	// ChunkBlob.Digest (of ChunkBlob.Size bytes) holds a frame of the
	// chunk, which the pack's list locates. It is the pusher's word:
	// lookups never answer it, and a composition verifies the frame's
	// bytes whenever it copies them (compose.go).
	Frame bool `json:"frame,omitempty"`
	// Repositories link the entry's blob (at most maxRepositories): the
	// pack of a Frame entry, which leaves ChunkBlob.Repository empty; a
	// v1 chunk blob, whose ChunkBlob.Repository is the first of them.
	Repositories []string `json:"repositories,omitempty"`
}

func chunkDir(d digest.Digest) string { return shardPath(Root, d) }

// shardPath is where the index keeps what it records of d under root:
// root/<algorithm>/<first two hex digits>/<hex>.
func shardPath(root string, d digest.Digest) string {
	hex := d.Encoded()
	return path.Join(root, d.Algorithm().String(), hex[:2], hex)
}

// EntryPath is where the entry saying that blob carries chunk is stored.
func EntryPath(chunk, blob digest.Digest) string {
	return path.Join(chunkDir(chunk), blob.Encoded())
}

// IndexManifest records the chunks of a cryo file manifest pushed to repo,
// each after verifying that its blob holds it. A chunk whose blob does not
// is left out (and logged); it fails nothing else.
func (ci *Index) IndexManifest(ctx context.Context, repo string, body []byte) error {
	var m ocispec.Manifest
	if err := json.Unmarshal(body, &m); err != nil {
		return nil
	}
	v2 := m.ArtifactType == format.ArtifactTypeFileV2 && format.IsTableMediaType(format.V2, m.Config.MediaType)
	if !v2 && (m.ArtifactType != format.ArtifactTypeFile || m.Config.MediaType != format.MediaTypeChunkTable) {
		return nil
	}
	if m.Config.Size <= 0 || m.Config.Size > format.MaxTableSize || m.Config.Digest.Validate() != nil {
		return nil
	}
	r, err := ci.repository(ctx, repo)
	if err != nil {
		return err
	}
	bp := ci.bufs.Get().(*[]byte)
	data, err := ci.readBlob(ctx, r, m.Config.Digest, m.Config.Size, *bp)
	*bp = data
	if err != nil {
		ci.bufs.Put(bp)
		return fmt.Errorf("read chunk table: %w", err)
	}
	if digest.FromBytes(data) != m.Config.Digest {
		ci.bufs.Put(bp)
		return fmt.Errorf("chunk table %s does not match its digest", m.Config.Digest)
	}
	parse := format.ParseTable
	if v2 {
		parse = format.ParseTableV2
	}
	tdata, err := format.DecodeTableBlob(m.Config.MediaType, data)
	var t *format.Table
	if err == nil {
		t, err = parse(tdata)
	}
	ci.bufs.Put(bp)
	if err != nil {
		return err
	}
	if v2 {
		return ci.indexFrames(ctx, repo, r, t)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(indexParallelism)
	type key struct{ chunk, blob digest.Digest }
	seen := map[key]bool{}
	for _, c := range t.Chunks {
		k := key{c.Digest, c.Blob}
		if c.Encoding == format.EncodingZero || seen[k] {
			continue
		}
		seen[k] = true
		g.Go(func() error { return ci.indexChunk(gctx, repo, r, c) })
	}
	return g.Wait()
}

// indexChunk records that chunk c is carried by its blob in repo, unless a
// verified entry for that blob exists, after verifying it.
func (ci *Index) indexChunk(ctx context.Context, repo string, r distribution.Repository, c format.Chunk) error {
	p := EntryPath(c.Digest, c.Blob)
	data, err := ci.driver.GetContent(ctx, p)
	if err != nil && !extstore.IsNotFound(err) {
		// An entry other repositories share is not overwritten on a
		// failed read.
		return fmt.Errorf("read entry %s: %w", p, err)
	}
	if err == nil {
		var old indexEntry
		if json.Unmarshal(data, &old) == nil && old.Verified && old.Digest == c.Blob {
			// Verified once: a blob's content never changes. Only the
			// repositories that link it change: this one is added, so
			// that the entry outlives the repository it was first
			// recorded in.
			repos, changed := withRepository(old.repositories(), repo)
			if !changed {
				return nil
			}
			if _, err := r.Blobs(ctx).Stat(ctx, c.Blob); err != nil {
				return nil
			}
			old.setRepositories(repos)
			return ci.put(ctx, p, old)
		}
	}
	if err := ci.verify(ctx, r, c); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		ci.opts.OnVerify(false)
		ci.opts.Logger.Warn("chunk index: chunk table names a blob that does not hold the chunk; not indexed",
			"repository", repo, "chunk", c.Digest, "blob", c.Blob, "err", err)
		return nil
	}
	ci.opts.OnVerify(true)
	e := indexEntry{Verified: true, ChunkBlob: api.ChunkBlob{
		Encoding: string(c.Encoding), MediaType: c.MediaType(), Digest: c.Blob, Size: c.BlobSize, ChunkSize: c.Size}}
	e.setRepositories([]string{repo})
	return ci.put(ctx, p, e)
}

// repositories are the repositories a v1 entry records as linking its
// blob: Repositories, or, in entries written before it existed,
// Repository.
func (e indexEntry) repositories() []string {
	if len(e.Repositories) > 0 || e.Repository == "" {
		return e.Repositories
	}
	return []string{e.Repository}
}

// setRepositories records repos in a v1 entry, the first also as
// Repository (what registries from before Repositories read).
func (e *indexEntry) setRepositories(repos []string) {
	e.Repositories, e.Repository = repos, ""
	if len(repos) > 0 {
		e.Repository = repos[0]
	}
}

// verify checks that chunk c's blob is linked in r, has the size the table
// says, and decodes to exactly the chunk's c.Size bytes with sha256
// c.Digest. A raw blob is the chunk itself: its digest is the chunk's
// (ParseTable checked that), and the registry checked the digest of the
// bytes when they were uploaded, so its size is all that is left to check.
// A zstd blob is read and decoded, never into more than c.Size bytes.
func (ci *Index) verify(ctx context.Context, r distribution.Repository, c format.Chunk) error {
	if c.Encoding == format.EncodingRaw {
		desc, err := r.Blobs(ctx).Stat(ctx, c.Blob)
		if err != nil {
			return fmt.Errorf("stat blob: %w", err)
		}
		if desc.Size != c.Size || c.Blob != c.Digest {
			return fmt.Errorf("raw blob %s has %d bytes, chunk %s has %d", c.Blob, desc.Size, c.Digest, c.Size)
		}
		return nil
	}
	if c.Encoding != format.EncodingZstd {
		return fmt.Errorf("encoding %q", c.Encoding)
	}
	weight := c.BlobSize + c.Size
	if err := ci.mem.Acquire(ctx, weight); err != nil {
		return err
	}
	defer ci.mem.Release(weight)
	bp, dp := ci.bufs.Get().(*[]byte), ci.bufs.Get().(*[]byte)
	defer ci.bufs.Put(bp)
	defer ci.bufs.Put(dp)
	blob, err := ci.readBlob(ctx, r, c.Blob, c.BlobSize, *bp)
	*bp = blob
	if err != nil {
		return err
	}
	out, err := ci.codec.Decode(c, blob, *dp)
	*dp = out
	return err
}

// readBlob reads blob d, linked in r, into buf, after checking that its
// real size is the size claimed for it: a manifest that claims a small
// blob cannot make the registry read a large one.
func (ci *Index) readBlob(ctx context.Context, r distribution.Repository, d digest.Digest, size int64, buf []byte) ([]byte, error) {
	rc, err := ci.openBlob(ctx, r, d, size, 0)
	if err != nil {
		return buf, err
	}
	defer rc.Close()
	if int64(cap(buf)) < size {
		buf = make([]byte, size)
	}
	buf = buf[:size]
	if _, err := io.ReadFull(rc, buf); err != nil {
		return buf, fmt.Errorf("read blob %s: %w", d, err)
	}
	return buf, nil
}

// openBlob opens blob d, linked in r with size bytes, at offset. It
// checks the link and the size through distribution's storage API, and
// then reads the data through the storage driver: distribution's own
// blob reader allocates a 4 MiB buffer on its first read, which the
// memory bounds of verification and composition (a few KiB per frame)
// would not count.
func (ci *Index) openBlob(ctx context.Context, r distribution.Repository, d digest.Digest, size, offset int64) (io.ReadCloser, error) {
	desc, err := r.Blobs(ctx).Stat(ctx, d)
	if err != nil {
		return nil, fmt.Errorf("stat blob %s: %w", d, err)
	}
	if desc.Size != size {
		return nil, fmt.Errorf("blob %s has %d bytes, not the %d claimed: %w", d, desc.Size, size, format.ErrDigestMismatch)
	}
	rc, err := ci.driver.Reader(ctx, distlayout.BlobDataPath(d), offset)
	if err != nil {
		return nil, fmt.Errorf("read blob %s: %w", d, err)
	}
	return rc, nil
}

func (ci *Index) put(ctx context.Context, p string, e indexEntry) error {
	data, _ := json.Marshal(e)
	if err := ci.driver.PutContent(ctx, p, data); err != nil {
		return fmt.Errorf("index chunk: %w", err)
	}
	return nil
}

// Lookup returns the verified live blobs that carry chunk d in the
// repositories visible says the caller may pull from, dropping stale
// entries. The repositories the caller may not see cost no blob stat.
func (ci *Index) Lookup(ctx context.Context, d digest.Digest, visible func(repo string) bool) ([]api.ChunkBlob, error) {
	entries, err := ci.driver.List(ctx, chunkDir(d))
	if extstore.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []api.ChunkBlob
	for _, e := range entries {
		data, err := ci.driver.GetContent(ctx, e)
		if err != nil {
			continue
		}
		var b indexEntry
		if json.Unmarshal(data, &b) != nil || !b.Verified || b.Frame || b.Digest.Validate() != nil {
			continue
		}
		// The first repository the caller may pull from that still
		// links the blob; an entry whose every repository let it go is
		// dropped.
		repos, dead := b.repositories(), 0
		for _, r := range repos {
			if !visible(r) {
				continue
			}
			cb := b.ChunkBlob
			cb.Repository = r
			live, err := ci.linked(ctx, cb)
			if err != nil {
				return nil, err
			}
			if live {
				out = append(out, cb)
				break
			}
			dead++
		}
		if dead == len(repos) {
			_ = ci.driver.Delete(ctx, e)
		}
	}
	return out, nil
}

// linked reports whether blob b exists and is linked in its repository.
func (ci *Index) linked(ctx context.Context, b api.ChunkBlob) (bool, error) {
	r, err := ci.repository(ctx, b.Repository)
	if err != nil {
		return false, nil
	}
	_, err = r.Blobs(ctx).Stat(ctx, b.Digest)
	if errors.Is(err, distribution.ErrBlobUnknown) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("stat blob %s: %w", b.Digest, err)
	}
	return true, nil
}

func (ci *Index) repository(ctx context.Context, repo string) (distribution.Repository, error) {
	return extstore.Repository(ctx, ci.ns, repo)
}

// Prune drops entries whose blob is no longer linked, entries written
// before verification existed (v1 entries that are not frames), the frame
// lists of packs their recorded repository no longer links, and those
// packs from the neighbors of the lists that stay; gc calls it.
func (ci *Index) Prune(ctx context.Context) (int, error) {
	// gone are the packs whose lists this pass drops: a list that names
	// one as a neighbor would otherwise keep the slot (and send a
	// composition to a list that is not there) until newer neighbors
	// push it out.
	gone := map[digest.Digest]bool{}
	// Each (repository, pack) is checked once in this pass, however many
	// lists, entries and anchors name it.
	links := ci.newLinkCache()
	lists, err := extstore.Prune(ctx, ci.driver, PacksRoot, func(p string) bool {
		data, err := ci.driver.GetContent(ctx, p)
		if err != nil {
			return false
		}
		var l packList
		if json.Unmarshal(data, &l) != nil {
			return false
		}
		pack := digest.Digest("sha256:" + path.Base(p))
		kept, dropped, err := links.keep(ctx, pack, l.Repositories)
		if err != nil || !dropped {
			return false
		}
		if len(kept) == 0 {
			gone[pack] = true
			return true
		}
		l.Repositories = kept
		data, _ = json.Marshal(l)
		_ = ci.driver.PutContent(ctx, p, data)
		return false
	})
	if err != nil {
		return lists, err
	}
	if len(gone) > 0 {
		if err := ci.pruneNeighbors(ctx, gone); err != nil {
			return lists, err
		}
	}
	entries, err := extstore.Prune(ctx, ci.driver, Root, func(p string) bool {
		data, err := ci.driver.GetContent(ctx, p)
		if err != nil {
			return false
		}
		var b indexEntry
		if json.Unmarshal(data, &b) != nil {
			return false
		}
		if !b.Verified && !b.Frame {
			return true
		}
		repos := b.Repositories
		if !b.Frame {
			repos = b.repositories()
		}
		kept, dropped, err := links.keep(ctx, b.Digest, repos)
		if err != nil || !dropped {
			return false
		}
		if len(kept) == 0 {
			return true
		}
		if b.Frame {
			b.Repositories = kept
		} else {
			b.setRepositories(kept)
		}
		_ = ci.put(ctx, p, b)
		return false
	})
	if err != nil {
		return lists + entries, err
	}
	if ra, ok := ci.anchors.(redisAnchors); ok {
		// On a redis cluster the masters are walked at once.
		n, err := ra.prune(ctx, func(pack digest.Digest, repos []string) ([]string, error) {
			kept, _, err := links.keep(ctx, pack, repos)
			return kept, err
		})
		entries += n
		if err != nil {
			return lists + entries, err
		}
	}
	return lists + entries, nil
}

// pruneNeighbors drops the packs in gone from the neighbors of every
// frame list (it deletes no list).
func (ci *Index) pruneNeighbors(ctx context.Context, gone map[digest.Digest]bool) error {
	_, err := extstore.Prune(ctx, ci.driver, PacksRoot, func(p string) bool {
		data, err := ci.driver.GetContent(ctx, p)
		if err != nil {
			return false
		}
		var l packList
		if json.Unmarshal(data, &l) != nil {
			return false
		}
		n := len(l.Neighbors)
		l.Neighbors = slices.DeleteFunc(l.Neighbors, func(d digest.Digest) bool { return gone[d] })
		if len(l.Neighbors) < n {
			data, _ = json.Marshal(l)
			_ = ci.driver.PutContent(ctx, p, data)
		}
		return false
	})
	return err
}
