package subscriber_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// deadState reads the dead state of a row: dead_at set, parked at
// available_at = 'infinity', and its lease.
type deadRow struct {
	dead, parked, locked bool
	attempts             int
	lastError            string
}

func readDead(t *testing.T, tbl schema.Table, eventID string) deadRow {
	t.Helper()
	var r deadRow
	var le *string
	err := testdb.Pool(t).QueryRow(context.Background(), `SELECT dead_at IS NOT NULL, available_at = 'infinity', locked_at IS NOT NULL, attempts, last_error
FROM `+tbl.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&r.dead, &r.parked, &r.locked, &r.attempts, &le)
	if err != nil {
		t.Fatal(err)
	}
	if le != nil {
		r.lastError = *le
	}
	return r
}

// TestLeaseExpiredOnLastAttemptGoesDead: a row whose lease expired on its
// last allowed attempt (the relay holding it crashed) is parked dead by the
// next claim, counted in outbox_dead_total and the outbox_dead gauge, never
// delivered again, listed by the runbook and removed by dead retention.
// The claim's path: without single-active (a single-active relay takes the
// leases back when it is elected, TestTakeBackOnLastAttemptGoesDead).
func TestLeaseExpiredOnLastAttemptGoesDead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "expired_outbox")
	const topic = "org.expired.v1"
	ids := enqueue(t, pool, tbl, topic, 2)
	// ids[0] was leased on its 3rd and last attempt by a relay that crashed
	// two hours ago; ids[1] is on its 2nd attempt, also abandoned.
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 3, locked_at = now() - interval '2 hours', available_at = now() - interval '3 hours' WHERE event_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 2, locked_at = now() - interval '2 hours', available_at = now() - interval '3 hours' WHERE event_id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	_, m := newMetrics(t)
	s := newSub(t, pool, subscriber.Config{Table: tbl, MaxAttempts: 3, PollInterval: 20 * time.Millisecond, Metrics: m,
		StatsInterval: 50 * time.Millisecond, DisableSingleActive: true})
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-ch:
		if msg.UUID != ids[1] {
			t.Fatalf("delivered %s, want only the row below max attempts (%s)", msg.UUID, ids[1])
		}
		msg.Ack()
	case <-time.After(2 * time.Minute):
		t.Fatal("the abandoned row below max attempts was not re-claimed")
	}
	select {
	case msg := <-ch:
		t.Fatalf("row delivered after its last attempt expired: %s", msg.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	r := readDead(t, tbl, ids[0])
	if !r.dead || !r.parked || r.locked || r.attempts != 3 || !strings.Contains(r.lastError, "lease of attempt 3 expired") {
		t.Fatalf("expired last attempt: %+v, want dead, parked, unlocked, attempts 3, last_error about the lease", r)
	}
	if got := testutil.ToFloat64(m.DeadTotal.WithLabelValues(tbl.Qualified(), topic)); got != 1 {
		t.Fatalf("outbox_dead_total = %v, want 1", got)
	}
	waitFor(t, "outbox_dead gauge", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.Dead.WithLabelValues(tbl.Qualified())) == 1 &&
			testutil.ToFloat64(m.Pending.WithLabelValues(tbl.Qualified())) == 0
	})
	dead, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
	if err != nil || len(dead) != 1 || dead[0].EventID.String() != ids[0] || dead[0].DeadAt == nil {
		t.Fatalf("runbook's Dead: %v, %+v", err, dead)
	}
	st, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil || st.Dead != 1 || st.Pending != 0 || st.Locked != 0 {
		t.Fatalf("runbook's Stats: %v, %+v", err, st)
	}
}

// TestDeadDoesNotDependOnMaxAttempts: raising MaxAttempts does not bring a
// dead row back (it stays parked and listed), and lowering it does not kill
// a row that is still retrying (it gets its next attempt, and dies when that
// attempt fails).
func TestDeadDoesNotDependOnMaxAttempts(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "maxchange_outbox")
	ids := enqueue(t, pool, tbl, "org.max.v1", 2)
	nackAll := func(max int, want int) {
		s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, MaxAttempts: max, PollInterval: 20 * time.Millisecond,
			Backoff: func(int) time.Duration { return 0 }}, nil)

		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = s.Close() }()
		sctx, cancel := context.WithCancel(ctx)
		defer cancel()
		ch, err := s.Subscribe(sctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < want; i++ {
			select {
			case msg := <-ch:
				subscriber.RecordError(msg, errors.New("broker down"))
				msg.Nack()
			case <-time.After(2 * time.Minute):
				t.Fatalf("max %d: delivery %d of %d missing", max, i+1, want)
			}
		}
		select {
		case msg := <-ch:
			t.Fatalf("max %d: unexpected delivery of %s", max, msg.UUID)
		case <-time.After(300 * time.Millisecond):
		}
	}
	// ids[0] dies at max 2; ids[1] is held back (attempts 1, due in an hour).
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 1, last_error = 'x', available_at = now() + interval '1 hour' WHERE event_id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	nackAll(2, 2)
	if r := readDead(t, tbl, ids[0]); !r.dead || r.attempts != 2 {
		t.Fatalf("after max 2: %+v", r)
	}
	// Raising MaxAttempts: the dead row stays dead and is not delivered.
	nackAll(10, 0)
	if r := readDead(t, tbl, ids[0]); !r.dead || !r.parked {
		t.Fatalf("after raising max: %+v", r)
	}
	// Lowering MaxAttempts below ids[1]'s attempts: it is retried once more,
	// then dead.
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 5, available_at = now() WHERE event_id = $1`, ids[1]); err != nil {
		t.Fatal(err)
	}
	nackAll(3, 1)
	if r := readDead(t, tbl, ids[1]); !r.dead || r.attempts != 6 {
		t.Fatalf("after lowering max: %+v", r)
	}
}

// TestReleaseAtLastAttemptGoesDead: a message whose handler never answers is
// released when its subscription stops; on its last allowed attempt the
// release parks it dead, counted once.
func TestReleaseAtLastAttemptGoesDead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "release_outbox")
	const topic = "org.release.v1"
	ids := enqueue(t, pool, tbl, topic, 1)
	_, m := newMetrics(t)
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, MaxAttempts: 1, PollInterval: 20 * time.Millisecond,
		CloseTimeout: 200 * time.Millisecond, Metrics: m}, nil)

	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var held *message.Message
	select {
	case held = <-ch:
	case <-time.After(2 * time.Minute):
		t.Fatal("not delivered")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	_ = held // never acked nor nacked
	r := readDead(t, tbl, ids[0])
	if !r.dead || !r.parked || r.locked || !strings.Contains(r.lastError, "last allowed attempt") {
		t.Fatalf("released at the last attempt: %+v", r)
	}
	if got := testutil.ToFloat64(m.DeadTotal.WithLabelValues(tbl.Qualified(), topic)); got != 1 {
		t.Fatalf("outbox_dead_total = %v, want 1", got)
	}
}
