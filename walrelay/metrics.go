package walrelay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/prometheus/client_golang/prometheus"
)

// Lag is how far the relay's slot is behind the server.
type Lag struct {
	// RetainedBytes is the WAL the server keeps for the slot (current
	// position minus restart_lsn): what a stalled relay costs on disk.
	RetainedBytes float64
	// UnconfirmedBytes is the WAL not yet confirmed by the relay (current
	// position minus confirmed_flush_lsn).
	UnconfirmedBytes float64
	// OldestUnsettledAge is the age of the commit of the oldest
	// transaction this relay read and has not settled; 0 when none, or on
	// a standby.
	OldestUnsettledAge time.Duration
}

// SlotLag reads the slot's lag from the server and the relay's oldest
// unsettled commit.
func (s *Subscriber) SlotLag(ctx context.Context) (Lag, error) {
	var l Lag
	err := s.pool.QueryRow(ctx, sqlq.WALSlotLag, s.cfg.Names.Slot).Scan(&l.RetainedBytes, &l.UnconfirmedBytes)
	if errors.Is(err, pgx.ErrNoRows) {
		return l, fmt.Errorf("walrelay: replication slot %s does not exist: it was dropped; run walrelay.Setup to create it (events committed meanwhile are not streamed)", s.cfg.Names.Slot)
	}
	if err != nil {
		return l, fmt.Errorf("walrelay: read the lag of slot %s: %w", s.cfg.Names.Slot, err)
	}
	if t := s.oldestUnsettled.Load(); t != 0 {
		l.OldestUnsettledAge = time.Since(time.Unix(0, t))
	}
	return l, nil
}

// MetricNames are the metrics of Collector.
var MetricNames = []string{"outbox_wal_slot_retained_bytes", "outbox_wal_slot_unconfirmed_bytes", "outbox_wal_oldest_unsettled_age_seconds", "outbox_wal_relay_active",
	"outbox_wal_slot_lost_total", "outbox_wal_backfilled_total", "outbox_wal_malformed_frames_total"}

// collector reads the lag at each scrape.
type collector struct {
	s                                  *Subscriber
	retained, unconfirmed, age, active *prometheus.Desc
	lost, backfilled, malformed        *prometheus.Desc
}

// Collector returns a Prometheus collector of the relay's slot: retained
// and unconfirmed WAL in bytes, the age of the oldest unsettled commit in
// seconds, whether this relay reads the slot, and the slots it found lost
// and the rows it backfilled from the table, and the sessions that a malformed
// replication frame ended. Each scrape runs one
// query (SlotLag). Register it on your registry.
func (s *Subscriber) Collector() prometheus.Collector {
	labels := prometheus.Labels{"table": s.cfg.Table.String(), "slot": s.cfg.Names.Slot}
	return &collector{s: s,
		retained:    prometheus.NewDesc(MetricNames[0], "WAL the server retains for the WAL relay's slot, in bytes.", nil, labels),
		unconfirmed: prometheus.NewDesc(MetricNames[1], "WAL the WAL relay has not confirmed, in bytes.", nil, labels),
		age:         prometheus.NewDesc(MetricNames[2], "Age of the commit of the oldest transaction the relay read and has not settled (0 when none).", nil, labels),
		active:      prometheus.NewDesc(MetricNames[3], "1 while this relay reads the slot, 0 on a standby.", nil, labels),
		lost:        prometheus.NewDesc(MetricNames[4], "Times this relay found the slot gone or invalidated and recreated it.", nil, labels),
		backfilled:  prometheus.NewDesc(MetricNames[5], "Rows this relay read from the table after a recreated slot (delivered before the stream).", nil, labels),
		malformed:   prometheus.NewDesc(MetricNames[6], "Replication sessions this relay ended on a malformed frame (a new session follows).", nil, labels),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.retained
	ch <- c.unconfirmed
	ch <- c.age
	ch <- c.active
	ch <- c.lost
	ch <- c.backfilled
	ch <- c.malformed
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	active := 0.0
	if c.s.Active() {
		active = 1
	}
	ch <- prometheus.MustNewConstMetric(c.active, prometheus.GaugeValue, active)
	ch <- prometheus.MustNewConstMetric(c.lost, prometheus.CounterValue, float64(c.s.slotLost.Load()))
	ch <- prometheus.MustNewConstMetric(c.backfilled, prometheus.CounterValue, float64(c.s.backfilled.Load()))
	ch <- prometheus.MustNewConstMetric(c.malformed, prometheus.CounterValue, float64(c.s.malformed.Load()))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	l, err := c.s.SlotLag(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(c.retained, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(c.retained, prometheus.GaugeValue, l.RetainedBytes)
	ch <- prometheus.MustNewConstMetric(c.unconfirmed, prometheus.GaugeValue, l.UnconfirmedBytes)
	ch <- prometheus.MustNewConstMetric(c.age, prometheus.GaugeValue, l.OldestUnsettledAge.Seconds())
}
