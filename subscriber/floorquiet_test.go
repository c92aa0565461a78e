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

// TestOrderedFloorSpacedWhilePinned: while a transaction pins the xmin
// horizon, a partition's floor that keeps moving is not written at every
// tick (each write would leave a row version the horizon keeps): with
// LockTTL 10 minutes, not for a minute. The relay delivers a key's rows every
// few milliseconds meanwhile, so its own floor moves at every tick; without
// the pin it is written at each (TestOrderedFloorWrittenWhenQuiet covers the
// end of a burst).
func TestOrderedFloorSpacedWhilePinned(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	pin, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pin.Rollback(ctx) }()
	if _, err := pin.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	cfg := orderedCfg(tbl)
	cfg.LockTTL = 10 * time.Minute
	rec := newRecorder()
	s := orderedSub(t, pool, cfg)
	consume(t, s, rec, func(*message.Message) bool { return true })
	first := enqueueKeyed(t, pool, tbl, "hot")
	rec.waitAcked(t, first, time.Minute)
	var part int
	if err := pool.QueryRow(ctx, `SELECT ordering_partition FROM `+tbl.Sanitize()+` WHERE ordering_key = 'hot' LIMIT 1`).Scan(&part); err != nil {
		t.Fatal(err)
	}
	floor := func() int64 {
		var f int64
		if err := pool.QueryRow(ctx, `SELECT floor_sequence FROM `+tbl.PartitionsTable()+` WHERE partition = $1`, part).Scan(&f); err != nil {
			t.Fatal(err)
		}
		return f
	}
	// The relay sees the pin within two ticks and a second; trickle rows
	// of the key for that long first, then read the written floor.
	trickle := func(d time.Duration) []keyed {
		var evs []keyed
		for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
			evs = append(evs, enqueueKeyed(t, pool, tbl, "hot")...)
		}
		return evs
	}
	rec.waitAcked(t, trickle(2*time.Second), time.Minute)
	before := floor()
	evs := trickle(3 * time.Second)
	rec.waitAcked(t, evs, time.Minute)
	if after := floor(); after != before {
		t.Fatalf("the floor of partition %d was written while the xmin horizon was pinned and the floor kept moving (%d, then %d); "+
			"it should be written at most every LockTTL/10 (a minute here)", part, before, after)
	}
	t.Logf("%d rows of one key delivered in 3 s under a pinned horizon; the written floor stayed at %d", len(evs), before)
}
