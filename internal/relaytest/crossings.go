package relaytest

// Crossings: cases where two features of the relays meet (a paused topic
// and a retry, a replay, a handover, a skip, the cleaner or a mode switch;
// MaxInFlight and held keys; a replay and another row's hold; a skip and a
// handover or a term's end; the cleaner and a held key; a lost slot and a
// held key). Each case quotes the sentences of the docs it holds the relays
// to, and skips, with the reason, a relay that does not make the promise.

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// crossings are the cases where two features meet (a paused topic and a
// retry, a replay, a handover, a skip, the cleaner or a mode switch; holds
// beside MaxInFlight, replays, handovers, term ends, the cleaner and a lost
// slot); Run runs them with the others.
var crossings = []suiteCase{
	{"PausedRetryWaits", TestPausedRetryWaits},
	{"PausedReplayWaits", TestPausedReplayWaits},
	{"PausedReplayOfRelayedRow", TestPausedReplayOfRelayedRow},
	{"PausedThroughHandover", TestPausedThroughHandover},
	{"SkipWhilePaused", TestSkipWhilePaused},
	{"PausedRowsSurviveCleaner", TestPausedRowsSurviveCleaner},
	{"MaxInFlightWithHeldKeys", TestMaxInFlightWithHeldKeys},
	{"ReplayEarlierRowWhileHeld", TestReplayEarlierRowWhileHeld},
	{"SkipAcrossHandover", TestSkipAcrossHandover},
	{"PauseKeptAcrossModeSwitch", TestPauseKeptAcrossModeSwitch},
	{"CleanerPassesHeldKey", TestCleanerPassesHeldKey},
	{"SkipDrainAcrossTermEnd", TestSkipDrainAcrossTermEnd},
	{"DeadRetentionOfHeldRow", TestDeadRetentionOfHeldRow},
	{"LostSlotKeepsHolds", TestLostSlotKeepsHolds},
	{"SwitchKeyedModesWithHeldKey", TestSwitchKeyedModesWithHeldKey},
	{"OverrunWhileSkipped", TestOverrunWhileSkipped},
	{"CloseWhileHoldsDrain", TestCloseWhileHoldsDrain},
	{"BulkReplayWithPreview", TestBulkReplayWithPreview},
	{"MaxAttemptsLoweredBetweenRuns", TestMaxAttemptsLoweredBetweenRuns},
	{"SharedRelaysPausedAndRetrying", TestSharedRelaysPausedAndRetrying},
	{"SkipRacingCleaner", TestSkipRacingCleaner},
	{"BulkSkipAndReplayAcrossHandover", TestBulkSkipAndReplayAcrossHandover},
	{"DeadReplayedBeforePausedRow", TestDeadReplayedBeforePausedRow},
	{"MaxInFlightOneWithRetryingKey", TestMaxInFlightOneWithRetryingKey},
	{"RetryScheduledAcrossClose", TestRetryScheduledAcrossClose},
	{"ReplayOfRetryingHold", TestReplayOfRetryingHold},
	{"OverrunFencedAcrossRelays", TestOverrunFencedAcrossRelays},
	{"PermanentDefectBesideRetryingKey", TestPermanentDefectBesideRetryingKey},
	{"CleanerAcrossHandovers", TestCleanerAcrossHandovers},
	{"StatsDuringHoldDrain", TestStatsDuringHoldDrain},
	{"OverrunBesideReplay", TestOverrunBesideReplay},
	{"SkipOfReplayWhileBusyIsFinal", TestSkipOfReplayWhileBusyIsFinal},
	{"FailedReplayOfSkippedRowHoldsOnlyItself", TestFailedReplayOfSkippedRowHoldsOnlyItself},
}

const topicB = "org.relaytest.crossing.b.v1"

// ---- helpers of the crossings ----

// skipIfNoPause skips a case about paused topics on a relay that cannot
// pause, after checking that the runbook refuses the pause as documented.
func skipIfNoPause(t *testing.T, e *env) {
	t.Helper()
	if e.r.Mode != ModeWAL {
		return
	}
	_, err := runbook.New(e.pool, e.tbl).PauseTopic(context.Background(), topicA, "relaytest", false)
	if !errors.Is(err, runbook.ErrPauseWAL) {
		t.Fatalf("PauseTopic on a WAL table: %v, want runbook.ErrPauseWAL", err)
	}
	t.Skipf("the %s relay cannot pause a topic: PauseTopic refuses with runbook.ErrPauseWAL (docs/OPERATIONS.md, \"Pausing a topic\")", e.r.Name)
}

func newPauseLog(topic string) *pauseLog { return &pauseLog{topic: topic, ch: make(chan struct{})} }

// pause pauses topic and waits until the relay that logs to seen has read
// the pause (the relays promise to claim no row of a paused topic from the
// wake-up that tells them of it); seen nil: no wait.
func (e *env) pause(topic string, seen *pauseLog) {
	e.t.Helper()
	if _, err := runbook.New(e.pool, e.tbl).PauseTopic(context.Background(), topic, "relaytest crossing", false); err != nil {
		e.t.Fatalf("pause %s: %v", topic, err)
	}
	if seen == nil {
		return
	}
	select {
	case <-seen.ch:
	case <-time.After(within):
		e.t.Fatalf("the relay did not read the pause of %s within %s", topic, within)
	}
}

func (e *env) resume(topic string) {
	e.t.Helper()
	if _, err := runbook.New(e.pool, e.tbl).ResumeTopic(context.Background(), topic, false); err != nil {
		e.t.Fatalf("resume %s: %v", topic, err)
	}
}

// heldByKey tells whether ev's failures are recorded in its key's hold
// (a keyed row of a keyed relay), not on the row.
func (e *env) heldByKey(ev event) bool { return e.r.keyed() && e.keys && ev.Key != "" }

// nackRecorded tells whether ev's nack was written: its key's hold is
// retrying at it (keyed relays), or the row has its last_error (the
// default relay, unkeyed rows).
func (e *env) nackRecorded(ev event) bool {
	if e.heldByKey(ev) {
		st, held := e.holdState(ev)
		return held && st == runbook.HoldRetrying
	}
	return e.row(ev.ID).LastError != ""
}

// waitDead waits until every event of evs is dead, and each keyed one
// holds its key (keyed relays).
func (e *env) waitDead(evs ...event) {
	e.t.Helper()
	e.eventually(within, func() bool {
		for _, ev := range evs {
			if !e.row(ev.ID).Dead() {
				return false
			}
			if e.heldByKey(ev) {
				if st, held := e.holdState(ev); !held || st != runbook.HoldDead {
					return false
				}
			}
		}
		return true
	}, func() string { return "rows not dead (or not holding their key): " + e.rowStates(evs) })
}

// replayRetrying is ReplayEvent, tried again while the refusal is one that
// passes on its own (a lease, a floor not written yet).
func (e *env) replayRetrying(ev event) error {
	return retry(within, func() error {
		_, err := runbook.New(e.pool, e.tbl).ReplayEvent(context.Background(), ev.ID, runbook.ReplayOptions{})
		return err
	}, func(err error) bool {
		return errors.Is(err, runbook.ErrLocked) || errors.Is(err, runbook.ErrNotRelayedYet)
	})
}

// refusal tells whether err is one of the runbook's refusals (the row is
// left as it is), not a failure.
func refusal(err error) bool {
	var nr *runbook.NotReplayableError
	return errors.As(err, &nr) || errors.Is(err, runbook.ErrHoldRefused) || errors.Is(err, runbook.ErrNotHeld) || errors.Is(err, runbook.ErrNotRelayedYet)
}

// add makes the handlers fail evs too.
func (f *failing) add(evs ...event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range evs {
		f.ids[ev.ID.String()] = true
	}
}

// notDeliveredBeyond fails for every event of evs delivered more than n times.
func (e *env) notDeliveredBeyond(n int, why string, evs ...event) {
	e.t.Helper()
	for _, ev := range evs {
		if d := e.rec.delivered(ev); d > n {
			e.t.Errorf("row %s (topic %s) delivered %d times, want at most %d: %s; deliveries of its key: %s", ev, ev.Topic, d, n, why, e.traceOf(ev))
		}
	}
}

func (e *env) traceOf(ev event) string {
	k := ev.Key
	if !e.keys {
		k = ""
	}
	e.rec.mu.Lock()
	defer e.rec.mu.Unlock()
	return fmt.Sprint(e.rec.trace[k])
}

// journal is the order in which handlers received messages, all relays.
type journal struct {
	mu  sync.Mutex
	ids []string
}

func (j *journal) wrap(h handler) handler {
	return func(ctx context.Context, m *message.Message) error {
		j.mu.Lock()
		j.ids = append(j.ids, m.UUID)
		j.mu.Unlock()
		if h == nil {
			return nil
		}
		return h(ctx, m)
	}
}

// nth returns the position of the n-th delivery (from 1) of ev, or -1.
func (j *journal) nth(ev event, n int) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	id := ev.ID.String()
	for i, x := range j.ids {
		if x == id {
			if n--; n == 0 {
				return i
			}
		}
	}
	return -1
}

// ackedInOrder fails unless key's first acks are exactly want, in order.
func (e *env) ackedInOrder(key string, want ...event) {
	e.t.Helper()
	e.rec.mu.Lock()
	got := append([]int64(nil), e.rec.ackOrder[key]...)
	e.rec.mu.Unlock()
	ws := make([]int64, len(want))
	for i, ev := range want {
		ws[i] = ev.Seq
	}
	if fmt.Sprint(got) != fmt.Sprint(ws) {
		e.t.Errorf("key %s: first acks %v, want %v; deliveries %s", key, got, ws, e.traceOf(want[0]))
	}
}

// ---- the cases ----

// TestPausedRetryWaits checks: a row of topic A is in a handler when A is paused,
// and its handler nacks it after the relay read the pause. Its retry is not
// delivered while A is paused (no attempt counted), nor, in a keyed mode,
// the key's next row (of a topic that flows); after the resume the row is
// retried, then the key goes on.
//
// docs/OPERATIONS.md, "Pausing a topic": "the relays read the paused topics
// at that wake-up and every PollInterval, and from then on claim no row of
// the topic [...] Rows already delivered finish. The topic's rows stay
// pending, untouched (no attempt counted)". docs/ORDERING.md, "Paused
// topics": "A row that failed and holds its key (retrying) is not delivered
// again while its topic is paused either; after the resume it is retried,
// then the key goes on".
func TestPausedRetryWaits(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	seen := newPauseLog(topicA)
	gate := make(chan struct{})
	var mu sync.Mutex
	nacked := map[string]bool{}
	// The first delivery of each row of A waits for the gate, then nacks.
	h := func(_ context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataTopic) != topicA {
			return nil
		}
		mu.Lock()
		first := !nacked[m.UUID]
		nacked[m.UUID] = true
		mu.Unlock()
		if first {
			e.block(gate)
			return errBroken
		}
		return nil
	}
	e.start("a", Options{Logger: seen}, h)
	e.waitAcked(within, e.enqueue(topicB, "")...) // at work
	evs := e.enqueue(topicA, "k", "")
	a1, u := evs[0], evs[1]
	b2 := e.enqueue(topicB, "k")[0]
	e.eventually(within, func() bool { return e.rec.delivered(a1) > 0 && e.rec.delivered(u) > 0 },
		func() string { return "the rows of A were not delivered: " + e.rowStates(evs) })
	e.pause(topicA, seen)
	close(gate) // both nack now, after the relay read the pause
	e.eventually(within, func() bool { return e.nackRecorded(a1) && e.nackRecorded(u) }, func() string {
		return "the nacks were not recorded: " + e.rowStates(evs)
	})
	flowing := e.enqueue(topicB, "other", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell) // many backoffs (20 ms) and polls (100 ms)
	e.notDeliveredBeyond(1, "retried while its topic is paused", a1, u)
	if e.heldByKey(b2) {
		e.notDeliveredBeyond(0, "its key waits behind a retrying row of a paused topic", b2)
	}
	for _, ev := range evs {
		if s := e.row(ev.ID); s.HoldAttempts > 1 || s.Attempts > 1 {
			t.Errorf("row %s is %s while its topic is paused: an attempt was counted beyond the nacked one", ev, s)
		}
	}
	e.resume(topicA)
	e.waitAcked(within, a1, u, b2)
	if e.heldByKey(b2) {
		e.ackedInOrder("k", a1, b2)
	}
	e.rec.checkOrder(t)
}

// TestPausedReplayWaits checks: rows of topic A go dead; A is paused; one dead
// row of a key and an unkeyed one are replayed one by one
// (runbook.Runbook.ReplayEvent), another of each by a bulk replay of A
// (runbook.Runbook.ReplayDead). The replayed rows are not delivered while A
// is paused, nor (keyed modes) the rows of their keys behind them; after
// the resume each is delivered, before its key's next row.
//
// docs/OPERATIONS.md, "Pausing a topic": "from then on claim no row of the
// topic"; "What a replay does: dead_at = NULL, attempts = 0, available_at =
// now() [...] so that the relay picks the rows up at once". docs/ORDERING.md,
// "Paused topics": "a key whose next row is of a paused topic is not
// delivered, and its later rows wait behind that row whatever their topic";
// "Operating held keys": a replay "clears its dead_at and attempts: the
// relay delivers it first, then the rest of its key".
func TestPausedReplayWaits(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	ctx := context.Background()
	seen := newPauseLog(topicA)
	one := e.enqueue(topicA, "k1", "")      // replayed by ReplayEvent
	bulk := e.enqueue(topicA, "k2", "")     // replayed by ReplayDead
	behind := e.enqueue(topicB, "k1", "k2") // the keys' next rows, of a topic that flows
	dead := append(append([]event(nil), one...), bulk...)
	bad := newFailing(dead...)
	e.start("a", Options{MaxAttempts: 1, Logger: seen}, permanentFor(bad))
	e.waitDead(dead...)
	e.pause(topicA, seen)
	bad.fix(dead...)
	for _, ev := range one {
		if err := e.replayRetrying(ev); err != nil {
			t.Fatalf("replay the dead row %s: %v", ev, err)
		}
	}
	rep, err := runbook.New(e.pool, e.tbl).ReplayDead(ctx, runbook.DeadFilter{Topic: topicA}, false)
	if err != nil {
		t.Fatalf("bulk replay of %s: %v", topicA, err)
	}
	if rep.Rows != int64(len(bulk)) {
		t.Errorf("bulk replay of %s replayed %d rows (left alone %d), want %d: %s", topicA, rep.Rows, rep.LeftAlone, len(bulk), e.rowStates(bulk))
	}
	for _, ev := range dead {
		if e.row(ev.ID).Dead() {
			t.Errorf("row %s still dead after its replay: %s", ev, e.row(ev.ID))
		}
	}
	flowing := e.enqueue(topicB, "other", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "replayed while its topic is paused: delivered before the resume", dead...)
	if e.heldByKey(behind[0]) {
		e.notDeliveredBeyond(0, "its key's replayed row (of a paused topic) comes first", behind...)
	}
	e.resume(topicA)
	e.waitAcked(within, append(dead, behind...)...)
	if e.heldByKey(behind[0]) {
		e.ackedInOrder("k1", one[0], behind[0])
		e.ackedInOrder("k2", bulk[0], behind[1])
	}
}

// TestPausedReplayOfRelayedRow checks: in ordered mode a keyed row of topic A
// already relayed is replayed while A is paused (a replay hold), and a row
// of its key of a topic that flows is committed after it. Neither is
// delivered while A is paused; after the resume the replayed row is
// delivered once more, then the key's next row.
//
// docs/ORDERING.md, "Operating held keys": "On a keyed row already relayed
// [...] it adds a replay hold: the row is delivered once more, before its
// key's next row." "Paused topics": "a key whose next row is of a paused
// topic is not delivered, and its later rows wait behind that row whatever
// their topic, so the order per key is kept".
func TestPausedReplayOfRelayedRow(t *testing.T, r Relay) {
	switch r.Mode {
	case ModeDefault:
		t.Skipf("the %s relay cannot replay a relayed row: it is published, and ReplayEvent refuses it (ErrAlreadyPublished; docs/OPERATIONS.md, \"A published event cannot be replayed\")", r.Name)
	case ModeWAL:
		t.Skipf("the %s relay cannot pause a topic (runbook.ErrPauseWAL), and replays only dead or failed rows", r.Name)
	}
	e := setup(t, r, true)
	seen := newPauseLog(topicA)
	j := &journal{}
	e.start("a", Options{Logger: seen}, j.wrap(nil))
	a5 := e.enqueue(topicA, "k")[0]
	e.waitAcked(within, a5)
	e.pause(topicA, seen)
	if err := e.replayRetrying(a5); err != nil {
		t.Fatalf("replay the relayed row %s: %v", a5, err)
	}
	b6 := e.enqueue(topicB, "k")[0]
	flowing := e.enqueue(topicB, "other", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "its replay is of a paused topic", a5)
	e.notDeliveredBeyond(0, "its key's replayed row (of a paused topic) comes first", b6)
	e.resume(topicA)
	e.waitAcked(within, b6)
	e.eventually(within, func() bool { return e.rec.delivered(a5) >= 2 }, func() string {
		return "the replayed row was not delivered again after the resume: " + e.traceOf(a5)
	})
	if again, next := j.nth(a5, 2), j.nth(b6, 1); again < 0 || next < again {
		t.Errorf("key k: the replay of %s (delivery #%d) came after the key's next row %s (delivery #%d); deliveries %s", a5, again, b6, next, e.traceOf(a5))
	}
}

// TestPausedThroughHandover checks: topic A is paused while relay a runs; a row of
// A that a nacked after the pause retries, rows of A and (keyed) rows
// behind them wait. a is closed and relay b started while A is still
// paused: b delivers nothing of A (nor the keys' rows behind it) until the
// resume, then everything, in order per key.
//
// docs/OPERATIONS.md, "Pausing a topic": "The pause is a row of
// <table>_paused_topics [...] the relays read the paused topics at that
// wake-up and every PollInterval, and from then on claim no row of the
// topic"; docs/ORDERING.md, "Paused topics" (as above), "Handovers and
// duplicates": "A first delivery is never out of order".
func TestPausedThroughHandover(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	seenA := newPauseLog(topicA)
	gate := make(chan struct{})
	var retried event
	var once sync.Once
	h := func(_ context.Context, m *message.Message) error {
		if m.UUID == retried.ID.String() {
			fail := false
			once.Do(func() { fail = true })
			if fail {
				e.block(gate)
				return errBroken
			}
		}
		return nil
	}
	retried = e.enqueue(topicA, "r")[0]
	a := e.start("a", Options{Logger: seenA}, h)
	e.eventually(within, func() bool { return e.rec.delivered(retried) > 0 }, func() string { return "not delivered: " + e.rowStates([]event{retried}) })
	e.pause(topicA, seenA)
	close(gate)
	e.eventually(within, func() bool { return e.nackRecorded(retried) }, func() string { return "nack not recorded: " + e.rowStates([]event{retried}) })
	behindR := e.enqueue(topicB, "r")
	heldA := e.enqueue(topicA, "k", "", "")
	behindK := e.enqueue(topicB, "k")
	flowing := e.enqueue(topicB, "l1", "l2", "")
	e.waitAcked(within, flowing...)
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	e.start("b", Options{Logger: newPauseLog(topicA)}, h)
	flowing2 := e.enqueue(topicB, "l1", "l3", "")
	e.waitAcked(within, flowing2...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "retried while its topic is paused, across a handover", retried)
	e.notDeliveredBeyond(0, "its topic is paused: delivered by a relay started while paused", heldA...)
	if e.heldByKey(behindK[0]) {
		e.notDeliveredBeyond(0, "its key waits behind a row of a paused topic", append(behindR, behindK...)...)
	}
	e.resume(topicA)
	all := append(append(append([]event{retried}, behindR...), heldA...), behindK...)
	e.waitAcked(within, all...)
	if e.heldByKey(behindK[0]) {
		e.ackedInOrder("r", retried, behindR[0])
		e.ackedInOrder("k", heldA[0], behindK[0])
	}
	e.rec.checkOrder(t)
}

// TestSkipWhilePaused checks: two keys are held by dead rows of topic A; A is
// paused and both held rows are skipped. Key m's next row is of topic B,
// which flows: it is delivered while A is paused. Key k's next row is of A:
// it waits, and so does k's row of B behind it, until the resume. The
// skipped rows are never delivered again.
//
// docs/ORDERING.md, "Operating held keys": "outbox dead skip [...] drops
// the held row from its key's order [...]: the relay continues the key with
// its next row and never delivers the skipped row again (unless replayed)."
// "Paused topics": "a key whose next row is of a paused topic is not
// delivered, and its later rows wait behind that row whatever their topic
// [...] Other keys keep flowing".
func TestSkipWhilePaused(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: a dead row blocks nothing, so there is nothing to skip (runbook's SkipEvent refuses with ErrNotHeld)", r.Name)
	}
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	ctx := context.Background()
	seen := newPauseLog(topicA)
	heads := e.enqueue(topicA, "k", "m")
	k2 := e.enqueue(topicA, "k")[0]
	behind := e.enqueue(topicB, "k", "m")
	k3, m2 := behind[0], behind[1]
	bad := newFailing(heads...)
	e.start("a", Options{MaxAttempts: 1, Logger: seen}, permanentFor(bad))
	e.waitDead(heads...)
	e.pause(topicA, seen)
	for _, ev := range heads {
		if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, ev.ID, false); err != nil {
			t.Fatalf("skip the dead held row %s: %v", ev, err)
		}
	}
	bad.fix(heads...) // a redelivery would now be acked, and seen
	e.waitAcked(within, m2)
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its topic is paused (the key's next row after a skip)", k2)
	e.notDeliveredBeyond(0, "its key waits behind a row of a paused topic", k3)
	e.resume(topicA)
	e.waitAcked(within, k2, k3)
	e.wait(quietSpell)
	for _, ev := range heads {
		if e.rec.acked(ev) {
			t.Errorf("the skipped row %s was delivered again: %s", ev, e.traceOf(ev))
		}
	}
	e.ackedInOrder("k", k2, k3)
	e.rec.checkOrder(t)
}

// TestPausedRowsSurviveCleaner checks: while topic A is paused the cleaner runs
// with a retention of a nanosecond (dead rows too): the rows of A, a row of
// A retrying, and (keyed modes) the rows of their keys waiting behind them
// stay; after the resume all are delivered, in order per key.
//
// docs/OPERATIONS.md, "Pausing a topic": "The topic's rows stay pending,
// untouched (no attempt counted)"; docs/ORDERING.md, "Paused topics": "The
// rows stay open, so the partition's floor stays below them and they
// remain in the backlog."; the cleaner's doc: it "never touches pending or
// recently published rows".
func TestPausedRowsSurviveCleaner(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	ctx := context.Background()
	seen := newPauseLog(topicA)
	gate := make(chan struct{})
	var retried event
	var once sync.Once
	h := func(_ context.Context, m *message.Message) error {
		if m.UUID == retried.ID.String() {
			fail := false
			once.Do(func() { fail = true })
			if fail {
				e.block(gate)
				return errBroken
			}
		}
		return nil
	}
	retried = e.enqueue(topicA, "r")[0]
	e.start("a", Options{Logger: seen}, h)
	e.eventually(within, func() bool { return e.rec.delivered(retried) > 0 }, func() string { return "not delivered: " + e.rowStates([]event{retried}) })
	e.pause(topicA, seen)
	close(gate)
	e.eventually(within, func() bool { return e.nackRecorded(retried) }, func() string { return "nack not recorded: " + e.rowStates([]event{retried}) })
	behindR := e.enqueue(topicB, "r")
	heldA := e.enqueue(topicA, "k", "")
	behindK := e.enqueue(topicB, "k")
	keys := make([]string, 20)
	for i := range keys {
		keys[i] = "c" + strconv.Itoa(i)
	}
	flowing := e.enqueue(topicB, keys...)
	e.waitAcked(within, flowing...)
	e.eventually(within, func() bool {
		for _, ev := range flowing {
			if !e.row(ev.ID).Delivered {
				return false
			}
		}
		return true
	}, func() string { return "acked rows not recorded delivered: " + e.rowStates(flowing[:1]) })
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, DeadRetention: time.Nanosecond, BatchSize: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var deleted int64
	for range 5 {
		n, d, err := cl.CleanOnce(ctx)
		if err != nil {
			t.Fatalf("clean: %v", err)
		}
		deleted += n + d
		e.wait(100 * time.Millisecond)
	}
	t.Logf("the cleaner deleted %d rows while %s was paused", deleted, topicA)
	waiting := append([]event{retried}, heldA...)
	if e.heldByKey(behindK[0]) { // the rows of the keys behind them wait too
		waiting = append(append(waiting, behindR...), behindK...)
	}
	for _, ev := range waiting {
		if s := e.row(ev.ID); !s.Found || s.Published || s.Delivered || s.Dead() {
			t.Errorf("row %s waiting for the resume of %s is %s after the cleaner, want pending", ev, topicA, s)
		}
	}
	e.resume(topicA)
	e.waitAcked(within, waiting...)
	if e.heldByKey(behindK[0]) {
		e.ackedInOrder("r", retried, behindR[0])
		e.ackedInOrder("k", heldA[0], behindK[0])
	}
	e.rec.checkOrder(t)
}

// TestMaxInFlightWithHeldKeys checks: MaxInFlight is 2. Three keys are held by
// dead rows with seven rows each behind them, and a slow message takes one
// slot for the whole case: rows of ten other keys are delivered through the
// one slot left (a held key's parked rows take no slot). Then the held rows
// are skipped (the default relay: the dead rows are replayed): the keys'
// rows flow through the same slot, never more than 2 messages in handlers.
//
// README, "Which relay?": "a failing or dead row holds back its own key
// only"; "No head-of-line blocking [...] in ordered mode it holds back its
// own key only"; docs/WAL.md, "Failures hold only their key": "The key's
// later rows are parked (settled without delivery [...]); other keys flow";
// subscriber.Config.MaxInFlight and walrelay.Config.MaxInFlight bound the
// messages in handlers.
func TestMaxInFlightWithHeldKeys(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	const limit = 2
	var dead, parked []event
	for _, k := range []string{"d1", "d2", "d3"} {
		evs := e.enqueue(topicA, k, k, k, k, k, k, k, k)
		dead, parked = append(dead, evs[0]), append(parked, evs[1:]...)
	}
	bad := newFailing(dead...)
	const topicSlow = "org.relaytest.crossing.slow.v1"
	gate := make(chan struct{})
	h := func(ctx context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataTopic) == topicSlow {
			e.block(gate)
		}
		return permanentFor(bad)(ctx, m)
	}
	e.start("a", Options{MaxInFlight: limit, MaxAttempts: 1}, h)
	e.waitDead(dead...)
	if r.keyed() {
		e.wait(quietSpell)
		e.notDeliveredBeyond(0, "its key is held by a dead row", parked...)
	}
	slowEv := e.enqueue(topicSlow, "slow")[0]
	e.eventually(within, func() bool { return e.rec.delivered(slowEv) > 0 }, func() string { return "the slow row was not delivered" })
	keys := make([]string, 10)
	for i := range keys {
		keys[i] = "f" + strconv.Itoa(i)
	}
	free := append(e.enqueue(topicB, keys...), e.enqueue(topicB, keys...)...)
	e.waitAcked(within, free...)
	if r.keyed() {
		for _, ev := range dead {
			if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, ev.ID, false); err != nil {
				t.Fatalf("skip the dead held row %s: %v", ev, err)
			}
		}
		bad.fix(dead...) // a redelivery would now be acked, and seen
	} else {
		bad.fix(dead...)
		if rep, err := runbook.New(e.pool, e.tbl).ReplayDead(ctx, runbook.DeadFilter{Topic: topicA}, false); err != nil || rep.Rows != int64(len(dead)) {
			t.Fatalf("bulk replay of the dead rows: %d rows, %v; want %d", rep.Rows, err, len(dead))
		}
		parked = append(parked, dead...)
	}
	e.waitAcked(within, parked...)
	close(gate)
	e.waitAcked(within, slowEv)
	if n := e.rec.maxOpenOf("a"); n > limit {
		t.Errorf("%d messages in handlers at once, MaxInFlight is %d", n, limit)
	}
	if r.keyed() {
		e.wait(quietSpell)
		for _, ev := range dead {
			if e.rec.acked(ev) {
				t.Errorf("the skipped row %s was delivered again", ev)
			}
		}
	}
	e.rec.checkOrder(t)
}

// TestReplayEarlierRowWhileHeld checks: key k went past its dead row x1 (skipped),
// then x2 was acked, then x3 went dead and holds k, with x4 parked behind
// it. An operator replays x1 while x3 holds k: the replay is delivered (as
// new work) or refused with the row left as it was; either way x4 is not
// delivered while x3 holds k, and after x3 is skipped x4 is delivered and
// x3 never.
//
// docs/WAL.md, "Replay": "The replay of an earlier row of a held key (a
// dead row the key went past, allowed while the hold is not draining) is
// delivered as new work when the row is still reset". docs/ORDERING.md,
// "Operating held keys": "a row whose key's is held by another row is
// refused with runbook.ErrNotHeld (replay or skip that one first)";
// "Dead rows wait for an operator. A dead row keeps its key held until it
// is replayed [...] or skipped."
func TestReplayEarlierRowWhileHeld(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: no row is parked behind another's hold", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	const topicFail = "org.relaytest.crossing.fail.v1" // its rows fail for good, unless fixed
	fixed := newFailing()
	h := func(_ context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataTopic) == topicFail && !fixed.has(m.UUID) {
			return subscriber.Permanent(errBroken)
		}
		return nil
	}
	x1 := e.enqueue(topicFail, "k")[0]
	e.start("a", Options{MaxAttempts: 1}, h)
	e.waitDead(x1)
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, x1.ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", x1, err)
	}
	x2 := e.enqueue(topicA, "k")[0]
	e.waitAcked(within, x2)
	x3 := e.enqueue(topicFail, "k")[0]
	e.waitDead(x3)
	x4 := e.enqueue(topicA, "k")[0]
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by the dead row "+x3.String(), x4)
	e.notDeliveredBeyond(1, "it was skipped", x1)
	fixed.add(x1) // its replay, if delivered, is acked
	before := e.row(x1.ID)
	err := e.replayRetrying(x1)
	switch {
	case err == nil:
		e.waitAcked(within, x1)
		t.Logf("the replay of %s while %s holds its key was delivered", x1, x3)
	case refusal(err):
		t.Logf("the replay of %s while %s holds its key was refused: %v", x1, x3, err)
		if s := e.row(x1.ID); s.Dead() != before.Dead() || s.LastError != before.LastError || s.Attempts != before.Attempts {
			t.Errorf("the refused replay changed row %s: was %s, is %s", x1, before, s)
		}
	default:
		t.Fatalf("replay %s: %v", x1, err)
	}
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is still held by the dead row "+x3.String()+" (the replay of an earlier row must not release it)", x4)
	if e.rec.acked(x3) {
		t.Errorf("the dead row %s was acked though its handler fails it", x3)
	}
	if st, held := e.holdState(x3); !held || st != runbook.HoldDead {
		t.Errorf("after the replay of %s, the hold of %s is held=%t state=%s, want dead; %s", x1, x3, held, st, e.rowStates([]event{x3, x4}))
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, x3.ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", x3, err)
	}
	e.waitAcked(within, x4)
	e.wait(quietSpell)
	if e.rec.acked(x3) {
		t.Errorf("the skipped row %s was delivered again", x3)
	}
	e.notDeliveredBeyond(2, "skipped, then replayed once", x1)
	e.rec.checkOrder(t)
}

// TestSkipAcrossHandover checks: key k is held by a dead row; the relay is closed,
// an operator skips the row while no relay runs, and another relay starts:
// it continues k with its next rows, in order, and never delivers the
// skipped row.
//
// docs/ORDERING.md, "The promises": "A skip is final. A skipped row is not
// delivered again, also after a handover"; docs/WAL.md: "Holds survive a
// relay restart: the next relay reads the holds table and parks the key's
// rows again".
func TestSkipAcrossHandover(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: there is nothing to skip (runbook's SkipEvent refuses with ErrNotHeld)", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	evs := e.enqueue(topicA, "k", "k", "k")
	bad := newFailing(evs[0])
	a := e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitDead(evs[0])
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", evs[1:]...)
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, evs[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", evs[0], err)
	}
	bad.fix(evs[0]) // a redelivery would now be acked, and seen
	more := e.enqueue(topicA, "k")
	e.start("b", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitAcked(within, append(evs[1:], more...)...)
	e.wait(quietSpell)
	if e.rec.acked(evs[0]) {
		t.Errorf("the skipped row %s was delivered by the relay started after the skip: %s", evs[0], e.traceOf(evs[0]))
	}
	e.ackedInOrder("k", evs[1], evs[2], more[0])
}

// TestPauseKeptAcrossModeSwitch checks: a default relay runs on a table (every
// optional column) and topic A is paused; the relay is closed and the table
// switched to the relay under test while A is still paused. The relay under
// test delivers nothing of A while the runbook still lists A as paused (or
// its set-up refuses the switch); after the resume every row is delivered.
//
// docs/OPERATIONS.md, "Pausing a topic": "The pause is a row of
// <table>_paused_topics [...] the relays read the paused topics [...] and
// from then on claim no row of the topic [...] The topic's rows stay
// pending, untouched [...], and show in outbox stats (paused topics),
// outbox topics and the console"; "Refused, with nothing changed: [...] any
// pause on a table the WAL relay streams: its replication slot would retain
// WAL for as long as the pause lasts". docs/ORDERING.md, "Switching modes".
func TestPauseKeptAcrossModeSwitch(t *testing.T, r Relay) {
	e := setup(t, r, false, schema.WithAllColumns())
	ctx := context.Background()
	// Paused before the default relay starts: it reads the paused topics
	// before its first claim.
	e.pause(topicA, nil)
	old, err := e.newDefault(false, Options{})
	if err != nil {
		t.Fatalf("the default relay: %v", err)
	}
	oldRelay, err := e.consume("old", old, nil)
	if err != nil {
		t.Fatal(err)
	}
	e.waitAcked(within, e.enqueue(topicB, "w1", "")...)
	heldA := e.enqueue(topicA, "p1", "")
	e.waitAcked(within, e.enqueue(topicB, "w2", "")...)
	if n := e.rec.delivered(heldA[0]) + e.rec.delivered(heldA[1]); n > 0 {
		t.Fatalf("the default relay delivered %d rows of the paused topic %s", n, topicA)
	}
	if err := oldRelay.Close(); err != nil {
		t.Fatalf("close the default relay: %v", err)
	}
	behind := e.enqueue(topicB, "p1") // p1's next row, of a topic that flows
	// refused: the switch was refused while A is paused; then nothing of
	// the table may have moved, and once A is resumed the switch goes
	// through and delivers everything in order.
	refused := func(what string, err error) {
		t.Logf("%s refused while %s is paused: %v", what, topicA, err)
		e.notDeliveredBeyond(0, "the switch to "+r.Name+" was refused", append(heldA, behind...)...)
		if _, err := runbook.New(e.pool, e.tbl).ResumeTopic(ctx, topicA, false); err != nil {
			t.Fatalf("resume %s after the refused switch to %s: %v", topicA, r.Name, err)
		}
		if r.SetUp != nil {
			if err := r.SetUp(ctx, e.pool, e.tbl); err != nil {
				t.Fatalf("the switch to %s, %s resumed: %v", r.Name, topicA, err)
			}
		}
		e.startOnceOtherModeGone("new", Options{}, nil, within)
		e.waitAcked(within, append(heldA, behind...)...)
		e.rec.checkOrder(t)
	}
	if r.SetUp != nil {
		if err := r.SetUp(ctx, e.pool, e.tbl); err != nil {
			refused("the switch to "+r.Name, err)
			return
		}
	}
	if _, err := e.startOnceOtherModeGoneTry("new", Options{}, nil, within); err != nil {
		refused("the start of the "+r.Name+" relay", err)
		return
	}
	flowing := e.enqueue(topicB, "w3", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	paused, err := runbook.New(e.pool, e.tbl).PausedTopics(ctx)
	if err != nil {
		t.Fatalf("paused topics: %v", err)
	}
	listed := false
	for _, p := range paused {
		listed = listed || p.Topic == topicA
	}
	if !listed {
		t.Fatalf("the runbook no longer lists %s as paused after the switch to %s: %+v", topicA, r.Name, paused)
	}
	e.notDeliveredBeyond(0, "its topic is listed as paused (runbook.PausedTopics) while the "+r.Name+" relay delivers it", heldA...)
	if e.heldByKey(behind[0]) {
		e.notDeliveredBeyond(0, "its key waits behind a row of a paused topic", behind...)
	}
	if _, err := runbook.New(e.pool, e.tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatalf("resume %s after the switch to %s: %v", topicA, r.Name, err)
	}
	e.waitAcked(within, append(heldA, behind...)...)
	e.rec.checkOrder(t)
}

// startOnceOtherModeGoneTry is startOnceOtherModeGone that returns a
// refusal other than schema.ErrRelayModeMix instead of failing.
func (e *env) startOnceOtherModeGoneTry(name string, o Options, h handler, within time.Duration) (*relay, error) {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for {
		rl, err := e.tryStart(name, o, h)
		if err == nil || !errors.Is(err, schema.ErrRelayModeMix) || time.Now().After(deadline) {
			return rl, err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestCleanerPassesHeldKey checks: key d is held by a dead row with ten rows
// parked behind it, the lowest sequences of their partition (ordered mode:
// every key here shares d's partition). Rows of other keys committed after
// them are delivered and recorded done; the cleaner, with a retention of a
// nanosecond and batches of 5 rows, deletes those rows and keeps every row
// of d; after the skip of d's dead row d's rows are delivered, in order.
//
// docs/ORDERING.md, "Append-only progress": "Fewer dead tuples and less
// vacuum follow, and the cleaner deletes keyed rows below the floors";
// cleaner's cleanKeyed: it deletes "the keyed rows at or below their
// partition's floor [...] that are older than Retention, never a row a
// held key still waits for or any row after it"; docs/OPERATIONS.md, "The
// life of a row": published rows are "deleted by the cleaner after
// OUTBOX_CLEANER_RETENTION"; docs/WAL.md, "Retention and counts": "The
// cleaner deletes settled rows older than the retention".
func TestCleanerPassesHeldKey(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	// Keys of d's partition (hashtext(key) & 63, as the generated column
	// ordering_partition): in ordered mode the cleaner reads a partition
	// from its lowest rows.
	var keys []string
	rows, err := e.pool.Query(ctx, `SELECT k FROM (SELECT 'c' || g AS k FROM generate_series(0, 20000) AS g) AS s
WHERE hashtext(k) & 63 = hashtext('d') & 63 ORDER BY length(k), k LIMIT 8`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
	}
	if err := rows.Err(); err != nil || len(keys) < 8 {
		t.Fatalf("keys of d's partition: %v (%v)", keys, err)
	}
	held := e.enqueue(topicA, "d", "d", "d", "d", "d", "d", "d", "d", "d", "d", "d")
	bad := newFailing(held[0])
	e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitDead(held[0])
	done := append(e.enqueue(topicA, keys...), e.enqueue(topicA, keys...)...)
	e.waitAcked(within, done...)
	e.eventually(within, func() bool {
		for _, ev := range done {
			if !e.row(ev.ID).Delivered {
				return false
			}
		}
		return true
	}, func() string { return "acked rows not recorded delivered: " + e.rowStates(done[len(done)-1:]) })
	if r.keyed() {
		e.notDeliveredBeyond(0, "its key is held by a dead row", held[1:]...)
	}
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, BatchSize: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var deleted int64
	gone := func() int {
		n := 0
		for _, ev := range done {
			if !e.row(ev.ID).Found {
				n++
			}
		}
		return n
	}
	e.eventually(within, func() bool {
		n, _, err := cl.CleanOnce(ctx)
		if err != nil {
			t.Fatalf("clean: %v", err)
		}
		deleted += n
		return gone() == len(done)
	}, func() string {
		return fmt.Sprintf("the cleaner deleted %d rows in all; %d of the %d delivered rows of other keys are gone; first left: %s",
			deleted, gone(), len(done), e.rowStates(done[:1]))
	})
	keep := held[:1] // the dead row (the default relay: its later rows were published, and deleted)
	if r.keyed() {
		keep = held
	}
	for _, ev := range keep {
		if !e.row(ev.ID).Found {
			t.Errorf("the cleaner deleted row %s of the held key d", ev)
		}
	}
	if r.keyed() {
		if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, held[0].ID, false); err != nil {
			t.Fatalf("skip the dead held row %s: %v", held[0], err)
		}
	} else {
		bad.fix(held[0])
		if err := e.replayRetrying(held[0]); err != nil {
			t.Fatalf("replay %s: %v", held[0], err)
		}
	}
	e.waitAcked(within, held[1:]...)
	if !r.keyed() {
		e.waitAcked(within, held[0])
	}
	e.rec.checkOrder(t)
}

// TestSkipDrainAcrossTermEnd checks: MaxInFlight is 2; key d is held by a dead
// row with twelve rows parked behind it. The dead row is skipped; while d's
// rows are being delivered (WAL: the hold drains, in batches of
// MaxInFlight rows) three more rows of d are committed and the relay's term
// ends (Relay.EndTerm: the ordered relay's leases lost, the WAL relay's
// session cut) with one of d's rows in a handler. Every row of d is
// delivered, first deliveries in order, never two copies of d in the
// relay's handlers at once, and the skipped row is never delivered.
//
// docs/WAL.md, "Replay"/"Skip": "the hold drains [...] It reads them in
// batches of MaxInFlight rows, the next once the previous is settled; while
// a batch was full, the key's streamed rows stay parked (the next batch
// reads them)"; "Holds survive a relay restart [...] a hold that was
// draining drains again from the start"; "Sessions are terms": "One copy
// per key within a relay". docs/ORDERING.md, "The promises": "A skip is
// final. A skipped row is not delivered again, also after a handover";
// "Terms": "One copy per key within a relay".
func TestSkipDrainAcrossTermEnd(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: there is nothing to skip or drain", r.Name)
	}
	if r.EndTerm == nil {
		t.Skipf("the %s relay has no way to end its term in the suite (Relay.EndTerm)", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	keys := make([]string, 13)
	for i := range keys {
		keys[i] = "d"
	}
	d := e.enqueue(topicA, keys...)
	bad := newFailing(d[0])
	gate := make(chan struct{})
	inHand := make(chan struct{})
	var once sync.Once
	h := func(ctx context.Context, m *message.Message) error {
		if m.UUID == d[4].ID.String() {
			first := false
			once.Do(func() { first = true })
			if first {
				close(inHand)
				select { // returns when its context ends, or at the gate
				case <-gate:
				case <-ctx.Done():
				case <-e.stop:
				}
			}
		}
		return permanentFor(bad)(ctx, m)
	}
	e.start("a", Options{MaxInFlight: 2, MaxAttempts: 1, CloseTimeout: 10 * time.Second}, h)
	e.waitDead(d[0])
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", d[1:]...)
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, d[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", d[0], err)
	}
	bad.fix(d[0]) // a redelivery would now be acked, and seen
	select {
	case <-inHand:
	case <-time.After(within):
		t.Fatalf("row %s not delivered after the skip: %s", d[4], e.rowStates(d[:5]))
	}
	more := e.enqueue(topicA, "d", "d", "d")
	other := e.enqueue(topicA, "o1", "o2")
	if err := r.EndTerm(ctx, e.pool, e.tbl); err != nil {
		t.Fatalf("end the relay's term: %v", err)
	}
	close(gate)
	e.waitAcked(within, append(append(d[1:], more...), other...)...)
	e.wait(quietSpell)
	if e.rec.acked(d[0]) {
		t.Errorf("the skipped row %s was delivered again: %s", d[0], e.traceOf(d[0]))
	}
	reportAll(t, "one copy per key within a relay", e.overlapsInRelays())
	e.rec.checkOrder(t)
}

// TestDeadRetentionOfHeldRow checks: key k is held by a dead row with rows parked
// behind it; the cleaner runs with a dead retention of a nanosecond. The
// dead retention deletes dead rows, but never the row a held key waits for
// (in every keyed relay): the key waits for an operator, nothing of k is
// deleted, and after the operator skips the hold that
// runbook.Runbook.HeldKeys lists, k's later rows are delivered in order. A
// relay without holds: the dead row is deleted and the key's later rows
// flow.
//
// README, "Guarantees": "Dead rows are never retried on their own: they
// are kept until an operator replays them [...], skips them (ordered and
// WAL modes: the row a held key waits for), or a dead retention you set
// deletes them (never the row a held key waits for)". docs/OPERATIONS.md,
// "Hold states": "dead: the held row failed for good; the key waits for an
// operator".
func TestDeadRetentionOfHeldRow(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	k := e.enqueue(topicA, "k", "k", "k", "k")
	bad := newFailing(k[0])
	e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitDead(k[0])
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Hour, DeadRetention: time.Nanosecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var dead int64
	for range 3 {
		_, d, err := cl.CleanOnce(ctx)
		if err != nil {
			t.Fatalf("clean: %v", err)
		}
		dead += d
		e.wait(100 * time.Millisecond)
	}
	gone := !e.row(k[0].ID).Found
	t.Logf("dead rows deleted by the dead retention: %d; the held row %s is gone: %t", dead, k[0], gone)
	for _, ev := range k[1:] {
		if !e.row(ev.ID).Found {
			t.Errorf("row %s, parked behind the held row, was deleted before it was delivered", ev)
		}
	}
	if !r.keyed() {
		if !gone {
			t.Errorf("the dead row %s was kept by a dead retention of 1ns: %s", k[0], e.rowStates(k[:1]))
		}
		e.waitAcked(within, k[1:]...)
		return
	}
	if gone {
		t.Fatalf("the dead retention deleted the row %s that key k's hold waits for: %s", k[0], e.rowStates(k))
	}
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row the dead retention kept", k[1:]...)
	held, err := runbook.New(e.pool, e.tbl).HeldKeys(ctx, 100)
	if err != nil {
		t.Fatalf("held keys: %v", err)
	}
	listed := false
	for _, h := range held {
		listed = listed || h.Key == "k"
	}
	if !listed {
		t.Fatalf("HeldKeys lists no hold for key k after the dead retention: %+v; %s", held, e.rowStates(k))
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, k[0].ID, false); err != nil {
		t.Fatalf("skip the held row %s after the dead retention: %v", k[0], err)
	}
	e.waitAcked(within, k[1:]...)
	e.ackedInOrder("k", k[1:]...)
}

// TestLostSlotKeepsHolds checks: the WAL relay's key k is held by a dead row with
// rows parked behind it; the relay is closed, its replication slot is
// dropped (a lost slot) and another row of k and rows of other keys are
// committed; a relay started then recreates the slot and reads the rows it
// missed from the table (the backfill). The backfill delivers the other
// keys' rows and none of k's while k is held; after the skip of k's dead
// row, k's rows are delivered in order and the dead row never.
//
// docs/WAL.md, "A lost slot": "the relay reads from the table every row not
// published, not dead and not below the recorded horizon [...] and
// delivers them first"; "Holds survive a relay restart: the next relay
// reads the holds table and parks the key's rows again"; "Failures hold
// only their key": "The key's later rows are parked".
func TestLostSlotKeepsHolds(t *testing.T, r Relay) {
	if r.Mode != ModeWAL {
		t.Skipf("the %s relay reads no replication slot", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	k := e.enqueue(topicA, "k", "k", "k")
	bad := newFailing(k[0])
	a := e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitDead(k[0])
	flow := e.enqueue(topicA, "o1", "o2", "")
	e.waitAcked(within, flow...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", k[1:]...)
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	slot := schema.WALSlotName(e.tbl)
	if err := retry(within, func() error {
		_, err := e.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot)
		return err
	}, func(err error) bool { return err != nil }); err != nil {
		t.Fatalf("drop the slot %s: %v", slot, err)
	}
	more := e.enqueue(topicA, "k")
	missed := e.enqueue(topicA, "o1", "o3", "")
	e.start("b", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitAcked(within, missed...)
	e.wait(quietSpell)
	parked := append(append([]event(nil), k[1:]...), more...)
	e.notDeliveredBeyond(0, "its key is held by a dead row (the backfill after a lost slot delivered it)", parked...)
	e.notDeliveredBeyond(1, "it is dead", k[0])
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, k[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", k[0], err)
	}
	bad.fix(k[0])
	e.waitAcked(within, parked...)
	e.wait(quietSpell)
	if e.rec.acked(k[0]) {
		t.Errorf("the skipped row %s was delivered again", k[0])
	}
	e.rec.checkOrder(t)
}
