package relaytest

// Crossings, fifth round: the operator's transitions of one row-state
// machine crossing each other (docs/ARCHITECTURE.md, "Row states"): the
// skip of a replay applied while the relay is too busy to read the replay,
// and a skipped row replayed, failing for good and skipped again. Each
// case quotes the sentences of the docs it holds the relays to, and skips,
// with the reason, a relay that does not make the promise.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ---- helpers of the fifth round ----

// skippedAt reads whether ev's row has skipped_at set, and the runbook's
// reading of it.
func (e *env) skippedAt(ev event) (column bool, s rowState) {
	e.t.Helper()
	if err := e.pool.QueryRow(context.Background(), `SELECT skipped_at IS NOT NULL FROM `+e.tbl.Sanitize()+` WHERE event_id = $1`, ev.ID).
		Scan(&column); err != nil {
		e.t.Fatalf("read skipped_at of %s: %v", ev, err)
	}
	return column, e.row(ev.ID)
}

// waitSkipped waits until ev's row is skipped: skipped_at set, and the
// runbook says skipped, not delivered, not dead.
func (e *env) waitSkipped(ev event, why string) {
	e.t.Helper()
	e.eventually(within, func() bool {
		col, s := e.skippedAt(ev)
		return col && s.Skipped && !s.Delivered && !s.Dead()
	}, func() string {
		col, _ := e.skippedAt(ev)
		return fmt.Sprintf("%s: row %s is not recorded as skipped (skipped_at set: %t): %s; holds of its key: %s", why, ev, col, e.rowStates([]event{ev}), e.holdsOf(ev.Key))
	})
}

// waitNoHold waits until the holds table has no hold of key, resolved
// ones included: the relay has cleaned up the key's last hold.
func (e *env) waitNoHold(key string) {
	e.t.Helper()
	e.eventually(within, func() bool {
		var n int
		err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+e.tbl.HoldsTable()+` WHERE ordering_key = $1`, key).Scan(&n)
		return err == nil && n == 0
	}, func() string { return "the hold of key " + key + " is not cleaned up: " + e.holdsOf(key) })
}

// skipRetrying is SkipEvent, tried again while the row's hold is in a
// state that passes on its own (a replay's copy on its way to dead).
func (e *env) skipRetrying(ev event) error {
	return retry(within, func() error {
		_, err := runbook.New(e.pool, e.tbl).SkipEvent(context.Background(), ev.ID, false)
		return err
	}, func(err error) bool { return errors.Is(err, runbook.ErrHoldRefused) })
}

// ---- the cases ----

// TestSkipOfReplayWhileBusyIsFinal checks: key k's first row k1 fails for
// good and holds the key, k2 behind it. A row of key b stays in its
// handler, a second row of b waits behind it: with MaxInFlight 2 the relay
// has read as many rows as it may and reads no more, but has a slot free.
// The operator replays k1 and, before the relay read that replay, skips
// it. The skip is applied (the hold moves on, k2 is delivered); then b's
// handler returns and the relay reads on. k1 is never delivered after the
// skip was applied, and it reads skipped (skipped_at set, the runbook says
// skipped), though the replay had reset its attempts.
//
// docs/WAL.md, "Skip": "A skip is final once applied, whatever came
// before it (a replay of the row, its copy in a handler): the row is
// marked skipped whatever its attempts"; "a skipped row is never
// delivered by the stream, which reads every keyed row's replay from the
// table and delivers it as the table has the row then". docs/ORDERING.md,
// "The promises": "A skip is final."
func TestSkipOfReplayWhileBusyIsFinal(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: no held row's replay to skip while the relay is busy", r.Name)
	}
	e := setup(t, r, true)
	k := e.enqueue(topicA, "k", "k")
	bad := newFailing(k[0])
	gate := make(chan struct{})
	h := func(ctx context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataOrderingKey) == "b" {
			e.block(gate) // b's second row waits behind the first
		}
		return permanentFor(bad)(ctx, m)
	}
	e.start("a", Options{MaxAttempts: 1, MaxInFlight: 2}, h)
	e.waitHold(within, k[0], runbook.HoldDead)
	b := e.enqueue(topicA, "b", "b")
	e.eventually(within, func() bool { return e.rec.openOf("a") == 1 && e.rec.delivered(b[0]) == 1 }, func() string {
		return "b's first row is not in its handler: " + e.rowStates(b)
	})
	if err := e.replayRetrying(k[0]); err != nil {
		t.Fatalf("replay the dead held row %s: %v", k[0], err)
	}
	if err := e.skipRetrying(k[0]); err != nil {
		t.Fatalf("skip the replay of %s: %v", k[0], err)
	}
	// Applied: the hold no longer holds k1, and the key went on.
	e.eventually(within, func() bool {
		st, held := e.holdState(k[0])
		return !held || st == runbook.HoldResolved
	}, func() string {
		return "the skip of the replay is not applied: " + e.rowStates(k) + "; holds of k: " + e.holdsOf("k")
	})
	e.waitAcked(within, k[1])
	tries := e.rec.delivered(k[0])
	close(gate)
	e.waitAcked(within, b...)
	// A row committed after the replay: once it is acked, the relay has
	// read past the replay.
	z := e.enqueue(topicA, "z")
	e.waitAcked(within, z...)
	e.wait(quietSpell)
	if n := e.rec.delivered(k[0]); n != tries {
		t.Errorf("row %s was delivered %d times after its skip was applied (replayed before the skip): a skip is final; deliveries of its key: %s",
			k[0], n-tries, e.traceOf(k[0]))
	}
	e.waitSkipped(k[0], "the skip of a replay")
	more := e.enqueue(topicA, "k")
	e.waitAcked(within, more...)
	e.rec.checkOrder(t)
}

// TestFailedReplayOfSkippedRowHoldsOnlyItself checks: key k's first row
// k1 fails for good and is skipped; k2 and k3 are delivered and the key's
// hold is cleaned up. The operator replays k1, which fails for good again:
// the failed replay holds only its own row. k4 is written; the operator
// skips k1 again: it reads skipped, is not delivered again, and neither
// are k2 and k3, delivered once before; k4 is delivered. The WAL relay
// also delivers k4 before the second skip (its failed replay holds no
// key); ordered mode delivers it after (its dead replay hold stays in the
// key's line, covering nothing).
//
// docs/WAL.md, "A failed replay holds only its own row": "the key's later
// rows, delivered before the replay or written after it, are neither
// delivered again nor held back"; "a skipped row replayed and skipped
// again stays skipped". docs/ORDERING.md, "How it works": a replay hold
// "covers nothing".
func TestFailedReplayOfSkippedRowHoldsOnlyItself(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: a dead row, replayed or not, holds nothing behind it", r.Name)
	}
	e := setup(t, r, true)
	k := e.enqueue(topicA, "k", "k", "k")
	bad := newFailing(k[0])
	e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitHold(within, k[0], runbook.HoldDead)
	if err := e.skipRetrying(k[0]); err != nil {
		t.Fatalf("skip the dead held row %s: %v", k[0], err)
	}
	e.waitAcked(within, k[1:]...)
	e.waitSkipped(k[0], "the first skip")
	// A later row moves the relay's progress past the hold's drain: the
	// hold is cleaned up.
	z := e.enqueue(topicA, "z")
	e.waitAcked(within, z...)
	e.waitNoHold("k")
	first := e.rec.delivered(k[0])
	if err := e.replayRetrying(k[0]); err != nil {
		t.Fatalf("replay the skipped row %s: %v", k[0], err)
	}
	e.eventually(within, func() bool { return e.rec.delivered(k[0]) > first && e.row(k[0].ID).Dead() }, func() string {
		return "the replay of the skipped row did not fail for good: " + e.rowStates(k[:1]) + "; holds of k: " + e.holdsOf("k")
	})
	k4 := e.enqueue(topicA, "k")
	if r.Mode == ModeWAL {
		// The WAL relay parks the failed replay without a hold: the key's
		// next row is not held back. Ordered mode keeps a dead replay hold
		// in the key's line (its next row waits for the skip or a replay).
		deadline := time.Now().Add(within)
		for !e.rec.acked(k4[0]) && time.Now().Before(deadline) {
			e.wait(50 * time.Millisecond)
		}
		if !e.rec.acked(k4[0]) {
			t.Errorf("row %s, written after the replay of %s failed for good, is not delivered: a failed replay holds only its own row; %s; holds of k: %s",
				k4[0], k[0], e.rowStates(k4), e.holdsOf("k"))
		}
	}
	if err := e.skipRetrying(k[0]); err != nil {
		t.Fatalf("skip the failed replay of %s: %v", k[0], err)
	}
	tries := e.rec.delivered(k[0])
	e.waitSkipped(k[0], "the skip of the failed replay")
	e.waitAcked(within, k4...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "delivered before the replay of the key's earlier row, which failed and was skipped", k[1:]...)
	if n := e.rec.delivered(k[0]); n != tries {
		t.Errorf("row %s was delivered %d times after it was skipped again", k[0], n-tries)
	}
}
