package fetch

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the scheduler's Prometheus metrics. A nil *Metrics records
// nothing.
type Metrics struct {
	bytes       *prometheus.CounterVec
	cache       *prometheus.CounterVec
	demand      prometheus.Histogram
	verifyFails *prometheus.CounterVec
	writeQueue  prometheus.Gauge
	writeFails  prometheus.Counter
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_puller_fetched_bytes_total", Help: "Blob bytes fetched, by endpoint.",
		}, []string{"endpoint"}),
		cache: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_puller_cache_lookups_total", Help: "Demand reads of chunks by node cache result (hit, miss).",
		}, []string{"result"}),
		demand: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "cryo_puller_demand_fetch_seconds", Help: "Latency of demand fetches (cache misses on the read path).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
		verifyFails: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_puller_verification_failures_total", Help: "Chunks whose content did not match their digest, by endpoint.",
		}, []string{"endpoint"}),
		writeQueue: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "cryo_puller_cache_write_queue_bytes", Help: "Verified chunk bytes waiting to be written into the node cache.",
		}),
		writeFails: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_puller_cache_write_failures_total", Help: "Verified chunks that could not be written into the node cache (served from memory, fetched again when next needed).",
		}),
	}
	reg.MustRegister(m.bytes, m.cache, m.demand, m.verifyFails, m.writeQueue, m.writeFails)
	return m
}

func (m *Metrics) fetched(endpoint string, n int64) {
	if m != nil {
		m.bytes.WithLabelValues(endpoint).Add(float64(n))
	}
}

func (m *Metrics) cacheHit() {
	if m != nil {
		m.cache.WithLabelValues("hit").Inc()
	}
}

func (m *Metrics) cacheMiss() {
	if m != nil {
		m.cache.WithLabelValues("miss").Inc()
	}
}

func (m *Metrics) demandLatency(d time.Duration) {
	if m != nil {
		m.demand.Observe(d.Seconds())
	}
}

func (m *Metrics) verifyFailed(endpoint string) {
	if m != nil {
		m.verifyFails.WithLabelValues(endpoint).Inc()
	}
}

func (m *Metrics) queued(n int64) {
	if m != nil {
		m.writeQueue.Add(float64(n))
	}
}

func (m *Metrics) writeFailed() {
	if m != nil {
		m.writeFails.Inc()
	}
}
