package runbook_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// recordRelayLockTTL starts a default relay with lockTTL on tbl, the way a
// deployment does, and closes it once it has recorded the table's mode and
// its LockTTL; the record stays.
func recordRelayLockTTL(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, lockTTL time.Duration) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, LockTTL: lockTTL}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	rec, ok, err := schema.RecordedMode(ctx, pool, tbl)
	if err != nil || !ok || rec.Mode != schema.ModeDefault || rec.LockTTL != lockTTL {
		t.Fatalf("after the relay started: record %+v (recorded %v, %v), want mode default with LockTTL %s", rec, ok, err, lockTTL)
	}
}

// TestLeasesJudgedByTheRelaysRecordedLockTTL: a relay running with
// LockTTL 5m records it at start, and ReplayEvent, ReplayDead and
// SkipEvent, given no LockTTL or a shorter one (the CLI's
// OUTBOX_RELAY_LOCK_TTL, the console's none), leave alone a row leased
// 90 s ago: a copy may still be in its handler, and the relay would not
// claim it again for 3.5 minutes. A LockTTL given above the recorded one
// is honoured (the larger judges); on a table where no relay recorded one,
// the 60 s default judges, and the same row is replayed.
func TestLeasesJudgedByTheRelaysRecordedLockTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "lockttl_outbox")
	recordRelayLockTTL(t, pool, tbl, 5*time.Minute)

	ids := enqueue(t, pool, tbl, tenantA, repeat(topicA, 3), nil)
	failedInHandler, deadLeased, leasedLongAgo := ids[0], ids[1], ids[2]
	// A failed row claimed again 90 s ago, its handler still running.
	exec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = 'timeout', available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, failedInHandler)
	// A dead row whose lease was taken 90 s ago.
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'timeout', dead_at = now(), available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, deadLeased)
	// A dead row leased 6 minutes ago: past the recorded 5 minutes.
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'timeout', dead_at = now(), available_at = now() - interval '7 minutes',
  locked_at = now() - interval '6 minutes' WHERE event_id = $1`, leasedLongAgo)
	before := states(t, pool, tbl, ids)
	rb := runbook.New(pool, tbl)

	for _, given := range []time.Duration{0, time.Minute} {
		for _, id := range []uuid.UUID{failedInHandler, deadLeased} {
			for _, dry := range []bool{true, false} {
				_, err := rb.ReplayEvent(ctx, id, runbook.ReplayOptions{LockTTL: given, DryRun: dry})
				var nre *runbook.NotReplayableError
				if !errors.Is(err, runbook.ErrLocked) || !errors.As(err, &nre) || nre.LockTTL != 5*time.Minute {
					t.Errorf("ReplayEvent of a row leased 90 s ago (LockTTL %s given, dry run %v): %v, want ErrLocked judged by 5m", given, dry, err)
				}
			}
		}
		for _, dry := range []bool{true, false} {
			res, err := rb.ReplayDead(ctx, runbook.DeadFilter{Topic: topicA, LockTTL: given}, dry)
			if err != nil {
				t.Fatal(err)
			}
			if res.LockTTL != 5*time.Minute {
				t.Errorf("ReplayDead (LockTTL %s given) judged by %s, want 5m", given, res.LockTTL)
			}
			if dry && res.Rows != 1 {
				t.Errorf("ReplayDead preview (LockTTL %s given): %d rows, want 1 (the row leased 6 minutes ago)", given, res.Rows)
			}
			if !dry {
				// Put the row replayed back: the next round sees the same rows.
				assertReset(t, pool, tbl, leasedLongAgo)
				exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'timeout', dead_at = now(), available_at = now() - interval '7 minutes',
  locked_at = now() - interval '6 minutes' WHERE event_id = $1`, leasedLongAgo)
			}
		}
	}
	for _, dry := range []bool{true, false} {
		if _, err := rb.SkipEvent(ctx, deadLeased, dry); !errors.Is(err, runbook.ErrLocked) {
			t.Errorf("SkipEvent of a dead row leased 90 s ago (dry run %v): %v, want ErrLocked", dry, err)
		}
	}
	assertUnchanged(t, "refused actions", before[:2], states(t, pool, tbl, ids[:2]))

	// A LockTTL above the recorded one judges: the row leased 6 minutes
	// ago is left alone under 10 minutes.
	if _, err := rb.ReplayEvent(ctx, leasedLongAgo, runbook.ReplayOptions{LockTTL: 10 * time.Minute}); !errors.Is(err, runbook.ErrLocked) {
		t.Errorf("ReplayEvent with LockTTL 10m of a row leased 6 minutes ago: %v, want ErrLocked", err)
	}

	// Where no relay recorded its LockTTL, the default (60 s) judges.
	plain := testdb.Table(t, "lockttl_plain_outbox")
	pids := enqueue(t, pool, plain, tenantA, repeat(topicA, 1), nil)
	exec(t, pool, plain, `UPDATE %s SET attempts = 2, last_error = 'timeout', available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, pids[0])
	if _, err := runbook.New(pool, plain).ReplayEvent(ctx, pids[0], runbook.ReplayOptions{}); err != nil {
		t.Fatalf("ReplayEvent of a row leased 90 s ago, no LockTTL recorded: %v", err)
	}
	assertReset(t, pool, plain, pids[0])
}
