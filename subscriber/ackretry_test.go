package subscriber_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestAckRetryHasItsOwnTimeout: an ack write stuck behind a row lock times
// out, and its retry, with a timeout of its own, writes the ack once the
// lock is gone; one stuck attempt does not eat the retries.
func TestAckRetryHasItsOwnTimeout(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "ackretry_outbox")
	ids := enqueue(t, pool, tbl, "org.ack.v1", 1)
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond})
	subscriber.SetWriteTimeout(s, 300*time.Millisecond)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-ch
	// Another transaction holds the row (a producer re-enqueueing it, an
	// operator's UPDATE): the first ack attempt waits past its timeout.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT 1 FROM `+tbl.Sanitize()+` WHERE event_id = $1 FOR UPDATE`, ids[0]); err != nil {
		t.Fatal(err)
	}
	msg.Ack()
	time.Sleep(450 * time.Millisecond) // the first attempt timed out at 300ms; the second waits
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the ack written by a retry", 2*time.Minute, func() bool { return state(t, pool, tbl, ids[0]).published })
}
