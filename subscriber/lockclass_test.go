package subscriber_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestOrderedLockClassAcrossSearchPath (issue 31, item 4): a writer names
// the table without its schema, through its search_path; the relay names
// it with the schema. The writer's transaction holds its key lock (its row
// has a sequence, not yet committed) while rows of another key of the same
// partition commit, are delivered and move the partition's floor. The
// relay's cut must see that writer's key lock, and deliver its row once it
// commits. With the lock class a hash of the name as each side spelled it,
// the cut missed the writer, the floor passed its row, and the row was never
// delivered.
func TestOrderedLockClassAcrossSearchPath(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	writers := testdb.NewPool(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["search_path"] = tbl.Schema()
	})
	unqualified := schema.MustParseTable(tbl.Name())
	k := "late-key"
	tx, err := writers.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	late := uuid.New()
	if _, err := publisher.Enqueue(ctx, tx, unqualified, publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: late,
		Payload: json.RawMessage(`{}`), OrderingKey: k}); err != nil {
		t.Fatal(err)
	}

	pool := testdb.Pool(t)
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	s := orderedSub(t, testdb.NewPool(t, nil), cfg)
	consume(t, s, rec, nil)
	// Rows of another key in the late row's partition, with higher
	// sequences, committed while the writer stays open.
	other := sameSlot(t, pool, k)
	var evs []keyed
	for i := 0; i < 5; i++ {
		evs = append(evs, enqueueKeyed(t, pool, tbl, other)...)
	}
	rec.waitAcked(t, evs, 10*time.Second)
	time.Sleep(300 * time.Millisecond) // a few more cycles: the floor moves if the cut missed the writer
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, []keyed{{k, late}}, 10*time.Second)
	rec.checkOrder(t)
}
