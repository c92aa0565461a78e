package schema_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// orderedInPlace reports whether tbl has the ordering columns, the ordered
// indexes and the companion tables with this version's hold states.
func orderedInPlace(t *testing.T, tbl schema.Table) (cols bool, indexes int, companions bool) {
	t.Helper()
	ctx := context.Background()
	pool := testdb.Pool(t)
	c, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	if companions, err = sqlq.OrderedTablesExist(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 AND indexname IN ($2 || '_keyed_by_part', $2 || '_keyed_by_key', $2 || '_pending_unkeyed')`,
		tbl.Schema(), tbl.Name()).Scan(&indexes); err != nil {
		t.Fatal(err)
	}
	return c.OrderingKey, indexes, companions
}

// WithOrderingKeyColumn on an existing default-mode table adds the ordering
// columns and their indexes, and keeps every row; the companion tables come
// with the switch to ordered mode (WithMode). On a table above
// OrderedRewriteMaxRows it refuses with ErrTableRewrite and the SQL to run,
// changing nothing, unless WithTableRewrite is given.
func TestMigrateExistingTableToOrdered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)

	small := testdb.Table(t, "small_outbox")
	if _, err := pool.Exec(ctx, `INSERT INTO `+small.Sanitize()+` (tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), 'a.b.c.v1', '{}', gen_random_uuid() FROM generate_series(1, 50)`); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, small, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatalf("migrate an existing table to ordered mode: %v", err)
	}
	if c, ix, comp := orderedInPlace(t, small); !c || ix != 3 || comp {
		t.Fatalf("after WithOrderingKeyColumn on an existing table: ordering_key %v, ordered indexes %d of 3, companion tables %v (want none: they come with the mode)", c, ix, comp)
	}
	if err := schema.Migrate(ctx, pool, small, schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatalf("switch to ordered mode: %v", err)
	}
	if c, ix, comp := orderedInPlace(t, small); !c || ix != 3 || !comp {
		t.Fatalf("after WithMode(ModeOrdered): ordering_key %v, ordered indexes %d of 3, companion tables %v", c, ix, comp)
	}
	var rows, keyed int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(ordering_key) FROM `+small.Sanitize()).Scan(&rows, &keyed); err != nil || rows != 50 || keyed != 0 {
		t.Fatalf("after the upgrade: %d rows, %d keyed (%v); want 50, 0", rows, keyed, err)
	}
	if err := schema.Migrate(ctx, pool, small, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatalf("second Migrate (idempotent): %v", err)
	}

	big := testdb.Table(t, "big_outbox")
	if _, err := pool.Exec(ctx, `INSERT INTO `+big.Sanitize()+` (tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), 'a.b.c.v1', '{}', gen_random_uuid() FROM generate_series(1, $1::int)`,
		schema.OrderedRewriteMaxRows+1); err != nil {
		t.Fatal(err)
	}
	err := schema.Migrate(ctx, pool, big, schema.WithAllColumns())
	if !errors.Is(err, schema.ErrTableRewrite) {
		t.Fatalf("Migrate of a large table to ordered mode: %v, want ErrTableRewrite", err)
	}
	for _, want := range []string{"WithTableRewrite", "--rewrite", "ADD COLUMN IF NOT EXISTS ordering_key", "CREATE TABLE IF NOT EXISTS " + big.HoldsTable(), "nothing was changed"} {
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("refusal lacks %q: %v", want, err)
		}
	}
	if c, ix, comp := orderedInPlace(t, big); c || ix != 0 || comp {
		t.Fatalf("refused Migrate changed the table: ordering_key %v, ordered indexes %d, companion tables %v", c, ix, comp)
	}
	if cols, _ := schema.DetectColumns(ctx, pool, big); cols.TraceContext || cols.Headers {
		t.Fatalf("refused Migrate added columns: %+v", cols)
	}
	if err := schema.Migrate(ctx, pool, big, schema.WithMode(schema.ModeOrdered), schema.WithTableRewrite()); err != nil {
		t.Fatalf("Migrate with WithTableRewrite: %v", err)
	}
	if c, ix, comp := orderedInPlace(t, big); !c || ix != 3 || !comp {
		t.Fatalf("after WithTableRewrite: ordering_key %v, ordered indexes %d of 3, companion tables %v", c, ix, comp)
	}

	// The SQL of the refusal, run by hand, does the same.
	byHand := testdb.Table(t, "hand_outbox")
	if _, err := pool.Exec(ctx, schema.OrderedUpgradeSQL(byHand)); err != nil {
		t.Fatalf("run OrderedUpgradeSQL: %v", err)
	}
	if c, ix, comp := orderedInPlace(t, byHand); !c || ix != 3 || !comp {
		t.Fatalf("after OrderedUpgradeSQL: ordering_key %v, ordered indexes %d of 3, companion tables %v", c, ix, comp)
	}
}
