package subscriber_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRouterRunEndsThenPoolCloses is the shutdown a Watermill service
// writes: r.Run(signalCtx) returns when the signal cancels its context, and
// the deferred pool.Close runs, with nobody closing the router's
// subscribers (the router closes them only in Router.Close). The leader,
// the standby and the listening connection must have given their pool
// connections back, so pool.Close returns, and the standby must stop trying
// to acquire one.
func TestRouterRunEndsThenPoolCloses(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t, nil)
	tbl := testdb.Table(t, "poolclose_outbox")
	ids := enqueue(t, pool, tbl, "org.poolclose.v1", 3)
	logs := watermill.NewCaptureLogger()
	cfg := subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond, ElectionInterval: 100 * time.Millisecond}
	leader, err := subscriber.New(context.Background(), pool, cfg, logs)
	if err != nil {
		t.Fatal(err)
	}
	standby, err := subscriber.New(context.Background(), pool, cfg, logs)
	if err != nil {
		t.Fatal(err)
	}
	// Only so that a failing run leaks no goroutine: the service under test
	// never closes them.
	t.Cleanup(func() { _ = leader.Close(); _ = standby.Close() })

	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	var handled atomic.Int64
	handle := func(*message.Message) error { handled.Add(1); return nil }
	r.AddConsumerHandler("leader", subscriber.AllTopics, leader, handle)
	r.AddConsumerHandler("standby", subscriber.AllTopics, standby, handle)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	runDone := make(chan error, 1)
	go func() { runDone <- r.Run(ctx) }()
	<-r.Running()
	waitFor(t, "every row published", 2*time.Minute, func() bool {
		for _, id := range ids {
			if !state(t, pool, tbl, id).published {
				return false
			}
		}
		return true
	})
	waitFor(t, "one leader and one standby", 2*time.Minute, func() bool { return leader.IsLeader() != standby.IsLeader() })

	cancel() // SIGTERM
	select {
	case err := <-runDone:
		if err != nil {
			t.Fatalf("router run: %v", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("Router.Run did not return within 60s of its context ending")
	}

	closed := make(chan struct{})
	go func() {
		pool.Close() // the service's deferred pool.Close
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(2 * time.Minute):
		st := pool.Stat()
		t.Fatalf("pool.Close still waits 60s after Router.Run returned: the subscribers hold %d connections", st.AcquiredConns())
	}
	// A standby that still ran its election would try the closed pool.
	time.Sleep(5 * cfg.ElectionInterval)
	for _, m := range logs.Captured()[watermill.ErrorLogLevel] {
		if strings.Contains(m.Msg, "acquire") {
			t.Fatalf("after the pool closed, a subscriber logged %q: %v", m.Msg, m.Err)
		}
	}
	if n := handled.Load(); n < int64(len(ids)) {
		t.Fatalf("handled %d messages, want at least %d", n, len(ids))
	}
}

// TestSubscribeAgainAfterEveryContextEnded: a subscriber whose
// subscriptions all ended (and so gave its connections back) delivers again
// when subscribed again.
func TestSubscribeAgainAfterEveryContextEnded(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t, nil)
	tbl := testdb.Table(t, "resubscribe_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond, ElectionInterval: 100 * time.Millisecond})
	for round := 0; round < 2; round++ {
		id := enqueue(t, pool, tbl, "org.resubscribe.v1", 1)[0]
		ctx, cancel := context.WithCancel(context.Background())
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case msg := <-ch:
			if msg.UUID != id {
				t.Fatalf("round %d: got %s, want %s", round, msg.UUID, id)
			}
			msg.Ack()
		case <-time.After(2 * time.Minute):
			t.Fatalf("round %d: no message within 60s", round)
		}
		waitFor(t, "the row published", 2*time.Minute, func() bool { return state(t, pool, tbl, id).published })
		cancel()
		for range ch {
		}
		waitFor(t, "no connection held", 2*time.Minute, func() bool { return pool.Stat().AcquiredConns() == 0 })
	}
}
