package walrelay_test

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// drainBacklog is the held key's backlog of the drain tests, drainInFlight
// their MaxInFlight: the documented bound on the rows a relay holds read
// and not settled is backoffReadAhead (4) x MaxInFlight.
const (
	drainBacklog  = 300
	drainInFlight = 4
)

// drainRun is a relay with MaxInFlight drainInFlight on a key of
// 1+drainBacklog rows whose head fails as fail says; it returns the rows'
// ids and a function that waits until every row but the head is acked, in
// sequence order and each once.
func drainRun(t *testing.T, fail func(n int) error, backoff time.Duration) (*pgxpool.Pool, schema.Table, *walrelay.Subscriber, []uuid.UUID, func()) {
	t.Helper()
	pool, tbl := cluster(t)
	keys := make([]string, 1+drainBacklog)
	for i := range keys {
		keys[i] = "held"
	}
	ids := enqueue(t, pool, tbl, keys...)
	s := relay(t, pool, tbl, func(c *walrelay.Config) {
		c.MaxInFlight = drainInFlight
		c.Backoff = func(int) time.Duration { return backoff }
	})
	var mu sync.Mutex
	handed := map[string]int{}
	var acked []int64
	rec := newRecorder()
	rec.consume(t, s, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		handed[msg.UUID]++
		if msg.UUID == ids[0].String() {
			return fail(handed[msg.UUID])
		}
		seq, _ := strconv.ParseInt(msg.Metadata.Get(schema.MetadataSequence), 10, 64)
		acked = append(acked, seq)
		return nil
	})
	return pool, tbl, s, ids, func() {
		t.Helper()
		rec.waitAcked(t, ids[1:], 60*time.Second)
		mu.Lock()
		defer mu.Unlock()
		if !slices.IsSorted(acked) || len(acked) != drainBacklog {
			t.Errorf("%d acks of the backlog, in order: %v; want %d, in order", len(acked), slices.IsSorted(acked), drainBacklog)
		}
	}
}

// TestWALDrainReadsInBatches (issue 42, item 6): a dead head holds its
// key with 300 rows parked behind it; after its replay the drain reads
// them from the table in batches, the next as the previous settles: the
// relay never holds more than 4 x MaxInFlight rows read and not settled.
// Before, the drain read the whole backlog at once (301 rows).
func TestWALDrainReadsInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dead := true
	var mu sync.Mutex
	pool, tbl, s, ids, wait := drainRun(t, func(int) error {
		mu.Lock()
		defer mu.Unlock()
		if dead {
			return subscriber.Permanent(errors.New("poison"))
		}
		return nil
	}, 20*time.Millisecond)
	waitFor(t, 30*time.Second, "the head dead and holding its key", func() bool {
		held, err := runbook.New(pool, tbl).HeldKeys(ctx, 10)
		return err == nil && len(held) == 1 && held[0].State == runbook.HoldDead && held[0].EventID == ids[0].String()
	})
	mu.Lock()
	dead = false
	mu.Unlock()
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, ids[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	wait()
	if peak := walrelay.PeakRows(s); peak > 4*drainInFlight {
		t.Errorf("%d rows held read and not settled at once, want at most 4 x MaxInFlight (%d)", peak, 4*drainInFlight)
	}
}

// TestWALSpilledRetryReadsInBatches (issue 42, item 6): a head that fails
// once, with 300 rows of its key behind it, is spilled; its retry reads the
// key's rows from the table in batches too.
func TestWALSpilledRetryReadsInBatches(t *testing.T) {
	t.Parallel()
	_, _, s, _, wait := drainRun(t, func(n int) error {
		if n == 1 {
			return errors.New("transient")
		}
		return nil
	}, time.Second)
	wait()
	if n := walrelay.Spilled(s); n < 1 {
		t.Fatalf("%d keys spilled, want the held key", n)
	}
	if peak := walrelay.PeakRows(s); peak > 4*drainInFlight {
		t.Errorf("%d rows held read and not settled at once, want at most 4 x MaxInFlight (%d)", peak, 4*drainInFlight)
	}
}
