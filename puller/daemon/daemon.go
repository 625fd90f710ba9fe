// Package daemon is the node puller's local HTTP API, served on a unix
// socket by `cryo puller serve` (one per node, as a DaemonSet runs it):
//
//	POST   /v1/mounts            {"ref": "host/repo:tag"} -> 201 Mount
//	GET    /v1/mounts            -> [Mount]
//	GET    /v1/mounts/{id}       -> Mount
//	POST   /v1/mounts/{id}/wait  -> Mount, once every chunk is local
//	DELETE /v1/mounts/{id}       -> 204, unmounted
//	GET    /metrics              Prometheus metrics
//
// A Mount's "dir" is an image dir for runsc restore --image-path.
package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"net/http"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/puller"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Resolver turns a reference into a snapshot source (endpoints in order).
type Resolver func(ctx context.Context, ref string) (puller.Source, error)

// Daemon serves the API.
type Daemon struct {
	p         *puller.Puller
	resolve   Resolver
	mountsDir string
	log       *slog.Logger
	gatherer  prometheus.Gatherer
	readyHist prometheus.Histogram
	loadHist  prometheus.Histogram

	mu     sync.Mutex
	mounts map[string]*entry
}

type entry struct {
	id, ref string
	m       *puller.Mount
	created time.Time
}

// Mount is the API's view of a mount.
type Mount struct {
	ID      string    `json:"id"`
	Ref     string    `json:"ref"`
	Created time.Time `json:"created"`
	puller.Progress
}

// New returns a Daemon that mounts under mountsDir. reg receives the
// daemon's metrics; gatherer is what /metrics serves.
func New(p *puller.Puller, resolve Resolver, mountsDir string, log *slog.Logger, reg prometheus.Registerer, gatherer prometheus.Gatherer) *Daemon {
	d := &Daemon{p: p, resolve: resolve, mountsDir: mountsDir, log: log, gatherer: gatherer, mounts: map[string]*entry{},
		readyHist: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "cryo_puller_time_to_ready_seconds", Help: "Time from a mount request until its image dir is ready.", Buckets: prometheus.ExponentialBuckets(0.005, 2, 14)}),
		loadHist:  prometheus.NewHistogram(prometheus.HistogramOpts{Name: "cryo_puller_time_to_loaded_seconds", Help: "Time from a mount request until every chunk is local.", Buckets: prometheus.ExponentialBuckets(0.05, 2, 14)}),
	}
	reg.MustRegister(d.readyHist, d.loadHist, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cryo_puller_cache_bytes", Help: "Bytes in the node cache."}, func() float64 {
		return float64(p.Cache().Stats().Bytes)
	}), prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "cryo_puller_mounts", Help: "Live mounts."}, func() float64 {
		d.mu.Lock()
		defer d.mu.Unlock()
		return float64(len(d.mounts))
	}))
	return d
}

// Handler is the API's HTTP handler.
func (d *Daemon) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/mounts", d.create)
	mux.HandleFunc("GET /v1/mounts", d.list)
	mux.HandleFunc("GET /v1/mounts/{id}", d.get)
	mux.HandleFunc("POST /v1/mounts/{id}/wait", d.wait)
	mux.HandleFunc("DELETE /v1/mounts/{id}", d.delete)
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

// Close unmounts everything.
func (d *Daemon) Close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	for id, e := range d.mounts {
		if err := e.m.Unmount(); err != nil {
			d.log.Error("unmount", "id", id, "err", err)
		}
		delete(d.mounts, id)
	}
}

func (d *Daemon) create(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Ref string `json:"ref"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 1<<16)).Decode(&req); err != nil || req.Ref == "" {
		httpError(w, http.StatusBadRequest, "want a JSON body {\"ref\": \"host/repo:tag\"}")
		return
	}
	src, err := d.resolve(r.Context(), req.Ref)
	if err != nil {
		httpError(w, http.StatusBadGateway, err.Error())
		return
	}
	var b [6]byte
	rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	m, err := d.p.Mount(r.Context(), src, filepath.Join(d.mountsDir, id))
	if err != nil {
		d.log.Error("mount", "ref", req.Ref, "err", err)
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	e := &entry{id: id, ref: req.Ref, m: m, created: time.Now()}
	d.readyHist.Observe(m.Progress().ReadyAfter)
	go func() {
		<-m.Loaded()
		if pr := m.Progress(); pr.Err == "" {
			d.loadHist.Observe(pr.LoadedAfter)
		}
	}()
	d.mu.Lock()
	d.mounts[id] = e
	d.mu.Unlock()
	d.log.Info("mounted", "id", id, "ref", req.Ref, "digest", src.Index.Digest, "dir", m.Dir(), "mode", m.Progress().Mode, "ready_ms", m.Progress().ReadyAfter*1000)
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

func (d *Daemon) delete(w http.ResponseWriter, r *http.Request) {
	e := d.lookup(w, r)
	if e == nil {
		return
	}
	if err := e.m.Unmount(); err != nil {
		httpError(w, http.StatusInternalServerError, err.Error())
		return
	}
	d.mu.Lock()
	delete(d.mounts, e.id)
	d.mu.Unlock()
	d.log.Info("unmounted", "id", e.id, "ref", e.ref)
	w.WriteHeader(http.StatusNoContent)
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
