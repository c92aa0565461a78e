package subscriber_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestListenerReconnectsFastAfterEachLoss: the LISTEN connection is killed
// (pg_terminate_backend) six times in a row; each time the listener is back
// within a second (its reconnect backoff starts again after every successful
// connection instead of growing to seconds), and afterwards a NOTIFY still
// wakes the relay at once, with polling every hour.
func TestListenerReconnectsFastAfterEachLoss(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "relisten_outbox")
	app := "relisten_" + tbl.Schema()
	own := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	s := newSub(t, own, subscriber.Config{Table: tbl, PollInterval: time.Hour})
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	listener := func() int {
		var pid int
		_ = pool.QueryRow(ctx, `SELECT COALESCE(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'`, app).Scan(&pid)
		return pid
	}
	waitFor(t, "the listener", 10*time.Second, func() bool { return listener() != 0 })
	for round := 1; round <= 6; round++ {
		old := listener()
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, old); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		waitFor(t, "the listener back", 10*time.Second, func() bool { p := listener(); return p != 0 && p != old })
		if d := time.Since(killed); d > time.Second {
			t.Fatalf("round %d: the listener came back %s after its connection was killed; the backoff did not start again", round, d)
		}
	}
	ids := enqueue(t, pool, tbl, "org.relisten.v1", 1)
	select {
	case msg := <-ch:
		if msg.UUID != ids[0] {
			t.Fatalf("delivered %s, want %s", msg.UUID, ids[0])
		}
		msg.Ack()
	case <-time.After(2 * time.Second):
		t.Fatal("a NOTIFY after the reconnections did not wake the relay")
	}
}
