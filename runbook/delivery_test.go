package runbook_test

import (
	"context"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

func receive(t *testing.T, ch <-chan *message.Message, what string) *message.Message {
	t.Helper()
	select {
	case msg, ok := <-ch:
		if !ok {
			t.Fatalf("%s: subscription closed", what)
		}
		return msg
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s: nothing delivered in 2 minutes", what)
	}
	return nil
}

func waitPublished(t *testing.T, pool interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, tbl schema.Table, ids []uuid.UUID) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int
		err := pool.QueryRow(context.Background(), replaceTable(`SELECT count(*) FROM %s WHERE published_at IS NOT NULL AND event_id = ANY($1::uuid[])`, tbl), uuidStrings(ids)).Scan(&n)
		if err != nil {
			t.Fatal(err)
		}
		if n == len(ids) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d rows published after 2 minutes", n, len(ids))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestReplayedDeadRowIsDelivered runs a real subscriber: dead rows are not
// delivered, and once replayed (one by event_id, the rest in bulk) they are.
func TestReplayedDeadRowIsDelivered(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "deliver_outbox")
	// Dead from the start: enqueued and made dead in one transaction.
	dead := enqueue(t, pool, tbl, tenantA, repeat(topicA, 3), func(tx pgx.Tx, ids []uuid.UUID) error {
		_, err := tx.Exec(context.Background(), replaceTable(`UPDATE %s SET attempts = 25, last_error = 'publish: broker unavailable', dead_at = now(), available_at = 'infinity' WHERE event_id = ANY($1::uuid[])`, tbl), uuidStrings(ids))
		return err
	})
	live := enqueue(t, pool, tbl, tenantA, []string{topicA}, nil)

	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(func() {
		cancel()
		if err := sub.Close(); err != nil {
			t.Errorf("close subscriber: %v", err)
		}
	})
	ch, err := sub.Subscribe(ctx, topicA)
	if err != nil {
		t.Fatal(err)
	}

	msg := receive(t, ch, "the live row")
	if msg.UUID != live[0].String() {
		t.Fatalf("delivered %s, want the live row %s (dead rows must not be delivered)", msg.UUID, live[0])
	}
	msg.Ack()
	waitPublished(t, pool, tbl, live)
	select {
	case msg := <-ch:
		t.Fatalf("dead row %s delivered before any replay", msg.UUID)
	case <-time.After(500 * time.Millisecond): // five polls
	}

	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, dead[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	msg = receive(t, ch, "the replayed row")
	if msg.UUID != dead[0].String() || msg.Metadata.Get(schema.MetadataAttempts) != "1" {
		t.Fatalf("delivered %s attempts %s, want %s attempts 1", msg.UUID, msg.Metadata.Get(schema.MetadataAttempts), dead[0])
	}
	msg.Ack()
	waitPublished(t, pool, tbl, dead[:1])

	res, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{Topic: topicA}, false)
	if err != nil {
		t.Fatal(err)
	}
	if res.Rows != 2 {
		t.Fatalf("bulk replay changed %d rows, want 2", res.Rows)
	}
	var got []string
	for i := range 2 {
		msg := receive(t, ch, "bulk replayed row")
		got = append(got, msg.UUID)
		if a := msg.Metadata.Get(schema.MetadataAttempts); a != "1" {
			t.Fatalf("bulk replayed row #%d delivered with attempts %s, want 1", i, a)
		}
		msg.Ack()
	}
	want := uuidStrings(dead[1:])
	sort.Strings(got)
	sort.Strings(want)
	if !slices.Equal(got, want) {
		t.Fatalf("bulk replay delivered %v, want %v", got, want)
	}
	waitPublished(t, pool, tbl, dead)
	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Dead != 0 || s.Pending != 0 {
		t.Fatalf("after the replays: %+v", s)
	}
}
