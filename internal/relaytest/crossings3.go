package relaytest

// Crossings, third round: the console's bulk skip and replay of several
// held keys while one relay hands over to another; a dead row replayed
// while the key's next row is of a paused topic; MaxInFlight 1 beside a
// retrying key; Close while a retry is scheduled. Each case quotes the
// sentences of the docs it holds the relays to, and skips, with the
// reason, a relay that does not make the promise.

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/runbook"
)

// TestBulkSkipAndReplayAcrossHandover checks: four keys are held by dead
// rows, two rows behind each. Relay a is closed and relay b started while
// an operator skips the held rows of two keys and replays those of the
// other two, one after another as the console's bulk skip and its replay
// of ticked rows do, from before a's Close to after b's start. The
// skipped rows are never delivered again, the replayed ones are delivered
// before their keys' next rows, and every key's rows behind are delivered
// in order.
//
// docs/ARCHITECTURE.md: the console has "held keys with filter, skip and
// bulk skip" and the replay of ticked rows, over the runbook.
// docs/ORDERING.md, "The promises": "A skip is final. A skipped row is not
// delivered again, also after a handover"; "Operating held keys": a
// replay "clears its dead_at and attempts: the relay delivers it first,
// then the rest of its key". docs/WAL.md: "Holds survive a relay restart:
// the next relay reads the holds table and parks the key's rows again".
func TestBulkSkipAndReplayAcrossHandover(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: a dead row blocks nothing, so there is nothing to skip (runbook's SkipEvent refuses with ErrNotHeld)", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	keys := []string{"s1", "s2", "p1", "p2"}
	heads := e.enqueue(topicA, keys...)
	behind := append(e.enqueue(topicA, keys...), e.enqueue(topicB, keys...)...)
	bad := newFailing(heads...)
	a := e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitDead(heads...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", behind...)
	skipped, replayed := heads[:2], heads[2:]
	bad.fix(replayed...)
	rb := runbook.New(e.pool, e.tbl)
	closed := make(chan error, 1)
	// The bulk skip's first row before the Close, the rest during it and
	// after b's start; the replays after.
	if _, err := rb.SkipEvent(ctx, skipped[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", skipped[0], err)
	}
	go func() { closed <- a.Close() }()
	if _, err := rb.SkipEvent(ctx, skipped[1].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s during the Close: %v", skipped[1], err)
	}
	if err := e.replayRetrying(replayed[0]); err != nil {
		t.Fatalf("replay the dead held row %s during the Close: %v", replayed[0], err)
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("close relay a: %v", err)
		}
	case <-time.After(within):
		t.Fatalf("relay a did not close within %s", within)
	}
	e.start("b", Options{MaxAttempts: 1}, permanentFor(bad))
	if err := e.replayRetrying(replayed[1]); err != nil {
		t.Fatalf("replay the dead held row %s after b's start: %v", replayed[1], err)
	}
	bad.fix(skipped...) // a redelivery would now be acked, and seen
	e.waitAcked(within, append(append([]event(nil), replayed...), behind...)...)
	e.wait(quietSpell)
	for _, ev := range skipped {
		if e.rec.acked(ev) {
			t.Errorf("the skipped row %s was delivered again across the handover: %s", ev, e.traceOf(ev))
		}
	}
	for i, k := range keys {
		want := []event{behind[i], behind[i+len(keys)]}
		if i >= 2 {
			want = append([]event{heads[i]}, want...)
		}
		e.ackedInOrder(k, want...)
	}
	e.notDeliveredBeyond(2, "dead once, replayed once", replayed...)
	e.rec.checkOrder(t)
	reportAll(t, "one copy per key within a relay", e.overlapsInRelays())
}

// TestDeadReplayedBeforePausedRow checks: key k's head k1 (of topic B,
// which flows) is dead and holds k; its next row k2 is of topic A, then
// k3 of B. A is paused and k1 replayed: k1 is delivered (its topic flows),
// but k2 is not, nor (keyed modes) k3 behind it, until the resume; then
// k2 and k3 are delivered, in order.
//
// docs/ORDERING.md, "Operating held keys": a replay "clears its dead_at
// and attempts: the relay delivers it first, then the rest of its key";
// "Paused topics": "a key whose next row is of a paused topic is not
// delivered, and its later rows wait behind that row whatever their
// topic, so the order per key is kept". docs/OPERATIONS.md, "Pausing a
// topic": "from then on claim no row of the topic".
func TestDeadReplayedBeforePausedRow(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	seen := newPauseLog(topicA)
	k1 := e.enqueue(topicB, "k")[0]
	bad := newFailing(k1)
	e.start("a", Options{MaxAttempts: 1, Logger: seen}, permanentFor(bad))
	e.waitDead(k1)
	e.pause(topicA, seen)
	k2 := e.enqueue(topicA, "k")[0]
	k3 := e.enqueue(topicB, "k")[0]
	if !e.heldByKey(k1) {
		e.waitAcked(within, k3) // no key: k3 is not behind anything
	}
	bad.fix(k1)
	if err := e.replayRetrying(k1); err != nil {
		t.Fatalf("replay the dead row %s: %v", k1, err)
	}
	e.waitAcked(within, k1)
	flowing := e.enqueue(topicB, "other", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its topic is paused (the key's next row after a replayed dead row)", k2)
	if e.heldByKey(k3) {
		e.notDeliveredBeyond(0, "its key waits behind a row of a paused topic", k3)
	}
	e.resume(topicA)
	e.waitAcked(within, k2, k3)
	if e.heldByKey(k3) {
		e.ackedInOrder("k", k1, k2, k3)
	}
	e.notDeliveredBeyond(2, "dead once, replayed once", k1)
	e.rec.checkOrder(t)
}

// TestMaxInFlightOneWithRetryingKey checks: MaxInFlight is 1. Key r's head
// fails (transiently) until the case fixes it, with a row of r behind it;
// meanwhile rows of twenty other keys and unkeyed rows are all delivered
// through the one slot (the retrying key does not keep the slot while it
// waits for its retry), never more than one message in handlers; after the
// fix r's rows are delivered, in order.
//
// README, "Which relay?": "a failing or dead row holds back its own key
// only"; docs/WAL.md, "A retrying key does not stop the others: the rows
// queued on a key whose head waits for its [retry] [...]";
// subscriber.Config.MaxInFlight and walrelay.Config.MaxInFlight bound the
// messages in handlers; docs/RELIABILITY.md: "A retry follows Backoff".
func TestMaxInFlightOneWithRetryingKey(t *testing.T, r Relay) {
	e := setup(t, r, true)
	evs := e.enqueue(topicA, "r", "r")
	head, next := evs[0], evs[1]
	bad := newFailing(head)
	h := func(_ context.Context, m *message.Message) error {
		if bad.has(m.UUID) {
			return errBroken
		}
		return nil
	}
	e.start("a", Options{MaxInFlight: 1, Backoff: 300 * time.Millisecond}, h)
	e.eventually(within, func() bool { return e.rec.delivered(head) >= 2 }, func() string {
		return "the retrying head was not retried: " + e.rowStates(evs)
	})
	keys := make([]string, 0, 25)
	for i := range 20 {
		keys = append(keys, "f"+strconv.Itoa(i))
	}
	keys = append(keys, "", "", "", "", "")
	others := append(e.enqueue(topicB, keys...), e.enqueue(topicB, keys...)...)
	e.waitAcked(within, others...)
	if e.rec.acked(head) {
		t.Fatalf("the failing head %s was acked", head)
	}
	if e.heldByKey(next) {
		e.notDeliveredBeyond(0, "its key's head is retrying", next)
	}
	bad.fix(head)
	e.waitAcked(within, head, next)
	if e.heldByKey(next) {
		e.ackedInOrder("r", head, next)
	}
	if n := e.rec.maxOpenOf("a"); n > 1 {
		t.Errorf("%d messages in handlers at once, MaxInFlight is 1", n)
	}
	e.rec.checkOrder(t)
}

// TestRetryScheduledAcrossClose checks: a keyed row k1 (with k2 behind it)
// and an unkeyed row u are nacked once, with a Backoff of 3 s; while their
// retries are scheduled relay a is closed and relay b started. Each is
// retried once (not lost, not doubled: two deliveries in all, one ack),
// k1 before k2.
//
// docs/RELIABILITY.md: "A retry follows Backoff, also while the relay
// sleeps: a nacked row is delivered again Backoff after the nack [...],
// and a keyed row before its key's next row"; docs/ORDERING.md,
// "Handovers and duplicates": "A first delivery is never out of order";
// docs/WAL.md: "Holds survive a relay restart", and "A session that finds
// a retrying hold (after a cut, a crash or a restart) retries it at once
// from the head".
func TestRetryScheduledAcrossClose(t *testing.T, r Relay) {
	e := setup(t, r, true)
	const topicFail = "org.relaytest.crossing.fail.v1"
	ff := &firstFails{topic: topicFail, seen: map[string]int{}}
	c := newCounter()
	o := Options{Backoff: 3 * time.Second}
	a := e.start("a", o, c.wrap("a", ff.handle))
	evs := e.enqueue(topicFail, "k", "")
	k1, u := evs[0], evs[1]
	k2 := e.enqueue(topicA, "k")[0]
	// The WAL relay keeps a retry of a small backlog in memory (docs/WAL.md,
	// "A retry is kept in memory while the key's backlog is small"): the
	// nacks are known to be in once both handlers returned.
	e.eventually(within, func() bool {
		if r.Mode == ModeWAL {
			return e.rec.delivered(k1) > 0 && e.rec.delivered(u) > 0 && e.rec.openOf("a") == 0
		}
		return e.nackRecorded(k1) && e.nackRecorded(u)
	}, func() string {
		return "the nacks were not recorded: " + e.rowStates(evs)
	})
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a while retries are scheduled: %v", err)
	}
	e.start("b", o, c.wrap("b", ff.handle))
	e.waitAcked(within, k1, u, k2)
	e.wait(quietSpell + o.Backoff)
	for _, ev := range evs {
		if d := e.rec.delivered(ev); d != 2 {
			t.Errorf("row %s delivered %d times (a %d, b %d), want 2: one nacked, one retry; deliveries %s", ev, d, c.of("a", ev), c.of("b", ev), e.traceOf(ev))
		}
	}
	if e.heldByKey(k2) {
		e.ackedInOrder("k", k1, k2)
	}
	reportAll(t, "an event in two handlers at once", c.doubled)
	e.rec.checkOrder(t)
}

// TestReplayOfRetryingHold checks: key k's head k1 failed once
// (transiently) and waits for its retry, with a Backoff of 5 s, and k2
// behind it; the consumer is fixed and an operator replays k1 while it
// retries. The replay is delivered (or refused, the row left for its
// retry), k1 before k2, and k1 is not delivered again after its ack: two
// deliveries in all, the scheduled retry not added to the replay's.
//
// docs/ORDERING.md and docs/WAL.md, "Hold states": `retrying` allows a
// replay; "Operating held keys": a replay "on a held row whose state
// allows it (retrying, dead) clears its dead_at and attempts: the relay
// delivers it first, then the rest of its key". docs/WAL.md: "a replay
// resets the head and the relay delivers it before the key's other rows,
// then drains".
func TestReplayOfRetryingHold(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: a retrying row is a pending row, with no hold to replay", r.Name)
	}
	e := setup(t, r, true)
	const topicFail = "org.relaytest.crossing.fail.v1"
	ff := &firstFails{topic: topicFail, seen: map[string]int{}}
	o := Options{Backoff: 5 * time.Second}
	e.start("a", o, ff.handle)
	k1 := e.enqueue(topicFail, "k")[0]
	k2 := e.enqueue(topicA, "k")[0]
	e.eventually(within, func() bool {
		if r.Mode == ModeWAL { // a small backlog's retry is in memory
			return e.rec.delivered(k1) > 0 && e.rec.openOf("a") == 0
		}
		return e.nackRecorded(k1)
	}, func() string { return "the nack was not recorded: " + e.rowStates([]event{k1, k2}) })
	err := e.replayRetrying(k1)
	switch {
	case err == nil:
		t.Logf("the replay of the retrying row %s was accepted", k1)
	case refusal(err):
		t.Logf("the replay of the retrying row %s was refused: %v", k1, err)
	default:
		t.Fatalf("replay the retrying row %s: %v", k1, err)
	}
	e.waitAcked(within, k1, k2)
	e.ackedInOrder("k", k1, k2)
	e.wait(quietSpell + o.Backoff)
	e.notDeliveredBeyond(2, "nacked once, then replayed or retried: the retry and the replay are one delivery", k1)
	e.notDeliveredBeyond(1, "delivered once its key's head was acked", k2)
	e.rec.checkOrder(t)
}
