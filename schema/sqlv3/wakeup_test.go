package sqlv3_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/schema/sqlv3"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// This test lives here, not in package subscriber, so that package
// subscriber's tests do not import watermill-sql either: a module that
// imports subscriber would otherwise still get watermill-sql v3 in its
// go.sum through them.

// TestWakeUpWatermillSQLPublisher: rows inserted through watermill-sql's
// stock publisher with sqlv3.Adapter (the interop path) wake a sleeping
// relay within moments, with a poll interval of 10 minutes: a delivery
// within the 2-minute wait is not the poll's, however slow the machine.
func TestWakeUpWatermillSQLPublisher(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	tenant := uuid.New()
	db, err := sql.Open("pgx", testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	pub, err := wsql.NewPublisher(db, wsql.PublisherConfig{SchemaAdapter: sqlv3.Adapter{Table: tbl}}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	const poll = 10 * time.Minute
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: poll}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		waitFor(t, "the relay asleep on the idle lock", 2*time.Minute, func() bool { return idleHeld(t, pool, tbl) })
		m := message.NewMessage(uuid.NewString(), []byte(`{"n":1}`))
		m.Metadata.Set(schema.MetadataTenantID, tenant.String())
		start := time.Now()
		if err := pub.Publish("org.thing.changed.v1", m); err != nil {
			t.Fatal(err)
		}
		select {
		case got := <-ch:
			got.Ack()
			if got.UUID != m.UUID {
				t.Fatalf("got %s, want %s", got.UUID, m.UUID)
			}
			t.Logf("message %d delivered %s after its publish began", i, time.Since(start).Round(time.Millisecond))
		case <-time.After(2 * time.Minute):
			t.Fatalf("message %d inserted through watermill-sql did not wake the relay within 2 minutes (poll interval %s)", i, poll)
		}
	}
}

// idleHeld reports whether some session holds the table's idle lock
// exclusively: a relay is idle and enqueues send NOTIFY.
func idleHeld(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) bool {
	t.Helper()
	var held bool
	err := pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND ((classid::bigint << 32) | objid::bigint) = $1 AND mode = 'ExclusiveLock' AND granted)`, sqlq.IdleLockKey(tbl)).Scan(&held)
	if err != nil {
		t.Fatal(err)
	}
	return held
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
