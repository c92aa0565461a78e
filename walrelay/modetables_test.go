package walrelay_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALSetupOnADefaultTableAddsTheHoldsTable (issue 57, item 5): a table
// migrated with every column is a default-mode table without the keyed
// modes' companion tables; walrelay.Setup (its switch to the WAL relay)
// adds <table>_holds, where the WAL relay keeps its held keys, and none of
// ordered mode's (<table>_partitions, <table>_relays); the WAL relay then
// relays the keyed rows.
func TestWALSetupOnADefaultTableAddsTheHoldsTable(t *testing.T) {
	t.Parallel()
	pool, tbl, _ := startCluster(t, nil, false)
	ctx := context.Background()
	tables := func() (holds, partitions, relays bool) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`,
			tbl.HoldsTable(), tbl.PartitionsTable(), tbl.RelaysTable()).Scan(&holds, &partitions, &relays); err != nil {
			t.Fatal(err)
		}
		return holds, partitions, relays
	}
	if h, p, r := tables(); h || p || r {
		t.Fatalf("a new default-mode table has keyed tables: holds %v, partitions %v, relays %v", h, p, r)
	}
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	if h, p, r := tables(); !h || p || r {
		t.Fatalf("after walrelay.Setup: holds %v, partitions %v, relays %v; want the holds table only", h, p, r)
	}
	if rec, ok, err := schema.RecordedMode(ctx, pool, tbl); err != nil || !ok || rec.Mode != schema.ModeWAL {
		t.Fatalf("after walrelay.Setup: mode %+v, recorded %v (%v); want wal", rec, ok, err)
	}
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	rec.waitAcked(t, enqueue(t, pool, tbl, "k", "k", ""), time.Minute)
}
