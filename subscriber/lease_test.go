package subscriber_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestHandlerOverrunLosesLease: a handler that ignores its context is not
// kept leased forever. Past DispatchTimeout plus the margin (LockTTL/2) the
// renewals stop, its message context is cancelled and the attempt counts as
// failed: nacked with an error saying the handler overran. LockTTL is 2 s
// (renewed every second): a renewal on a loaded machine may come a second
// late before the lease lapses and the claim loop takes the row again.
func TestHandlerOverrunLosesLease(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "overrun_outbox")
	ids := enqueue(t, pool, tbl, "org.overrun.v1", 1)
	_, m := newMetrics(t)
	const lockTTL, dispatchTimeout = 2 * time.Second, 3 * time.Second
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond, LockTTL: lockTTL,
		DispatchTimeout: dispatchTimeout, Backoff: func(int) time.Duration { return time.Hour }, Metrics: m,
		CloseTimeout: 100 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-ch // never acked nor nacked: the handler hangs and ignores its context
	begin := time.Now()
	select {
	case <-msg.Context().Done():
		if d, margin := time.Since(begin), dispatchTimeout+lockTTL/2; d < margin-50*time.Millisecond {
			t.Fatalf("message context cancelled after %s, before DispatchTimeout plus margin (%s)", d, margin)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("an overrunning handler keeps its message context and lease")
	}
	waitFor(t, "the overrun recorded as a failed attempt", 2*time.Minute, func() bool {
		st := state(t, pool, tbl, ids[0])
		return !st.locked && st.lastError != nil
	})
	st := state(t, pool, tbl, ids[0])
	if st.attempts != 1 || st.published || st.due < 30*time.Minute || !strings.Contains(*st.lastError, "overran") {
		t.Fatalf("after the overrun: %+v, last_error %q", st, *st.lastError)
	}
	renewed := testutil.ToFloat64(m.LeaseExtended.WithLabelValues(tbl.Qualified()))
	if renewed < 1 {
		t.Fatalf("lease renewed %v times before the cap, want at least once", renewed)
	}
	time.Sleep(lockTTL) // two renewal periods
	if again := testutil.ToFloat64(m.LeaseExtended.WithLabelValues(tbl.Qualified())); again != renewed {
		t.Fatalf("lease renewed after the cap: %v then %v", renewed, again)
	}
}

// TestLostExtendReplyKeepsFence: a renewal whose UPDATE committed but whose
// reply never reached the relay does not break the fence of the later ack.
// The test runs the renewal itself, with the parameters the relay sends,
// and the relay then acks with what it knows.
func TestLostExtendReplyKeepsFence(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "lostreply_outbox")
	ids := enqueue(t, pool, tbl, "org.lost.v1", 1)
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond})
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-ch
	var (
		id       string
		attempts int32
		lockedAt time.Time
	)
	if err := pool.QueryRow(ctx, `SELECT id::text, attempts, locked_at FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[0]).
		Scan(&id, &attempts, &lockedAt); err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	q := sqlq.NewQueries(tbl, schema.Columns{})
	tag, err := pool.Exec(ctx, q.Extend, id, attempts, lockedAt)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("the renewal: %v, %d rows", err, tag.RowsAffected())
	}
	msg.Ack()
	waitFor(t, "the ack after a renewal the relay never heard of", 2*time.Minute, func() bool {
		return state(t, pool, tbl, ids[0]).published
	})
}
