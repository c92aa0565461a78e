package subscriber_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/experiment"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestBoundedClaimLateLockTaker: with the prototype bounded claim
// (docs/XMIN.md, option c), a row of a transaction that began long before
// the claims' bound and wrote the outbox only after it (so the cut did not
// see it) is still delivered, by the sweep, within about LockTTL/4; rows of
// short transactions are delivered at once.
func TestBoundedClaimLateLockTaker(t *testing.T) {
	prev := experiment.BoundedClaim.Swap(true)
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 4 * time.Second})
	experiment.BoundedClaim.Store(prev)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		seen = map[string]time.Time{}
	)
	go func() {
		for m := range ch {
			mu.Lock()
			seen[m.UUID] = time.Now()
			mu.Unlock()
			m.Ack()
		}
	}()
	waitFor := func(ids []string, within time.Duration) time.Duration {
		t.Helper()
		start := time.Now()
		for time.Since(start) < within {
			mu.Lock()
			n := 0
			for _, id := range ids {
				if _, ok := seen[id]; ok {
					n++
				}
			}
			mu.Unlock()
			if n == len(ids) {
				return time.Since(start)
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Fatalf("%d events not delivered within %s", len(ids), within)
		return 0
	}
	waitFor(enqueue(t, pool, tbl, "org.bounded.v1", 5), 5*time.Second)

	// A transaction that starts now and writes the outbox later.
	late, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = late.Rollback(context.Background()) }()
	if _, err := late.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	// Meanwhile short transactions flow, and the bound moves past the late
	// transaction's start.
	for range 5 {
		time.Sleep(200 * time.Millisecond)
		if d := waitFor(enqueue(t, pool, tbl, "org.bounded.v1", 3), 5*time.Second); d > 2*time.Second {
			t.Errorf("short transactions' events delivered after %s", d)
		}
	}
	id := uuid.New()
	if _, err := publisher.Enqueue(ctx, late, tbl, publisher.Message{TenantID: tenant, Topic: "org.bounded.v1", EventID: id,
		Payload: json.RawMessage(`{"late":true}`)}); err != nil {
		t.Fatal(err)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	d := waitFor([]string{id.String()}, 10*time.Second)
	t.Logf("late transaction's event delivered %s after its commit (sweep every LockTTL/4 = 1s)", d.Round(time.Millisecond))
	for start := time.Now(); !state(t, pool, tbl, id.String()).published; time.Sleep(20 * time.Millisecond) {
		if time.Since(start) > 5*time.Second {
			t.Fatal("the late event's ack was not written")
		}
	}
}
