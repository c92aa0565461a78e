package subscriber_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRelayClaimsNothingOnATableSwitchedAwayWhileItsLockWasDown: a
// default relay's connections are cut and cannot come back for a while (a
// partition); a switch to ordered mode sees no relay-mode lock and is
// accepted meanwhile. When the default relay's connection returns, it
// takes its lock again, finds the table switched away, gives its lock
// back and claims nothing: every event written after that is delivered by
// the ordered relay alone, keyed ones in order, and more ordered relays may
// start. With single-active on (the default), the relay gives the table's
// single-active lock back too: an ordered relay refuses to start while a
// session holds it.
func TestRelayClaimsNothingOnATableSwitchedAwayWhileItsLockWasDown(t *testing.T) {
	t.Parallel()
	for _, single := range []bool{false, true} {
		t.Run(fmt.Sprintf("single-active %t", single), func(t *testing.T) {
			t.Parallel()
			claimsNothingSwitchedAway(t, single)
		})
	}
}

func claimsNothingSwitchedAway(t *testing.T, singleActive bool) {
	ctx := context.Background()
	admin := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	role := "relay_" + uuid.NewString()[:8]
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN SUPERUSER`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1`, role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE IF EXISTS `+role)
	})
	pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.User = role })
	logs := watermill.NewCaptureLogger()
	def, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, DisableSingleActive: !singleActive, LockTTL: time.Second,
		PollInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond}, logs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = def.Close() })
	defRec := newRecorder()
	consume(t, def, defRec, nil)
	modeLockHolder := func() string {
		h, err := pgmeta.Holder(ctx, admin, pgmeta.RelayMode(tbl.Qualified(), false))
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	waitFor(t, "the default relay holds its mode lock", time.Minute, func() bool { return modeLockHolder() != "" })

	// The partition: the role cannot log in, its sessions end.
	if _, err := admin.Exec(ctx, `ALTER ROLE `+role+` NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the default relay's sessions end", time.Minute, func() bool {
		var left int
		if err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = $1`, role).Scan(&left); err != nil {
			t.Fatal(err)
		}
		return left == 0 && modeLockHolder() == ""
	})
	if err := schema.SwitchMode(ctx, admin, tbl, schema.ModeOrdered, "test"); err != nil {
		t.Fatalf("switch to ordered mode while the default relay's lock is down: %v", err)
	}
	ord := subOnceOtherModeGone(t, admin, orderedCfg(tbl))
	ordRec := newRecorder()
	consume(t, ord, ordRec, nil)

	// The partition heals: the default relay takes its lock again.
	if _, err := admin.Exec(ctx, `ALTER ROLE `+role+` LOGIN`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the default relay takes its mode lock again and finds the table switched away", time.Minute, func() bool {
		for _, l := range logs.Captured()[watermill.ErrorLogLevel] {
			if strings.Contains(l.Msg, "switched to another relay mode") {
				return true
			}
		}
		return false
	})

	var keys []string
	for i := range 60 {
		keys = append(keys, fmt.Sprintf("k%d", i%6))
	}
	events := enqueueKeyed(t, admin, tbl, keys...)
	unkeyed := enqueue(t, admin, tbl, "org.thing.changed.v1", 20)
	ordRec.waitAcked(t, events, 2*time.Minute)
	waitFor(t, "the unkeyed events are published", 2*time.Minute, func() bool {
		for _, id := range unkeyed {
			if !state(t, admin, tbl, id).published {
				return false
			}
		}
		return true
	})
	ordRec.checkOrder(t)
	defRec.mu.Lock()
	delivered := len(defRec.seen)
	defRec.mu.Unlock()
	if delivered > 0 {
		t.Fatalf("the default relay delivered %d events on a table switched to ordered mode while its lock was down", delivered)
	}
	// It gave its lock back (it claims nothing more): a second ordered
	// relay starts beside it.
	if h := modeLockHolder(); h != "" {
		t.Fatalf("the default relay on a table switched away still holds its mode lock (%s)", h)
	}
	waitFor(t, "the default relay gives the single-active lock back", time.Minute, func() bool {
		h, err := pgmeta.Holder(ctx, admin, pgmeta.Leader(tbl.Qualified()))
		if err != nil {
			t.Fatal(err)
		}
		return h == ""
	})
	if _, err := subscriber.New(ctx, admin, orderedCfg(tbl), nil); err != nil {
		t.Fatalf("an ordered relay beside the fenced default relay: %v", err)
	}
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}
}
