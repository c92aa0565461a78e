package inbox

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics holds the inbox collectors. Labels are table and consumer only,
// never a key. A nil *Metrics is valid and records nothing.
type Metrics struct {
	Processed  *prometheus.CounterVec // inbox_processed_total{table,consumer}
	Duplicates *prometheus.CounterVec // inbox_duplicates_total{table,consumer}
	Failures   *prometheus.CounterVec // inbox_failures_total{table,consumer}
}

// MetricNames are the names of the inbox metrics, for alert rules and
// dashboards.
var MetricNames = []string{"inbox_processed_total", "inbox_duplicates_total", "inbox_failures_total"}

// NewMetrics creates the collectors and registers them on reg, like
// metrics.New. A nil reg creates unregistered collectors. Registering twice
// on the same registry returns the registry's error; create one Metrics per
// registry and share it between inboxes (the labels tell them apart).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	labels := []string{"table", "consumer"}
	m := &Metrics{
		Processed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_processed_total", Help: "Messages whose handler ran and whose effects committed with their inbox record.",
		}, labels),
		Duplicates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_duplicates_total", Help: "Messages acked without running the handler: their key was already committed for the consumer.",
		}, labels),
		Failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "inbox_failures_total", Help: "Messages nacked by the inbox middleware: handler error or panic, invalid key, database failure, or a concurrent copy under FailFast.",
		}, labels),
	}
	if reg == nil {
		return m, nil
	}
	var errs []error
	for _, c := range []prometheus.Collector{m.Processed, m.Duplicates, m.Failures} {
		if err := reg.Register(c); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("inbox: register metrics: %w", err)
	}
	return m, nil
}

func (m *Metrics) processed(l [2]string) {
	if m != nil {
		m.Processed.WithLabelValues(l[0], l[1]).Inc()
	}
}

func (m *Metrics) duplicate(l [2]string) {
	if m != nil {
		m.Duplicates.WithLabelValues(l[0], l[1]).Inc()
	}
}

func (m *Metrics) failed(l [2]string) {
	if m != nil {
		m.Failures.WithLabelValues(l[0], l[1]).Inc()
	}
}
