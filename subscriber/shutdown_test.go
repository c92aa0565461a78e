package subscriber_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRouterCloseLetsInFlightMessagesFinish: a router closed while its
// handlers are publishing (the daemon's SIGTERM) cancels the Subscribe
// context, but the messages in flight keep a live context until the
// subscriber's CloseTimeout: they finish, are acked, and no attempt is
// burned.
func TestRouterCloseLetsInFlightMessagesFinish(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "drain_outbox")
	ids := enqueue(t, pool, tbl, "org.drain.v1", 5)
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond, CloseTimeout: 10 * time.Second})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(subscriber.CaptureError)
	var started, cancelled atomic.Int64
	r.AddConsumerHandler("slow", subscriber.AllTopics, s, func(msg *message.Message) error {
		started.Add(1)
		select {
		case <-time.After(time.Second): // a slow broker
			return nil
		case <-msg.Context().Done():
			cancelled.Add(1)
			return msg.Context().Err()
		}
	})
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	waitFor(t, "5 messages in flight", 2*time.Minute, func() bool { return started.Load() == 5 })
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if n := cancelled.Load(); n != 0 {
		t.Fatalf("%d in-flight messages saw a cancelled context at close", n)
	}
	for _, id := range ids {
		st := state(t, pool, tbl, id)
		if !st.published || st.attempts != 1 || st.locked || st.lastError != nil {
			t.Fatalf("row %s after close: %+v, want published on its first attempt", id, st)
		}
	}
}

// TestCloseCancelsInFlightAfterCloseTimeout: a handler that outlives
// CloseTimeout sees its context cancelled then, not before; its lease is
// given back with the attempt counted.
func TestCloseCancelsInFlightAfterCloseTimeout(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "drain_late_outbox")
	ids := enqueue(t, pool, tbl, "org.drain.v1", 1)
	const closeTimeout = 700 * time.Millisecond
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond, CloseTimeout: closeTimeout}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	msg := <-ch
	cancel() // what a router does at Close
	begin := time.Now()
	select {
	case <-msg.Context().Done():
		t.Fatalf("message context cancelled %s after the Subscribe context, before CloseTimeout", time.Since(begin))
	case <-time.After(closeTimeout / 2):
	}
	select {
	case <-msg.Context().Done():
		if d := time.Since(begin); d < closeTimeout-50*time.Millisecond {
			t.Fatalf("message context cancelled after %s, before CloseTimeout %s", d, closeTimeout)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("message context never cancelled after CloseTimeout")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if st := state(t, pool, tbl, ids[0]); st.locked || st.published || st.attempts != 1 {
		t.Fatalf("row after close timeout: %+v, want released with its attempt counted", st)
	}
}

// TestClaimNotCancelledBetweenUpdateAndRows: a Subscribe context cancelled
// while a claim's rows are being read does not orphan the batch: the claim
// finishes on a context of its own, and the leases of the rows not
// delivered are given back at once (attempts undone), not after LockTTL.
func TestClaimNotCancelledBetweenUpdateAndRows(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "claim_cancel_outbox")
	ids := enqueue(t, pool, tbl, "org.claim.v1", 20)
	// Rows larger than pgx's read buffer, so that reading them takes the
	// socket after the cancel.
	if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET payload = jsonb_build_object('pad', repeat('x', 10000))`); err != nil {
		t.Fatal(err)
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: time.Hour, LockTTL: time.Hour, DisableNotify: true})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The cancel lands after the UPDATE committed, before the rows are read,
	// and the reading starts after pgx would have reacted to it.
	hooked := make(chan struct{})
	var once sync.Once
	subscriber.AfterClaimQuery(s, func() {
		once.Do(func() {
			cancel()
			time.Sleep(1500 * time.Millisecond)
			close(hooked)
		})
	})
	if _, err := s.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	<-hooked
	// Nothing reads the channel: no message is in flight.
	waitFor(t, "leases given back", 2*time.Minute, func() bool {
		for _, id := range ids {
			if st := state(t, pool, tbl, id); st.locked || st.attempts != 0 {
				return false
			}
		}
		return true
	})
}
