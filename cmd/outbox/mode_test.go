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

// TestStatsReadsTheRecordedMode: `outbox stats` reads a table created with
// every column (README step 1) as a default-mode table, says when a mode
// is only inferred, and `outbox migrate --mode=default` records it.
func TestStatsReadsTheRecordedMode(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	stats := func() runbook.TableStats {
		t.Helper()
		r := rbRun(t, rbEnv(), "stats", "--table="+tbl.String(), "--json")
		r.expect(t, 0, nil, nil)
		return rbDecode[runbook.TableStats](t, r.stdout)
	}
	if s := stats(); s.Mode != schema.ModeDefault || s.ModeInferred {
		t.Fatalf("a new table with every column: %+v, want mode default, recorded", s)
	}
	rbRun(t, rbEnv(), "stats", "--table="+tbl.String()).expect(t, 0, []string{"mode                 default "}, nil)

	// A table migrated by an earlier version (whose Migrate with every
	// column created ordered mode's companion tables): nothing recorded,
	// the mode is inferred (as ordered: the companion tables exist), and
	// says so.
	rbExec(t, pool, tbl, schema.OrderedUpgradeSQL(tbl))
	rbExec(t, pool, tbl, `DELETE FROM `+pgx.Identifier{tbl.Schema(), tbl.Name() + "_mode"}.Sanitize())
	if s := stats(); s.Mode != schema.ModeOrdered || !s.ModeInferred {
		t.Fatalf("without a record: %+v, want the inferred ordered mode", s)
	}
	rbRun(t, rbEnv(), "stats", "--table="+tbl.String()).expect(t, 0, []string{"(inferred: none recorded"}, nil)
	rbRun(t, rbEnv(), "migrate", "--table="+tbl.String(), "--mode=default").expect(t, 0, []string{"recorded " + tbl.String() + " as relayed in default mode"}, nil)
	if s := stats(); s.Mode != schema.ModeDefault || s.ModeInferred {
		t.Fatalf("after migrate --mode=default: %+v", s)
	}
	rbRun(t, rbEnv(), "migrate", "--table="+tbl.String(), "--mode=fast").expect(t, 2, nil, []string{"--mode=\"fast\""})
	rbRun(t, rbEnv(), "migrate", "--table="+tbl.String(), "--mode=default", "--ordered").expect(t, 2, nil, []string{"excludes"})
}

// TestDeadListAndBulkReplayInOrderedMode: in a table `outbox migrate
// --ordered` created, a keyed row held by its key's dead hold is listed by
// `outbox dead list` and counted by `outbox stats`; a bulk replay's
// preview counts it, and leaves alone (and says so) a keyed row that
// `outbox dead replay --event-id` refuses.
func TestDeadListAndBulkReplayInOrderedMode(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := schema.MustParseTable(testdb.Schema(t) + ".outbox")
	rbRun(t, rbEnv(), "migrate", "--table="+tbl.String(), "--ordered").expect(t, 0, []string{"ordered mode"}, nil)
	if m, err := runbook.New(pool, tbl).Mode(ctx); err != nil || m != schema.ModeOrdered {
		t.Fatalf("after migrate --ordered: mode %q, %v", m, err)
	}
	held, above := uuid.New(), uuid.New()
	var seq int64
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		seq, err = publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: rbTenant, Topic: rbTopicA, EventID: held,
			Payload: json.RawMessage(`{}`), OrderingKey: "k-held"})
		if err != nil {
			return err
		}
		_, err = publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: rbTenant, Topic: rbTopicA, EventID: above,
			Payload: json.RawMessage(`{}`), OrderingKey: "k-above"})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The ordered relay's dead hold; a keyed row that died in default
	// mode before the switch, above its partition's floor.
	rbExec(t, pool, tbl, `INSERT INTO `+tbl.HoldsTable()+` (ordering_key, partition, sequence, attempts, available_at, last_error, dead_at)
VALUES ('k-held', hashtext('k-held') & 63, $1, 3, 'infinity', 'broker said no', now())`, seq)
	rbMarkDead(t, pool, tbl, "died before the switch", above)

	r := rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--json")
	r.expect(t, 0, nil, nil)
	list := rbDecode[struct {
		Table        string        `json:"table"`
		Rows         []runbook.Row `json:"rows"`
		DeadHeldKeys int           `json:"dead_held_keys"`
	}](t, r.stdout)
	if got := rbIDs(list.Rows); len(got) != 2 || got[0] != held || got[1] != above || !list.Rows[0].Held {
		t.Fatalf("dead list: %+v, want the held row and the row above the floor", list.Rows)
	}
	r = rbRun(t, rbEnv(), "stats", "--table="+tbl.String(), "--json")
	r.expect(t, 0, nil, nil)
	if s := rbDecode[runbook.TableStats](t, r.stdout); s.Dead != 2 || s.DeadHeldKeys != 1 || s.Mode != schema.ModeOrdered {
		t.Fatalf("stats: %+v", s)
	}

	rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--event-id="+above.String(), "--dry-run").
		expect(t, 1, nil, []string{"above its partition's floor"})
	before := rbSnapshot(t, pool, tbl)
	r = rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--all", "--dry-run", "--json")
	r.expect(t, 0, nil, nil)
	if rep := rbDecode[replayReport](t, r.stdout); rep.Rows != 1 || rep.LeftAlone != 1 {
		t.Fatalf("bulk replay preview: %+v, want 1 row (the held one) and 1 left alone", rep)
	}
	rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--all", "--dry-run").
		expect(t, 0, []string{"Rows it changes: 1", "Left alone: 1 dead row"}, nil)
	r = rbRun(t, rbEnv("OUTBOX_ENVIRONMENT", "development"), "dead", "replay", "--table="+tbl.String(), "--all", "--confirm", "--json")
	r.expect(t, 0, nil, nil)
	if rep := rbDecode[replayReport](t, r.stdout); rep.Changed != 1 {
		t.Fatalf("bulk replay: %+v", rep)
	}
	if after := rbSnapshot(t, pool, tbl); after[above] != before[above] {
		t.Fatalf("the bulk replay changed the row a single replay refuses: %s -> %s", before[above], after[above])
	}
	if st, ok, err := runbook.New(pool, tbl).HoldOfEvent(ctx, held); err != nil || !ok || st != runbook.HoldRetrying {
		t.Fatalf("the held row after the bulk replay: %v %v %v, want retrying (due now)", st, ok, err)
	}
}
