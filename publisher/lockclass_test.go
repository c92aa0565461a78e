package publisher_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestKeyLockClassIsTheTableOID: a keyed Enqueue and EnqueueBatch take the
// per-key lock in the class of the table's OID, whether the writer names the
// table with its schema or through its search_path, and the relay's lookup
// (LookupOrderingLockClass) gives the same class. The class is a regclass
// constant of the cached prepared statement: after the table is dropped and
// made again (a new OID), the same connection's next Enqueue takes the new
// class (PostgreSQL re-plans a statement whose regclass constant's relation
// changed).
func TestKeyLockClassIsTheTableOID(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithOrderingKeyColumn())
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, `SET search_path = `+pgx.Identifier{tbl.Schema()}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	unqualified := schema.MustParseTable(tbl.Name())

	// lockClasses enqueues one keyed row with each table name (single and
	// batch) in one transaction and returns the classes of the key locks
	// the transaction holds.
	lockClasses := func(enq *publisher.Enqueuer) []int32 {
		t.Helper()
		var classes []int32
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			for _, tb := range []schema.Table{tbl, unqualified} {
				m := newMsg("org.organization.created.v1")
				m.OrderingKey = "k-" + tb.String()
				if _, err := enq.Enqueue(ctx, tx, tb, m); err != nil {
					return err
				}
				b := newMsg("org.organization.created.v1")
				b.OrderingKey = "b-" + tb.String()
				if _, err := enq.EnqueueBatch(ctx, tx, tb, []publisher.Message{b}); err != nil {
					return err
				}
			}
			rows, err := tx.Query(ctx, `SELECT classid::int8::int4 FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 2 AND pid = pg_backend_pid() ORDER BY objid`)
			if err != nil {
				return err
			}
			classes, err = pgx.CollectRows(rows, pgx.RowTo[int32])
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return classes
	}
	check := func(classes []int32) {
		t.Helper()
		want, err := sqlq.LookupOrderingLockClass(ctx, pool, tbl)
		if err != nil {
			t.Fatal(err)
		}
		var oid int32
		if err := pool.QueryRow(ctx, `SELECT $1::text::regclass::oid::int4`, tbl.Sanitize()).Scan(&oid); err != nil {
			t.Fatal(err)
		}
		if want != oid {
			t.Fatalf("LookupOrderingLockClass = %d, table OID %d", want, oid)
		}
		if len(classes) != 4 {
			t.Fatalf("%d key locks held, want 4 (%v)", len(classes), classes)
		}
		for _, c := range classes {
			if c != want {
				t.Fatalf("key lock classes %v, want all %d (the table's OID)", classes, want)
			}
		}
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	// Seven times: PostgreSQL plans a prepared statement's first five runs
	// for their arguments, then may keep a generic plan.
	for range 7 {
		check(lockClasses(enq))
	}

	// The table made again under the same name: a new OID, and the same
	// connection's cached statements.
	if _, err := pool.Exec(ctx, `DROP TABLE `+tbl.Sanitize()+` CASCADE`); err != nil {
		t.Fatal(err)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatal(err)
	}
	for range 7 {
		check(lockClasses(enq))
	}
}
