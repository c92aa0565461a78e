package subscriber_test

import (
	"context"
	"encoding/json"

	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The default relay's promises that its bounded claim and its sweep must
// keep (issue 43). Each test failed before its fix.

// TestSweepSkipsPausedTopic: with a topic paused, the bounded claim's sweep
// (every LockTTL/4, here every second) claims none of its rows: they stay
// pending and untouched, as docs/OPERATIONS.md ("Pausing a topic") says.
// Before, the sweep ran the claim without the paused-topic filter and
// delivered them.
func TestSweepSkipsPausedTopic(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "sweep_paused_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 4 * time.Second, Metrics: m})
	if !subscriber.Bounded(s) {
		t.Fatal("the relay claims without the bound: the test needs the sweep")
	}
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	enqueue(t, pool, tbl, topicB, 1)
	waitFor(t, "the first row of B", 2*time.Minute, func() bool { return log.count(topicB) == 1 })
	if res, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "broken consumer", false); err != nil || !res.Paused {
		t.Fatalf("PauseTopic: %+v, %v", res, err)
	}
	waitFor(t, "the relay to see the pause", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.PausedTopics.WithLabelValues(tbl.Qualified())) == 1
	})
	idsA := enqueue(t, pool, tbl, topicA, 5)
	enqueue(t, pool, tbl, topicB, 1)
	waitFor(t, "B's row while A is paused", 2*time.Minute, func() bool { return log.count(topicB) == 2 })
	time.Sleep(3500 * time.Millisecond) // three sweeps
	if n := log.count(topicA); n != 0 {
		t.Fatalf("%d rows of paused topic A delivered (by the sweep)", n)
	}
	for _, id := range idsA {
		if st := state(t, pool, tbl, id); st.published || st.locked || st.attempts != 0 {
			t.Fatalf("row %s of paused topic A: %+v, want pending and untouched", id, st)
		}
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "A's rows after the resume", 2*time.Minute, func() bool { return log.count(topicA) == 5 })
}

// TestSweepCountsOnlyMissedRows: draining an ordinary backlog (no crash, no
// explicit available_at) for several sweeps counts nothing in
// outbox_sweep_claimed_total: the sweep claims only rows below the bound,
// which the bounded claim cannot see. Before, the sweep ran the unbounded
// claim and took (and counted) backlog rows the bounded claim would have
// taken anyway. LockTTL is 12 s (a sweep every 3 s), so that a row claimed
// and waiting for the slow consumer on a loaded machine does not see its
// lease expire (the sweep would rightly take it back, and count it).
func TestSweepCountsOnlyMissedRows(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "sweep_count_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 12 * time.Second, Metrics: m})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var got atomic.Int64
	go func() {
		for msg := range ch {
			time.Sleep(4 * time.Millisecond) // the drain lasts at least 8 s: two sweeps or more
			msg.Ack()
			got.Add(1)
		}
	}()
	enqueue(t, pool, tbl, "org.sweep.v1", 1)
	waitFor(t, "the first row", 2*time.Minute, func() bool { return got.Load() == 1 })
	const n = 2000
	enqueue(t, pool, tbl, "org.sweep.v1", n)
	start := time.Now()
	waitFor(t, "the backlog to drain", 5*time.Minute, func() bool { return got.Load() >= n+1 })
	t.Logf("the backlog drained in %s (a sweep every 3 s)", time.Since(start).Round(time.Millisecond))
	if c := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); c != 0 {
		t.Fatalf("outbox_sweep_claimed_total = %v after an ordinary backlog, want 0", c)
	}
}

// TestSweepKeepsMaxInFlight: the sweep counts the batch in the claim loop's
// hands and its pre-claimed next batch: with MaxInFlight 20 no more than 20
// rows are leased and unanswered, however the sweep and the claim loop
// interleave. Before, a consumer that read slowly got 30.
func TestSweepKeepsMaxInFlight(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "sweep_inflight_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 4 * time.Second, BatchSize: 10, MaxInFlight: 20})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	// The bound is set, so that the sweep has something to do before the fix.
	enqueue(t, pool, tbl, "org.inflight.v1", 1)
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	next := func() *message.Message {
		t.Helper()
		select {
		case msg := <-ch:
			return msg
		case <-time.After(time.Minute):
			t.Fatal("no delivery within a minute")
			return nil
		}
	}
	next().Ack()
	enqueue(t, pool, tbl, "org.inflight.v1", 200)
	held := []*message.Message{next()} // one read, then the consumer is slow
	time.Sleep(3 * time.Second)        // three sweeps
	leased := func() int {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE locked_at IS NOT NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := leased(); n > 20 {
		t.Errorf("%d rows leased and unanswered with MaxInFlight 20", n)
	}
	deadline := time.After(2 * time.Second)
read:
	for {
		select {
		case msg := <-ch:
			held = append(held, msg)
		case <-deadline:
			break read
		}
	}
	if len(held) > 20 {
		t.Errorf("%d messages delivered and unanswered with MaxInFlight 20", len(held))
	}
	for _, msg := range held {
		msg.Ack()
	}
}

// TestDownMigrationTurnsTheBoundOff: after AvailableAtDownSQL a running relay
// claims without a bound (docs/XMIN.md): a writer that does its business
// work first and writes the outbox last (its row's available_at is its
// transaction's start under the old default) is delivered at once, not by
// the sweep. Before, the default was read once, at New.
//
// The verdict does not depend on the machine's speed: the sweep runs every
// 5 minutes (LockTTL 20 minutes), its first run long after the test's
// 2-minute wait, and only the sweep claims a row below a kept bound; so a
// delivery within the wait is the claim loop's, and
// outbox_sweep_claimed_total stays 0.
func TestDownMigrationTurnsTheBoundOff(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "bounded_down_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	const lockTTL = 20 * time.Minute
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: lockTTL, Metrics: m})
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 3), time.Minute)
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000009", "down")); err != nil {
		t.Fatal(err)
	}
	late := lateWriter(t, pool, tbl)
	for range 5 {
		time.Sleep(200 * time.Millisecond)
		d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 1), time.Minute)
	}
	id := late()
	took, ok := d.within([]string{id}, 2*time.Minute)
	if !ok {
		t.Fatalf("after the down migration a late writer's row was not delivered within %s of its commit (the sweep runs every %s): the relay kept the bound", took.Round(time.Second), lockTTL/4)
	}
	t.Logf("after the down migration a late writer's row was delivered %s after its commit", took.Round(time.Millisecond))
	if n := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); n != 0 {
		t.Fatalf("the sweep claimed %v rows, want 0: the relay kept the bound", n)
	}
	// And back up: the relay takes the bound again.
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000009", "up")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the bound after the up migration", 2*time.Minute, func() bool {
		d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 1), time.Minute)
		_, set := subscriber.BoundOf(s)
		return set
	})
}

// TestBoundedClaimAdvancesDuringADrain: a relay started with a backlog
// sets a bound from its first full claim and moves it with every claim of
// the drain, so that under a pinned horizon each claim walks about one
// batch of entries, not every entry since the drain began. Before, the
// bound moved only after a claim that was not full, so a relay started
// with a backlog had none until the backlog was gone.
func TestBoundedClaimAdvancesDuringADrain(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_drain_outbox")
	ids := enqueue(t, pool, tbl, "org.drain.v1", 1000)
	// The backlog is older than the cut's margin (50 ms) before the relay
	// starts: on a fast machine 300 rows can be claimed within the margin
	// of their insert, and a bound at the cut is then rightly below them.
	time.Sleep(200 * time.Millisecond)
	s := newSub(t, pool, subscriber.Config{Table: tbl, BatchSize: 50})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	gate := make(chan struct{})
	var got atomic.Int64
	go func() {
		for msg := range ch {
			if got.Add(1) == 300 {
				<-gate
			}
			msg.Ack()
		}
	}()
	waitFor(t, "300 deliveries", time.Minute, func() bool { return got.Load() >= 300 })
	var row200 time.Time
	if err := pool.QueryRow(context.Background(), `SELECT available_at FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[199]).Scan(&row200); err != nil {
		t.Fatal(err)
	}
	at, set := subscriber.BoundOf(s)
	close(gate)
	if !set {
		t.Fatal("no bound after 300 rows of a backlog were claimed: every claim of the drain walks from the oldest entry")
	}
	if at.Before(row200) {
		t.Fatalf("the bound (%s) is below the 200th row of the backlog (%s) after 300 were claimed: the drain's claims walk what they claimed before",
			at.Format(time.RFC3339Nano), row200.Format(time.RFC3339Nano))
	}
	waitFor(t, "the backlog to drain", time.Minute, func() bool { return got.Load() >= 1000 })
}

// TestKeyedRowWakesIdleDefaultRelay: a row with an ordering key, enqueued
// into a table with the ordering columns, wakes an idle default relay at
// once, with a poll interval of 10 minutes, as an unkeyed row does. Before,
// a keyed commit tried only the ordered relays' idle lock and the default
// relay found the row at its next poll.
func TestKeyedRowWakesIdleDefaultRelay(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "keyed_wake_outbox", schema.WithAllColumns())
	// The poll and the sweep every 10 minutes: a delivery within the
	// 2-minute wait is the wake-up's, however slow the machine.
	const poll = 10 * time.Minute
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: poll, LockTTL: 4 * poll})
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, pool, tbl, "org.keyed.v1", 1), time.Minute)
	for i := range 3 {
		waitFor(t, "the relay to go idle", 2*time.Minute, func() bool { return idleHeld(t, pool, tbl) })
		id := uuid.New()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.keyed.v1", EventID: id,
				Payload: json.RawMessage(`{}`), OrderingKey: "key-" + string(rune('a'+i))})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		took, ok := d.within([]string{id.String()}, 2*time.Minute)
		if !ok {
			t.Fatalf("a keyed row did not reach the idle default relay within %s (PollInterval %s): its commit did not wake it", took.Round(time.Second), poll)
		}
		t.Logf("keyed row %d delivered %s after its commit", i, took.Round(time.Millisecond))
	}
}
