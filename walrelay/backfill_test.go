package walrelay_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALBacklogBeforeSetup: five rows pending when walrelay.Setup runs
// (keyed and unkeyed) are delivered by the first relay, then the stream's
// rows; runbook.Runbook.Stats counts none of them streamed before it was delivered,
// and all of them streamed, none pending, once they were. Before, the slot
// started at Setup's position: the five were never delivered, and the
// horizon of the first progress record counted them streamed (the cleaner
// then deleted them).
func TestWALBacklogBeforeSetup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl, _ := startCluster(t, nil, false)
	backlog := enqueue(t, pool, tbl, "a", "a", "b", "", "")
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	// Setup is idempotent: a second call changes nothing.
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	if st, err := runbook.New(pool, tbl).Stats(ctx); err != nil || st.Pending != 5 || st.StreamedUnpublished != 0 {
		t.Fatalf("before the relay runs: %+v, %v; want 5 pending, none streamed", st, err)
	}
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	rec.waitAcked(t, backlog, 30*time.Second)
	after := enqueue(t, pool, tbl, "a", "b", "")
	rec.waitAcked(t, after, 30*time.Second)
	rec.mu.Lock()
	for k, seqs := range rec.byKey {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] < seqs[i-1] {
				t.Errorf("key %q delivered out of order: %v", k, seqs)
			}
		}
	}
	rec.mu.Unlock()
	waitFor(t, 30*time.Second, "the eight rows counted streamed, none pending", func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		return err == nil && st.Pending == 0 && st.StreamedUnpublished == 8
	})
}

// TestWALBackfillKeepsCommitOrderInATopic: two unkeyed rows of one topic
// commit in the opposite order to their sequences while no relay runs,
// and the slot is lost; the backfill delivers them in commit order, as the
// stream would have (the server tracks commit timestamps). Before, the
// backfill delivered them in sequence order.
func TestWALBackfillKeepsCommitOrderInATopic(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl, _ := clusterWith(t, map[string]string{"track_commit_timestamp": "on"})
	rec := newRecorder()
	a := relay(t, pool, tbl, nil)
	rec.consume(t, a, nil)
	first := enqueue(t, pool, tbl, "")
	rec.waitAcked(t, first, 30*time.Second)
	time.Sleep(400 * time.Millisecond) // a records its position
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	// T1 takes the lower sequence, T2 the higher; T2 commits first.
	begin := func() (pgx.Tx, uuid.UUID) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		id := uuid.New()
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: id, Payload: json.RawMessage(`{"n":1}`)}}); err != nil {
			t.Fatal(err)
		}
		return tx, id
	}
	t1, id1 := begin()
	t2, id2 := begin()
	if err := t2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := t1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var seq1, seq2 int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $1), (SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $2)`, id1, id2).Scan(&seq1, &seq2); err != nil {
		t.Fatal(err)
	}
	if seq1 >= seq2 {
		t.Fatalf("sequences %d, %d: the test needs T1's below T2's", seq1, seq2)
	}
	dropSlot(t, pool, tbl)
	rec.mu.Lock()
	rec.byKey[""] = nil
	rec.mu.Unlock()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	rec.waitAcked(t, []uuid.UUID{id1, id2}, 30*time.Second)
	rec.mu.Lock()
	got := append([]int64(nil), rec.byKey[""]...)
	rec.mu.Unlock()
	var firsts []int64
	seen := map[int64]bool{}
	for _, s := range got {
		if (s == seq1 || s == seq2) && !seen[s] {
			seen[s] = true
			firsts = append(firsts, s)
		}
	}
	if len(firsts) != 2 || firsts[0] != seq2 || firsts[1] != seq1 {
		t.Fatalf("the backfill delivered the topic's rows %v (first deliveries %v); want commit order [%d %d]", got, firsts, seq2, seq1)
	}
}
