package walrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/tests"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/relaytest"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// conformanceRelay describes the WAL relay on the private cluster of pool
// to the conformance suite (internal/relaytest).
func conformanceRelay(pool *pgxpool.Pool) relaytest.Relay {
	return relaytest.Relay{
		Name:    "wal",
		Mode:    relaytest.ModeWAL,
		Pool:    func(testing.TB) *pgxpool.Pool { return pool },
		Migrate: []schema.MigrateOption{schema.WithAllColumns()},
		SetUp: func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) error {
			_, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{})
			return err
		},
		New: func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table, o relaytest.Options) (message.Subscriber, error) {
			cfg := walrelay.Config{Table: tbl, MaxAttempts: o.MaxAttempts, MaxInFlight: o.MaxInFlight,
				CloseTimeout: o.CloseTimeout, DispatchTimeout: o.DispatchTimeout, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
				Backoff: func(int) time.Duration { return o.Backoff }}
			if o.PollInterval > 0 {
				// The stream loop's only tick is StatusInterval's.
				cfg.StatusInterval, cfg.ElectionInterval = o.PollInterval, o.PollInterval
			}
			return walrelay.New(ctx, pool, cfg, watermill.NopLogger{})
		},
		// The session's end: its walsender is terminated; the relay starts
		// another session on the slot.
		EndTerm: func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) error {
			_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`,
				walrelay.DefaultNames(tbl).Slot)
			return err
		},
	}
}

// TestConformance runs the conformance suite and Watermill's universal
// suite against the WAL relay, on one private wal_level=logical cluster
// that the cases share (each in a schema of its own).
func TestConformance(t *testing.T) {
	t.Parallel()
	clusterSlots <- struct{}{}
	t.Cleanup(func() { <-clusterSlots })
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{
		"wal_level": "logical", "max_replication_slots": "100", "max_wal_senders": "100", "wal_sender_timeout": "10s",
		"max_connections": "300",
	}})
	cfg, err := pgxpool.ParseConfig(pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 100
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	r := conformanceRelay(pool)
	t.Run("wal", func(t *testing.T) {
		t.Parallel()
		relaytest.Run(t, r)
	})
	t.Run("universal", func(t *testing.T) {
		t.Parallel()
		relaytest.Universal(t, r, tests.Features{
			ConsumerGroups:      false, // every subscription of a table shares its rows
			ExactlyOnceDelivery: false,
			// Rows without an ordering key are delivered one at a time per
			// topic, in commit order, a nacked one before the next
			// (docs/WAL.md, "Per key"); the suite publishes in order.
			GuaranteedOrder:                     true,
			GuaranteedOrderWithSingleSubscriber: true,
			Persistent:                          true,
		})
	})
}
