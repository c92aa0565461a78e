package subscriber_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestOrderedRetryWakesTheRelay: a keyed row nacked while the ordered relay
// sleeps (its idle lock held, PollInterval and the lease tick 10 minutes
// away) is delivered again after its Backoff, not at the relay's next poll
// or tick: the run that ends on the retrying hold asks the engine for a
// wake-up at its time. Before, the retry waited for the next tick.
func TestOrderedRetryWakesTheRelay(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	cfg := orderedCfg(tbl)
	cfg.PollInterval = 10 * time.Minute
	cfg.ElectionInterval = 10 * time.Minute
	cfg.LockTTL = 30 * time.Minute
	cfg.Backoff = func(int) time.Duration { return 100 * time.Millisecond }
	evs := enqueueKeyed(t, pool, tbl, "retry-k")
	sub := orderedSub(t, pool, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	asleep := func() bool { return idleKeyHeld(t, pool, sqlq.OrderedIdleLockKey(tbl)) }
	var first *message.Message
	select {
	case first = <-msgs:
	case <-time.After(2 * time.Minute):
		t.Fatal("the row was not delivered")
	}
	if first.UUID != evs[0].event.String() {
		t.Fatalf("delivered %s, want %s", first.UUID, evs[0].event)
	}
	// Nack only once the relay sleeps on its idle lock: nothing else will
	// wake it for 10 minutes.
	waitFor(t, "the ordered relay to sleep on its idle lock", 2*time.Minute, asleep)
	// Once it holds the lock the relay looks once more before it sleeps;
	// let that pass (this only makes the test see a missing wake-up: with
	// one, the verdict is the same at any speed).
	time.Sleep(500 * time.Millisecond)
	waitFor(t, "the ordered relay to sleep on its idle lock", 2*time.Minute, asleep)
	var nacked atomic.Int64
	nacked.Store(time.Now().UnixNano())
	first.Nack()
	select {
	case again := <-msgs:
		if again.UUID != first.UUID {
			t.Fatalf("delivered %s after the nack, want %s again", again.UUID, first.UUID)
		}
		again.Ack()
		t.Logf("delivered again %s after the nack (Backoff 100ms)", time.Since(time.Unix(0, nacked.Load())).Round(time.Millisecond))
	case <-time.After(2 * time.Minute):
		t.Fatal("the nacked row was not delivered again within 2 minutes (the relay's next poll and tick are 10 minutes away): the retry did not wake the relay")
	}
}
