package router

import (
	"errors"

	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/watermill-outbox/metrics"
)

// RegisterMetrics registers the outbox metrics (package metrics) on reg and, when
// r is not nil, Watermill's own router metrics (handler execution time,
// messages published and received) for r. Pass the returned Metrics to the
// publisher and subscriber configurations.
func RegisterMetrics(reg prometheus.Registerer, r *message.Router) (*metrics.Metrics, error) {
	m, err := metrics.New(reg)
	if err != nil {
		return nil, err
	}
	if r != nil {
		if reg == nil {
			return nil, errors.New("router: metrics need a registry")
		}
		wmetrics.NewPrometheusMetricsBuilder(reg, "", "").AddPrometheusRouterMetrics(r)
	}
	return m, nil
}
