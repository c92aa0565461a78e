package runbook_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALBulkReplayWhileDraining (issue 42, item 4): in a WAL table, a
// key's hold drains (its held row x3 skipped, the next parked row in a
// handler) while an earlier row of the key, x1, is dead (skipped once, then
// replayed while x3 held the key, and dead again). A bulk replay by topic,
// by cause and with a preview's snapshot, and a replay of x1 or x3, are all
// refused by the one hold rule (a replay while a hold drains is refused):
// nothing changes. Once the hold is resolved, the bulk replay resets x1
// (x3, skipped, is not dead: a replay of that row resets it) and the relay
// delivers both. Before, ReplayDead reset the key's dead rows while the hold
// drained, and the relay parked their UPDATEs as copies of drained rows:
// none was delivered, and none was dead any more.
func TestWALBulkReplayWhileDraining(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := walCluster(t)
	msgs := make([]publisher.Message, 5)
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: tenantA, Topic: topicA, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: "k"}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	x1, x3, x4 := ids[0], ids[2], ids[3]
	release := make(chan struct{})
	released := false
	inHandler := make(chan struct{}, 1)
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: time.Second, MaxInFlight: 4, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if !released {
			close(release)
		}
		_ = s.Close()
	})
	c := consume(t, s, func(msg *message.Message, n int) error {
		id := uuid.MustParse(msg.UUID)
		switch {
		case (id == x1 && n <= 1) || (id == x3 && n == 0):
			return subscriber.Permanent(errors.New("poison"))
		case id == x4 && n == 0:
			select {
			case inHandler <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-msg.Context().Done():
				return errors.New("session ended")
			}
		}
		return nil
	})
	heldAt := func(id uuid.UUID, st runbook.HoldState) func() bool {
		return func() bool {
			list, err := runbook.New(pool, tbl).ListHolds(ctx, runbook.HoldsFilter{})
			return err == nil && len(list) == 1 && list[0].EventID == id.String() && list[0].State == st
		}
	}
	waitUntil(t, 20*time.Second, "x1 dead, holding k", heldAt(x1, runbook.HoldDead))
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, x1, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "x3 dead, holding k", heldAt(x3, runbook.HoldDead))
	// x1, skipped, is replayed while x3 holds k; it fails again and is dead
	// without moving the hold.
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, x1, runbook.ReplayOptions{}); err != nil {
		t.Fatalf("replay of the skipped row x1 while x3 holds k: %v", err)
	}
	waitUntil(t, 20*time.Second, "x1 dead again, x3 holding k", func() bool {
		var dead bool
		err := pool.QueryRow(ctx, `SELECT dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, x1).Scan(&dead)
		return err == nil && dead && c.count(c.delivers, x1) == 2 && heldAt(x3, runbook.HoldDead)()
	})
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, x3, false); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inHandler:
	case <-time.After(2 * time.Minute):
		t.Fatal("x4 not in its handler: the hold did not drain")
	}
	waitUntil(t, 20*time.Second, "k's hold draining", heldAt(x3, runbook.HoldDraining))

	before := holdSnapshot(t, pool, tbl, tbl.HoldsTable())
	all := runbook.DeadFilter{Topic: topicA}
	if res, err := runbook.New(pool, tbl).ReplayDead(ctx, all, false); err != nil || res.Rows != 0 {
		t.Errorf("bulk replay by topic while k's hold drains: %d rows, %v; want 0 (refused)", res.Rows, err)
	}
	preview, err := runbook.New(pool, tbl).ReplayDead(ctx, all, true)
	if err != nil || preview.Rows != 0 {
		t.Errorf("preview of a bulk replay while k's hold drains: %d rows, %v; want 0", preview.Rows, err)
	}
	withSnapshot := all
	withSnapshot.Expect = &runbook.ReplaySnapshot{Rows: 1, MaxSequence: 1 << 40}
	if res, err := runbook.New(pool, tbl).ReplayDead(ctx, withSnapshot, false); res.Rows != 0 {
		t.Errorf("bulk replay with a snapshot of the dead row while k's hold drains: %d rows, %v; want 0", res.Rows, err)
	}
	var cause string
	if err := pool.QueryRow(ctx, `SELECT `+sqlq.CauseOf("last_error")+` FROM `+tbl.Sanitize()+` WHERE event_id = $1`, x1).Scan(&cause); err != nil {
		t.Fatal(err)
	}
	if res, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{AllTopics: true, Cause: cause}, false); err != nil || res.Rows != 0 {
		t.Errorf("bulk replay by cause while k's hold drains: %d rows, %v; want 0 (refused)", res.Rows, err)
	}
	for _, id := range []uuid.UUID{x1, x3} {
		_, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
		var re *runbook.HoldRuleError
		if !errors.As(err, &re) || re.State != runbook.HoldDraining || re.Op != runbook.OpReplay {
			t.Errorf("replay of %s while k's hold drains: %v; want a refusal by the hold's rules (draining)", id, err)
		}
	}
	if after := holdSnapshot(t, pool, tbl, tbl.HoldsTable()); after != before {
		t.Fatalf("the refused replays changed the table:\nbefore %s\nafter  %s", before, after)
	}

	released = true
	close(release)
	waitUntil(t, 20*time.Second, "k's hold resolved", func() bool {
		list, err := runbook.New(pool, tbl).ListHolds(ctx, runbook.HoldsFilter{})
		return err == nil && len(list) == 0
	})
	if res, err := runbook.New(pool, tbl).ReplayDead(ctx, all, false); err != nil || res.Rows != 1 {
		t.Fatalf("bulk replay once k's hold is resolved: %d rows, %v; want 1 (x1; x3 is skipped, not dead)", res.Rows, err)
	}
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, x3, runbook.ReplayOptions{}); err != nil {
		t.Fatalf("replay of the skipped row x3 once k's hold is resolved: %v", err)
	}
	waitUntil(t, 20*time.Second, "x1 and x3 delivered again", func() bool {
		return c.count(c.acked, x1) == 1 && c.count(c.acked, x3) == 1
	})
}

// TestWALReplayOfAnEarlierRowOfAHeldKey: a key went past a dead row (x1,
// skipped) and a later row (x3) went dead and holds the key. A replay of
// x1 is allowed by the hold rule (the hold is dead, not draining), and the
// relay delivers it while x3 still holds the key. Before, the relay took
// the replay's UPDATE for the stream's copy of a row the earlier drain had
// read (x1's sequence is below the hold's through) and parked it: x1 was
// never delivered, and no longer dead.
func TestWALReplayOfAnEarlierRowOfAHeldKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := walCluster(t)
	msgs := make([]publisher.Message, 4)
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: tenantA, Topic: topicA, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: "k"}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	x1, x3 := ids[0], ids[2]
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: time.Second, MaxInFlight: 4, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	c := consume(t, s, func(msg *message.Message, n int) error {
		id := uuid.MustParse(msg.UUID)
		if (id == x1 && n == 0) || id == x3 {
			return subscriber.Permanent(errors.New("poison"))
		}
		return nil
	})
	heldAt := func(id uuid.UUID, st runbook.HoldState) func() bool {
		return func() bool {
			list, err := runbook.New(pool, tbl).ListHolds(ctx, runbook.HoldsFilter{})
			return err == nil && len(list) == 1 && list[0].EventID == id.String() && list[0].State == st
		}
	}
	waitUntil(t, 20*time.Second, "x1 dead, holding k", heldAt(x1, runbook.HoldDead))
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, x1, false); err != nil {
		t.Fatal(err)
	}
	waitUntil(t, 20*time.Second, "x3 dead, holding k", heldAt(x3, runbook.HoldDead))
	if rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, x1, runbook.ReplayOptions{}); err != nil || rep.Changed != 1 {
		t.Fatalf("replay of x1 while x3 holds its key: %+v, %v", rep, err)
	}
	waitUntil(t, 20*time.Second, "x1 delivered again", func() bool { return c.count(c.acked, x1) == 1 })
	if !heldAt(x3, runbook.HoldDead)() {
		t.Fatal("x3 no longer holds its key")
	}
	if n := c.count(c.acked, ids[3]); n != 0 {
		t.Fatalf("the row behind x3 delivered %d times while x3 holds the key", n)
	}
}

// TestWALBulkReplayWaitsForAConcurrentSkip: a bulk replay that runs while
// another operator's skip of the held row is not committed yet waits for it
// (the replay's statement locks the holds it reads, as a single replay
// does) and then leaves the row alone: the hold is skip_requested. Before,
// the bulk replay read the hold as of its snapshot (dead), reset the row
// beside the skip, and the relay applying the skip took the replay for a
// copy of a drained row.
func TestWALBulkReplayWaitsForAConcurrentSkip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := walCluster(t)
	x := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{{TenantID: tenantA, Topic: topicA, EventID: x, Payload: json.RawMessage(`{"n":1}`), OrderingKey: "k"}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// x is dead and holds k, as the relay leaves it.
	exec(t, pool, tbl, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), attempts = 1, last_error = 'poison', available_at = 'infinity' WHERE event_id = $1`, x)
	exec(t, pool, tbl, `INSERT INTO `+tbl.HoldsTable()+` (mode, ordering_key, partition, sequence, event_id, dead_at) SELECT 'wal', ordering_key, ordering_partition, sequence, event_id, now() FROM `+tbl.Sanitize()+` WHERE event_id = $1`, x)
	skip, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = skip.Rollback(ctx) }()
	if _, err := skip.Exec(ctx, sqlq.WALSkipHoldIn(tbl), x, []string{"dead"}); err != nil {
		t.Fatal(err)
	}
	type result struct {
		rows int64
		err  error
	}
	done := make(chan result, 1)
	go func() {
		res, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{Topic: topicA}, false)
		done <- result{res.Rows, err}
	}()
	// The replay's statement waits for the skip's lock (or, without the
	// lock, is already done).
	waitUntil(t, 20*time.Second, "the bulk replay waiting for the skip, or done", func() bool {
		if len(done) > 0 {
			return true
		}
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%lh AS MATERIALIZED%')`).Scan(&waiting)
		return err == nil && waiting
	})
	if err := skip.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var r result
	select {
	case r = <-done:
	case <-time.After(2 * time.Minute):
		t.Fatal("the bulk replay did not return")
	}
	if r.err != nil || r.rows != 0 {
		t.Fatalf("bulk replay beside a skip of the held row: %d rows, %v; want 0 (the hold is skip_requested)", r.rows, r.err)
	}
	if st := state(t, pool, tbl, x); !st.Dead {
		t.Fatalf("the held row was reset beside the skip: %+v", st)
	}
}

// TestWALReplayOfSkippedRowWithoutError: a skipped row need not have
// failed (ordered mode moves a hold to its key's next row before that row
// is tried, and a skip of that hold marks the row skipped with attempts 0
// and no last_error); in a WAL table (after a switch) ReplayEvent resets
// it like any skipped row, instead of refusing it as not failed.
func TestWALReplayOfSkippedRowWithoutError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := walCluster(t)
	id := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenantA, Topic: topicA, EventID: id, Payload: json.RawMessage(`{"n":1}`), OrderingKey: "k"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET skipped_at = now() WHERE event_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	res, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
	if err != nil || res.Changed != 1 {
		t.Fatalf("replay of a skipped row that never failed: %+v, %v; want it reset", res, err)
	}
	var skipped bool
	if err := pool.QueryRow(ctx, `SELECT skipped_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&skipped); err != nil || skipped {
		t.Fatalf("after the replay: skipped_at set %t (%v), want cleared", skipped, err)
	}
}
