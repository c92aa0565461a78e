package schema_test

import (
	"context"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateAddsPausedTopicsTable: Migrate creates the paused topics'
// table with a new table, and adds it to a table made before it (migration
// 000007); the table refuses an over-long reason.
func TestMigrateAddsPausedTopicsTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := schema.MustParseTable(testdb.Schema(t) + ".org_outbox")
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	check := func(want bool) {
		t.Helper()
		ok, err := schema.PausedTopicsExist(ctx, pool, tbl)
		if err != nil || ok != want {
			t.Fatalf("paused topics table exists %v (%v), want %v", ok, err, want)
		}
	}
	check(true)
	if _, err := pool.Exec(ctx, schema.PausedTopicsDownSQL(tbl)); err != nil {
		t.Fatal(err)
	}
	check(false)
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	check(true)
	q := schema.NewPausedTopicsQueries(tbl)
	long := make([]byte, schema.PauseReasonMaxBytes+1)
	for i := range long {
		long[i] = 'x'
	}
	if _, err := pool.Exec(ctx, q.Pause, "a.b.c.v1", string(long)); err == nil {
		t.Fatal("the table accepted a reason over PauseReasonMaxBytes")
	}
}
