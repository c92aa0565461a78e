package subscriber_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestOrderedMaxInFlightCountsOnce: an ordered subscription with keyed rows
// of many keys and unkeyed rows pending never has more than MaxInFlight
// messages unanswered: its key runners and its claim loop share one count.
func TestOrderedMaxInFlightCountsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	const maxInFlight = 4
	var msgs []publisher.Message
	for i := range 40 {
		m := publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: uuid.New(), Payload: json.RawMessage(`{"n":1}`)}
		if i%2 == 0 {
			m.OrderingKey = fmt.Sprintf("k%d", i)
		}
		msgs = append(msgs, m)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	cfg := orderedCfg(tbl)
	cfg.MaxInFlight, cfg.BatchSize = maxInFlight, maxInFlight
	s := orderedSub(t, pool, cfg)
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	// Hold every message until no new one arrives for a while, then
	// answer them all: the most ever held is what the relay let out.
	var (
		mu      sync.Mutex
		held    []*message.Message
		most    int
		acked   = map[string]bool{}
		arrived = make(chan struct{}, 1)
	)
	go func() {
		for m := range ch {
			mu.Lock()
			held = append(held, m)
			most = max(most, len(held))
			mu.Unlock()
			select {
			case arrived <- struct{}{}:
			default:
			}
		}
	}()
	deadline := time.After(2 * time.Minute)
	for {
		mu.Lock()
		done := len(acked) == len(msgs)
		mu.Unlock()
		if done {
			break
		}
		select {
		case <-arrived:
			continue
		case <-time.After(300 * time.Millisecond):
		case <-deadline:
			t.Fatalf("only %d of %d events acked", len(acked), len(msgs))
		}
		mu.Lock()
		for _, m := range held {
			acked[m.UUID] = true
			m.Ack()
		}
		held = nil
		mu.Unlock()
	}
	mu.Lock()
	defer mu.Unlock()
	if most > maxInFlight {
		t.Errorf("%d messages unanswered at once with MaxInFlight %d", most, maxInFlight)
	}
}
