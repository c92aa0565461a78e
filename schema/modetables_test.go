package schema_test

import (
	"context"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// relationsOf lists the tables and sequences of tbl's schema (a fresh one
// per test: tbl's and its companions only), as "name (table)" or "name
// (sequence)", by name.
func relationsOf(t *testing.T, tbl schema.Table) []string {
	t.Helper()
	rows, err := testdb.Pool(t).Query(context.Background(), `SELECT c.relname || CASE c.relkind WHEN 'S' THEN ' (sequence)' ELSE ' (table)' END
FROM pg_class AS c WHERE c.relnamespace = $1::regnamespace AND c.relkind IN ('r', 'p', 'S') ORDER BY c.relname`, tbl.Schema())
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// defaultModeTables are the relations of a default-mode table named name:
// the table and its sequence, the record of its relay mode (and the
// relays' lock TTL), the paused topics and the death notices the default
// relay reads and writes, and the console's replay jobs.
func defaultModeTables(name string) []string {
	return []string{name + " (table)", name + "_dead_notices (table)", name + "_mode (table)", name + "_paused_topics (table)",
		name + "_replay_jobs (table)", name + "_sequence_seq (sequence)"}
}

// with returns the relations of a default-mode table plus the companion
// tables of a keyed mode (suffixes), by name.
func with(name string, suffixes ...string) []string {
	out := defaultModeTables(name)
	for _, s := range suffixes {
		out = append(out, name+s+" (table)")
	}
	slices.Sort(out)
	return out
}

// TestEachModeHasItsTables (issue 57, item 5): Migrate gives a new table
// (every optional column included) only what the default relay and the
// operator surfaces need; the companion tables of the keyed modes come with
// the switch to them (schema.SwitchMode, which Migrate's WithMode, `outbox
// migrate --mode`, walrelay.Setup and every relay's start run): ordered
// mode adds <table>_partitions, <table>_relays and <table>_holds, the WAL
// relay <table>_holds. A switch back to the default mode keeps them; a
// Migrate of the table asks for nothing more. Before, Migrate with every
// column created the three whatever the mode.
func TestEachModeHasItsTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)

	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	if got, want := relationsOf(t, tbl), defaultModeTables("org_outbox"); !reflect.DeepEqual(got, want) {
		t.Fatalf("a new table migrated with every column:\n got %v\nwant %v", got, want)
	}
	if cols, err := schema.DetectColumns(ctx, pool, tbl); err != nil || !cols.OrderingKey || !cols.TraceContext || !cols.Headers {
		t.Fatalf("a new table migrated with every column lacks columns: %+v, %v", cols, err)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	if got, want := relationsOf(t, tbl), defaultModeTables("org_outbox"); !reflect.DeepEqual(got, want) {
		t.Fatalf("a second Migrate with every column:\n got %v\nwant %v", got, want)
	}

	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeOrdered, "test"); err != nil {
		t.Fatal(err)
	}
	ordered := with("org_outbox", "_holds", "_partitions", "_relays")
	if got := relationsOf(t, tbl); !reflect.DeepEqual(got, ordered) {
		t.Fatalf("after the switch to ordered mode:\n got %v\nwant %v", got, ordered)
	}
	if ready, _, err := sqlq.OrderedReady(ctx, pool, tbl); err != nil || !ready {
		t.Fatalf("after the switch to ordered mode, ready for ordered relays %v (%v)", ready, err)
	}
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeDefault, "test"); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	if got := relationsOf(t, tbl); !reflect.DeepEqual(got, ordered) {
		t.Fatalf("switched back to the default mode and migrated, the keyed tables stay (nothing is dropped):\n got %v\nwant %v", got, ordered)
	}

	// The WAL relay keeps its holds in <table>_holds; it has no partitions
	// and no membership.
	wal := testdb.Table(t, "wal_outbox", schema.WithAllColumns())
	if err := schema.SwitchMode(ctx, pool, wal, schema.ModeWAL, "test"); err != nil {
		t.Fatal(err)
	}
	if got, want := relationsOf(t, wal), with("wal_outbox", "_holds"); !reflect.DeepEqual(got, want) {
		t.Fatalf("after the switch to the WAL relay:\n got %v\nwant %v", got, want)
	}

	// Migrate's WithMode(ModeOrdered) switches, so the table has them at once.
	keyed := testdb.Table(t, "keyed_outbox", schema.WithMode(schema.ModeOrdered))
	if got, want := relationsOf(t, keyed), with("keyed_outbox", "_holds", "_partitions", "_relays"); !reflect.DeepEqual(got, want) {
		t.Fatalf("a new table migrated in ordered mode:\n got %v\nwant %v", got, want)
	}

	// The printed SQL follows the same rule.
	p := schema.MustParseTable("public.app_outbox")
	if up := schema.UpSQL(p, schema.WithAllColumns()); strings.Contains(up, p.HoldsTable()) || strings.Contains(up, p.PartitionsTable()) ||
		!strings.Contains(up, "ordering_key") {
		t.Fatalf("UpSQL with every column creates the keyed tables, or lacks ordering_key:\n%s", up)
	}
	if up := schema.UpSQL(p, schema.WithMode(schema.ModeOrdered)); !strings.Contains(up, "CREATE TABLE IF NOT EXISTS "+p.HoldsTable()) ||
		!strings.Contains(up, "CREATE TABLE IF NOT EXISTS "+p.PartitionsTable()) || !strings.Contains(up, "CREATE TABLE IF NOT EXISTS "+p.RelaysTable()) {
		t.Fatalf("UpSQL in ordered mode lacks the keyed tables:\n%s", up)
	}
}
