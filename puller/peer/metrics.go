package peer

import "github.com/prometheus/client_golang/prometheus"

// Metrics are a pool's and a server's Prometheus metrics. Bytes fetched
// upstream are the fetch scheduler's cryo_puller_fetched_bytes_total, by
// endpoint (which counts what peers served too, as stored bytes, under
// endpoint="peers"). A nil *Metrics records nothing.
type Metrics struct {
	received prometheus.Counter
	served   prometheus.Counter
	errors   *prometheus.CounterVec
	refusals prometheus.Counter
	live     prometheus.Gauge
}

// NewMetrics creates the metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		received: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_puller_peer_received_bytes_total", Help: "Chunk bytes taken from peers of the pool (verified).",
		}),
		served: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_puller_peer_served_bytes_total", Help: "Chunk bytes served to peers of the pool.",
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "cryo_puller_peer_errors_total", Help: "Peer requests that failed, by kind (unreachable, timeout, refused, busy, corrupt, short, local: no connection to the peer free on this node in time, other); the chunks were fetched upstream.",
		}, []string{"kind"}),
		refusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "cryo_puller_peer_refused_requests_total", Help: "Requests to this node's peer server refused for want of the pool token.",
		}),
		live: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "cryo_puller_peers_live", Help: "Peers of the pool not being avoided, this node included if it is one.",
		}),
	}
	reg.MustRegister(m.received, m.served, m.errors, m.refusals, m.live)
	return m
}

func (m *Metrics) receivedBytes(n int64) {
	if m != nil {
		m.received.Add(float64(n))
	}
}

func (m *Metrics) servedBytes(n int64) {
	if m != nil {
		m.served.Add(float64(n))
	}
}

func (m *Metrics) failed(kind string) {
	if m != nil {
		m.errors.WithLabelValues(kind).Inc()
	}
}

func (m *Metrics) refused() {
	if m != nil {
		m.refusals.Inc()
	}
}

func (m *Metrics) setLive(n int) {
	if m != nil {
		m.live.Set(float64(n))
	}
}
