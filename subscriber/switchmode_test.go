package subscriber_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestSwitchToOrderedKeepsDeadAndPublished: a table with every column is
// relayed in default mode, where one keyed row dies and one is published;
// switched to ordered mode, the dead row stays dead (counted dead, never
// delivered), the published one is not delivered again, the key's later
// rows are delivered in order, and a replay of the dead row delivers it
// once and it is dead no more.
func TestSwitchToOrderedKeepsDeadAndPublished(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	first := enqueueKeyed(t, pool, tbl, "k", "k")
	dead, published := first[0], first[1]

	def := orderedSub(t, pool, subscriber.Config{Table: tbl, MaxAttempts: 1, LockTTL: time.Second, PollInterval: 100 * time.Millisecond})
	defRec := newRecorder()
	consume(t, def, defRec, func(m *message.Message) bool { return m.UUID != dead.event.String() })
	defRec.waitAcked(t, []keyed{published}, 30*time.Second)
	waitUntil(t, 30*time.Second, func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		return err == nil && st.Dead == 1
	})
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}

	later := enqueueKeyed(t, pool, tbl, "k", "k")
	o := subOnceOtherModeGone(t, pool, orderedCfg(tbl))
	rec := newRecorder()
	consume(t, o, rec, nil)
	rec.waitAcked(t, later, 30*time.Second)
	rec.checkOrder(t)
	for _, e := range []keyed{dead, published} {
		if rec.isAcked(e.event) {
			t.Errorf("event %s (dead or published in default mode) delivered again after the switch", e.event)
		}
	}
	st, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Dead != 1 || st.Mode != schema.ModeOrdered {
		t.Errorf("after the switch: mode %s, %d dead, want ordered with the default mode's dead row", st.Mode, st.Dead)
	}
	waitUntil(t, 30*time.Second, func() bool {
		_, err := runbook.New(pool, tbl).ReplayEvent(ctx, dead.event, runbook.ReplayOptions{})
		return err == nil
	})
	rec.waitAcked(t, []keyed{dead}, 30*time.Second)
	waitUntil(t, 30*time.Second, func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		return err == nil && st.Dead == 0
	})
}
