package subscriber_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestKeyedRowWakesDefaultRelayStartedBeforeOrderingKey (issue 56 item 6):
// a default relay started on a table without the ordering_key column, which
// schema.Migrate(..., schema.WithAllColumns()) then adds while the relay
// runs, is woken by keyed commits at once, with a poll interval of 10
// minutes, as by unkeyed ones. Before, the relay took the keyed writers'
// idle lock only when the column was there at its start (it reads the
// columns once), so each keyed row waited for the poll.
func TestKeyedRowWakesDefaultRelayStartedBeforeOrderingKey(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "late_key_outbox")
	// The poll and the sweep every 10 minutes: a delivery within the
	// 2-minute wait is the wake-up's, however slow the machine.
	const poll = 10 * time.Minute
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: poll, LockTTL: 4 * poll})
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, pool, tbl, "org.keyed.v1", 1), time.Minute)
	waitFor(t, "the relay to go idle", 2*time.Minute, func() bool { return idleHeld(t, pool, tbl) })
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	// A writer that reads the columns now, as a process started after the
	// migration does: it writes the key and tries the keyed rows' idle lock.
	e, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		waitFor(t, "the relay to go idle", 2*time.Minute, func() bool { return idleHeld(t, pool, tbl) })
		id := uuid.New()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := e.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.keyed.v1", EventID: id,
				Payload: json.RawMessage(`{}`), OrderingKey: "key-" + string(rune('a'+i))})
			return err
		}); err != nil {
			t.Fatal(err)
		}
		took, ok := d.within([]string{id.String()}, 2*time.Minute)
		if !ok {
			t.Fatalf("a keyed row did not reach the idle default relay within %s (PollInterval %s): its commit did not wake the relay started before the table had ordering_key",
				took.Round(time.Second), poll)
		}
		t.Logf("keyed row %d delivered %s after its commit", i, took.Round(time.Millisecond))
	}
}
