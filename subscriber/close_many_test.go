package subscriber_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestCloseTimeoutWithManyInFlight: 1,500 messages in flight, none acked,
// in each mode: Close gives up on them after CloseTimeout and returns, and
// a new subscriber delivers every row again (nothing lost).
func TestCloseTimeoutWithManyInFlight(t *testing.T) {
	t.Parallel()
	const n = 1500
	for _, ordered := range []bool{false, true} {
		t.Run(fmt.Sprintf("ordered=%v", ordered), func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t)
			tbl := testdb.Table(t, "close_many_outbox", schema.WithOrderingKeyColumn())
			var want []string
			if ordered {
				keys := make([]string, n)
				for i := range keys {
					keys[i] = fmt.Sprintf("k%d", i)
				}
				for _, e := range enqueueKeyed(t, pool, tbl, keys...) {
					want = append(want, e.event.String())
				}
			} else {
				want = enqueue(t, pool, tbl, "org.thing.changed.v1", n)
			}
			cfg := subscriber.Config{Table: tbl, Ordered: ordered, BatchSize: 500, MaxInFlight: n, CloseTimeout: 300 * time.Millisecond,
				ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond}
			s, err := subscriber.New(pool, cfg, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
			if err != nil {
				t.Fatal(err)
			}
			held := make([]*message.Message, 0, n)
			for len(held) < n {
				select {
				case msg := <-ch:
					held = append(held, msg) // never acked
				case <-time.After(30 * time.Second):
					t.Fatalf("%d of %d messages in flight after 30 s", len(held), n)
				}
			}
			closed := make(chan error, 1)
			go func() { closed <- s.Close() }()
			select {
			case err := <-closed:
				if err != nil {
					t.Fatalf("Close: %v", err)
				}
			case <-time.After(20 * time.Second):
				t.Fatalf("Close did not return within 20 s with %d messages in flight (CloseTimeout 300 ms)", n)
			}
			again := newSub(t, pool, cfg)
			ch2, err := again.Subscribe(context.Background(), subscriber.AllTopics)
			if err != nil {
				t.Fatal(err)
			}
			got := map[string]bool{}
			deadline := time.After(60 * time.Second)
			for len(got) < n {
				select {
				case msg := <-ch2:
					got[msg.UUID] = true
					msg.Ack()
				case <-deadline:
					t.Fatalf("%d of %d events delivered again within 60 s", len(got), n)
				}
			}
			for _, id := range want {
				if !got[id] {
					t.Fatalf("event %s not delivered again", id)
				}
			}
		})
	}
}
