package relaytest

// Crossings, fourth round: a default relay's lease lost by an overrunning
// handler while a second default relay shares the table; a permanent
// defect (a huge payload) beside a retrying key; the cleaner's published
// and dead retentions running while relays hand over; the runbook's Stats,
// Backlog and Event during a hold's drain; DispatchTimeout ending a
// handler's context while an operator replays another row of its key.
// Each case quotes the sentences of the docs it holds the relays to, and
// skips, with the reason, a relay that does not make the promise.

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// ---- helpers of the fourth round ----

// enqueuePayload commits one row of topic and key with payload.
func (e *env) enqueuePayload(topic, key string, payload json.RawMessage) event {
	e.t.Helper()
	ctx := context.Background()
	ev := event{ID: uuid.New(), Key: key, Topic: topic}
	msg := publisher.Message{TenantID: e.tenant, Topic: topic, EventID: ev.ID, Payload: payload}
	if e.keys {
		msg.OrderingKey = key
	}
	seqs, err := e.commit(ctx, []publisher.Message{msg})
	if err != nil {
		e.t.Fatalf("enqueue: %v", err)
	}
	ev.Seq = seqs[0]
	return ev
}

// errDefect is the error of a handler that can never accept a payload.
var errDefect = errors.New("relaytest: the payload is too large for the consumer, it can never be accepted")

// ---- the cases ----

// TestOverrunFencedAcrossRelays checks: two default relays share the
// table (DisableSingleActive), with a DispatchTimeout of 1 s. The first
// delivery of row x goes to a handler that ignores its context and answers
// (acks) only once the case lets it, long after its lease was lost; the
// row is delivered again (by either relay, a new lease) and that copy
// fails permanently, so x is dead. The first handler's late ack is
// refused: x stays dead, not published, and the rows around it flow.
//
// README: "Leases are fenced: a relay whose lease passed to another cannot
// ack, nack or renew the row." docs/RELIABILITY.md: "Leases cannot be held
// forever: a handler that ignores its context loses its lease at
// DispatchTimeout plus LockTTL/2, renewals stop, its context is cancelled,
// the attempt is nacked as handler overran"; "a permanent error parks it
// at once". docs/OPERATIONS.md, "OutboxLeaseFenceRejections": "A relay
// answered for a row whose lease had already [passed]".
func TestOverrunFencedAcrossRelays(t *testing.T, r Relay) {
	if r.Mode != ModeDefault {
		t.Skipf("the %s relay writes no row lease (its keyed rows run under a partition lease or a replication session): the fencing of a row's lease by a second relay sharing the table is the default relay's (DisableSingleActive is default mode only)", r.Name)
	}
	e := setup(t, r, true)
	gate := make(chan struct{})
	var mu sync.Mutex
	var x event
	firstDone := make(chan struct{})
	firsts := 0
	var ctxEnded bool
	h := func(ctx context.Context, m *message.Message) error {
		mu.Lock()
		isX := m.UUID == x.ID.String()
		n := 0
		if isX {
			firsts++
			n = firsts
		}
		mu.Unlock()
		if !isX {
			return nil
		}
		if n > 1 {
			return subscriber.Permanent(errBroken)
		}
		e.block(gate) // ignores ctx: overruns
		mu.Lock()
		ctxEnded = ctx.Err() != nil
		mu.Unlock()
		close(firstDone)
		return nil
	}
	o := Options{DisableSingleActive: true, DispatchTimeout: time.Second}
	x = e.enqueue(topicA, "")[0]
	e.start("a", o, h)
	e.eventually(within, func() bool { return e.rec.delivered(x) > 0 }, func() string { return "x not delivered: " + e.rowStates([]event{x}) })
	e.start("b", o, h)
	others := e.enqueue(topicB, "", "", "", "", "")
	e.eventually(within, func() bool { return e.rec.delivered(x) >= 2 && e.row(x.ID).Dead() }, func() string {
		return "the overrunning copy's row was not delivered again and parked dead: " + e.rowStates([]event{x}) + "; deliveries " + strconv.Itoa(e.rec.delivered(x))
	})
	e.waitAcked(within, others...)
	close(gate)
	select {
	case <-firstDone:
	case <-time.After(within):
		t.Fatalf("the first handler of x did not return within %s", within)
	}
	e.wait(quietSpell)
	s := e.row(x.ID)
	if s.Published || s.Delivered || !s.Dead() {
		t.Errorf("row x after the late ack of its first, overrun copy: %s, want dead and not published (the late ack is fenced)", s)
	}
	mu.Lock()
	ended := ctxEnded
	mu.Unlock()
	if !ended {
		t.Errorf("the overrunning handler's context was not ended when its lease was lost")
	}
	more := e.enqueue(topicB, "", "")
	e.waitAcked(within, more...)
	t.Logf("x delivered %d times (a %d, b %d messages in all); row %s", e.rec.delivered(x), e.rec.deliveriesBy("a"), e.rec.deliveriesBy("b"), s)
}

// TestPermanentDefectBesideRetryingKey checks: key r's head r1 fails
// (transiently) until the case fixes it, r2 behind it; key d's head d1 has
// a payload of 512 KiB that the consumer can never accept (it fails it
// with subscriber.Permanent), d2 behind it; ten other keys flow. With
// MaxAttempts 1000, d1 is dead at its first delivery (delivered once,
// never retried); the other keys' rows are delivered; in a keyed mode r2
// and d2 wait behind their heads. After the fix r1 and r2 are delivered in
// order; (keyed) after a skip of d1, d2 is delivered.
//
// docs/RELIABILITY.md: "Poison: a message that errors [...] never block
// the healthy ones; they end dead; a permanent error goes dead at once".
// docs/CONSUMERS.md: "fail a payload you can never accept with
// subscriber.Permanent(err): the row goes dead at once". docs/ORDERING.md:
// "At MaxAttempts or for a subscriber.Permanent error the hold gets dead_at
// and the key stays held"; docs/WAL.md: "Failures hold only their key [...]
// at once for subscriber.Permanent". README, "Which relay?": "a failing or
// dead row holds back its own key only".
func TestPermanentDefectBesideRetryingKey(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	big := json.RawMessage(`{"blob":"` + strings.Repeat("x", 512<<10) + `"}`)
	const limit = 64 << 10
	r1 := e.enqueue(topicA, "r")[0]
	d1 := e.enqueuePayload(topicA, "d", big)
	behind := e.enqueue(topicA, "r", "d")
	r2, d2 := behind[0], behind[1]
	bad := newFailing(r1)
	h := func(_ context.Context, m *message.Message) error {
		if len(m.Payload) > limit {
			return subscriber.Permanent(errDefect)
		}
		if bad.has(m.UUID) {
			return errBroken
		}
		return nil
	}
	e.start("a", Options{Backoff: 200 * time.Millisecond}, h)
	keys := make([]string, 0, 12)
	for i := range 10 {
		keys = append(keys, "o"+strconv.Itoa(i))
	}
	keys = append(keys, "", "")
	others := append(e.enqueue(topicB, keys...), e.enqueue(topicB, keys...)...)
	e.waitDead(d1)
	e.eventually(within, func() bool { return e.rec.delivered(r1) >= 3 }, func() string { return "the retrying head was not retried: " + e.rowStates([]event{r1}) })
	e.waitAcked(within, others...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "it failed permanently: dead at once, not retried", d1)
	if s := e.row(d1.ID); !s.Dead() || s.Published || s.Delivered {
		t.Errorf("the defective row d1 is %s, want dead", s)
	}
	if e.rec.acked(r1) {
		t.Fatalf("the failing head %s was acked", r1)
	}
	if e.heldByKey(r2) {
		e.notDeliveredBeyond(0, "its key's head is retrying", r2)
		e.notDeliveredBeyond(0, "its key's head is dead", d2)
	} else {
		e.waitAcked(within, d2)
	}
	bad.fix(r1)
	e.waitAcked(within, r1, r2)
	if e.heldByKey(r2) {
		e.ackedInOrder("r", r1, r2)
		e.wait(quietSpell)
		e.notDeliveredBeyond(0, "its key's head is dead", d2)
		if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, d1.ID, false); err != nil {
			t.Fatalf("skip the dead held row d1: %v", err)
		}
		e.waitAcked(within, d2)
		e.ackedInOrder("d", d2)
	}
	e.wait(quietSpell)
	e.notDeliveredBeyond(1, "it failed permanently: dead at once, and skipped or left dead", d1)
	e.rec.checkOrder(t)
}

// TestCleanerAcrossHandovers checks: the cleaner runs with a published and
// a dead retention of 1 ns, a pass every 50 ms, for the whole case, while
// relay a delivers, is closed, rows are committed with no relay running,
// relay b starts and is closed, and relay c starts. Every key's rows (ten
// keys, three rows each, one per phase) and the unkeyed rows are
// delivered, each key's in order: the cleaner deletes no row that was not
// delivered, whatever the relays' handovers left written (ordered mode's
// floors written by a closing relay, the WAL relay's progress). A row dead
// by a permanent error is gone or dead, never delivered again.
//
// cleaner.Config: Retention "keeps published rows this long after
// published_at"; DeadRetention "also deletes dead rows [...] except the
// row a held key waits for". docs/ORDERING.md: "the cleaner deletes keyed
// rows below the floors"; "Gauges, the runbook and the cleaner read the
// written floors". docs/WAL.md: "The cleaner deletes settled rows older
// than the retention". docs/OPERATIONS.md: pending rows are those "the
// relay claims"; only published and dead rows are deleted.
func TestCleanerAcrossHandovers(t *testing.T, r Relay) {
	e := setup(t, r, true)
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, DeadRetention: time.Nanosecond, BatchSize: 5}, nil)
	if err != nil {
		t.Fatal(err)
	}
	stopClean := make(chan struct{})
	cleaned := make(chan struct{})
	var cleanErr error
	var deleted, deadDeleted int64
	go func() {
		defer close(cleaned)
		for {
			select {
			case <-stopClean:
				return
			case <-time.After(50 * time.Millisecond):
			}
			n, d, err := cl.CleanOnce(context.Background())
			if err != nil {
				cleanErr = err
				return
			}
			deleted += n
			deadDeleted += d
		}
	}()
	var stopOnce sync.Once
	stop := func() {
		stopOnce.Do(func() { close(stopClean) })
		<-cleaned
	}
	t.Cleanup(stop)
	keys := make([]string, 0, 12)
	for i := range 10 {
		keys = append(keys, "k"+strconv.Itoa(i))
	}
	keys = append(keys, "", "")
	h := func(_ context.Context, m *message.Message) error {
		if strings.Contains(string(m.Payload), `"poison"`) {
			return subscriber.Permanent(errBroken)
		}
		return nil
	}
	var all []event
	poison := e.enqueuePayload(topicA, "", json.RawMessage(`{"poison":true}`))
	phase1 := e.enqueue(topicA, keys...)
	all = append(all, phase1...)
	a := e.start("a", Options{MaxAttempts: 1}, h)
	e.waitAcked(within, phase1...)
	// The dead retention may delete the poison row as soon as it is dead.
	e.eventually(within, func() bool {
		s := e.row(poison.ID)
		return e.rec.delivered(poison) > 0 && e.rec.openOf("a") == 0 && (!s.Found || s.Dead())
	}, func() string {
		return "the poison row was not parked dead (nor deleted dead): " + e.rowStates([]event{poison})
	})
	phase2 := e.enqueue(topicA, keys...) // committed while a runs; maybe delivered by a
	all = append(all, phase2...)
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	phase3 := e.enqueue(topicB, keys...) // no relay runs
	all = append(all, phase3...)
	e.wait(300 * time.Millisecond) // cleaner passes with no relay running
	b := e.start("b", Options{MaxAttempts: 1}, h)
	e.waitAcked(within, phase2...)
	phase4 := e.enqueue(topicA, keys...)
	all = append(all, phase4...)
	if err := b.Close(); err != nil {
		t.Fatalf("close relay b: %v", err)
	}
	e.wait(300 * time.Millisecond)
	e.start("c", Options{MaxAttempts: 1}, h)
	e.waitAcked(within, all...)
	e.wait(quietSpell) // the cleaner keeps running; duplicates of a handover may come
	stop()
	if cleanErr != nil {
		t.Fatalf("clean: %v", cleanErr)
	}
	t.Logf("the cleaner deleted %d published (or settled) rows and %d dead rows during the handovers", deleted, deadDeleted)
	if e.rec.acked(poison) {
		t.Errorf("the dead row %s was delivered again and acked: %s", poison, e.row(poison.ID))
	}
	if s := e.row(poison.ID); s.Found && !s.Dead() {
		t.Errorf("the dead row %s is %s, want dead or deleted", poison, s)
	}
	if e.heldByKey(phase1[0]) {
		for i, k := range keys[:10] {
			e.ackedInOrder(k, phase1[i], phase2[i], phase3[i], phase4[i])
		}
	}
	e.rec.checkOrder(t)
}

// reportConsistent fails when what the runbook reports contradicts what the
// handlers saw: a row not acked (and not known dead) that the runbook calls
// delivered, missing from Backlog, or not counted in Stats' pending. The
// runbook is read before the recorder, so an ack landing between the two
// reads can only make the check looser.
func (e *env) reportConsistent(when string, undone func() []event) runbook.TableStats {
	e.t.Helper()
	ctx := context.Background()
	rb := runbook.New(e.pool, e.tbl)
	st, err := rb.Stats(ctx)
	if err != nil {
		e.t.Fatalf("stats: %v", err)
	}
	backlog, err := rb.Backlog(ctx, runbook.BacklogOptions{Limit: 1000})
	if err != nil {
		e.t.Fatalf("backlog: %v", err)
	}
	events := map[string]runbook.Row{}
	for _, ev := range undone() {
		info, err := rb.Event(ctx, ev.ID)
		if err != nil {
			e.t.Fatalf("runbook's Event %s: %v", ev, err)
		}
		events[ev.ID.String()] = info
	}
	inBacklog := map[string]bool{}
	for _, row := range backlog {
		inBacklog[row.EventID.String()] = true
	}
	notAcked := e.rec.notAcked(undone())
	for _, ev := range notAcked {
		if info, ok := events[ev.ID.String()]; ok && info.Delivered {
			e.t.Errorf("%s: the runbook calls row %s delivered, but no handler acked it", when, ev)
		}
		if !inBacklog[ev.ID.String()] {
			e.t.Errorf("%s: row %s, not acked, is missing from Backlog (%d rows): %s", when, ev, len(backlog), e.row(ev.ID))
		}
	}
	if st.Pending < int64(len(notAcked)) {
		e.t.Errorf("%s: Stats counts %d pending rows, but %d rows are not acked: %+v", when, st.Pending, len(notAcked), st)
	}
	return st
}

// TestStatsDuringHoldDrain checks: key h's head h1 is dead (held, in a
// keyed mode) with five rows behind it; rows of other keys flow. The
// runbook's Stats, Backlog and Event are read all along: before the
// replay they report h1 dead (a dead held key, five rows waiting behind
// it, keyed modes); h1 is replayed and the drain of the key is held up in
// a handler (h2 there, h3 to h6 behind it); at every reading no row that
// was not acked is reported delivered, each is in Backlog and counted
// pending; once the drain ends the runbook reports nothing pending, dead
// or held.
//
// docs/OPERATIONS.md, the numbers of Stats: pending is "not delivered and
// not dead: above the floor, the held row of a retrying hold, rows waiting
// behind any held row (waiting_behind_held_keys), a due replay" (WAL: "not
// delivered, not dead, parked rows included"); dead is "the row a dead
// hold is at" / "dead_at set"; held keys are "holds not resolved (replays
// included); dead_held_keys those with dead_at" / "holds not released";
// "a row delivered since counts as pending until then (never the
// reverse)". runbook.Backlog: "Rows waiting for a retry, rows leased by a
// relay and rows waiting behind a held key are included".
func TestStatsDuringHoldDrain(t *testing.T, r Relay) {
	e := setup(t, r, true)
	h1 := e.enqueue(topicA, "h")[0]
	rest := e.enqueue(topicA, "h", "h", "h", "h", "h")
	others := e.enqueue(topicB, "o0", "o1", "o2", "o3", "")
	bad := newFailing(h1)
	gate := make(chan struct{})
	blocked := newFailing(rest...)
	h := func(_ context.Context, m *message.Message) error {
		if bad.has(m.UUID) {
			return subscriber.Permanent(errBroken)
		}
		if blocked.has(m.UUID) {
			e.block(gate)
		}
		return nil
	}
	var mu sync.Mutex
	replayed := false
	undone := func() []event {
		mu.Lock()
		defer mu.Unlock()
		evs := append(append([]event(nil), rest...), others...)
		if replayed {
			evs = append(evs, h1)
		}
		return evs
	}
	e.start("a", Options{MaxAttempts: 1}, h)
	e.waitDead(h1)
	e.waitAcked(within, others...)
	keyed := e.heldByKey(h1)
	var st runbook.TableStats
	e.eventually(within, func() bool {
		st = e.reportConsistent("h1 dead", undone)
		ok := st.Dead == 1
		if keyed {
			ok = ok && st.HeldKeys == 1 && st.DeadHeldKeys == 1 && st.WaitingBehindHeldKeys == int64(len(rest)) && st.Pending >= int64(len(rest))
		}
		return ok
	}, func() string { return "Stats while h1 is dead: " + fmtStats(st) })
	if keyed {
		e.notDeliveredBeyond(0, "its key's head is dead", rest...)
	}
	bad.fix(h1)
	mu.Lock()
	replayed = true
	mu.Unlock()
	if err := e.replayRetrying(h1); err != nil {
		t.Fatalf("replay the dead row h1: %v", err)
	}
	e.reportConsistent("h1 replayed", undone)
	e.waitAcked(within, h1)
	e.eventually(within, func() bool { return e.rec.delivered(rest[0]) > 0 }, func() string { return "h2 not delivered after the replay: " + e.rowStates(rest[:1]) })
	e.eventually(within, func() bool {
		st = e.reportConsistent("the drain held up in a handler", undone)
		return st.Dead == 0 && st.DeadHeldKeys == 0
	}, func() string { return "Stats during the drain still report h1 dead: " + fmtStats(st) })
	for range 5 {
		e.wait(quietSpell / 5)
		e.reportConsistent("the drain held up in a handler", undone)
	}
	if keyed {
		e.notDeliveredBeyond(0, "its key's previous row is in a handler", rest[1:]...)
	}
	close(gate)
	e.waitAcked(within, rest...)
	e.eventually(within, func() bool {
		st = e.reportConsistent("the drain ended", undone)
		return st.Pending == 0 && st.Dead == 0 && st.HeldKeys == 0 && st.DeadHeldKeys == 0 && st.WaitingBehindHeldKeys == 0 && st.Retrying == 0
	}, func() string { return "Stats once every row was acked: " + fmtStats(st) + "; " + e.holdsOf("h") })
	if keyed {
		e.ackedInOrder("h", append([]event{h1}, rest...)...)
	}
	e.rec.checkOrder(t)
}

func fmtStats(st runbook.TableStats) string {
	return "pending " + strconv.FormatInt(st.Pending, 10) + ", retrying " + strconv.FormatInt(st.Retrying, 10) +
		", dead " + strconv.FormatInt(st.Dead, 10) + ", held keys " + strconv.FormatInt(st.HeldKeys, 10) +
		", dead held keys " + strconv.FormatInt(st.DeadHeldKeys, 10) + ", waiting behind held keys " + strconv.FormatInt(st.WaitingBehindHeldKeys, 10) +
		", replays due " + strconv.FormatInt(st.ReplaysDue, 10)
}

// TestOverrunBesideReplay checks: the relay's DispatchTimeout is 1 s. Key
// k's rows k1 (acked), k2 and k3: k2's first copy waits for its context to
// end and then fails with the context's error; while it waits, an operator
// replays k1 (accepted, or refused as the runbook documents). k2's context
// ends (DispatchTimeout passed), k2 is retried and acked, then k3, and in
// a keyed mode never two copies of k in the relay's handlers at once; an
// accepted replay delivers k1 once more, a refused one not at all (the
// default relay refuses it: k1 is published).
//
// subscriber.Config.DispatchTimeout: "then the renewals stop, the
// message's context is cancelled and the attempt counts as failed".
// docs/ORDERING.md: "A handler that has not answered DispatchTimeout plus
// LockTTL/2 after delivery counts as a failed attempt in the same way
// (handler overran)"; "One copy per key within a relay"; "Replaying a
// keyed row that was acked or skipped delivers it once more, before its
// key's next row"; "a row whose key is held by another row is refused
// with runbook.ErrNotHeld". docs/OPERATIONS.md (the default relay's k1 is
// published): "A row that is published, pending without an error, or
// leased by a relay right now is refused with the reason, and nothing
// changes".
func TestOverrunBesideReplay(t *testing.T, r Relay) {
	e := setup(t, r, true)
	var mu sync.Mutex
	var k2 event
	first := true
	ctxEnded := make(chan struct{})
	h := func(ctx context.Context, m *message.Message) error {
		mu.Lock()
		wait := m.UUID == k2.ID.String() && first
		if wait {
			first = false
		}
		mu.Unlock()
		if !wait {
			return nil
		}
		select {
		case <-ctx.Done():
			close(ctxEnded)
			return ctx.Err()
		case <-e.stop:
			return errBroken
		}
	}
	e.start("a", Options{DispatchTimeout: time.Second}, h)
	k1 := e.enqueue(topicA, "k")[0]
	e.waitAcked(within, k1)
	e.eventually(within, func() bool { return e.row(k1.ID).Delivered }, func() string { return "k1 acked but not recorded delivered: " + e.rowStates([]event{k1}) })
	mu.Lock()
	k2 = e.enqueue(topicA, "k")[0]
	mu.Unlock()
	k3 := e.enqueue(topicA, "k")[0]
	e.eventually(within, func() bool { return e.rec.delivered(k2) > 0 }, func() string { return "k2 not delivered: " + e.rowStates([]event{k2}) })
	err := e.replayRetrying(k1)
	accepted := err == nil
	select {
	case <-ctxEnded:
	default:
		t.Logf("the replay of k1 was answered while k2's first copy was still in its handler")
	}
	switch {
	case err == nil:
		t.Logf("the replay of k1 was accepted")
	case refusal(err):
		t.Logf("the replay of k1 was refused: %v", err)
	default:
		t.Fatalf("replay k1: %v", err)
	}
	if r.Mode == ModeDefault && accepted {
		t.Errorf("the replay of the published row k1 was accepted, want it refused (a published row is not replayable)")
	}
	select {
	case <-ctxEnded:
	case <-time.After(within):
		t.Fatalf("k2's handler context did not end within %s (DispatchTimeout 1 s): %s", within, e.rowStates([]event{k2}))
	}
	e.waitAcked(within, k2, k3)
	if accepted {
		e.eventually(within, func() bool { return e.rec.delivered(k1) >= 2 }, func() string {
			return "the accepted replay of k1 was not delivered: " + e.rowStates([]event{k1}) + "; deliveries " + e.traceOf(k1)
		})
	}
	e.wait(quietSpell)
	want := 1
	if accepted {
		want = 2
	}
	if d := e.rec.delivered(k1); d != want {
		t.Errorf("k1 delivered %d times, want %d (replay accepted: %t); deliveries %s", d, want, accepted, e.traceOf(k1))
	}
	if e.heldByKey(k2) {
		e.ackedInOrder("k", k1, k2, k3)
		e.notDeliveredBeyond(1, "delivered once its key's previous row was acked", k3)
		reportAll(t, "one copy per key within a relay", e.overlapsInRelays())
	}
	e.rec.checkOrder(t)
}
