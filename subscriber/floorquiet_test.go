package subscriber_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestOrderedFloorWrittenWhenQuiet: a partition's floor that stopped moving
// is written at the next tick, not LockTTL/10 after the last write. With
// LockTTL 10 minutes (a moving floor is written at most once a minute) the
// written progress covers a burst within 30 s of its last ack; before, the
// runbook counted the burst pending for a minute.
func TestOrderedFloorWrittenWhenQuiet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	cfg := orderedCfg(tbl)
	cfg.LockTTL = 10 * time.Minute
	rec := newRecorder()
	s := orderedSub(t, pool, cfg)
	consume(t, s, rec, func(*message.Message) bool { return true })
	var events []keyed
	for i := range 10 {
		keys := make([]string, 20)
		for j := range keys {
			keys[j] = "k" + strconv.Itoa((i*7+j)%40)
		}
		events = append(events, enqueueKeyed(t, pool, tbl, keys...)...)
	}
	rec.waitAcked(t, events, 2*time.Minute)
	acked := time.Now()
	for {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			break
		}
		if time.Since(acked) > 30*time.Second {
			t.Fatalf("30 s after the last ack the runbook counts %d of %d rows pending: the floors of quiet partitions were not written", st.Pending, len(events))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%d events; the written floors covered them %s after the last ack", len(events), time.Since(acked).Round(time.Millisecond))
}
