package schema_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateAddsPausedTopicsTable: Migrate creates the paused topics'
// table with a new table, and adds it to a table made before it (migration
// 000007); the table refuses an over-long reason.
func TestMigrateAddsPausedTopicsTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := migratedCompanion(t, "paused topics", sqlq.PausedTopicsExist, schema.PausedTopicsDownSQL)
	q := sqlq.NewPausedTopicsQueries(tbl)
	long := make([]byte, schema.PauseReasonMaxBytes+1)
	for i := range long {
		long[i] = 'x'
	}
	if _, err := pool.Exec(ctx, q.Pause, "a.b.c.v1", string(long)); err == nil {
		t.Fatal("the table accepted a reason over PauseReasonMaxBytes")
	}
}

// migratedCompanion migrates a new table and checks the companion table
// that exists looks up: Migrate made it, down drops it, and Migrate adds it
// again to the table made before it. It returns the pool and the table.
func migratedCompanion(t *testing.T, what string, exists func(context.Context, schema.Querier, schema.Table) (bool, error),
	down func(schema.Table) string) (*pgxpool.Pool, schema.Table) {
	t.Helper()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := schema.MustParseTable(testdb.Schema(t) + ".org_outbox")
	check := func(want bool) {
		t.Helper()
		ok, err := exists(ctx, pool, tbl)
		if err != nil || ok != want {
			t.Fatalf("%s table exists %v (%v), want %v", what, ok, err, want)
		}
	}
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	check(true)
	if _, err := pool.Exec(ctx, down(tbl)); err != nil {
		t.Fatal(err)
	}
	check(false)
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	check(true)
	return pool, tbl
}
