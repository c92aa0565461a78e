// Package metrics defines the Prometheus collectors of the outbox (listed in docs/OPERATIONS.md).
// Labels are low-cardinality only: table, topic and result; never tenant_id,
// event_id or sequence.
//
// Create one Metrics per registry with New and pass it to the publisher,
// subscriber, cleaner and router configurations. A nil *Metrics is valid and
// records nothing.
package metrics

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Results of a dispatch, the values of the result label.
const (
	ResultSuccess = "success"
	ResultFailure = "failure"
)

// Metrics holds the outbox collectors.
type Metrics struct {
	EnqueueTotal     *prometheus.CounterVec   // outbox_enqueue_total{table,topic}
	DispatchTotal    *prometheus.CounterVec   // outbox_dispatch_total{table,topic,result}
	DeadTotal        *prometheus.CounterVec   // outbox_dead_total{table,topic}
	DispatchLatency  *prometheus.HistogramVec // outbox_dispatch_latency_seconds{table,topic,result}
	Pending          *prometheus.GaugeVec     // outbox_pending{table}
	Dead             *prometheus.GaugeVec     // outbox_dead{table}
	Locked           *prometheus.GaugeVec     // outbox_locked{table}
	RelayLeader      *prometheus.GaugeVec     // outbox_relay_leader{table}
	OldestPendingAge *prometheus.GaugeVec     // outbox_oldest_pending_age_seconds{table}
	DeliveryLag      *prometheus.HistogramVec // outbox_delivery_lag_seconds{table}
	CleanerDeleted   *prometheus.CounterVec   // outbox_cleaner_deleted_total{table,kind}
	LeaseExtended    *prometheus.CounterVec   // outbox_lease_extended_total{table}
	FenceRejected    *prometheus.CounterVec   // outbox_fence_rejected_total{table,op}
	HeldKeys         *prometheus.GaugeVec     // outbox_held_keys{table}
	PausedTopics     *prometheus.GaugeVec     // outbox_paused_topics{table}
	SweepClaimed     *prometheus.CounterVec   // outbox_sweep_claimed_total{table}
	Delivered        *prometheus.CounterVec   // outbox_delivered_total{table,path}
	HotFallback      *prometheus.CounterVec   // outbox_hot_fallback_total{table,reason}
	HotLatency       *prometheus.HistogramVec // outbox_hot_commit_to_ack_seconds{table}
}

// The paths of outbox_delivered_total: the hot path (subscriber.HotPath:
// handed over by the writer's process after its commit) and the cold path
// (a relay's claim).
const (
	PathHot  = "hot"
	PathCold = "cold"
)

// Names of the exported metrics, for alert rules and dashboards.
var Names = []string{
	"outbox_enqueue_total",
	"outbox_dispatch_total",
	"outbox_dead_total",
	"outbox_dispatch_latency_seconds",
	"outbox_pending",
	"outbox_dead",
	"outbox_locked",
	"outbox_relay_leader",
	"outbox_oldest_pending_age_seconds",
	"outbox_delivery_lag_seconds",
	"outbox_cleaner_deleted_total",
	"outbox_lease_extended_total",
	"outbox_fence_rejected_total",
	"outbox_held_keys",
	"outbox_paused_topics",
	"outbox_sweep_claimed_total",
	"outbox_delivered_total",
	"outbox_hot_fallback_total",
	"outbox_hot_commit_to_ack_seconds",
}

// New creates the collectors and registers them on reg. A nil reg creates
// unregistered collectors (useful in tests). Registering twice on the same
// registry returns the error from the registry.
func New(reg prometheus.Registerer) (*Metrics, error) {
	latencyBuckets := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30}
	m := &Metrics{
		EnqueueTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_enqueue_total", Help: "Events written into an outbox table (idempotent re-enqueues excluded).",
		}, []string{"table", "topic"}),
		DispatchTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_dispatch_total", Help: "Outbox messages handled by the relay, by result (success = acked, failure = nacked).",
		}, []string{"table", "topic", "result"}),
		DeadTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_dead_total", Help: "Outbox rows that entered the dead state (counted once, at first entry).",
		}, []string{"table", "topic"}),
		DispatchLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "outbox_dispatch_latency_seconds", Help: "Time from delivery of an outbox message to its ack or nack.",
			Buckets: latencyBuckets,
		}, []string{"table", "topic", "result"}),
		Pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_pending", Help: "Rows not published and not dead (leased and retrying rows included).",
		}, []string{"table"}),
		Dead: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_dead", Help: "Rows not published and dead (dead_at set): waiting for a replay or the dead retention.",
		}, []string{"table"}),
		Locked: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_locked", Help: "Unpublished rows currently leased by a relay.",
		}, []string{"table"}),
		RelayLeader: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_relay_leader", Help: "1 when this process holds the table's single-active relay lock, else 0.",
		}, []string{"table"}),
		OldestPendingAge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_oldest_pending_age_seconds", Help: "Age of the oldest unpublished, not dead row.",
		}, []string{"table"}),
		DeliveryLag: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "outbox_delivery_lag_seconds", Help: "Time from created_at of a row to its ack (published_at).",
			Buckets: latencyBuckets,
		}, []string{"table"}),
		CleanerDeleted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_cleaner_deleted_total", Help: "Rows deleted by the cleaner, by kind (published or dead).",
		}, []string{"table", "kind"}),
		LeaseExtended: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_lease_extended_total", Help: "Leases renewed for messages handled longer than half the lock TTL.",
		}, []string{"table"}),
		FenceRejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_fence_rejected_total", Help: "Acks, nacks or lease renewals refused because the lease had passed to another holder.",
		}, []string{"table", "op"}),
		HeldKeys: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_held_keys", Help: "Ordering keys held back by a failing, dead or skipped row (ordered mode).",
		}, []string{"table"}),
		PausedTopics: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "outbox_paused_topics", Help: "Topics an operator paused, as the relay last read them: their rows are not relayed until resumed.",
		}, []string{"table"}),
		SweepClaimed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_sweep_claimed_total", Help: "Rows the default relay's unbounded sweep leased beside the bounded claim: expired leases, or rows the claim's bound missed.",
		}, []string{"table"}),
		Delivered: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_delivered_total", Help: "Outbox messages acked by the default or ordered relay, by path (hot = handed over by the writer's process after its commit, cold = claimed).",
		}, []string{"table", "path"}),
		HotFallback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "outbox_hot_fallback_total", Help: "Events the hot path left to the cold path, by reason (queue_full, no_subscription, paused, keyed, stopped, not_leased).",
		}, []string{"table", "reason"}),
		HotLatency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "outbox_hot_commit_to_ack_seconds", Help: "Time from the writer's commit to the ack of an event the hot path delivered (the forwarder acks after its publish).",
			Buckets: latencyBuckets,
		}, []string{"table"}),
	}
	if reg == nil {
		return m, nil
	}
	var errs []error
	for _, c := range m.collectors() {
		if err := reg.Register(c); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("register outbox metrics: %w", err)
	}
	return m, nil
}

func (m *Metrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.EnqueueTotal, m.DispatchTotal, m.DeadTotal, m.DispatchLatency,
		m.Pending, m.Dead, m.Locked, m.RelayLeader, m.OldestPendingAge, m.DeliveryLag, m.CleanerDeleted,
		m.LeaseExtended, m.FenceRejected, m.HeldKeys, m.PausedTopics, m.SweepClaimed, m.Delivered, m.HotFallback, m.HotLatency}
}

// Enqueued counts n new events of topic in table.
func (m *Metrics) Enqueued(table, topic string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.EnqueueTotal.WithLabelValues(table, topic).Add(float64(n))
}

// Swept counts n rows the default relay's sweep leased in table.
func (m *Metrics) Swept(table string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.SweepClaimed.WithLabelValues(table).Add(float64(n))
}
