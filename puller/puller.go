// Package puller runs on a node and turns a snapshot reference into an image
// dir that `runsc restore --image-path` can use before the snapshot is
// downloaded: a FUSE mount (imagefs) whose large files are fetched lazily,
// demand reads first (fetch), into a node cache shared by every mount
// (cache), which writes each chunk once, in place, into the snapshot's
// image dir being assembled. Once every chunk of a snapshot is there, the
// dir is flushed and committed ("materialized"), and later mounts of the
// same snapshot use it with no FUSE in the path. Without FUSE it falls back to an eager, verified pull into such a
// dir. Load does what a mount does in the background (pin, fetch every
// chunk, materialize) without presenting anything; Mount presents a load.
//
// Snapshot memory is the node's secret: the FUSE mount serves only the
// puller's uid (default_permissions, files 0400, dirs 0500), and the mount
// points it creates, the node cache and the materialized dirs are 0700
// (files 0600 or 0400).
package puller

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/cryo-oci/cryo/format"
	"github.com/cryo-oci/cryo/puller/cache"
	"github.com/cryo-oci/cryo/puller/fetch"
	"github.com/cryo-oci/cryo/puller/imagefs"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
)

// Options configure a Puller.
type Options struct {
	// CacheDir holds the node cache and materialized image dirs.
	CacheDir string
	// CacheCap bounds the node cache in bytes (0: no cap).
	CacheCap int64
	// Workers, Deadline, WriteBuffer: see fetch.Options.
	Workers     int
	Deadline    time.Duration
	WriteBuffer int64
	// NoFUSE forces the eager fallback even where /dev/fuse exists.
	NoFUSE bool
	// SmallFileLimit: files other than pages.img up to this size are held
	// in memory, fetched before the mount is ready (default 64 MiB).
	SmallFileLimit int64
	// SmallFilesCap bounds the bytes one mount holds in memory for small
	// files (default 256 MiB); files beyond it are served lazily, like
	// pages.img, so no snapshot can make the puller hold more.
	SmallFilesCap int64
	// PrefetchAhead bounds the bytes of chunks a load has queued for its
	// background fetches and not yet seen in (default 256 MiB), so that
	// the memory a load holds does not grow with its snapshot.
	PrefetchAhead int64
	// Logger receives structured logs. Default: slog.Default().
	Logger *slog.Logger
	// FetchMetrics, if set, receives fetch metrics.
	FetchMetrics *fetch.Metrics
	// KeepFetchLog records every fetch, for tests.
	KeepFetchLog bool
	// ReadLog, if set, gets a line for every FUSE read and every read of
	// the gofer's file API (file, offset, length, start, duration), to see
	// where a restore waits.
	ReadLog io.Writer
	// RecordFor is how long a mount records its working set after the
	// sandbox's first read of pages.img (default profile.DefaultRecordFor),
	// or longer while the app faults (profile.Recorder), and so bounds
	// how long a recording holds its sweep.
	RecordFor time.Duration
	// RecordSweepRate, if > 0, holds the background sweep of pages.img by
	// the sandbox's loader to at most this many bytes a second (less on a
	// slow link) for RecordHoldFor after the first read of pages.img and
	// RecordHoldFor after each page fault, never past the recording, so that
	// it does not load the app's windows before the app faults on them and
	// the recorded working set holds them all (sweephold.go;
	// DefaultRecordSweepRate). For restores that record a profile to
	// publish; page faults are never held.
	RecordSweepRate float64
	// Peers, if set, is the node's pool of peer pullers (peer.Pool): every
	// load asks a chunk's owner among them before its endpoints, for
	// snapshots whose Source names their Repository.
	Peers Peers
	// PeerUpstream gives the endpoints (mirrors, then the registry) of a
	// repository ("host[:port]/name"), for the chunks this node serves to
	// its peers (ServeChunks) and does not hold. Without it, peers are
	// served only what the node holds or is fetching.
	PeerUpstream func(ctx context.Context, repository string) ([]fetch.Endpoint, error)
}

// Peers is a pool of peer pullers, as loads use it: the fetch.Peers of
// one repository's snapshots.
type Peers interface {
	For(repository string) fetch.Peers
}

// Puller mounts snapshots on a node.
type Puller struct {
	opts  Options
	cache *cache.Store
	codec *format.Codec
	// mu guards writing: the materialized dirs being written, by
	// snapshot, which loads of the same snapshot join.
	mu      sync.Mutex
	writing map[digest.Digest]*imageWrite
	// fetching joins the fetches of one chunk by several mounts.
	fetching fetch.Flights
	// served are the schedulers of the chunks served to peers, by
	// repository (ServeChunks).
	servedMu  sync.Mutex
	served    map[string]*servedRepo
	closeOnce sync.Once
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
	if opts.PrefetchAhead <= 0 {
		opts.PrefetchAhead = DefaultPrefetchAhead
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
	return &Puller{opts: opts, cache: c, codec: codec, served: map[string]*servedRepo{}}, nil
}

// Close releases the puller's decoders and the node cache's open files.
// Call it once every load and mount of the puller has ended; the node
// cache stays on disk. Calls after the first do nothing.
func (p *Puller) Close() {
	p.closeOnce.Do(func() {
		p.closeServed()
		p.codec.Close()
		p.cache.Close()
	})
}

// Cache returns the node cache.
func (p *Puller) Cache() *cache.Store { return p.cache }

// Source is where a snapshot comes from: its index descriptor and the
// endpoints to fetch from, in order of preference (mirrors first).
type Source struct {
	Index     ocispec.Descriptor
	Endpoints []fetch.Endpoint
	// Repository is the primary's registry and repository
	// ("host[:port]/name"): where the peers (Options.Peers) that own the
	// snapshot's chunks fetch them. Empty: no peers are asked.
	Repository string
	// Profile, if set, finds the snapshot's working-set profile while its
	// chunk tables load (profile.Auto: its referrers at the primary). The
	// chunks of the profile's ranges are fetched first, in its order, at
	// fetch.Profile, from before the mount is ready; everything else
	// follows in ascending offset order. A profile is a hint: one that
	// cannot be found or used is logged and the load goes on without.
	Profile profile.Finder
}

// profileLookupTimeout bounds a load's profile lookup, which runs beside
// the fetching of its small files (a mount) or the loading of its tables
// (Load): one that has not answered by then is canceled and the load goes
// on without a profile.
const profileLookupTimeout = 5 * time.Second

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
	Mode         string        `json:"mode"` // "fuse", "gofer", "materialized" or "eager"
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
	// Profile is the working-set profile the load fetched first, if any.
	Profile *profile.Info `json:"profile,omitempty"`
	// RecordSweepRate is the highest rate, in bytes a second, this mount
	// holds the sandbox's sweep of pages.img to while it records its profile
	// (Options.RecordSweepRate, or the mount's own MountOptions or
	// FilesOptions.RecordSweepRate); 0: not held, as for a materialized
	// or eager mount, which has no sweep to hold.
	RecordSweepRate float64 `json:"recordSweepRate,omitempty"`
}

// Load makes the snapshot local on this node without presenting it (no
// mount, no FUSE): it pins the snapshot's chunks in the node cache, fetches
// every chunk the cache lacks (verified, the ranges of src.Profile's
// profile first, then by offset) straight into the snapshot's image dir being assembled, commits
// that as its materialized dir, and releases the pins, so that a later
// Mount bind-mounts the dir and needs no FUSE, and other snapshots find its
// chunks, until it is evicted. A snapshot whose materialized dir the cache
// holds is local already: Load fetches nothing. Load is what a mount does
// in the background; a node agent calls it to preload a snapshot before any
// sandbox needs it. It returns the snapshot.
func (p *Puller) Load(ctx context.Context, src Source) (*format.Snapshot, error) {
	// Its end stops the table loads that an error left running.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l, err := p.newLoad(ctx, src, time.Now())
	if err != nil {
		return nil, err
	}
	defer func() {
		l.stop()
		l.release()
	}()
	if _, ok := p.Materialized(src.Index.Digest); ok {
		return l.snap, nil
	}
	if err := l.prepare(ctx); err != nil {
		return nil, err
	}
	all := make([]int, len(l.snap.Files))
	for i := range all {
		all[i] = i
	}
	if err := l.run(ctx, all, closed); err != nil {
		return nil, err
	}
	return l.snap, nil
}

// load is a snapshot being made local on the node: its chunk tables, its
// pins in the node cache, the fetch scheduler that fills the cache, and how
// far it got. Load runs one to its end; a Mount presents one while it runs.
type load struct {
	p     *Puller
	src   Source
	snap  *format.Snapshot
	start time.Time
	total int64
	// local counts the bytes of the snapshot known to be local.
	local atomic.Int64
	// tables load the chunk tables part by part (begin); chunks are each
	// file's chunks, sched the scheduler and pinned the chunks pinned in
	// the node cache, once prepared. The load pins its snapshot's
	// materialized dir from the start.
	tables *tables
	chunks [][]format.Chunk
	// prepared is closed once prepareTables has set chunks and pinned.
	prepared chan struct{}
	// awaitSandbox, if positive, holds the background fetches past
	// pages.img's lead until sandboxRead is closed (at a sandbox's first
	// read of pages.img) or for that long (FilesOptions.AwaitSandbox).
	awaitSandbox time.Duration
	// runsWhenTold: the sandbox runs when Mount.SandboxStarted says so
	// (FilesOptions.RunsWhenTold).
	runsWhenTold bool
	// holdEnd, if set, is when a recording mount's hold of the sweep ends
	// (sweepHold.end): the background fetches past pages.img's lead (all
	// of them, other lazy files included, once a window is queued) wait
	// for it too, or they would take the link from the app's page faults
	// while the sweep, held, leaves them room. Only a load that waits for
	// its sandbox (awaitSandbox: the gofer's mounts) waits for the hold
	// to start; a FUSE mount's background starts when the mount is ready,
	// and is held only from the sandbox's first read on.
	holdEnd     func() time.Time
	sandboxRead chan struct{}
	sandboxOnce sync.Once
	sched       *fetch.Scheduler
	pinned      []digest.Digest
	// asm is the snapshot's image dir the chunks are written into as they
	// come (cache.Assemble), committed as its materialized dir at the end.
	asm *cache.Assembly
	// profileInfo says which profile was fetched first (prepare).
	profileInfo *profile.Info

	mu      sync.Mutex
	localAt time.Duration
}

// newLoad loads the snapshot index of src and pins the snapshot's
// materialized dir: pin first, then look (Materialized), so that a dir
// found is not evicted while in use, and one written by this load is not
// evicted before the chunks it was written from.
func (p *Puller) newLoad(ctx context.Context, src Source, start time.Time) (*load, error) {
	snap, err := format.LoadSnapshot(ctx, Failover(src.Endpoints), src.Index)
	if err != nil {
		return nil, err
	}
	p.cache.PinImage(src.Index.Digest)
	return &load{p: p, src: src, snap: snap, start: start, total: snap.LogicalSize(), prepared: make(chan struct{}), sandboxRead: make(chan struct{})}, nil
}

// prepare loads every chunk table, pins every stored chunk in the node
// cache and starts the fetch scheduler.
func (l *load) prepare(ctx context.Context) error {
	l.beginAll(ctx, ctx)
	return l.prepareTables(ctx)
}

// beginAll is begin (under ctx) for a load that wants every table at
// once: they start loading while the profile is looked up and its chunks
// queued (useProfile, waiting under wait).
func (l *load) beginAll(ctx, wait context.Context) {
	found := l.begin(ctx)
	l.tables.startAll()
	l.useProfile(wait, found)
}

// begin starts the load's fetch scheduler and looks its profile up (in
// the background), but loads no chunk table: tables load part by part,
// as reads need them (l.tables, under ctx), the rest in prepareTables.
// Its result is for useProfile.
func (l *load) begin(ctx context.Context) <-chan foundProfile {
	o := l.p.opts
	l.tables = newTables(ctx, Failover(l.src.Endpoints), l.snap, o.Deadline)
	// A restoring sandbox's loader reads pages.img from its start, and
	// runsc restore waits on those first reads: the first part's table
	// loads now, while runsc starts, not when the first read waits for it.
	for fi, f := range l.snap.Files {
		if f.Path == format.PagesFile && len(f.Parts) > 1 {
			l.tables.hurrySpan(fi, 0, 1)
		}
	}
	found := l.findProfile(ctx)
	fo := fetch.Options{Workers: o.Workers, Deadline: o.Deadline, WriteBuffer: o.WriteBuffer, Logger: o.Logger, Metrics: o.FetchMetrics, KeepLog: o.KeepFetchLog, InFlight: &l.p.fetching, RunsWhenTold: l.runsWhenTold}
	if o.Peers != nil && l.src.Repository != "" {
		fo.Peers = o.Peers.For(l.src.Repository)
	}
	l.sched = fetch.New(l.src.Endpoints, l.p.cache, l.p.codec, fo)
	return found
}

// prepareTables waits for every chunk table, pins every stored chunk in
// the node cache and starts assembling the snapshot's image dir. Chunks
// fetched before (reads, the profile's first) went to the node cache as
// chunk files; fetchAll copies them in place.
func (l *load) prepareTables(ctx context.Context) error {
	chunks, err := l.tables.all(ctx)
	if err != nil {
		return err
	}
	l.chunks = chunks
	for _, fc := range chunks {
		for _, c := range fc {
			if c.Encoding != format.EncodingZero {
				l.pinned = append(l.pinned, c.Digest)
			}
		}
	}
	l.p.cache.Pin(l.pinned)
	if l.asm, err = l.p.cache.Assemble(l.snap, chunks); err != nil {
		// Reads do not need it: the chunks then go to chunk files, and
		// the materialized dir is written from them at the end.
		l.p.opts.Logger.Warn("cannot assemble the snapshot's image dir in the node cache", "snapshot", l.src.Index.Digest, "err", err)
	}
	close(l.prepared)
	return nil
}

// foundProfile is what a profile lookup found.
type foundProfile struct {
	p        *profile.Profile
	info     profile.Info
	warnings []string
	err      error
}

// findProfile starts looking up the load's profile (Source.Profile), to
// run while the small files or the chunk tables load; nil if there is
// nothing to look up.
func (l *load) findProfile(ctx context.Context) <-chan foundProfile {
	if l.src.Profile == nil {
		return nil
	}
	c := make(chan foundProfile, 1)
	go func() {
		ctx, cancel := context.WithTimeout(ctx, profileLookupTimeout)
		defer cancel()
		p, info, warnings, err := l.src.Profile.Find(ctx, l.src.Index)
		c <- foundProfile{p, info, warnings, err}
	}()
	return c
}

// useProfile waits for the profile lookup (bounded by
// profileLookupTimeout) and queues the
// chunks of the profile's ranges at fetch.Profile, in its order. A
// profile that is missing, late or unusable is logged, never an error.
func (l *load) useProfile(ctx context.Context, c <-chan foundProfile) {
	if c == nil {
		return
	}
	log := l.p.opts.Logger
	var f foundProfile
	select {
	case f = <-c: // within profileLookupTimeout
	case <-ctx.Done():
		return
	}
	for _, w := range f.warnings {
		log.Warn(w, "snapshot", l.src.Index.Digest)
	}
	if f.err != nil {
		log.Warn("no profile used", "snapshot", l.src.Index.Digest, "err", f.err)
		return
	}
	if f.p == nil {
		return
	}
	ranges, warnings, err := f.p.For(l.snap)
	for _, w := range warnings {
		log.Warn(w, "snapshot", l.src.Index.Digest, "profile", f.info.Digest)
	}
	if err != nil {
		log.Warn("profile not used", "snapshot", l.src.Index.Digest, "profile", f.info.Digest, "err", err)
		return
	}
	info := f.info
	info.Ranges, info.Bytes = len(ranges), (&profile.Profile{Ranges: ranges}).Bytes()
	chunks, err := profileChunks(ctx, l.tables, ranges)
	if err != nil {
		log.Warn("profile not used", "snapshot", l.src.Index.Digest, "profile", f.info.Digest, "err", err)
		return
	}
	l.profileInfo = &info
	l.sched.FetchProfile(chunks)
}

// profileTablesTimeout bounds how long a load waits for the tables of the
// parts its profile's ranges fall in before it goes on without the
// profile.
const profileTablesTimeout = 10 * time.Second

// profileChunks lists the chunks covering ranges, in the ranges' order,
// each once: the tables of their parts are loaded first, as a read's (at
// most urgentTableLoads at a time), for up to profileTablesTimeout.
func profileChunks(ctx context.Context, t *tables, ranges []profile.Range) ([]format.Chunk, error) {
	ctx, cancel := context.WithTimeout(ctx, profileTablesTimeout)
	defer cancel()
	type span struct {
		fi     int
		off, n int64
	}
	var spans []span
	for _, r := range ranges {
		for fi, f := range t.snap.Files {
			if f.Path != r.Path || r.Length <= 0 || r.Offset < 0 {
				continue
			}
			if n := min(r.Length, f.Size-r.Offset); n > 0 {
				spans = append(spans, span{fi, r.Offset, n})
				t.hurrySpan(fi, r.Offset, n)
			}
		}
	}
	var out []format.Chunk
	seen := map[digest.Digest]bool{}
	for _, sp := range spans {
		chunks, err := t.span(ctx, sp.fi, sp.off, sp.n)
		if err != nil {
			return nil, err
		}
		for _, c := range chunks {
			if !seen[c.Digest] {
				seen[c.Digest] = true
				out = append(out, c)
			}
		}
	}
	return out, nil
}

// run fetches every chunk of the given files (indexes into the snapshot's
// files) into the node cache, then, once materializeAfter is closed (or
// ctx ends), commits the materialized image dir.
func (l *load) run(ctx context.Context, files []int, materializeAfter <-chan struct{}) error {
	if err := l.fetchAll(ctx, files); err != nil {
		return err
	}
	l.mu.Lock()
	l.localAt = time.Since(l.start)
	l.mu.Unlock()
	select {
	case <-materializeAfter:
	case <-ctx.Done():
		return ctx.Err()
	}
	return l.materialize(ctx)
}

// closed is a closed channel: no wait.
var closed = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// fetchAll prefetches every chunk of the given files, the prefetch list's
// first, the rest in file and offset order, and waits for them. It queues
// half of Options.PrefetchAhead at a time (to the end of a pack) whenever
// at most PrefetchAhead bytes of chunks are queued and not yet in: at
// most 1.5 times PrefetchAhead and a pack are queued at once.
func (l *load) fetchAll(ctx context.Context, files []int) error {
	ahead := l.p.opts.PrefetchAhead
	var q inFlight
	// In file and offset order: the profile's chunks, queued first at
	// their own priority (prepare), are already on their way. With
	// awaitSandbox, pages.img's lead goes first and the rest waits for
	// the sandbox (waitSandbox).
	lead, rest := splitLead(l.snap, l.chunks, files, l.awaitSandbox > 0)
	for i, segments := range [][][]format.Chunk{lead, rest} {
		if i > 0 && l.awaitSandbox > 0 {
			if err := l.waitSandbox(ctx); err != nil {
				return err
			}
		}
		for _, all := range segments {
			for len(all) > 0 {
				if i > 0 {
					if err := l.waitHold(ctx); err != nil {
						return err
					}
				}
				part := window(all, ahead/2)
				all = all[len(part):]
				if err := l.queue(ctx, part, &q); err != nil {
					return err
				}
				if err := q.waitUntil(ctx, ahead, &l.local); err != nil {
					return err
				}
			}
		}
	}
	return q.waitUntil(ctx, 0, &l.local)
}

// queue queues the fetches of chunks (one window of fetchAll) onto q,
// counts the chunks it need not fetch as local, and copies those another
// image dir (or a chunk file) holds into this one while the fetches
// queued run, so that the commit finds every file complete in place.
func (l *load) queue(ctx context.Context, chunks []format.Chunk, q *inFlight) error {
	// Prefetch returns the fetches of the chunks it queued in their
	// order; the others are zero or held by the node cache.
	queued := l.sched.Prefetch(chunks)
	next := 0
	var held []format.Chunk
	for _, c := range chunks {
		if c.Encoding != format.EncodingZero && next < len(queued) && queued[next].Chunk().Digest == c.Digest {
			next++
			continue
		}
		if c.Encoding != format.EncodingZero {
			held = append(held, c)
		}
		l.local.Add(c.Size)
	}
	q.add(queued)
	for _, c := range held {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		l.p.cache.Localize(c.Digest)
	}
	return nil
}

// inFlight are a load's queued fetches not yet waited for, oldest first,
// and their chunks' bytes.
type inFlight struct {
	pending []*fetch.Pending
	bytes   int64
}

func (q *inFlight) add(queued []*fetch.Pending) {
	for _, pd := range queued {
		q.bytes += pd.Chunk().Size
	}
	q.pending = append(q.pending, queued...)
}

// waitUntil waits for the oldest fetches until at most max bytes are
// in flight (0: all of them; a chunk is never empty), adding each one's
// bytes to local.
func (q *inFlight) waitUntil(ctx context.Context, max int64, local *atomic.Int64) error {
	for len(q.pending) > 0 && q.bytes > max {
		pd := q.pending[0]
		if err := pd.Wait(ctx); err != nil {
			return err
		}
		local.Add(pd.Chunk().Size)
		q.bytes -= pd.Chunk().Size
		q.pending = q.pending[1:]
	}
	return nil
}

// DefaultPrefetchAhead is Options.PrefetchAhead's default. A queued fetch
// costs the scheduler about half a KiB, and a load that queued every
// chunk of a snapshot at once held memory that grew with the snapshot (18
// MB of queued fetches for 2 GiB of format v2's 64 KiB chunks; 300 MB
// would be 32 GiB's). The fetch workers take a few packs at a time (12
// of at most 4 MiB), so a window this deep never leaves them idle.
const DefaultPrefetchAhead = 256 << 20

// window returns the first chunks of chunks that come to at least max
// bytes (all of them if they come to less), and the rest of the pack the
// last stored one of them lies in, zero chunks between its frames
// included: a pack's range is not cut in two.
func window(chunks []format.Chunk, max int64) []format.Chunk {
	var n int64
	var pack digest.Digest
	for i, c := range chunks {
		n += c.Size
		if c.Packed() {
			pack = c.Blob
		}
		if n < max {
			continue
		}
		end := i + 1
		if pack == "" {
			return chunks[:end]
		}
		for j := end; j < len(chunks); j++ {
			if chunks[j].Packed() {
				if chunks[j].Blob != pack {
					break
				}
				end = j + 1
			}
		}
		return chunks[:end]
	}
	return chunks
}

// AwaitRestore is the FilesOptions.AwaitSandbox of a mount a sandbox is
// restored from at once (cryo restore, cryo mount --backend gofer, the
// standalone gofer): on an idle node runsc restore reaches its first read
// of pages.img 0.2-0.5 s after the mount is ready, and the background
// load has its tables after 0.05-0.35 s.
const AwaitRestore = 2 * time.Second

// sandboxLead is how much of pages.img a load held for its sandbox
// (FilesOptions.AwaitSandbox) fetches at once: what gVisor's loader reads
// first, which runsc restore waits on (16 reads of 1 MiB in flight through
// cryo's gofer; FUSE: 128 of 256 KiB).
const sandboxLead = 32 << 20

// splitLead lists the chunks of the given files (indexes), in file and
// offset order, as segments of the snapshot's tables (not copies). If
// split, they are split in two: the chunks of pages.img's first
// sandboxLead bytes, and all others; else lead is empty.
func splitLead(snap *format.Snapshot, chunks [][]format.Chunk, files []int, split bool) (lead, rest [][]format.Chunk) {
	for _, fi := range files {
		cs := chunks[fi]
		if split && snap.Files[fi].Path == format.PagesFile {
			n := 0
			for n < len(cs) && cs[n].Offset < sandboxLead {
				n++
			}
			lead = append(lead, cs[:n])
			cs = cs[n:]
		}
		rest = append(rest, cs)
	}
	return lead, rest
}

// waitSandbox returns once a sandbox read pages.img (sandboxReads) or
// the load's awaitSandbox has passed, or with ctx's error once it ended.
func (l *load) waitSandbox(ctx context.Context) error {
	t := time.NewTimer(l.awaitSandbox)
	defer t.Stop()
	select {
	case <-l.sandboxRead:
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// waitHold returns once a recording's hold of the sweep has ended (at
// once without one, or before it started), or with ctx's error once it
// ended. A fault can extend the hold while it waits.
func (l *load) waitHold(ctx context.Context) error {
	if l.holdEnd == nil {
		return nil
	}
	for {
		d := time.Until(l.holdEnd())
		if d <= 0 {
			return nil
		}
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// sandboxReads says a sandbox reads pages.img: its loader runs, and the
// load holds back nothing more for it.
func (l *load) sandboxReads() { l.sandboxOnce.Do(func() { close(l.sandboxRead) }) }

// imageWrite is a materialized dir being written; err and stopped are set
// before done is closed. stopped says the write ended because its load
// was stopped (its context ended, its scheduler closed), not because it
// failed: a load that joined it writes again.
type imageWrite struct {
	done    chan struct{}
	err     error
	stopped bool
}

// materialize writes the snapshot as a plain image dir from the node
// cache (cache.WriteImage: verified, flushed, committed with its
// completion marker); once however many loads of the snapshot finish at
// the same time. The write runs in the load that started it, under its
// context: nothing of a load writes into the node cache once it has
// returned. A load that joined another's write writes again for itself if
// that one was stopped (canceled, past its deadline, its scheduler
// closed).
func (l *load) materialize(ctx context.Context) error {
	// A chunk the cache lost or dropped as damaged is fetched again.
	src := cached{cache: l.p.cache, next: scheduled{s: l.sched, prio: fetch.Read}}
	d := l.src.Index.Digest
	for {
		l.p.mu.Lock()
		w, joined := l.p.writing[d]
		if !joined {
			w = &imageWrite{done: make(chan struct{})}
			if l.p.writing == nil {
				l.p.writing = map[digest.Digest]*imageWrite{}
			}
			l.p.writing[d] = w
		}
		l.p.mu.Unlock()
		if !joined {
			w.err = l.p.cache.WriteImage(ctx, l.snap, l.chunks, src)
			w.stopped = w.err != nil && (ctx.Err() != nil || errors.Is(w.err, fetch.ErrClosed))
			l.p.mu.Lock()
			delete(l.p.writing, d)
			l.p.mu.Unlock()
			close(w.done)
			if w.err != nil {
				return fmt.Errorf("materialize: %w", w.err)
			}
			return nil
		}
		select {
		case <-w.done:
		case <-ctx.Done():
			return ctx.Err()
		}
		if w.stopped && ctx.Err() == nil {
			continue
		}
		if w.err != nil {
			return fmt.Errorf("materialize: %w", w.err)
		}
		return nil
	}
}

// localSeconds is when every chunk was local, in seconds since the load
// started (0 until then).
func (l *load) localSeconds() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.localAt.Seconds()
}

// stop stops the load's fetches, retries included.
func (l *load) stop() {
	if l.sched != nil {
		l.sched.Close()
	}
}

// release releases the load's pins, once nothing of it runs any more.
func (l *load) release() {
	l.asm.Release()
	l.p.cache.Unpin(l.pinned)
	l.p.cache.UnpinImage(l.src.Index.Digest)
}

// Mount is a snapshot made available as an image dir: a presenter (a FUSE
// filesystem, or a bind mount of the materialized dir) over a load.
type Mount struct {
	l       *load
	dir     string
	mode    string
	ready   time.Duration
	server  *fuse.Server
	fsStats imagefs.Stats
	// materialized is the materialized dir a MountFiles mount reads.
	materialized string
	// materializeAfter holds the background load's materializing back
	// until closed (FilesOptions).
	materializeAfter <-chan struct{}
	// files are what imagefs serves: every file's chunks, and the small
	// files' bytes.
	files []imagefs.File
	// rec records the working set of the sandbox reading the mount;
	// faulted is set at its first page fault on pages.img.
	rec *profile.Recorder
	// hold, if set, holds the sandbox's sweep of pages.img while the
	// working set is recorded (Options.RecordSweepRate, or the mount's
	// own MountOptions or FilesOptions.RecordSweepRate, which wins). Nil
	// for a materialized or eager mount.
	hold    *sweepHold
	faulted atomic.Bool

	loaded chan struct{}
	mu     sync.Mutex
	loadAt time.Duration
	err    error
	cancel context.CancelFunc
	// background is the load running after a FUSE mount is ready.
	background sync.WaitGroup

	// closeOnce and unmountOnce make close and Unmount run once however
	// many callers (two concurrent DELETEs of a mount in the daemon).
	closeOnce, unmountOnce sync.Once
	unmountErr             error
}

// Mount makes the snapshot available at dir and returns when dir is a
// complete image dir for runsc restore: small files fetched and verified,
// large files served lazily. The rest loads in the background, as Load
// does; Loaded reports when it is done. An already materialized snapshot
// is bind-mounted from the node cache instead (no FUSE); without FUSE,
// Mount loads eagerly.
func (p *Puller) Mount(ctx context.Context, src Source, dir string) (*Mount, error) {
	return p.MountWith(ctx, src, dir, MountOptions{})
}

// MountOptions tune MountWith.
type MountOptions struct {
	// RecordSweepRate, if > 0, holds this mount's sweep as
	// Options.RecordSweepRate does every mount's (this rate wins): for a
	// mount whose recorded profile will be kept (the daemon's
	// "recordProfile"). A materialized or eager mount holds nothing.
	RecordSweepRate float64
}

// MountWith is Mount with opts.
func (p *Puller) MountWith(ctx context.Context, src Source, dir string, opts MountOptions) (*Mount, error) {
	return p.mount(ctx, src, dir, false, FilesOptions{RecordSweepRate: opts.RecordSweepRate})
}

// MountFiles makes the snapshot readable through the Mount's ReadAt, for
// a presenter other than FUSE (the checkpoint gofer's file API, which
// reads it into a restoring sandbox's memory), and returns once ReadAt
// can serve every file: small files fetched and verified, large files
// read lazily, the rest loading in the background as in Mount. dir is
// created 0700 and left empty for the presenter's own files; nothing of
// the snapshot is written there. A materialized snapshot is read from its
// materialized dir. MountFiles needs no FUSE.
func (p *Puller) MountFiles(ctx context.Context, src Source, dir string, opts FilesOptions) (*Mount, error) {
	return p.mount(ctx, src, dir, true, opts)
}

// FilesOptions tune MountFiles.
type FilesOptions struct {
	// MaterializeAfter, if set, holds the materialized dir's writing back
	// until it is closed, once every chunk is local: a restore closes it
	// when the sandbox has every page, so that writing the snapshot once
	// more does not slow the sandbox's loading down. Nil: at once.
	MaterializeAfter <-chan struct{}
	// AwaitSandbox, if positive, holds the background load back, all but
	// the start of pages.img that gVisor's loader reads first, until a
	// sandbox first reads pages.img through ReadAt, or for this long once
	// the background load has its chunk tables: a restore starts runsc on
	// the same cores, and verifying the whole snapshot meanwhile slows
	// runsc restore down (docs/benchmarks.md, "The background waits for
	// the sandbox"). Reads are never held. (A FUSE mount holds nothing:
	// measured, it gained nothing there.)
	AwaitSandbox time.Duration
	// RecordSweepRate, if > 0, holds this mount's sweep as
	// Options.RecordSweepRate does every mount's: for a mount whose
	// recorded profile will be kept (this rate wins over the puller's).
	RecordSweepRate float64
	// RunsWhenTold: the sandbox runs when Mount.SandboxStarted says so,
	// not at its first page fault (fetch.Options.RunsWhenTold), for a
	// restore that runs runsc itself and sees it return. Until then a
	// profile's chunks stay behind the loader's reads.
	RunsWhenTold bool
}

// mount is Mount, or with files MountFiles.
func (p *Puller) mount(ctx context.Context, src Source, dir string, files bool, opts FilesOptions) (*Mount, error) {
	start := time.Now()
	materializeAfter := opts.MaterializeAfter
	if materializeAfter == nil {
		materializeAfter = closed
	}
	m := &Mount{dir: dir, loaded: make(chan struct{}), cancel: func() {}, materializeAfter: materializeAfter,
		rec: profile.NewRecorder(src.Index.Digest, p.opts.RecordFor)}
	// The mount's own rate, if asked, over the puller's. Set on the lazy
	// paths below only: a materialized or eager mount has no sweep to hold.
	holdRate := p.opts.RecordSweepRate
	if opts.RecordSweepRate > 0 {
		holdRate = opts.RecordSweepRate
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("mount point %s: %w", dir, err)
	}
	l, err := p.newLoad(ctx, src, start)
	if err != nil {
		return nil, err
	}
	m.l = l
	if img, ok := p.Materialized(src.Index.Digest); ok {
		// Read from the dir (MountFiles), or bind-mount it.
		if files {
			m.materialized = img
		} else if err := bindMount(img, dir); err != nil {
			m.close()
			return nil, err
		}
		m.mode = "materialized"
		m.ready = time.Since(start)
		l.local.Store(l.total)
		m.finish(nil)
		return m, nil
	}
	bg, cancel := context.WithCancel(context.Background())
	m.cancel = cancel
	if !files && (p.opts.NoFUSE || !FUSEAvailable()) {
		p.opts.Logger.Warn("FUSE unavailable: pulling the whole snapshot before restore", "snapshot", src.Index.Digest)
		m.mode = "eager"
		l.beginAll(bg, ctx)
		all := make([]int, len(l.snap.Files))
		for i := range all {
			all[i] = i
		}
		if err := m.loadAll(bg, all); err != nil {
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
		m.ready = time.Since(start)
		return m, nil
	}
	// Ready needs the small files and the profile's first chunks queued,
	// not the chunk tables of the large files: those load as reads need
	// them, and the rest in the background (tables).
	// Lazy from here: a sandbox reads as it restores (AwaitSandbox).
	l.awaitSandbox = opts.AwaitSandbox
	l.runsWhenTold = opts.RunsWhenTold
	found := l.begin(bg)
	m.hold = newSweepHold(holdRate, l.sched.PeakRate, m.rec.Until)
	if m.hold != nil {
		l.holdEnd = m.hold.end
	}
	m.files = make([]imagefs.File, len(l.snap.Files))
	for i, f := range l.snap.Files {
		m.files[i] = imagefs.File{Path: f.Path, Size: f.Size, Mode: uint32(f.Mode), Span: func(ctx context.Context, off, n int64) ([]format.Chunk, error) {
			return l.tables.span(ctx, i, off, n)
		}, Near: func(off, n int64) []format.Chunk {
			return l.tables.loadedSpan(i, off, n)
		}, Faults: &imagefs.FaultHistory{}}
	}
	profiled := make(chan struct{})
	go func() {
		defer close(profiled)
		l.useProfile(ctx, found)
	}()
	lazy, err := m.fetchSmallFiles(ctx)
	<-profiled
	if err != nil {
		m.close()
		return nil, err
	}
	if files {
		m.mode = "gofer"
		m.ready = time.Since(start)
		m.startBackground(bg, lazy)
		return m, nil
	}
	root := imagefs.New(m.files, p.cache, imagefs.Sources{
		Fault: scheduled{s: l.sched, prio: fetch.Fault},
		Read:  scheduled{s: l.sched, prio: fetch.Read},
	}, &m.fsStats, p.opts.ReadLog, m.observeFUSE)
	server, err := fs.Mount(dir, root, imagefs.MountOptions("cryo:"+src.Index.Digest.Encoded()[:12]))
	if err != nil {
		m.close()
		return nil, fmt.Errorf("FUSE mount at %s: %w", dir, err)
	}
	m.server = server
	m.mode = "fuse"
	m.ready = time.Since(start)
	m.startBackground(bg, lazy)
	return m, nil
}

// startBackground loads the given files (indexes) in the background, as
// a ready mount does.
func (m *Mount) startBackground(ctx context.Context, files []int) {
	m.background.Add(1)
	go func() {
		defer m.background.Done()
		if err := m.loadAll(ctx, files); err != nil && ctx.Err() == nil {
			m.l.p.opts.Logger.Error("background load failed", "snapshot", m.l.src.Index.Digest, "err", err)
		}
	}()
}

// ReadAt fills p with the bytes of the snapshot's file path at off, which
// must lie within the file, verified, from the node cache or fetched at
// priority prio (fetch.Fault for reads a sandbox waits on) ahead of the
// background load. A materialized mount reads its materialized dir. It is
// how presenters other than FUSE (MountFiles) read the mount; a FUSE or
// bind mount serves the same bytes.
func (m *Mount) ReadAt(ctx context.Context, path string, p []byte, off int64, prio fetch.Priority) error {
	i, ok := m.fileIndex(path)
	if !ok {
		return fmt.Errorf("snapshot %s has no file %q: %w", m.l.src.Index.Digest, path, os.ErrNotExist)
	}
	if w := m.l.p.opts.ReadLog; w != nil {
		t0 := time.Now()
		defer func() {
			fmt.Fprintf(w, "read %s off=%d len=%d start=%s took=%s prio=%d\n", path, off, len(p), t0.Format("15:04:05.000000"), time.Since(t0), prio)
		}()
	}
	m.account(i, off, int64(len(p)), prio)
	if m.sweep(i, prio) {
		m.hold.wait(ctx, int64(len(p)))
	}
	if m.materialized != "" || m.files == nil {
		// A MountFiles mount of a materialized snapshot reads its dir; a
		// bind mount (materialized, or eager) reads through its mount point.
		dir := m.materialized
		if dir == "" {
			dir = m.dir
		}
		return m.readMaterialized(dir, i, p, off)
	}
	src := format.ChunkSource(scheduled{s: m.l.sched, prio: prio})
	return imagefs.ReadAt(ctx, m.l.p.cache, &m.files[i], p, off, src, &m.fsStats)
}

// sweep reports whether a read of file i at prio is the loader's sweep of
// pages.img while the mount loads (what a recording's hold holds).
func (m *Mount) sweep(i int, prio fetch.Priority) bool {
	return prio < fetch.Fault && m.l.snap.Files[i].Path == format.PagesFile && m.materialized == "" && m.files != nil
}

// account counts a read of n bytes at off of file i, at prio, as the
// sandbox's: the working set records what it waited on (of the lazy
// files; small files are fetched before the mount is ready anyway), a
// page fault tells the scheduler the sandbox runs, and a first read of
// pages.img starts a recording's hold and then lets the held background
// go.
func (m *Mount) account(i int, off, n int64, prio fetch.Priority) {
	path := m.l.snap.Files[i].Path
	switch {
	case m.files != nil && m.files[i].Data != nil:
	case path != format.PagesFile:
		m.rec.Waited(path, off, n)
	case prio >= fetch.Fault:
		m.rec.Waited(path, off, n)
		m.faulted.Store(true)
		m.sandboxFaulted()
		m.hold.faulted(time.Now())
	default:
		m.rec.Swept()
	}
	if path == format.PagesFile && m.materialized == "" && m.files != nil {
		m.hold.begin(time.Now())
		m.l.sandboxReads()
	}
}

// Place reports where the verified bytes [off, off+n) of the snapshot's
// file path lie in place in the node store, for a reader that reads them
// itself instead of through ReadAt (the checkpoint gofer, over the file
// API): the file of the snapshot's materialized dir, or of its assembly
// once every chunk the range overlaps was written there (cache.Assembly's
// InPlace). A range found in place counts as read at prio (ReadAt's
// bookkeeping); one not found counts as nothing, for ReadAt to read. (A
// reader that cannot read the file it was given and falls back to ReadAt
// has the range counted twice, which the working set and the sandbox's
// first read take as once.) A recording's hold (Options.RecordSweepRate)
// holds a sweep read found in place as it holds one read through ReadAt.
// Small files a loading mount serves from memory are never in place.
func (m *Mount) Place(ctx context.Context, path string, off, n int64, prio fetch.Priority) (cache.InPlace, bool) {
	i, ok := m.fileIndex(path)
	if !ok || off < 0 || n <= 0 || off+n > m.l.snap.Files[i].Size {
		return cache.InPlace{}, false
	}
	var in cache.InPlace
	switch {
	case m.materialized != "":
		if in, ok = m.materializedPlace(i, m.materialized); !ok {
			return cache.InPlace{}, false
		}
	case m.files == nil || m.files[i].Data != nil:
		return cache.InPlace{}, false // a bind mount; a small file in memory
	case !m.faulted.Load():
		// Until its sandbox runs (its first page fault), a restore's
		// loader reads while runsc decodes the kernel's state, on the
		// same cores: reads at the pace of the file API leave runsc
		// more of them (in place, a 256 MiB restore ran again later).
		return cache.InPlace{}, false
	default:
		select {
		case <-m.l.prepared:
		default:
			return cache.InPlace{}, false // no assembly yet
		}
		if in, ok = m.l.asm.InPlace(i, off, n); ok {
			break
		}
		// Once loaded, the assembly is the snapshot's materialized dir
		// (a daemon's mount commits it as soon as every chunk is in,
		// while its sandbox may still be loading).
		select {
		case <-m.loaded:
		default:
			return cache.InPlace{}, false
		}
		dir, found := m.l.p.cache.Image(m.l.src.Index.Digest)
		if !found {
			return cache.InPlace{}, false
		}
		if in, ok = m.materializedPlace(i, dir); !ok {
			return cache.InPlace{}, false
		}
	}
	if w := m.l.p.opts.ReadLog; w != nil {
		fmt.Fprintf(w, "read %s off=%d len=%d start=%s took=0s prio=%d in place\n", path, off, n, time.Now().Format("15:04:05.000000"), prio)
	}
	m.account(i, off, n, prio)
	if m.sweep(i, prio) {
		m.hold.wait(ctx, n)
	}
	return in, true
}

// LinkRoundTrip is the load's round trip to its endpoints
// (fetch.Scheduler.RoundTrip), 0 before any fetch was measured or without
// a load (a materialized snapshot): what gofer.LinkReporter asks.
func (m *Mount) LinkRoundTrip() time.Duration {
	if m.l == nil || m.l.sched == nil {
		return 0
	}
	return m.l.sched.RoundTrip()
}

// FileSize returns the size of the snapshot's file path.
func (m *Mount) FileSize(path string) (int64, bool) {
	i, ok := m.fileIndex(path)
	if !ok {
		return 0, false
	}
	return m.l.snap.Files[i].Size, true
}

func (m *Mount) fileIndex(path string) (int, bool) {
	for i, f := range m.l.snap.Files {
		if f.Path == path {
			return i, true
		}
	}
	return 0, false
}

// materializedPlace returns where file i lies in the materialized dir dir
// (pinned by the mount), looked up on every call as readMaterialized
// opens it on every read: a dir found damaged and replaced by a later
// commit is answered by its new file, never by the inode it replaced.
func (m *Mount) materializedPlace(i int, dir string) (cache.InPlace, bool) {
	f := m.l.snap.Files[i]
	name := filepath.Join(dir, filepath.FromSlash(f.Path))
	info, err := os.Lstat(name)
	if err != nil || !info.Mode().IsRegular() || info.Size() != f.Size {
		return cache.InPlace{}, false
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return cache.InPlace{}, false
	}
	return cache.InPlace{Path: name, Dev: uint64(st.Dev), Ino: st.Ino}, true
}

// readMaterialized reads file i of a materialized mount from dir, its
// materialized dir or a bind mount of it (written from verified chunks,
// pinned by the mount).
func (m *Mount) readMaterialized(dir string, i int, p []byte, off int64) error {
	f := m.l.snap.Files[i]
	if off < 0 || off+int64(len(p)) > f.Size {
		return fmt.Errorf("%s: read of %d bytes at %d past its %d bytes", f.Path, len(p), off, f.Size)
	}
	fh, err := os.Open(filepath.Join(dir, filepath.FromSlash(f.Path)))
	if err != nil {
		return err
	}
	defer fh.Close()
	if _, err := fh.ReadAt(p, off); err != nil {
		return fmt.Errorf("read %s of materialized snapshot %s: %w", f.Path, m.l.src.Index.Digest, err)
	}
	return nil
}

// fetchSmallFiles fetches and verifies the small files into memory, for
// imagefs to serve, and returns the other files (indexes), served lazily.
func (m *Mount) fetchSmallFiles(ctx context.Context) ([]int, error) {
	var lazy, small []int
	// budget bounds what the mount holds in memory: small files past it
	// are served lazily, so a snapshot of many large "small" files (or of
	// gigabytes of zeros) cannot exhaust the puller's memory.
	budget := m.l.p.opts.SmallFilesCap
	for i := range m.files {
		f := &m.files[i]
		if f.Path == format.PagesFile || f.Size > m.l.p.opts.SmallFileLimit || f.Size > budget {
			lazy = append(lazy, i)
			continue
		}
		budget -= f.Size
		small = append(small, i)
		m.l.tables.hurry(i)
	}
	// The mount is not ready until these are here: fetch them as faults
	// are, ahead of everything, each file's queued at once (WantNear), so
	// that a far registry costs one round trip for a file's pack, not one
	// per chunk.
	tables := make([][]format.Chunk, len(small))
	for k, i := range small {
		chunks, err := m.l.tables.file(ctx, i)
		if err != nil {
			return nil, err
		}
		tables[k] = chunks
		m.l.sched.WantNear(chunks, nil)
	}
	for k, i := range small {
		f := &m.files[i]
		data := make([]byte, 0, f.Size)
		chunks := tables[k]
		for _, c := range chunks {
			b, err := m.l.sched.Get(ctx, c, nil, fetch.Fault)
			if err != nil {
				return nil, fmt.Errorf("fetch %s: %w", f.Path, err)
			}
			data = append(data, b...)
		}
		if got := digest.FromBytes(data); got != m.l.snap.Files[i].Digest {
			return nil, fmt.Errorf("%s hashes to %s, snapshot says %s: %w", f.Path, got, m.l.snap.Files[i].Digest, format.ErrDigestMismatch)
		}
		f.Data = data
		m.l.local.Add(f.Size)
	}
	return lazy, nil
}

// loadAll runs the load over the given files and materializes the
// snapshot, then reports the mount loaded.
func (m *Mount) loadAll(ctx context.Context, files []int) error {
	err := m.l.prepareTables(ctx)
	if err == nil {
		// Materializing reads and writes the whole snapshot once more:
		// while a sandbox still loads its pages from this mount, it would
		// take the disk and the CPU from it (MaterializeAfter).
		err = m.l.run(ctx, files, m.materializeAfter)
	}
	m.finish(err)
	return err
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
	m.loadAt = time.Since(m.l.start)
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

// Digest is the mounted snapshot's index digest.
func (m *Mount) Digest() digest.Digest { return m.l.src.Index.Digest }

// Snapshot is the mounted snapshot.
func (m *Mount) Snapshot() *format.Snapshot { return m.l.snap }

// observeFUSE is told of every FUSE read of a lazy file: it records the
// working set and reports whether the sandbox waits on the read (not
// pages.img's background sweep: profile.Classifier), and a page fault's
// read of pages.img (shorter than imagefs.FaultBelow) tells the scheduler
// the sandbox runs. A longer read taken for a fault does not: through
// FUSE the sweep's first reads arrive in any order, and some are taken
// for faults while runsc restore, which waits on the sweep's reads,
// still runs. A recording's hold (Options.RecordSweepRate) holds the
// sweep's reads here, and lasts while the sandbox faults.
func (m *Mount) observeFUSE(path string, off, n int64) (waited bool) {
	waited = m.rec.Read(path, off, n)
	if path == format.PagesFile && (waited || n < imagefs.FaultBelow) {
		// A fault, of either kind, makes a recording's hold last. (A
		// sweep read of runsc's restore taken for a fault, see above,
		// extends it too, while the hold's first RecordHoldFor runs
		// anyway.)
		m.hold.faulted(time.Now())
		if n < imagefs.FaultBelow {
			m.sandboxFaulted()
		}
	}
	if !waited && path == format.PagesFile && n >= imagefs.FaultBelow {
		// The sweep's read, held while a recording holds it (FUSE gives
		// the callback no ctx: the hold's end, never past the recording,
		// bounds the wait).
		m.hold.wait(context.Background(), n)
	}
	return waited
}

// SandboxStarted tells the mount that its sandbox runs: runsc restore
// returned. A mount made with FilesOptions.RunsWhenTold needs it for its
// profile's chunks to go ahead of the loader's reads; for any other it
// says what the sandbox's first page fault said already.
func (m *Mount) SandboxStarted() {
	if m.l != nil && m.l.sched != nil {
		m.l.sched.SandboxStarted()
	}
}

// sandboxFaulted tells the load's scheduler that the sandbox faulted (it
// runs, unless FilesOptions.RunsWhenTold).
func (m *Mount) sandboxFaulted() {
	if m.l.sched != nil {
		m.l.sched.SandboxFaulted()
	}
}

// Profile returns the working set recorded so far: the reads the sandbox
// waited on (page-fault windows of pages.img, and the lazy reads of other
// files), in first-access order, for Options.RecordFor after its first
// read of pages.img, or longer while the app faults (profile.Recorder).
// A mount of a materialized snapshot by bind mount sees
// no reads and records nothing.
func (m *Mount) Profile() *profile.Profile { return m.rec.Profile() }

// FetchLog returns the fetches made so far (with Options.KeepFetchLog).
func (m *Mount) FetchLog() []fetch.LogEntry {
	if m.l.sched == nil {
		return nil
	}
	return m.l.sched.Log()
}

// Progress reports the mount's state.
func (m *Mount) Progress() Progress {
	pr := Progress{Digest: m.l.src.Index.Digest, Dir: m.dir, Mode: m.mode, TotalBytes: m.l.total, LocalBytes: m.l.local.Load(),
		DemandChunks: m.fsStats.DemandChunks.Load(), ReadySeconds: m.ready.Seconds(), Profile: m.l.profileInfo, RecordSweepRate: m.hold.rate()}
	select {
	case <-m.loaded:
		pr.Loaded = true
		pr.LocalSeconds = m.l.localSeconds()
		m.mu.Lock()
		pr.LoadedSeconds = m.loadAt.Seconds()
		if m.err != nil {
			pr.Err = m.err.Error()
		}
		m.mu.Unlock()
	default:
	}
	if m.l.sched != nil {
		pr.FetchedChunks = len(m.l.sched.Log())
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
		// A MountFiles mount has nothing mounted at its dir.
		if m.mode != "" && m.mode != "gofer" && m.materialized == "" {
			m.unmountErr = unmount(m.dir)
		}
		m.close()
	})
	return m.unmountErr
}

// close stops loading and releases the mount's pins, once.
func (m *Mount) close() {
	m.closeOnce.Do(func() {
		m.rec.Stop()
		m.cancel()
		m.l.stop()
		// The background load stops at its next step; nothing of this
		// mount writes to the node cache once close returns.
		m.background.Wait()
		m.l.release()
		m.finish(errors.New("unmounted"))
	})
}
