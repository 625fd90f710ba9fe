package registry

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/cryo-oci/cryo/registry/api"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metrics are cryo's own registry metrics, in a registry of their own so
// that several Servers can live in one process. /metrics serves them
// together with distribution's (process-wide) HTTP metrics.
type metrics struct {
	reg           *prometheus.Registry
	bytesServed   *prometheus.CounterVec
	bytesReceived *prometheus.CounterVec
	// requests counts requests served (the registry's cost is mostly per
	// request: authorization, path resolution, a blob's stat and open).
	requests     *prometheus.CounterVec
	chunkLookups *prometheus.CounterVec
	// chunkVerifications counts chunk table entries the chunk index
	// checked against their blob, by result (ok, refused).
	chunkVerifications *prometheus.CounterVec
	// composedBytes counts frame bytes copied into composed packs.
	composedBytes prometheus.Counter
	// indexFailures counts manifest PUTs whose chunks could not be
	// indexed at all.
	indexFailures prometheus.Counter
}

func newMetrics(s *Server) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		bytesServed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_registry_response_bytes_total",
			Help: "Bytes of HTTP response bodies served, by kind of object (blob, manifest, other).",
		}, []string{"kind"}),
		bytesReceived: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_registry_request_bytes_total",
			Help: "Bytes of HTTP request bodies received (uploads), by kind of object (blob, manifest, other).",
		}, []string{"kind"}),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_registry_requests_total",
			Help: "HTTP requests served, by kind of object (blob, manifest, other).",
		}, []string{"kind"}),
		chunkLookups: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_registry_chunk_index_lookups_total",
			Help: "Chunk index lookups by result (hit: some blob carries the chunk; miss).",
		}, []string{"result"}),
		chunkVerifications: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_registry_chunk_index_verifications_total",
			Help: "Chunks of pushed chunk tables the chunk index checked against their blob before recording them, by result (ok; refused: the blob does not hold the chunk, or could not be read).",
		}, []string{"result"}),
		composedBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_registry_composed_bytes_total",
			Help: "Frame bytes the registry copied, verified, into packs it composed for format v2 pushers (bytes not uploaded).",
		}),
		indexFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_registry_chunk_index_failures_total",
			Help: "Manifest PUTs, stored and answered 201, whose indexing failed, some or all of their chunks unrecorded (the index's storage failed, or the chunk table could not be read or parsed): a later PUT naming them records them.",
		}),
	}
	readOnly := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "cryo_registry_read_only",
		Help: "1 while the registry refuses writes for maintenance (a read-only marker in storage, or a cache flush a garbage collection owes), else 0.",
	}, func() float64 {
		if s.maint.WritesRefused() != "" {
			return 1
		}
		return 0
	})
	m.reg.MustRegister(m.bytesServed, m.bytesReceived, m.requests, m.chunkLookups, m.chunkVerifications, m.composedBytes, m.indexFailures, readOnly, &statsCollector{server: s, ttl: 30 * time.Second})
	return m
}

// chunkVerified counts one chunk index verification.
func (m *metrics) chunkVerified(ok bool) {
	if ok {
		m.chunkVerifications.WithLabelValues("ok").Inc()
	} else {
		m.chunkVerifications.WithLabelValues("refused").Inc()
	}
}

// composed counts the frames of a composition.
func (m *metrics) composed(resp *api.ComposeResponse) {
	for _, f := range resp.Frames {
		m.composedBytes.Add(float64(f.PackLength))
	}
}

func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(prometheus.Gatherers{m.reg, prometheus.DefaultGatherer}, promhttp.HandlerOpts{})
}

// instrument counts the requests h serves and the bytes of their bodies.
func (m *metrics) instrument(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		kind := "other"
		switch {
		case strings.Contains(r.URL.Path, "/blobs/"):
			kind = "blob"
		case strings.Contains(r.URL.Path, "/manifests/"):
			kind = "manifest"
		}
		cw := &countingWriter{ResponseWriter: w}
		cr := &countingReader{ReadCloser: r.Body}
		r.Body = cr
		h.ServeHTTP(cw, r)
		m.bytesServed.WithLabelValues(kind).Add(float64(cw.n))
		m.bytesReceived.WithLabelValues(kind).Add(float64(cr.n))
		m.requests.WithLabelValues(kind).Inc()
	})
}

// countingWriter counts body bytes. It keeps the io.ReaderFrom of the
// underlying writer, so blob downloads still use sendfile.
type countingWriter struct {
	http.ResponseWriter
	n int64
}

func (c *countingWriter) Write(b []byte) (int, error) {
	n, err := c.ResponseWriter.Write(b)
	c.n += int64(n)
	return n, err
}

func (c *countingWriter) ReadFrom(r io.Reader) (int64, error) {
	var n int64
	var err error
	if rf, ok := c.ResponseWriter.(io.ReaderFrom); ok {
		n, err = rf.ReadFrom(r)
	} else {
		n, err = io.Copy(c.ResponseWriter, r)
	}
	c.n += n
	return n, err
}

func (c *countingWriter) Flush() {
	if f, ok := c.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (c *countingWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// countingReader counts request body bytes.
type countingReader struct {
	io.ReadCloser
	n int64
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.ReadCloser.Read(b)
	c.n += int64(n)
	return n, err
}

// statsCollector exports storage statistics, computed at most once per ttl
// because they walk the storage.
type statsCollector struct {
	server *Server
	ttl    time.Duration
	mu     sync.Mutex
	at     time.Time
	last   *Stats
}

var (
	descBlobs        = prometheus.NewDesc("cryo_registry_blobs", "Blobs stored (each once, however many repositories link it).", nil, nil)
	descBlobBytes    = prometheus.NewDesc("cryo_registry_blob_bytes", "Bytes of all stored blobs.", nil, nil)
	descSnapshots    = prometheus.NewDesc("cryo_registry_snapshots", "Distinct cryo snapshots stored.", nil, nil)
	descLogicalBytes = prometheus.NewDesc("cryo_registry_snapshot_logical_bytes", "Sum of the logical sizes (files as restored) of all distinct snapshots.", nil, nil)
	descChunkBytes   = prometheus.NewDesc("cryo_registry_chunk_blob_bytes", "Bytes of stored chunk blobs.", nil, nil)
	descDedupRatio   = prometheus.NewDesc("cryo_registry_dedup_ratio", "Logical bytes of all snapshots divided by the bytes of stored chunk blobs.", nil, nil)
)

func (c *statsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descBlobs, descBlobBytes, descSnapshots, descLogicalBytes, descChunkBytes, descDedupRatio} {
		ch <- d
	}
}

func (c *statsCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	if c.last == nil || time.Since(c.at) > c.ttl {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		st, err := c.server.Stats(ctx)
		cancel()
		if err != nil {
			c.server.log.Error("compute storage stats", "err", err)
		} else {
			c.last, c.at = st, time.Now()
		}
	}
	st := c.last
	c.mu.Unlock()
	if st == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(descBlobs, prometheus.GaugeValue, float64(st.Blobs))
	ch <- prometheus.MustNewConstMetric(descBlobBytes, prometheus.GaugeValue, float64(st.BlobBytes))
	ch <- prometheus.MustNewConstMetric(descSnapshots, prometheus.GaugeValue, float64(st.Snapshots))
	ch <- prometheus.MustNewConstMetric(descLogicalBytes, prometheus.GaugeValue, float64(st.LogicalBytes))
	ch <- prometheus.MustNewConstMetric(descChunkBytes, prometheus.GaugeValue, float64(st.ChunkBlobBytes))
	ch <- prometheus.MustNewConstMetric(descDedupRatio, prometheus.GaugeValue, st.DedupRatio())
}
