package subscriber_test

import (
	"context"
	"encoding/json"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// xminWalkEnv runs TestBoundedClaimWalkUnderAPin, which pins the cluster's
// xmin horizon for the length of a 20,000-row drain (tens of seconds).
const xminWalkEnv = "OUTBOX_TEST_XMIN_WALK"

// TestBoundedClaimWalkUnderAPin measures what docs/XMIN.md promises of the
// bounded claim: under a pinned xmin horizon, a relay that was caught up
// drains a burst of rows committed at once (OUTBOX_TEST_XMIN_WALK rows,
// 20,000 with "1") and
// each claim walks about its own batch of index entries, not every entry
// the drain has left behind. It prints the index entries read in the
// pending index (pg_stat_user_indexes.idx_tup_read) per row delivered and
// fails above 20 (about 210 before the bound moved during a drain). Run:
//
//	OUTBOX_TEST_XMIN_WALK=1 go test -count=1 -v -run TestBoundedClaimWalkUnderAPin ./subscriber/
func TestBoundedClaimWalkUnderAPin(t *testing.T) {
	env := os.Getenv(xminWalkEnv)
	if env == "" {
		t.Skip("set " + xminWalkEnv + "=1 to pin the xmin horizon through a 20,000-row drain")
	}
	rows := 20000
	if n, err := strconv.Atoi(env); err == nil && n > 1 {
		rows = n
	}
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "xmin_walk_outbox")
	// The sweep every 150 s: the drain's reads are the claims'.
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 10 * time.Minute})
	cctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	ch, err := s.Subscribe(cctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var got atomic.Int64
	go func() {
		for msg := range ch {
			msg.Ack()
			got.Add(1)
		}
	}()
	for i := range 20 { // caught up, the bound near the head
		enqueue(t, pool, tbl, "org.walk.v1", 1)
		waitFor(t, "a delivery", 2*time.Minute, func() bool { return got.Load() == int64(i+1) })
	}
	pin, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pin.Close(context.Background()) })
	if _, err := pin.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`); err != nil {
		t.Fatal(err)
	}
	if _, err := pin.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	index := tbl.Schema() + "." + tbl.Name() + "_pending_by_available"
	reads := func() int64 {
		time.Sleep(1500 * time.Millisecond) // backends report their counts at most once a second
		var n int64
		if err := pool.QueryRow(ctx, `SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelid = to_regclass($1)`, index).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before, delivered0 := reads(), got.Load()
	start := time.Now()
	// The burst commits at once: the relay then drains a backlog.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for left := rows; left > 0; left -= 500 {
			msgs := make([]publisher.Message, min(left, 500))
			for i := range msgs {
				msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.walk.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)}
			}
			if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the burst to drain", 10*time.Minute, func() bool { return got.Load() >= delivered0+int64(rows) })
	took := time.Since(start)
	after := reads()
	if _, err := pin.Exec(ctx, `ROLLBACK`); err != nil {
		t.Fatal(err)
	}
	delivered := got.Load() - delivered0
	per := float64(after-before) / float64(delivered)
	t.Logf("under a pinned horizon: %d rows delivered in %s, %d entries read in %s: %.1f per row delivered",
		delivered, took.Round(time.Millisecond), after-before, index, per)
	if per > 20 {
		t.Fatalf("the claims read %.1f index entries per row delivered: their walk is not bounded", per)
	}
}
