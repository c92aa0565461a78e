package subscriber_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/relaytest"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// conformanceRelay describes the table relay, in the default or ordered
// mode, to the conformance suite (internal/relaytest).
func conformanceRelay(ordered bool) relaytest.Relay {
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
			Backoff: func(int) time.Duration { return o.Backoff }}
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
	// The default relay runs Watermill's universal suite in TestPubSub.
	t.Run("ordered universal", func(t *testing.T) {
		t.Parallel()
		relaytest.Universal(t, conformanceRelay(true), suiteFeatures)
	})
}
