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
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestKeysHeldAndDeadSkip: `outbox keys held` lists a dead held key;
// `outbox dead skip` previews without --confirm and records the skip with it.
func TestKeysHeldAndDeadSkip(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	id := uuid.New()
	var seq int64
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		seq, err = publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.org.changed.v1", EventID: id,
			Payload: json.RawMessage(`{}`), OrderingKey: "org-1"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	rbExec(t, pool, tbl, `INSERT INTO `+tbl.HoldsTable()+` (ordering_key, partition, sequence, attempts, available_at, last_error, dead_at)
VALUES ('org-1', hashtext('org-1') & 63, $1, 3, 'infinity', 'boom', now())`, seq)

	r := rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String(), "--json")
	r.expect(t, 0, nil, nil)
	held := rbDecode[[]runbook.HeldKey](t, r.stdout)
	if len(held) != 1 || held[0].Key != "org-1" || held[0].EventID != id.String() || held[0].DeadAt == nil {
		t.Fatalf("keys held: %+v", held)
	}
	rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String()).expect(t, 0, []string{"org-1", "dead", "outbox dead skip"}, nil)
	// dead list shows the keyed dead row, with its hold's attempts and error, and says it holds its key.
	rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String()).expect(t, 0, []string{id.String(), "boom", "1 dead row", "1 key held by a dead row", "outbox keys held --table=" + tbl.String()}, nil)
	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--json")
	r.expect(t, 0, []string{id.String(), `"attempts": 3`}, nil)
	r = rbRun(t, rbEnv(), "stats", "--table="+tbl.String(), "--json")
	st := rbDecode[runbook.TableStats](t, r.stdout)
	if st.Mode != schema.ModeOrdered || st.Dead != 1 || st.Pending != 0 || st.DeadHeldKeys != 1 {
		t.Fatalf("stats --json of an ordered table with one dead held row: %+v", st)
	}

	rbRun(t, rbEnv(), "dead", "skip", "--table="+tbl.String(), "--event-id="+id.String()).expect(t, 2, []string{"org-1"}, []string{"--confirm"})
	rbRun(t, rbEnv(), "dead", "skip", "--table="+tbl.String(), "--event-id="+id.String(), "--confirm").expect(t, 0, []string{"Skipped event"}, nil)
	rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String()).expect(t, 0, []string{"skip requested"}, nil)
	rbRun(t, rbEnv(), "dead", "skip", "--table="+tbl.String(), "--event-id="+uuid.NewString(), "--confirm").expect(t, 1, nil, []string{"does not hold its ordering key"})
}
