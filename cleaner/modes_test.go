package cleaner_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestCleanerKeepsRowsParkedBehindAWALHold (issue 31 item 8): in a table
// the WAL relay streams, a row parked behind a held key (its key's earlier
// row is dead) is not delivered, even when the recorded horizon has passed
// it and the key has been held longer than Retention: the cleaner must keep
// it, and the runbook must count it pending, not streamed. The progress
// record and the hold are written as walrelay writes them (no replication
// is needed to reach this state).
func TestCleanerKeepsRowsParkedBehindAWALHold(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "wal_outbox", schema.WithOrderingKeyColumn())
	pub := "p_" + tbl.Schema()
	for _, sql := range []string{sqlq.WALCreateProgressTable(tbl), sqlq.WALCreateHoldsTable(tbl), sqlq.WALCreatePublication(pub, tbl)} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), sqlq.WALDropPublication(pub)) })
	// What walrelay.Setup records.
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeWAL, "test"); err != nil {
		t.Fatal(err)
	}

	keys := []string{"held", "held", "held", "ok", ""}
	ids := make([]uuid.UUID, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.wal.v1", EventID: ids[i], Payload: json.RawMessage(`{}`), OrderingKey: k}
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := enq.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// The key's first row went dead and holds the key (the relay's
	// MarkDeadHold); all rows were written long ago.
	for _, sql := range []string{
		`UPDATE ` + tbl.Sanitize() + ` SET available_at = now() - interval '10 days', created_at = now() - interval '10 days'`,
		`WITH d AS (UPDATE ` + tbl.Sanitize() + ` SET attempts = 25, last_error = 'no', dead_at = now() - interval '9 days', available_at = 'infinity'
  WHERE event_id = $1 RETURNING sequence, event_id)
INSERT INTO ` + tbl.HoldsTable() + ` (mode, ordering_key, partition, sequence, event_id, created_at, dead_at)
  SELECT 'wal', 'held', 0, sequence, event_id, now() - interval '9 days', now() - interval '9 days' FROM d`,
	} {
		args := []any{}
		if len(sql) > 0 && sql[:4] == "WITH" {
			args = append(args, ids[0])
		}
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	// A horizon past every row, recorded now (the relay's Progress).
	if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.WALProgressTable()+` (slot, confirmed_lsn, horizon) VALUES ('s', '0/0', pg_current_xact_id())`); err != nil {
		t.Fatal(err)
	}

	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Mode != schema.ModeWAL || s.Pending != 2 || s.WaitingBehindHeldKeys != 2 || s.Dead != 1 || s.StreamedUnpublished != 2 ||
		s.HeldKeys != 1 || s.DeadHeldKeys != 1 {
		t.Fatalf("WAL stats: %+v; want pending 2 (parked), dead 1, streamed 2, 1 dead held key", s)
	}
	for i, wantDelivered := range []bool{false, false, false, true, true} {
		r, err := runbook.New(pool, tbl).Event(ctx, ids[i])
		if err != nil || r.Delivered != wantDelivered || (i == 0 && !r.Held) || ((i == 1 || i == 2) && r.WaitingBehind == nil) {
			t.Fatalf("event %d: %+v, %v; want delivered %v", i, r, err, wantDelivered)
		}
	}

	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	published, dead, err := c.CleanOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var left []uuid.UUID
	rows, err := pool.Query(ctx, `SELECT event_id FROM `+tbl.Sanitize()+` ORDER BY sequence`)
	if err != nil {
		t.Fatal(err)
	}
	if left, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID]); err != nil {
		t.Fatal(err)
	}
	if published != 2 || dead != 0 || len(left) != 3 || left[0] != ids[0] || left[1] != ids[1] || left[2] != ids[2] {
		t.Fatalf("cleaned %d streamed, %d dead; left %v; want the 2 streamed rows deleted and the dead row and the 2 rows parked behind it kept (%v)",
			published, dead, left, ids[:3])
	}
}

// TestCleanerKeepsUndeliveredKeyedRows: in an ordered table the cleaner
// deletes keyed rows the relay is done with (at or below the floor, not
// held) and keeps, however old, the rows above the floor, the row a dead
// hold holds and the rows waiting behind it, even below the floor.
func TestCleanerKeepsUndeliveredKeyedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "ord_outbox", schema.WithMode(schema.ModeOrdered))
	keys := []string{"done", "held", "held", "held", "above"}
	ids := make([]uuid.UUID, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.ord.v1", EventID: ids[i], Payload: json.RawMessage(`{}`), OrderingKey: k}
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := enq.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	for _, st := range []struct {
		sql  string
		args []any
	}{
		{`UPDATE ` + tbl.Sanitize() + ` SET created_at = now() - interval '10 days'`, nil},
		// Floors just below the "above" row; the "held" key held dead at its
		// second row.
		{`UPDATE ` + tbl.PartitionsTable() + ` SET floor_sequence = (SELECT sequence - 1 FROM ` + tbl.Sanitize() + ` WHERE event_id = $1)`, []any{ids[4]}},
		{`INSERT INTO ` + tbl.HoldsTable() + ` (ordering_key, partition, sequence, attempts, available_at, last_error, dead_at)
SELECT ordering_key, ordering_partition, sequence, 25, 'infinity', 'no', now() - interval '9 days' FROM ` + tbl.Sanitize() + ` WHERE event_id = $1`, []any{ids[2]}},
	} {
		if _, err := pool.Exec(ctx, st.sql, st.args...); err != nil {
			t.Fatal(err)
		}
	}
	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Hour, DeadRetention: time.Hour}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.CleanOnce(ctx); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT event_id FROM `+tbl.Sanitize()+` ORDER BY sequence`)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 3 || left[0] != ids[2] || left[1] != ids[3] || left[2] != ids[4] {
		t.Fatalf("left %v; want the dead held row, the row behind it and the row above the floor: %v", left, ids[2:])
	}
	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil || s.Pending != 2 || s.Dead != 1 || s.WaitingBehindHeldKeys != 1 {
		t.Fatalf("stats after cleaning: %+v, %v", s, err)
	}
}
