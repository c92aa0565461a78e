package sqlv3_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestAdapterClaimOfKeyedTable: on a table with ordering_key and skipped_at
// (schema.DetectColumns), the adapters' claim, read through database/sql as
// watermill-sql reads it, gives a keyed row its ordering_key metadata, an
// unkeyed row none, and leaves a skipped row out.
func TestAdapterClaimOfKeyedTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "keyed_adapter_outbox", schema.WithAllColumns())
	cols, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	if !cols.OrderingKey || !cols.SkippedAt {
		t.Fatalf("DetectColumns of a table with every column: %+v, want OrderingKey and SkippedAt", cols)
	}
	msg := func(key string) publisher.Message {
		return publisher.Message{TenantID: uuid.New(), Topic: "org.keyed.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`), OrderingKey: key}
	}
	keyed, unkeyed, skipped := msg("order-7"), msg(""), msg("order-8")
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{keyed, unkeyed, skipped})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET skipped_at = now() WHERE event_id = $1`, skipped.EventID); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	a := sqlq.Adapter{Table: tbl, Columns: cols}
	claim := a.ClaimStatement(sqlq.AllTopics)
	rows, err := db.QueryContext(ctx, claim.SQL, claim.Args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	keys := map[string]string{}
	for rows.Next() {
		_, m, err := a.ScanClaimed(rows)
		if err != nil {
			t.Fatal(err)
		}
		keys[m.UUID] = m.Metadata.Get(schema.MetadataOrderingKey)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(keys) != 2 || keys[keyed.EventID.String()] != "order-7" || keys[unkeyed.EventID.String()] != "" {
		t.Fatalf("claimed %v, want the keyed row with ordering_key order-7 and the unkeyed row without, and not the skipped row %s", keys, skipped.EventID)
	}
}
