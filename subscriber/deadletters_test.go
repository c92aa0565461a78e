package subscriber_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestDeadLettersOnlyForTheForwarder: the messages meant only for the
// router's dead-letter path (package deadletter) go to a subscription that
// asks for them (the forwarder's, through Forwarder.AddTo), never to one of
// the relay's own user. A plain subscription parks a row whose headers are
// not a JSON object dead without delivering it, as before. A subscription
// that asks gets it without its headers, carrying the decoding error as its
// cause; even an ack sends it dead, never published. It also gets the
// death notice of a row whose lease expired on its last allowed attempt,
// carrying the row's last_error, and its answer deletes the notice while
// the row stays dead.
func TestDeadLettersOnlyForTheForwarder(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "deadletters_outbox", schema.WithHeadersColumn())
	const topic = "org.deadletters.v1"
	badHeaders := func() string {
		id := uuid.NewString()
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, headers)
VALUES ($1::uuid, $2, '{"n":1}', $3::uuid, '["not", "an", "object"]')`, tenant.String(), topic, id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// LockTTL 4 s: the bounded claim's sweep, which finds an expired lease
	// below the bound, runs every second.
	cfg := subscriber.Config{Table: tbl, MaxAttempts: 3, PollInterval: 20 * time.Millisecond, DisableSingleActive: true, LockTTL: 4 * time.Second}

	// A plain subscription: parked dead, never delivered.
	plain := badHeaders()
	s1, err := subscriber.New(ctx, pool, cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch1, err := s1.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the plain subscription parks the row dead", 2*time.Minute, func() bool { return readDead(t, tbl, plain).dead })
	// The row was nacked instead of handed over (its handover would block
	// until received): nothing is waiting on the channel.
	select {
	case m := <-ch1:
		t.Fatalf("a plain subscription received %s", m.UUID)
	default:
	}
	if err := s1.Close(); err != nil {
		t.Fatal(err)
	}

	// A subscription that asks for dead letters.
	refused := badHeaders()
	s2 := newSub(t, pool, cfg)
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch2, err := s2.Subscribe(deadletter.Want(sctx), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	receive := func(id string) *message.Message {
		t.Helper()
		select {
		case m := <-ch2:
			if m.UUID != id {
				t.Fatalf("received %s, want %s", m.UUID, id)
			}
			return m
		case <-time.After(2 * time.Minute):
			t.Fatalf("%s not handed out", id)
		}
		return nil
	}
	m := receive(refused)
	if cause := deadletter.Cause(m.Context()); cause == nil || !strings.Contains(cause.Error(), "headers column is not a JSON object") {
		t.Fatalf("the refused row's cause is %v, want the decoding error", cause)
	}
	if m.Metadata.Get(schema.MetadataEventID) != refused || m.Metadata.Get(schema.MetadataTopic) != topic {
		t.Fatalf("the refused row's metadata %v, want the outbox's own keys", m.Metadata)
	}
	m.Ack()
	waitFor(t, "the acked refused row goes dead", 2*time.Minute, func() bool { return readDead(t, tbl, refused).dead })
	if r := readDead(t, tbl, refused); !strings.Contains(r.lastError, "headers column is not a JSON object") {
		t.Fatalf("the refused row: %+v, want dead with the decoding error", r)
	}
	var published bool
	if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, refused).Scan(&published); err != nil || published {
		t.Fatalf("the acked refused row published %v (%v), want never", published, err)
	}

	// A death notice.
	killed := uuid.NewString()
	if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, locked_at, available_at)
VALUES ($1::uuid, $2, '{"n":1}', $3::uuid, 3, now() - interval '1 hour', now() - interval '1 hour')`, tenant.String(), topic, killed); err != nil {
		t.Fatal(err)
	}
	m = receive(killed)
	if cause := deadletter.Cause(m.Context()); cause == nil || !strings.Contains(cause.Error(), "lease of attempt 3 expired") {
		t.Fatalf("the death notice's cause is %v, want the row's last_error", cause)
	}
	if r := readDead(t, tbl, killed); !r.dead || r.locked {
		t.Fatalf("the row of a death notice: %+v, want dead, not leased", r)
	}
	m.Nack()
	waitFor(t, "the answered notice is deleted", 2*time.Minute, func() bool {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+sqlq.DeadNoticesTable(tbl)).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 0
	})
	if r := readDead(t, tbl, killed); !r.dead {
		t.Fatalf("after the notice's answer: %+v, want dead", r)
	}
}
