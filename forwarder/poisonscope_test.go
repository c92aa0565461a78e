package forwarder_test

import (
	"context"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestPoisonQueueCopiesOnlyDeathsInsideIt (issue 56 item 4): what
// forwarder.PoisonQueue promises, and what it does not. A failure inside it
// that sends the row dead (here a Permanent refusal of a middleware) is
// copied once. Two events that die without a failure reaching it get no
// copy, and are dead with a last_error that says why, for `outbox dead
// list` and a replay: a row leased on its last allowed attempt whose lease
// expired (its relay was killed during that attempt), parked dead by the
// next claim, and a row whose stored headers are not a JSON object, dead
// before the router sees it. The README and the go doc promised a copy of
// every dead event.
func TestPoisonQueueCopiesOnlyDeathsInsideIt(t *testing.T) {
	t.Parallel()
	stack := func(pub message.Publisher) []message.HandlerMiddleware {
		pq, err := forwarder.PoisonQueue(pub, "poison")
		if err != nil {
			t.Fatal(err)
		}
		return []message.HandlerMiddleware{subscriber.CaptureError, pq, fraudCheck(true)}
	}
	rig := newPoisonRig(t, "fwd_pq_scope_outbox", stack, func(*message.Message) error { return nil }, false)
	ctx := context.Background()
	pool := testdb.Pool(t)
	// Killed on its last allowed attempt: leased an hour ago with attempts
	// at MaxAttempts, never renewed.
	killed := uuid.New()
	if _, err := pool.Exec(ctx, `INSERT INTO `+rig.tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, locked_at, available_at)
VALUES ($1::uuid, $2, '{"order":"fine"}', $3::uuid, $4::int, now() - interval '1 hour', now() - interval '1 hour')`,
		uuid.NewString(), topic, killed.String(), poisonMaxAttempts); err != nil {
		t.Fatal(err)
	}
	// Headers that are a JSON array, written by hand.
	badHeaders := uuid.New()
	if _, err := pool.Exec(ctx, `INSERT INTO `+rig.tbl.Sanitize()+` (tenant_id, topic, payload, event_id, headers)
VALUES ($1::uuid, $2, '{"order":"fine"}', $3::uuid, '["not", "an", "object"]')`, uuid.NewString(), topic, badHeaders.String()); err != nil {
		t.Fatal(err)
	}
	flagged := enqueueIn(t, rig.tbl, producerSpan(t), `{"order":"flagged"}`)
	for _, c := range []struct {
		name  string
		id    uuid.UUID
		cause string
	}{
		{"the row killed on its last attempt", killed, "expired"},
		{"the row with headers that are not a JSON object", badHeaders, "headers column is not a JSON object"},
		{"the refused row", flagged, "fraud check: order flagged"},
	} {
		published, dead, _, lastError := rig.settle(t, c.id.String())
		if published || !dead {
			t.Fatalf("%s: published %v dead %v, want dead", c.name, published, dead)
		}
		if !strings.Contains(lastError, c.cause) {
			t.Errorf("%s: last_error %q, want it to name %q", c.name, lastError, c.cause)
		}
	}
	// Each row is dead, and PoisonQueue publishes its copy before the nack
	// that sends the row dead: every copy there will be is counted.
	if got := rig.copies.Load(); got != 1 {
		t.Fatalf("%d poison copies, want 1 (the refused row's)", got)
	}
	if got := (<-rig.metas).Get(middleware.ReasonForPoisonedKey); !strings.Contains(got, "fraud check: order flagged") {
		t.Errorf("the poison copy's reason is %q, want the refusal", got)
	}
}
