package runbook_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// startRelay starts a relay of tbl (ordered mode with ordered) whose
// handler fails every event in fail permanently and acks the others; it
// returns the consumer and a stop that closes the relay and waits for its
// handlers.
func startRelay(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, ordered bool, fail func(uuid.UUID) bool) (*consumer, func()) {
	t.Helper()
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: ordered, MaxAttempts: 100, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: time.Second,
		Backoff: func(int) time.Duration { return time.Hour }}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	c := consume(t, sub, func(msg *message.Message, _ int) error {
		if fail(uuid.MustParse(msg.UUID)) {
			return subscriber.Permanent(errors.New("poison"))
		}
		return nil
	})
	stopped := false
	stop := func() {
		if stopped {
			return
		}
		stopped = true
		if err := sub.Close(); err != nil {
			t.Error(err)
		}
		c.wg.Wait()
	}
	t.Cleanup(stop)
	return c, stop
}

// eventState reads the event through the runbook.
func eventState(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) runbook.Row {
	t.Helper()
	r, err := runbook.New(pool, tbl).Event(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// holdAt returns the state of the hold at the event's row, 0 when none.
func holdAt(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) runbook.HoldState {
	t.Helper()
	s, held, err := runbook.New(pool, tbl).HoldOfEvent(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if !held {
		return 0
	}
	return s
}

// replayAccepted waits until a dry run of the replay of id is accepted
// (an ordered relay writes its floors at its next tick).
func replayAccepted(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) {
	t.Helper()
	waitUntil(t, 15*time.Second, "the replay of "+id.String()+" accepted", func() bool {
		_, err := runbook.New(pool, tbl).ReplayEvent(context.Background(), id, runbook.ReplayOptions{DryRun: true})
		if err != nil && !errors.Is(err, runbook.ErrNotRelayedYet) {
			t.Fatalf("replay of %s: %v", id, err)
		}
		return err == nil
	})
}

// TestSkipOfReplayedSkippedRowStaysSkippedOrdered (issue 54, item 7): in
// ordered mode a row skipped, replayed, and whose replay is skipped
// before a relay runs is skipped, never delivered again, and never read as
// delivered.
func TestSkipOfReplayedSkippedRowStaysSkippedOrdered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "rs7_outbox", schema.WithMode(schema.ModeOrdered))
	ids := enqueueKeys(t, pool, tbl, "k", "k")
	k1, k2 := ids[0], ids[1]
	c, stop := startRelay(t, pool, tbl, true, func(id uuid.UUID) bool { return id == k1 })
	waitUntil(t, 15*time.Second, "k1 dead", func() bool { return holdAt(t, pool, tbl, k1) == runbook.HoldDead })
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, k1, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 15*time.Second, "k1 skipped, k2 delivered", func() bool {
		return eventState(t, pool, tbl, k1).Skipped && c.count(c.acked, k2) == 1
	})
	replayAccepted(t, pool, tbl, k1)
	stop()
	delivered := c.count(c.delivers, k1)

	// No relay runs: the replay, then its skip.
	if rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, k1, runbook.ReplayOptions{}); err != nil || rep.Changed != 1 {
		t.Fatalf("replay of the skipped row: %+v, %v", rep, err)
	}
	if r := eventState(t, pool, tbl, k1); r.State() != runbook.RowPending || !r.ReplayDue {
		t.Fatalf("replayed row reads %s (%+v), want pending with its replay due", r.State(), r)
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, k1, false); err != nil {
		t.Fatalf("skip of the replay: %v", err)
	}
	if r := eventState(t, pool, tbl, k1); r.State() != runbook.RowPending || !r.SkipRequested {
		t.Fatalf("row whose replay's skip is requested reads %s (%+v), want pending with a skip requested", r.State(), r)
	}

	c2, _ := startRelay(t, pool, tbl, true, func(uuid.UUID) bool { return false })
	waitUntil(t, 15*time.Second, "the replay hold applied", func() bool { return holdAt(t, pool, tbl, k1) == 0 })
	if r := eventState(t, pool, tbl, k1); r.State() != runbook.RowSkipped {
		t.Fatalf("row skipped, replayed and skipped again reads %s (%+v), want skipped", r.State(), r)
	}
	if n := c2.count(c2.delivers, k1) + c.count(c.delivers, k1) - delivered; n != 0 {
		t.Fatalf("the skipped row was delivered %d times after its skip", n)
	}
}

// TestSkipOfFailedReplayOfDefaultDeadRowOrdered (issue 54, item 9): a
// keyed row that went dead under the default relay, replayed after the
// switch to ordered mode (a replay hold), that fails again and whose
// replay is skipped reads as skipped, not delivered.
func TestSkipOfFailedReplayOfDefaultDeadRowOrdered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "rs9_outbox", schema.WithOrderingKeyColumn())
	k1 := enqueueKeys(t, pool, tbl, "k")[0]
	_, stop := startRelay(t, pool, tbl, false, func(id uuid.UUID) bool { return id == k1 })
	waitUntil(t, 15*time.Second, "k1 dead under the default relay", func() bool { return eventState(t, pool, tbl, k1).State() == runbook.RowDead })
	stop()

	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatal(err)
	}
	k2 := enqueueKeys(t, pool, tbl, "k")[0]
	c, _ := startRelay(t, pool, tbl, true, func(id uuid.UUID) bool { return id == k1 })
	waitUntil(t, 15*time.Second, "k2 delivered", func() bool { return c.count(c.acked, k2) == 1 })
	replayAccepted(t, pool, tbl, k1)
	if rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, k1, runbook.ReplayOptions{}); err != nil || rep.Changed != 1 {
		t.Fatalf("replay of the dead row: %+v, %v", rep, err)
	}
	waitUntil(t, 15*time.Second, "the replay dead", func() bool { return holdAt(t, pool, tbl, k1) == runbook.HoldDead })
	if r := eventState(t, pool, tbl, k1); r.State() != runbook.RowDead {
		t.Fatalf("failed replay reads %s (%+v), want dead", r.State(), r)
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, k1, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 15*time.Second, "the skip applied", func() bool { return holdAt(t, pool, tbl, k1) == 0 })
	if r := eventState(t, pool, tbl, k1); r.State() != runbook.RowSkipped || r.LastError == nil {
		t.Fatalf("skipped failed replay reads %s (%+v), want skipped with its last error", r.State(), r)
	}
}
