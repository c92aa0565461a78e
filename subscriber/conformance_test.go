package subscriber_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/outboxkit/watermill-outbox/internal/relaytest"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// conformanceRelay describes the table relay, in the default or ordered
// mode, to the conformance suite (internal/relaytest).
func conformanceRelay(ordered bool) relaytest.Relay { return conformanceRelayWith(ordered, nil) }

// conformanceRelayWith is conformanceRelay whose relays record metrics in m.
func conformanceRelayWith(ordered bool, m *metrics.Metrics) relaytest.Relay {
	r := relaytest.Relay{Name: "default", Mode: relaytest.ModeDefault}
	if ordered {
		r.Name, r.Mode = "ordered", relaytest.ModeOrdered
		r.Migrate = []schema.MigrateOption{schema.WithAllColumns()}
	}
	if ordered {
		// A term's end: the heartbeats fail for twice the lease (LockTTL
		// 1 s), as in TestOrderedLostLeaseKeepsOneCopyPerKey.
		r.EndTerm = func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `LOCK TABLE `+tbl.RelaysTable()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
					return err
				}
				time.Sleep(2 * time.Second)
				return nil
			})
		}
	}
	r.Pool = func(t testing.TB) *pgxpool.Pool { return testdb.Pool(t) }
	r.New = func(_ context.Context, pool *pgxpool.Pool, tbl schema.Table, o relaytest.Options) (message.Subscriber, error) {
		cfg := subscriber.Config{Table: tbl, Ordered: ordered, LockTTL: 2 * time.Second, PollInterval: 100 * time.Millisecond,
			ElectionInterval: 100 * time.Millisecond, MaxAttempts: o.MaxAttempts, MaxInFlight: o.MaxInFlight,
			CloseTimeout: o.CloseTimeout, DispatchTimeout: o.DispatchTimeout, DisableSingleActive: o.DisableSingleActive && !ordered,
			Backoff: func(int) time.Duration { return o.Backoff }, Metrics: m}
		if ordered {
			cfg.LockTTL = time.Second
		}
		if o.PollInterval > 0 {
			// Every periodic look at rows as far: ordered mode's membership
			// tick is min(ElectionInterval, LockTTL/3), the default relay's
			// sweep runs every LockTTL/4.
			cfg.PollInterval, cfg.ElectionInterval, cfg.LockTTL = o.PollInterval, o.PollInterval, 3*o.PollInterval
		}
		if o.MaxInFlight > 0 && o.MaxInFlight < subscriber.ClaimBatchSizeDefault {
			cfg.BatchSize = o.MaxInFlight
		}
		return subscriber.New(context.Background(), pool, cfg, o.Logger)
	}
	// Asleep: the relay holds the table's idle lock exclusively (ordered
	// mode's own lock for keyed rows), as it does only while it sleeps
	// (docs/ARCHITECTURE.md, "Wake-up").
	r.Asleep = func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) (bool, error) {
		key := sqlq.IdleLockKey(tbl)
		if ordered {
			key = sqlq.OrderedIdleLockKey(tbl)
		}
		var held bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND ((classid::bigint << 32) | objid::bigint) = $1 AND mode = 'ExclusiveLock' AND granted)`, key).Scan(&held)
		return held, err
	}
	return r
}

// TestConformance runs the conformance suite against the default relay
// and ordered mode.
func TestConformance(t *testing.T) {
	t.Parallel()
	t.Run("default", func(t *testing.T) {
		t.Parallel()
		relaytest.Run(t, conformanceRelay(false))
	})
	t.Run("ordered", func(t *testing.T) {
		t.Parallel()
		relaytest.Run(t, conformanceRelay(true))
	})
	// The default relay with its hot path: the suite's writers commit
	// through the HotPath of the relay started last on the table
	// (docs/HOTPATH.md), and every promise of the default relay holds.
	t.Run("default hot", func(t *testing.T) {
		t.Parallel()
		_, m := newMetrics(t)
		t.Cleanup(func() {
			// The cases run with the hot path for real: some of their
			// events were delivered without a claim.
			if n := testutil.CollectAndCount(m.Delivered); n == 0 || sumCounter(t, m.Delivered, metrics.PathHot) == 0 {
				t.Errorf("no event of the suite was delivered by the hot path")
			}
		})
		relaytest.Run(t, hotRelay(m))
	})
	// The default relay runs Watermill's universal suite in TestPubSub.
	t.Run("ordered universal", func(t *testing.T) {
		t.Parallel()
		relaytest.Universal(t, conformanceRelay(true), suiteFeatures)
	})
}

// hotRelay is the default relay whose writers commit through the hot path
// of the relay started last on their table (the cold path when none runs).
func hotRelay(m *metrics.Metrics) relaytest.Relay {
	r := conformanceRelayWith(false, m)
	r.Name = "default hot"
	var mu sync.Mutex
	hot := map[schema.Table]*subscriber.HotPath{}
	newRelay := r.New
	r.New = func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table, o relaytest.Options) (message.Subscriber, error) {
		sub, err := newRelay(ctx, pool, tbl, o)
		if err != nil {
			return nil, err
		}
		h, err := subscriber.NewHotPath(sub.(*subscriber.Subscriber), subscriber.HotConfig{})
		if err != nil {
			return nil, err
		}
		mu.Lock()
		hot[tbl] = h
		mu.Unlock()
		return sub, nil
	}
	r.Enqueue = func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table, msgs []publisher.Message) ([]int64, error) {
		mu.Lock()
		h := hot[tbl]
		mu.Unlock()
		var seqs []int64
		if h == nil {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var err error
				seqs, err = publisher.EnqueueBatch(ctx, tx, tbl, msgs)
				return err
			})
			return seqs, err
		}
		err := h.BeginFunc(ctx, pool, func(tx *subscriber.HotTx) error {
			var err error
			seqs, err = tx.EnqueueBatch(ctx, msgs)
			return err
		})
		return seqs, err
	}
	return r
}

// sumCounter sums the series of c whose path label is path.
func sumCounter(t *testing.T, c *prometheus.CounterVec, path string) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 1024)
	c.Collect(ch)
	close(ch)
	var sum float64
	for pm := range ch {
		var d dto.Metric
		if err := pm.Write(&d); err != nil {
			t.Fatal(err)
		}
		for _, l := range d.GetLabel() {
			if l.GetName() == "path" && l.GetValue() == path {
				sum += d.GetCounter().GetValue()
			}
		}
	}
	return sum
}
