package walrelay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestWALDeadLettersOnlyForTheForwarder: as the table relays do
// (subscriber's TestDeadLettersOnlyForTheForwarder), the WAL relay hands a
// row whose stored headers are not a JSON object to a subscription that
// asks for dead letters (Forwarder.AddTo's), without its headers and with
// the decoding error as its cause, and even an ack of it sends the row
// dead, never published; a plain subscription (the relay's own user)
// never receives it: the row is parked dead before any handler.
func TestWALDeadLettersOnlyForTheForwarder(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	badHeaders := func(key string) string {
		id := uuid.NewString()
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, headers, ordering_key)
VALUES ($1::uuid, 'org.deadletters.v1', '{"n":1}', $2::uuid, '["not", "an", "object"]', $3)`, uuid.NewString(), id, key); err != nil {
			t.Fatal(err)
		}
		return id
	}

	plain := relay(t, pool, tbl, nil)
	ch, err := plain.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	id := badHeaders("plain")
	waitFor(t, 30*time.Second, "the plain subscription parks the row dead", func() bool { return rowDead(t, pool, tbl, id) })
	select {
	case m := <-ch:
		t.Fatalf("a plain subscription received %s", m.UUID)
	default:
	}
	if err := plain.Close(); err != nil {
		t.Fatal(err)
	}

	asks := relay(t, pool, tbl, nil)
	ch, err = asks.Subscribe(deadletter.Want(ctx), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	id = badHeaders("asks")
	var m *message.Message
	for m == nil || m.UUID != id {
		select {
		case m = <-ch:
			if m.UUID != id {
				m.Ack() // not a row of this test
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("the subscription that asks for dead letters did not receive %s", id)
		}
	}
	cause := deadletter.Cause(m.Context())
	if cause == nil || !strings.Contains(cause.Error(), "headers column is not a JSON object") {
		t.Fatalf("the refused message's cause is %v, want the headers' decoding error", cause)
	}
	if m.Metadata.Get(schema.MetadataEventID) != id {
		t.Fatalf("the refused message carries %v, want the row's own metadata", m.Metadata)
	}
	m.Ack() // a poison queue's ack: the row is dead all the same
	waitFor(t, 30*time.Second, "the acked refusal parks the row dead", func() bool { return rowDead(t, pool, tbl, id) })
	var published bool
	var lastError string
	if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL, COALESCE(last_error, '') FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&published, &lastError); err != nil {
		t.Fatal(err)
	}
	if published || !strings.Contains(lastError, "headers column is not a JSON object") {
		t.Fatalf("after the ack of the refused message: published %t, last_error %q; want dead with the decoding error, not published", published, lastError)
	}
}

// rowDead reports whether the row with event_id id is dead.
func rowDead(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id string) bool {
	t.Helper()
	var dead bool
	if err := pool.QueryRow(context.Background(), `SELECT dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	return dead
}
