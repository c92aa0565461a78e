package publisher_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// TestEnqueueInATransactionThatIsPrepared: PostgreSQL refuses to PREPARE
// (two-phase commit) a transaction that has executed NOTIFY, and the
// default Enqueue notifies while a relay is idle. An Enqueuer with
// DisableNotify sends none, so its transaction can be prepared (the relay
// finds the row at its next poll). With max_prepared_transactions = 0 (this
// machine's server) PREPARE fails either way, but for that reason only.
func TestEnqueueInATransactionThatIsPrepared(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "prepared_outbox")
	// An idle relay: the table's idle lock held exclusively.
	holder, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Close(context.Background()) })
	if _, err := holder.Exec(ctx, sqlq.TryIdleLock, sqlq.IdleLockKey(tbl)); err != nil {
		t.Fatal(err)
	}
	var maxPrepared int
	if err := pool.QueryRow(ctx, `SELECT current_setting('max_prepared_transactions')::int`).Scan(&maxPrepared); err != nil {
		t.Fatal(err)
	}
	quiet, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		t.Fatal(err)
	}
	prepare := func(e *publisher.Enqueuer) error {
		t.Helper()
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(context.Background()) }()
		if _, err := e.Enqueue(ctx, tx, tbl, newMsg("org.prepared.v1")); err != nil {
			t.Fatal(err)
		}
		gid := "outbox-test-" + tbl.Schema()
		_, err = tx.Exec(ctx, `PREPARE TRANSACTION '`+gid+`'`)
		if err == nil {
			_, _ = conn.Exec(ctx, `ROLLBACK PREPARED '`+gid+`'`)
		}
		return err
	}
	const notifyRefused = "cannot PREPARE a transaction that has executed LISTEN, UNLISTEN, or NOTIFY"
	def, _ := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err := prepare(def); maxPrepared > 0 && (err == nil || !strings.Contains(err.Error(), notifyRefused)) {
		t.Errorf("the default Enqueue with a relay idle, then PREPARE: %v, want PostgreSQL's refusal of NOTIFY (the README says so)", err)
	}
	err = prepare(quiet)
	if maxPrepared == 0 {
		t.Logf("max_prepared_transactions = 0: PREPARE is refused for that reason (%v); only the absence of NOTIFY is checked", err)
	}
	switch {
	case maxPrepared > 0 && err != nil:
		t.Fatalf("DisableNotify, then PREPARE: %v", err)
	case err != nil && strings.Contains(err.Error(), notifyRefused):
		t.Fatalf("DisableNotify, then PREPARE: %v: the enqueue sent NOTIFY", err)
	}
}
