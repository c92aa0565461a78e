package main

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
)

// TestDeadSkipInDefaultMode (issue 57, item 4): `outbox dead skip` sets a
// dead event of a default-mode table aside: a preview changes nothing, the
// confirmed skip marks it skipped (not dead, not delivered) and prints the
// audit line with the operator and the reason; a second skip is refused.
func TestDeadSkipInDefaultMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "skipcli_outbox")
	id := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.skip.v1", EventID: id, Payload: json.RawMessage(`{}`)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 3, last_error = 'poison', dead_at = now(), available_at = 'infinity' WHERE event_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	args := []string{"dead", "skip", "--table=" + tbl.String(), "--event-id=" + id.String()}
	rbRun(t, rbEnv(), args...).expect(t, 2, []string{"Skip event " + id.String(), "skipped_at = now()"}, []string{"nothing changed"})
	if r, err := runbook.New(pool, tbl).Event(ctx, id); err != nil || r.State() != runbook.RowDead {
		t.Fatalf("after the preview: %+v, %v; want dead", r, err)
	}
	rbRun(t, rbEnv("USER", "alice"), append(args, "--confirm", "--reason=poison payload, ticket 42")...).
		expect(t, 0, []string{"Skipped event " + id.String(), "marked skipped"}, []string{`audit: action=skip`, `operator="alice"`, `reason="poison payload, ticket 42"`})
	if r, err := runbook.New(pool, tbl).Event(ctx, id); err != nil || r.State() != runbook.RowSkipped || r.Delivered || r.DeadAt != nil {
		t.Fatalf("after the skip: %+v, %v; want skipped", r, err)
	}
	rbRun(t, rbEnv(), append(args, "--confirm")...).expect(t, 1, nil, []string{"skipped already", "nothing changed"})
}
