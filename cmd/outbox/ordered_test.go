package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestKeysHeldAndDeadSkip: `outbox keys held` lists a dead held key with
// its state and the actions the state allows; `outbox dead skip` previews
// without --confirm and records the skip with it; then the hold is
// skip_requested, offers no action, and a second skip or a replay is
// refused by the hold's rules with nothing changed.
func TestKeysHeldAndDeadSkip(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns(), schema.WithMode(schema.ModeOrdered))
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
	if len(held) != 1 || held[0].Key != "org-1" || held[0].EventID != id.String() || held[0].DeadAt == nil || held[0].State != runbook.HoldDead {
		t.Fatalf("keys held: %+v", held)
	}
	r = rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String())
	r.expect(t, 0, []string{"STATE", "ACTIONS", "outbox dead skip"}, nil)
	if f := heldLine(t, r.stdout, "org-1"); f[4] != "dead" || f[5] != "replay,skip" {
		t.Fatalf("keys held: state %q, actions %q; want dead and replay,skip:\n%s", f[4], f[5], r.stdout)
	}
	r = rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String(), "--json")
	r.expect(t, 0, []string{`"state": "dead"`}, nil)
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
	r = rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String())
	r.expect(t, 0, []string{"skip_requested"}, nil)
	if f := heldLine(t, r.stdout, "org-1"); f[4] != "skip_requested" || f[5] != "-" {
		t.Fatalf("keys held: state %q, actions %q; want skip_requested and none:\n%s", f[4], f[5], r.stdout)
	}
	var before string
	if err := pool.QueryRow(ctx, `SELECT h::text FROM `+tbl.HoldsTable()+` AS h`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	rbRun(t, rbEnv(), "dead", "skip", "--table="+tbl.String(), "--event-id="+id.String(), "--confirm").expect(t, 1, nil, []string{"skip_requested, which refuses skip"})
	rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--event-id="+id.String(), "--confirm").expect(t, 1, nil, []string{"skip_requested, which refuses replay"})
	var after string
	if err := pool.QueryRow(ctx, `SELECT h::text FROM `+tbl.HoldsTable()+` AS h`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != before {
		t.Fatalf("a refused skip or replay changed the hold:\n%s\n%s", before, after)
	}
	// A resolved hold (a tombstone) is listed only with --resolved.
	var seq2 int64
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		seq2, err = publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.org.changed.v1", EventID: uuid.New(),
			Payload: json.RawMessage(`{}`), OrderingKey: "org-2"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	rbExec(t, pool, tbl, `INSERT INTO `+tbl.HoldsTable()+` (ordering_key, partition, sequence, resolved_at) VALUES ('org-2', hashtext('org-2') & 63, $1, now())`, seq2)
	if r = rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String()); strings.Contains(r.stdout, "org-2") {
		t.Fatalf("keys held lists a resolved hold:\n%s", r.stdout)
	}
	r = rbRun(t, rbEnv(), "keys", "held", "--table="+tbl.String(), "--resolved", "--json")
	r.expect(t, 0, []string{`"state": "skip_requested"`, `"ordering_key": "org-2"`, `"state": "resolved"`}, nil)
	rbRun(t, rbEnv(), "dead", "skip", "--table="+tbl.String(), "--event-id="+uuid.NewString(), "--confirm").expect(t, 1, nil, []string{"event not found"})
}

// heldLine returns the fields of the line of `outbox keys held` for key
// (ORDERING_KEY SEQUENCE EVENT_ID TOPIC STATE ACTIONS ATTEMPTS ...).
func heldLine(t *testing.T, stdout, key string) []string {
	t.Helper()
	for _, line := range strings.Split(stdout, "\n") {
		if f := strings.Fields(line); len(f) >= 7 && f[0] == key {
			return f
		}
	}
	t.Fatalf("keys held has no line for %q:\n%s", key, stdout)
	return nil
}
