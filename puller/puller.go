// Package puller runs on a node and turns a snapshot reference into an image
// dir that `runsc restore --image-path` can use before the snapshot is
// downloaded: a FUSE mount (imagefs) whose large files are fetched lazily,
// demand reads first (fetch), into a node cache shared by every mount
// (cache). Once every chunk of a snapshot is local, the puller writes it
// out once as a plain image dir ("materialized"), and later mounts of the
// same snapshot use that dir with no FUSE in the path. Without FUSE it falls
// back to an eager, verified pull into such a dir.
//
// Snapshot memory is the node's secret: the FUSE mount serves only the
// puller's uid (default_permissions, files 0400, dirs 0500), and the mount
// points it creates, the node cache and the materialized dirs are 0700
// (files 0600 or 0400).
package puller

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/imagefs"
	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"
)

// Options configure a Puller.
type Options struct {
	// CacheDir holds the node cache and materialized image dirs.
	CacheDir string
	// CacheCap bounds the node cache in bytes (0: no cap).
	CacheCap int64
	// Workers, Deadline: see fetch.Options.
	Workers  int
	Deadline time.Duration
	// NoFUSE forces the eager fallback even where /dev/fuse exists.
	NoFUSE bool
	// SmallFileLimit: files other than pages.img up to this size are held
	// in memory, fetched before the mount is ready (default 64 MiB).
	SmallFileLimit int64
	// SmallFilesCap bounds the bytes one mount holds in memory for small
	// files (default 256 MiB); files beyond it are served lazily, like
	// pages.img, so no snapshot can make the puller hold more.
	SmallFilesCap int64
	// Logger receives structured logs. Default: slog.Default().
	Logger *slog.Logger
	// FetchMetrics, if set, receives fetch metrics.
	FetchMetrics *fetch.Metrics
	// KeepFetchLog records every fetch, for tests.
	KeepFetchLog bool
	// ReadLog, if set, gets a line for every FUSE read (file, offset,
	// length, start, duration), to see where a restore waits.
	ReadLog io.Writer
}

// Puller mounts snapshots on a node.
type Puller struct {
	opts  Options
	cache *cache.Store
	codec *format.Codec
	// materializing joins mounts of one snapshot writing its plain dir;
	// fetching, the fetches of one chunk by several mounts.
	materializing, fetching singleflight.Group
}

// New opens the node cache and returns a Puller.
func New(opts Options) (*Puller, error) {
	if opts.CacheDir == "" {
		return nil, errors.New("puller: no cache dir")
	}
	if opts.SmallFileLimit <= 0 {
		opts.SmallFileLimit = 64 << 20
	}
	if opts.SmallFilesCap <= 0 {
		opts.SmallFilesCap = 256 << 20
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	c, err := cache.Open(opts.CacheDir, opts.CacheCap)
	if err != nil {
		return nil, err
	}
	codec, err := format.NewCodec(0)
	if err != nil {
		return nil, err
	}
	return &Puller{opts: opts, cache: c, codec: codec}, nil
}

// Cache returns the node cache.
func (p *Puller) Cache() *cache.Store { return p.cache }

// Source is where a snapshot comes from: its index descriptor and the
// endpoints to fetch from, in order of preference (mirrors first).
type Source struct {
	Index     ocispec.Descriptor
	Endpoints []fetch.Endpoint
	// Prefetch, if set, lists the byte ranges to load first, in order (a
	// prefetch profile: what an app touched first in an earlier restore);
	// everything else follows in ascending offset order.
	Prefetch []Range
}

// Range is a byte range of a file of the snapshot.
type Range struct {
	Path   string `json:"path"`
	Offset int64  `json:"offset"`
	Length int64  `json:"length"`
}

// FUSEAvailable reports whether this node can mount FUSE filesystems.
func FUSEAvailable() bool {
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// MaterializedDir is where the plain image dir of snapshot d lives once
// every chunk of it is local. It may be missing or incomplete: use
// Materialized to get a dir that is safe to restore from.
func (p *Puller) MaterializedDir(d digest.Digest) string {
	return p.cache.ImagePath(d)
}

// Materialized returns snapshot d's materialized image dir if the node
// cache holds it complete (its completion marker is there), and marks it
// used. A caller that restores from it while the puller may evict it (a
// long-lived daemon) should use Mount, which pins it.
func (p *Puller) Materialized(d digest.Digest) (string, bool) {
	return p.cache.Image(d)
}

// Progress describes a mount.
type Progress struct {
	Digest       digest.Digest `json:"digest"`
	Dir          string        `json:"dir"`
	Mode         string        `json:"mode"` // "fuse", "materialized" or "eager"
	TotalBytes   int64         `json:"totalBytes"`
	LocalBytes   int64         `json:"localBytes"`
	DemandChunks int64         `json:"demandChunks"`
	// ReadySeconds is when the dir was ready for runsc restore, in seconds
	// since Mount was called; LocalSeconds when every chunk was in the node
	// cache; LoadedSeconds when the materialized image dir was written too.
	ReadySeconds  float64 `json:"readySeconds"`
	LocalSeconds  float64 `json:"localSeconds,omitempty"`
	LoadedSeconds float64 `json:"loadedSeconds,omitempty"`
	Loaded        bool    `json:"loaded"`
	Err           string  `json:"error,omitempty"`
	FetchedChunks int     `json:"fetchedChunks"`
}

// Mount is a snapshot made available as an image dir.
type Mount struct {
	p       *Puller
	src     Source
	snap    *format.Snapshot
	dir     string
	mode    string
	start   time.Time
	ready   time.Duration
	server  *fuse.Server
	sched   *fetch.Scheduler
	fsStats imagefs.Stats
	// pinned are the chunks the mount pins in the node cache; it pins its
	// snapshot's materialized dir too.
	pinned []digest.Digest
	files  []imagefs.File

	total   int64
	local   atomic.Int64
	loaded  chan struct{}
	mu      sync.Mutex
	loadAt  time.Duration
	localAt time.Duration
	err     error
	cancel  context.CancelFunc
	// background is the load running after a FUSE mount is ready.
	background sync.WaitGroup

	// closeOnce and unmountOnce make close and Unmount run once however
	// many callers (two concurrent DELETEs of a mount in the daemon).
	closeOnce, unmountOnce sync.Once
	unmountErr             error
}

// Mount makes the snapshot available at dir and returns when dir is a
// complete image dir for runsc restore: small files fetched and verified,
// large files served lazily. The rest loads in the background; Loaded
// reports when it is done. An already materialized snapshot is bind-mounted
// from the node cache instead (no FUSE); without FUSE, Mount pulls eagerly.
func (p *Puller) Mount(ctx context.Context, src Source, dir string) (*Mount, error) {
	m := &Mount{p: p, src: src, dir: dir, start: time.Now(), loaded: make(chan struct{})}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("mount point %s: %w", dir, err)
	}
	snap, err := format.LoadSnapshot(ctx, Failover(src.Endpoints), src.Index)
	if err != nil {
		return nil, err
	}
	m.snap = snap
	m.total = snap.LogicalSize()
	// Pin first, then look: an image dir found is not evicted under the
	// bind mount. A mount that loads the snapshot keeps the pin for the
	// dir it writes: evicting that before the chunks it was written from
	// would waste the write.
	p.cache.PinImage(src.Index.Digest)
	if img, ok := p.Materialized(src.Index.Digest); ok {
		if err := bindMount(img, dir); err != nil {
			m.close()
			return nil, err
		}
		m.mode = "materialized"
		m.ready = time.Since(m.start)
		m.local.Store(m.total)
		m.finish(nil)
		return m, nil
	}
	bg, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	m.sched = fetch.New(src.Endpoints, p.cache, p.codec, fetch.Options{Workers: p.opts.Workers, Deadline: p.opts.Deadline, Logger: p.opts.Logger, Metrics: p.opts.FetchMetrics, KeepLog: p.opts.KeepFetchLog, InFlight: &p.fetching})
	files, lazy, err := m.prepare(ctx)
	if err != nil {
		m.close()
		return nil, err
	}
	if p.opts.NoFUSE || !FUSEAvailable() {
		p.opts.Logger.Warn("FUSE unavailable: pulling the whole snapshot before restore", "snapshot", src.Index.Digest)
		m.mode = "eager"
		if err := m.loadAll(bg, lazy); err != nil {
			m.close()
			return nil, err
		}
		img, ok := p.Materialized(src.Index.Digest)
		if !ok {
			m.close()
			return nil, fmt.Errorf("snapshot %s: materialized dir missing after the pull", src.Index.Digest)
		}
		if err := bindMount(img, dir); err != nil {
			m.close()
			return nil, err
		}
		m.ready = time.Since(m.start)
		return m, nil
	}
	root := imagefs.New(files, p.cache, m.sched, &m.fsStats, p.opts.ReadLog)
	server, err := fs.Mount(dir, root, imagefs.MountOptions("cryo:"+src.Index.Digest.Encoded()[:12]))
	if err != nil {
		m.close()
		return nil, fmt.Errorf("FUSE mount at %s: %w", dir, err)
	}
	m.server = server
	m.mode = "fuse"
	m.ready = time.Since(m.start)
	m.background.Add(1)
	go func() {
		defer m.background.Done()
		if err := m.loadAll(bg, lazy); err != nil && bg.Err() == nil {
			p.opts.Logger.Error("background load failed", "snapshot", src.Index.Digest, "err", err)
		}
	}()
	return m, nil
}

// prepare loads every chunk table, pins the chunks, and fetches the small
// files. It returns the files for imagefs and the lazy ones.
func (m *Mount) prepare(ctx context.Context) ([]imagefs.File, []*imagefs.File, error) {
	src := Failover(m.src.Endpoints)
	files := make([]imagefs.File, len(m.snap.Files))
	tables := make([][]*format.PartTable, len(m.snap.Files))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(8)
	for i := range m.snap.Files {
		f := &m.snap.Files[i]
		files[i] = imagefs.File{Path: f.Path, Size: f.Size, Mode: uint32(f.Mode)}
		tables[i] = make([]*format.PartTable, len(f.Parts))
		for part := range f.Parts {
			g.Go(func() error {
				pt, err := format.LoadPart(gctx, src, f, part)
				tables[i][part] = pt
				return err
			})
		}
	}
	if err := g.Wait(); err != nil {
		return nil, nil, err
	}
	for i := range files {
		for _, pt := range tables[i] {
			files[i].Chunks = append(files[i].Chunks, pt.Table.Chunks...)
		}
	}
	m.files = files
	return m.prepareFiles(ctx, files)
}

func (m *Mount) prepareFiles(ctx context.Context, files []imagefs.File) ([]imagefs.File, []*imagefs.File, error) {
	var lazy []*imagefs.File
	for i := range files {
		for _, c := range files[i].Chunks {
			if c.Encoding != format.EncodingZero {
				m.pinned = append(m.pinned, c.Digest)
			}
		}
	}
	m.p.cache.Pin(m.pinned)
	// budget bounds what the mount holds in memory: small files past it
	// are served lazily, so a snapshot of many large "small" files (or of
	// gigabytes of zeros) cannot exhaust the puller's memory.
	budget := m.p.opts.SmallFilesCap
	for i := range files {
		f := &files[i]
		if f.Path == format.PagesFile || f.Size > m.p.opts.SmallFileLimit || f.Size > budget {
			lazy = append(lazy, f)
			continue
		}
		budget -= f.Size
		data := make([]byte, 0, f.Size)
		// The mount is not ready until these are here: fetch them as
		// faults are, ahead of everything.
		for _, c := range f.Chunks {
			b, err := m.sched.Get(ctx, c, nil, fetch.Fault)
			if err != nil {
				return nil, nil, fmt.Errorf("fetch %s: %w", f.Path, err)
			}
			data = append(data, b...)
		}
		if got := digest.FromBytes(data); got != m.snap.Files[i].Digest {
			return nil, nil, fmt.Errorf("%s hashes to %s, snapshot says %s: %w", f.Path, got, m.snap.Files[i].Digest, format.ErrDigestMismatch)
		}
		f.Data = data
		m.local.Add(f.Size)
	}
	return files, lazy, nil
}

// loadAll prefetches every chunk of the lazy files in offset order, then
// materializes the snapshot.
func (m *Mount) loadAll(ctx context.Context, lazy []*imagefs.File) error {
	var pending []*fetch.Pending
	for _, c := range prefetchOrder(lazy, m.src.Prefetch) {
		if c.Encoding != format.EncodingZero && !m.p.cache.Has(c.Digest) {
			if ps := m.sched.Prefetch([]format.Chunk{c}); len(ps) > 0 {
				pending = append(pending, ps[0])
				continue
			}
		}
		m.local.Add(c.Size)
	}
	for _, pd := range pending {
		if err := pd.Wait(ctx); err != nil {
			m.finish(err)
			return err
		}
		m.local.Add(pd.Chunk().Size)
	}
	m.mu.Lock()
	m.localAt = time.Since(m.start)
	m.mu.Unlock()
	err := m.materialize(ctx)
	m.finish(err)
	return err
}

// prefetchOrder lists every chunk of the lazy files once: first those
// covering the ranges of the prefetch list, in its order, then the rest in
// file and offset order.
func prefetchOrder(lazy []*imagefs.File, list []Range) []format.Chunk {
	type key struct{ file, chunk int }
	seen := map[key]bool{}
	var out []format.Chunk
	add := func(fi, ci int) {
		if k := (key{fi, ci}); !seen[k] {
			seen[k] = true
			out = append(out, lazy[fi].Chunks[ci])
		}
	}
	for _, r := range list {
		for fi, f := range lazy {
			if f.Path != r.Path {
				continue
			}
			t := format.Table{Chunks: f.Chunks}
			first, last := t.Locate(r.Offset, r.Length)
			for ci := first; ci < last; ci++ {
				add(fi, ci)
			}
		}
	}
	for fi, f := range lazy {
		for ci := range f.Chunks {
			add(fi, ci)
		}
	}
	return out
}

// materialize writes the snapshot as a plain image dir from the node cache,
// verifying every file's sha256, into a temporary dir committed into place
// with its completion marker; once however many mounts of the snapshot
// finish loading at the same time.
func (m *Mount) materialize(ctx context.Context) error {
	for {
		ch := m.p.materializing.DoChan(m.src.Index.Digest.String(), func() (any, error) { return nil, m.writeMaterialized(ctx) })
		var err error
		select {
		case res := <-ch:
			err = res.Err
		case <-ctx.Done():
			// Unmounted while another mount writes the dir: that
			// mount's write goes on without this one.
			return ctx.Err()
		}
		// The write joined was another mount's, which was unmounted: write
		// it again, for this one.
		if err != nil && ctx.Err() == nil && (errors.Is(err, context.Canceled) || errors.Is(err, fetch.ErrClosed)) {
			continue
		}
		return err
	}
}

// writeMaterialized writes the image dir: every file flushed (fdatasync)
// before the cache flushes the dirs, writes the marker and renames it into
// place. Files are 0600 and dirs 0700 whatever modes the snapshot records:
// the image is the puller's alone.
func (m *Mount) writeMaterialized(ctx context.Context) error {
	d := m.src.Index.Digest
	if _, ok := m.p.Materialized(d); ok {
		return nil
	}
	// Unique per writer: a dir named after the process would be shared by
	// two mounts of the snapshot in one daemon.
	tmp, err := m.p.cache.NewImageDir(d)
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	var buf []byte
	for i := range m.snap.Files {
		if buf, err = m.writeFile(ctx, tmp, i, buf); err != nil {
			return fmt.Errorf("materialize %s: %w", m.snap.Files[i].Path, err)
		}
	}
	return m.p.cache.CommitImage(d, tmp)
}

// writeFile writes file i of the snapshot under dir, verified and flushed.
// A chunk the cache dropped as damaged is fetched again.
func (m *Mount) writeFile(ctx context.Context, dir string, i int, buf []byte) ([]byte, error) {
	f := &m.snap.Files[i]
	name := filepath.Join(dir, filepath.FromSlash(f.Path))
	if err := os.MkdirAll(filepath.Dir(name), 0o700); err != nil {
		return buf, err
	}
	out, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return buf, err
	}
	defer out.Close()
	h := sha256.New()
	for _, c := range m.files[i].Chunks {
		if err := ctx.Err(); err != nil {
			return buf, err
		}
		if buf, err = m.chunk(ctx, c, buf); err != nil {
			return buf, err
		}
		h.Write(buf)
		if c.Encoding != format.EncodingZero {
			if _, err := out.WriteAt(buf, c.Offset); err != nil {
				return buf, err
			}
		}
	}
	if got := digest.NewDigestFromBytes(digest.SHA256, h.Sum(nil)); got != f.Digest {
		return buf, fmt.Errorf("hashes to %s, snapshot says %s: %w", got, f.Digest, format.ErrDigestMismatch)
	}
	if err := out.Truncate(f.Size); err != nil {
		return buf, err
	}
	if err := unix.Fdatasync(int(out.Fd())); err != nil {
		return buf, fmt.Errorf("sync: %w", err)
	}
	return buf, out.Close()
}

// chunk returns chunk c's verified bytes in buf: from the node cache, or
// fetched again if the cache held it damaged.
func (m *Mount) chunk(ctx context.Context, c format.Chunk, buf []byte) ([]byte, error) {
	if c.Encoding == format.EncodingZero {
		return m.p.codec.Decode(c, nil, buf)
	}
	data, err := m.p.cache.Get(c.Digest, buf, false)
	if err == nil || !errors.Is(err, cache.ErrNotFound) {
		return data, err
	}
	data, err = m.sched.Get(ctx, c, nil, fetch.Read)
	if err != nil {
		return buf, err
	}
	// Fetched bytes may be shared with other readers: copy them out.
	return append(buf[:0], data...), nil
}

func (m *Mount) finish(err error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	select {
	case <-m.loaded:
		return
	default:
	}
	m.err = err
	m.loadAt = time.Since(m.start)
	close(m.loaded)
}

// Loaded is closed when every byte of the snapshot is local (or loading
// failed: see Err).
func (m *Mount) Loaded() <-chan struct{} { return m.loaded }

// Err is the background load's error, once Loaded is closed.
func (m *Mount) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.err
}

// Dir is the image dir.
func (m *Mount) Dir() string { return m.dir }

// Snapshot is the mounted snapshot.
func (m *Mount) Snapshot() *format.Snapshot { return m.snap }

// FetchLog returns the fetches made so far (with Options.KeepFetchLog).
func (m *Mount) FetchLog() []fetch.LogEntry {
	if m.sched == nil {
		return nil
	}
	return m.sched.Log()
}

// Progress reports the mount's state.
func (m *Mount) Progress() Progress {
	pr := Progress{Digest: m.src.Index.Digest, Dir: m.dir, Mode: m.mode, TotalBytes: m.total, LocalBytes: m.local.Load(),
		DemandChunks: m.fsStats.DemandChunks.Load(), ReadySeconds: m.ready.Seconds()}
	select {
	case <-m.loaded:
		pr.Loaded = true
		m.mu.Lock()
		pr.LoadedSeconds = m.loadAt.Seconds()
		pr.LocalSeconds = m.localAt.Seconds()
		if m.err != nil {
			pr.Err = m.err.Error()
		}
		m.mu.Unlock()
	default:
	}
	if m.sched != nil {
		pr.FetchedChunks = len(m.sched.Log())
	}
	return pr
}

// Unmount detaches the image dir, stops loading and releases the mount's
// cache pins. The detach is lazy (MNT_DETACH): a restored sandbox's gofer
// may hold the mount in its own mount namespace, and a plain unmount would
// wait for it forever; the FUSE server's loops end when the last reference
// goes.
//
// Unmount is idempotent and safe to call concurrently: the work is done
// once, and every call returns its result.
func (m *Mount) Unmount() error {
	m.unmountOnce.Do(func() {
		if m.mode != "" {
			m.unmountErr = unmount(m.dir)
		}
		m.close()
	})
	return m.unmountErr
}

// close stops loading and releases the mount's pins, once.
func (m *Mount) close() {
	m.closeOnce.Do(func() {
		if m.cancel != nil {
			m.cancel()
		}
		if m.sched != nil {
			m.sched.Close()
		}
		// The background load stops at its next step; nothing of this
		// mount writes to the node cache once close returns.
		m.background.Wait()
		m.p.cache.Unpin(m.pinned)
		m.p.cache.UnpinImage(m.src.Index.Digest)
		m.finish(errors.New("unmounted"))
	})
}
