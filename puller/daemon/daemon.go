// Package daemon is the node puller's local HTTP API, served on a unix
// socket by `cryo puller serve` (one per node, as a DaemonSet runs it):
//
//	POST   /v1/mounts            {"ref": "host/repo:tag"} -> 201 Mount
//	                             (503 at Options.MaxMounts live mounts)
//	                             {"ref": ..., "backend": "gofer"}: the dir
//	                             holds only gcs_opts.json, for cryo's
//	                             checkpoint gofer (no FUSE)
//	                             "profile": "auto", "none" or a profile's
//	                             manifest digest: what to fetch first
//	                             (puller/profile; default: the puller's
//	                             --profile)
//	                             "recordProfile": true: the profile this
//	                             mount records is one to keep; its sweep
//	                             is held while it records (SPEC.md 16.2)
//	GET    /v1/mounts            -> [Mount]
//	GET    /v1/mounts/{id}       -> Mount
//	POST   /v1/mounts/{id}/wait  -> Mount, once every chunk is local
//	GET    /v1/mounts/{id}/profile -> the working set recorded so far
//	                             (application/vnd.cryo.profile.v1+json)
//	DELETE /v1/mounts/{id}       -> 204, unmounted (404 to all but one of
//	                             concurrent DELETEs of a mount)
//	GET    /v1/mounts/{id}/files/{path}  byte ranges of a mount's files
//	                             (the gofer's file API, package gofer)
//	GET    /metrics              Prometheus metrics
//
// and the checkpoints the workload triggers (checkpoints.go). A Mount's
// "dir" is an image dir for runsc restore --image-path.
//
// Whoever can connect to the socket can mount any snapshot the puller's
// credentials reach and read it: Listen makes the socket 0600 (root's), or
// 0660 for one group.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/puller"
	"github.com/cryo-oci/cryo/puller/gofer"
	"github.com/cryo-oci/cryo/puller/profile"
	"github.com/opencontainers/go-digest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sys/unix"
	"oras.land/oras-go/v2/registry"
)

// Resolver turns a reference into a snapshot source (endpoints in order)
// whose profile is found as choice says: "auto" (or ""), "none" or a
// profile's manifest digest.
type Resolver func(ctx context.Context, ref, choice string) (puller.Source, error)

// DefaultMaxMounts is the default cap on live mounts.
const DefaultMaxMounts = 256

// Options configure a Daemon.
type Options struct {
	// MountsDir is where mounts are made, one 0700 dir per mount; New
	// creates it 0700 (and makes an existing one 0700).
	MountsDir string
	// Socket is the path of the socket the API is served on, named in
	// the gcs_opts.json of gofer mounts (required for them).
	Socket string
	// MaxMounts caps live mounts (mounts being made count too); a request
	// over it is refused with 503 (0: DefaultMaxMounts).
	MaxMounts int
	// Logger receives structured logs (default slog.Default()).
	Logger *slog.Logger
	// Registerer receives the daemon's metrics; Gatherer is what /metrics
	// serves. Default: a registry of their own.
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer
	// Checkpoint prepares the checkpoints the API takes (POST
	// /v1/checkpoints); nil: none.
	Checkpoint CheckpointFunc
	// CheckpointRepos, if any, are the only repositories checkpoints may
	// go to: "host/name" is that repository, "host/prefix/" every one
	// under it. A checkpoint to another is refused (403).
	CheckpointRepos []string
}

// Daemon serves the API.
type Daemon struct {
	p         *puller.Puller
	resolve   Resolver
	mountsDir string
	socket    string
	max       int
	log       *slog.Logger
	gatherer  prometheus.Gatherer
	readyHist prometheus.Histogram
	loadHist  prometheus.Histogram

	checkpoint      CheckpointFunc
	checkpointRepos []string

	mu       sync.Mutex
	mounts   map[string]*entry
	creating int // mounts being made, counted against max
	// checkpoints are those the workload triggers, counted against max
	// apart from mounts.
	checkpoints         map[string]*checkpointEntry
	creatingCheckpoints int
	// closed is set by Close: nothing is added after it.
	closed bool
}

type entry struct {
	id, ref string
	m       *puller.Mount
	created time.Time
	// deleting is set by the one DELETE that unmounts the entry; others
	// get 404.
	deleting bool
}

// Mount is the API's view of a mount.
type Mount struct {
	ID      string    `json:"id"`
	Ref     string    `json:"ref"`
	Created time.Time `json:"created"`
	puller.Progress
}

// New returns a Daemon that mounts under opts.MountsDir. It makes the
// node cache and the mounts dir 0700: what they hold is snapshot memory.
func New(p *puller.Puller, resolve Resolver, opts Options) (*Daemon, error) {
	if opts.MountsDir == "" {
		return nil, errors.New("daemon: no mounts dir")
	}
	if opts.MaxMounts <= 0 {
		opts.MaxMounts = DefaultMaxMounts
	}
	for _, r := range opts.CheckpointRepos {
		if err := validCheckpointRepo(r); err != nil {
			return nil, fmt.Errorf("daemon: checkpoint repository %q: %w (want host[:port]/name, or host[:port]/prefix/ for every repository under it, host[:port]/ for all of the host's)", r, err)
		}
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Registerer == nil || opts.Gatherer == nil {
		reg := prometheus.NewRegistry()
		opts.Registerer, opts.Gatherer = reg, reg
	}
	for _, dir := range []string{p.Cache().Root(), opts.MountsDir} {
		if err := privateDir(dir); err != nil {
			return nil, err
		}
	}
	d := &Daemon{p: p, resolve: resolve, mountsDir: opts.MountsDir, socket: opts.Socket, max: opts.MaxMounts, log: opts.Logger, gatherer: opts.Gatherer, mounts: map[string]*entry{}, checkpoints: map[string]*checkpointEntry{}, checkpoint: opts.Checkpoint, checkpointRepos: opts.CheckpointRepos,
		readyHist: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "cryo_puller_time_to_ready_seconds", Help: "Time from a mount request until its image dir is ready.", Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)}),
		loadHist:  prometheus.NewHistogram(prometheus.HistogramOpts{Name: "cryo_puller_time_to_loaded_seconds", Help: "Time from a mount request until every chunk is local.", Buckets: prometheus.ExponentialBuckets(0.05, 2, 14)}),
	}
	if d.checkpoint != nil && d.socket != "" {
		d.adoptCheckpoints()
	}
	if err := registerAll(opts.Registerer, d.readyHist, d.loadHist, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cryo_puller_cache_bytes", Help: "Bytes in the node cache."}, func() float64 {
		return float64(p.Cache().Stats().Bytes)
	}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cryo_puller_mounts", Help: "Live mounts."}, func() float64 {
		d.mu.Lock()
		defer d.mu.Unlock()
		return float64(len(d.mounts))
	})); err != nil {
		return nil, err
	}
	return d, nil
}

// validCheckpointRepo checks an Options.CheckpointRepos entry: a registry
// host and a repository name (or prefix, ending in "/", maybe empty) as
// references spell them, so that it can match one.
func validCheckpointRepo(r string) error {
	host, name, ok := strings.Cut(r, "/")
	if !ok {
		return errors.New("no repository")
	}
	ref := registry.Reference{Registry: host, Repository: strings.TrimSuffix(name, "/")}
	if err := ref.ValidateRegistry(); err != nil {
		return err
	}
	if ref.Repository == "" && name == "" {
		return nil // the whole host
	}
	return ref.ValidateRepository()
}

func registerAll(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("daemon metrics: %w", err)
		}
	}
	return nil
}

// privateDir creates dir (and its parents) if needed and makes it 0700.
func privateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("make %s private: %w", dir, err)
	}
	return nil
}

// Listen creates the API's unix socket at path (replacing the socket a
// previous puller left there, never another kind of file) and listens on
// it. The socket is 0600, its owner's only; with gid >= 0 it is 0660 and
// group gid's too. It never exists with a wider mode: it is created under
// umask 0177 (the umask is the process's, so files other goroutines create
// meanwhile get no wider modes either), then opened to the group.
func Listen(path string, gid int) (net.Listener, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != os.ModeSocket {
			return nil, fmt.Errorf("socket %s: a %s is there, not a socket", path, fi.Mode().Type())
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	old := unix.Umask(0o177)
	ln, err := net.Listen("unix", path)
	unix.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	mode := os.FileMode(0o600)
	if gid >= 0 {
		mode = 0o660
		if err := os.Chown(path, -1, gid); err != nil {
			ln.Close()
			return nil, fmt.Errorf("socket %s: group %d: %w", path, gid, err)
		}
	}
	if err := os.Chmod(path, mode); err != nil {
		ln.Close()
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	return ln, nil
}

// LookupGroup returns the id of the group named (or numbered) s.
func LookupGroup(s string) (int, error) {
	if gid, err := strconv.Atoi(s); err == nil && gid >= 0 {
		return gid, nil
	}
	g, err := user.LookupGroup(s)
	if err != nil {
		return -1, err
	}
	return strconv.Atoi(g.Gid)
}

// Handler is the API's HTTP handler.
func (d *Daemon) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/mounts", d.create)
	mux.HandleFunc("GET /v1/mounts", d.list)
	mux.HandleFunc("GET /v1/mounts/{id}", d.get)
	mux.HandleFunc("POST /v1/mounts/{id}/wait", d.wait)
	mux.HandleFunc("GET /v1/mounts/{id}/profile", d.profile)
	mux.HandleFunc("DELETE /v1/mounts/{id}", d.delete)
	gofer.RegisterFiles(mux, d.files)
	mux.HandleFunc("POST /v1/checkpoints", d.createCheckpoint)
	mux.HandleFunc("GET /v1/checkpoints", d.listCheckpoints)
	mux.HandleFunc("GET /v1/checkpoints/{id}", d.getCheckpoint)
	mux.HandleFunc("POST /v1/checkpoints/{id}/wait", d.waitCheckpoint)
	mux.HandleFunc("DELETE /v1/checkpoints/{id}", d.deleteCheckpoint)
	gofer.RegisterUploads(mux, d.sink)
	mux.Handle("GET /metrics", promhttp.HandlerFor(d.gatherer, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	return mux
}

// MetricsHandler serves only GET /metrics and GET /healthz: what may be
// exposed on a TCP port (a pod network) without exposing the mount API.
func (d *Daemon) MetricsHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(d.gatherer, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusOK) })
	return mux
}

// Close unmounts everything and ends the checkpoints not pushed yet
// (they leave no tag).
func (d *Daemon) Close() {
	d.mu.Lock()
	d.closed = true
	checkpoints := d.checkpoints
	d.checkpoints = map[string]*checkpointEntry{}
	var mounts []*entry
	for id, e := range d.mounts {
		if !e.deleting { // else its DELETE unmounts it
			mounts = append(mounts, e)
		}
		delete(d.mounts, id)
	}
	d.mu.Unlock()
	// Outside the lock: a checkpoint being tagged is let finish for a
	// while.
	ended := d.closeCheckpoints(checkpoints)
	for _, e := range mounts {
		if err := e.m.Unmount(); err != nil {
			d.log.Error("unmount", "id", e.id, "err", err)
		}
	}
	<-ended
}

func (d *Daemon) create(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Ref     string `json:"ref"`
		Backend string `json:"backend"`
		Profile string `json:"profile"`
		// RecordProfile says the mount's recorded profile is one to
		// keep: its sweep is held while it records (SPEC.md 16.2).
		RecordProfile bool `json:"recordProfile"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil || req.Ref == "" {
		httpError(w, http.StatusBadRequest, "want a JSON body {\"ref\": \"host/repo:tag\"}")
		return
	}
	switch req.Backend {
	case "", "fuse":
	case "gofer":
		if d.socket == "" {
			httpError(w, http.StatusBadRequest, "this puller was started without its socket path: no gofer mounts")
			return
		}
	default:
		httpError(w, http.StatusBadRequest, fmt.Sprintf("backend %q: want fuse or gofer", req.Backend))
		return
	}
	if p := req.Profile; p != "" && p != "auto" && p != "none" {
		if _, err := digest.Parse(p); err != nil {
			httpError(w, http.StatusBadRequest, fmt.Sprintf("profile %q: want auto, none or a profile's manifest digest", p))
			return
		}
	}
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		httpError(w, http.StatusServiceUnavailable, "the puller is shutting down")
		return
	}
	if n := len(d.mounts) + d.creating; n >= d.max {
		d.mu.Unlock()
		w.Header().Set("Retry-After", "10")
		httpError(w, http.StatusServiceUnavailable, fmt.Sprintf("the puller holds %d mounts, its limit (--max-mounts %d): unmount one first", n, d.max))
		return
	}
	d.creating++
	d.mu.Unlock()
	// done ends the reservation, adding e (if any) to the live mounts
	// unless the daemon closed meanwhile; it reports whether e was added.
	var once sync.Once
	done := func(e *entry) (added bool) {
		once.Do(func() {
			d.mu.Lock()
			d.creating--
			added = e != nil && !d.closed
			if added {
				d.mounts[e.id] = e
			}
			d.mu.Unlock()
		})
		return added
	}
	defer done(nil)
	src, err := d.resolve(r.Context(), req.Ref, req.Profile)
	if err != nil {
		httpError(w, http.StatusBadGateway, err.Error())
		return
	}
	var b [6]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	dir := filepath.Join(d.mountsDir, id)
	if err := os.Mkdir(dir, 0o700); err != nil {
		httpError(w, http.StatusInternalServerError, fmt.Sprintf("mount point: %v", err))
		return
	}
	// A mount whose profile is one to keep holds its sweep (SPEC.md 16.2),
	// through the gofer or FUSE alike.
	var holdRate float64
	if req.RecordProfile {
		holdRate = puller.DefaultRecordSweepRate
	}
	var m *puller.Mount
	if req.Backend == "gofer" {
		// A sandbox manager asks for a gofer mount to restore from it
		// next: its background load waits for the sandbox, as cryo
		// restore's does.
		fo := puller.FilesOptions{AwaitSandbox: puller.AwaitRestore, RecordSweepRate: holdRate}
		m, err = d.p.MountFiles(r.Context(), src, dir, fo)
		if err == nil {
			err = gofer.WriteImageDir(dir, gofer.Config{MediaType: gofer.MediaType, Reference: req.Ref, Index: src.Index.Digest, Socket: d.socket, Mount: id})
			if err != nil {
				m.Unmount()
			}
		}
	} else {
		m, err = d.p.MountWith(r.Context(), src, dir, puller.MountOptions{RecordSweepRate: holdRate})
	}
	if err != nil {
		removeImageDir(dir)
		d.log.Error("mount", "ref", req.Ref, "err", err)
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	e := &entry{id: id, ref: req.Ref, m: m, created: time.Now()}
	if !done(e) {
		m.Unmount()
		removeImageDir(dir)
		httpError(w, http.StatusServiceUnavailable, "the puller is shutting down")
		return
	}
	d.readyHist.Observe(m.Progress().ReadySeconds)
	go func() {
		<-m.Loaded()
		if pr := m.Progress(); pr.Err == "" {
			d.loadHist.Observe(pr.LoadedSeconds)
		}
	}()
	d.log.Info("mounted", "id", id, "ref", req.Ref, "digest", src.Index.Digest, "dir", m.Dir(), "mode", m.Progress().Mode, "ready_ms", m.Progress().ReadySeconds*1000)
	writeJSON(w, http.StatusCreated, view(e))
}

func (d *Daemon) list(w http.ResponseWriter, r *http.Request) {
	d.mu.Lock()
	out := []Mount{}
	for _, e := range d.mounts {
		out = append(out, view(e))
	}
	d.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	writeJSON(w, http.StatusOK, out)
}

func (d *Daemon) lookup(w http.ResponseWriter, r *http.Request) *entry {
	d.mu.Lock()
	e := d.mounts[r.PathValue("id")]
	d.mu.Unlock()
	if e == nil {
		httpError(w, http.StatusNotFound, "no mount "+r.PathValue("id"))
	}
	return e
}

func (d *Daemon) get(w http.ResponseWriter, r *http.Request) {
	if e := d.lookup(w, r); e != nil {
		writeJSON(w, http.StatusOK, view(e))
	}
}

// profile serves the working set a mount recorded so far.
func (d *Daemon) profile(w http.ResponseWriter, r *http.Request) {
	e := d.lookup(w, r)
	if e == nil {
		return
	}
	data, err := e.m.Profile().Encode()
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", profile.MediaType)
	w.Write(data)
}

func (d *Daemon) wait(w http.ResponseWriter, r *http.Request) {
	e := d.lookup(w, r)
	if e == nil {
		return
	}
	select {
	case <-e.m.Loaded():
		writeJSON(w, http.StatusOK, view(e))
	case <-r.Context().Done():
	}
}

// delete unmounts a mount. Of concurrent DELETEs of one mount, one
// unmounts it and the others get 404, so its chunks are unpinned once.
func (d *Daemon) delete(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	d.mu.Lock()
	e := d.mounts[id]
	if e == nil || e.deleting {
		d.mu.Unlock()
		httpError(w, http.StatusNotFound, "no mount "+id)
		return
	}
	e.deleting = true
	d.mu.Unlock()
	err := e.m.Unmount()
	d.mu.Lock()
	if err != nil {
		e.deleting = false // still listed: the caller may try again
	} else {
		delete(d.mounts, id)
	}
	d.mu.Unlock()
	if err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	removeImageDir(e.m.Dir())
	d.log.Info("unmounted", "id", e.id, "ref", e.ref)
	w.WriteHeader(http.StatusNoContent)
}

// files finds a mount's files for the file API.
func (d *Daemon) files(id string) (gofer.Files, digest.Digest, bool) {
	d.mu.Lock()
	e := d.mounts[id]
	d.mu.Unlock()
	if e == nil {
		return nil, "", false
	}
	return e.m, e.m.Digest(), true
}

func view(e *entry) Mount {
	return Mount{ID: e.id, Ref: e.ref, Created: e.created, Progress: e.m.Progress()}
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func httpError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]string{"error": msg})
}
