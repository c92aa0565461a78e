package relaytest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Generous deadlines: a condition that does not hold within them is a
// failure, not a slow machine.
const (
	within     = 30 * time.Second
	quietSpell = 1500 * time.Millisecond // a window for a row that must not be delivered to show up
)

// TestOrderThroughHandoverAndRestart checks that rows sharing an ordering key are
// first delivered in sequence order while handlers nack some rows, a
// relay closes (its keys pass to the other relay: a handover) and a new
// relay starts (a restart). README "Which relay?", docs/ORDERING.md
// "Order", docs/WAL.md "Per key".
func TestOrderThroughHandoverAndRestart(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay promises no order (README, \"Which relay?\": retries reorder)", r.Name)
	}
	e := setup(t, r, true)
	// Each row is nacked at its first attempt when its hash says so: the
	// same rows in every run, a tenth of them.
	h := func(_ context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataAttempts) <= "1" && hashOf(m.UUID)%10 == 0 {
			return errBroken
		}
		return nil
	}
	batch := func(round int) []event {
		var evs []event
		for i := range 5 {
			keys := make([]string, 20)
			for j := range keys {
				keys[j] = "k" + strconv.Itoa((round*3+i+j)%20)
			}
			evs = append(evs, e.enqueue(topicA, keys...)...)
		}
		return evs
	}
	a := e.start("a", Options{}, h)
	e.start("b", Options{}, h)
	first := batch(0)
	e.eventually(within, func() bool { return len(e.rec.notAcked(first)) <= len(first)/2 }, func() string { return "half of the first batch not acked" })
	if err := a.Close(); err != nil { // a handover: b (a standby, or a sharer) goes on
		t.Fatalf("close relay a: %v", err)
	}
	second := batch(1)
	e.start("c", Options{}, h) // a restart
	e.eventually(within, func() bool { return len(e.rec.notAcked(second)) <= len(second)/2 }, func() string { return "half of the second batch not acked" })
	third := batch(2)
	all := append(append(first, second...), third...)
	e.waitAcked(within, all...)
	e.rec.checkOrder(t)
}

// TestOneCopyPerKey checks that a relay has at most one copy of a key in its
// handlers, also when a handler ignores its context and keeps a message
// past the end of its term (Relay.EndTerm: the ordered relay's leases
// lost, the WAL relay's session ended): within the documented overrun the
// key's next copy waits for the old one. docs/ORDERING.md "Terms",
// docs/WAL.md "Sessions are terms".
func TestOneCopyPerKey(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay promises no per-key delivery: it hands out rows of one key concurrently by design", r.Name)
	}
	e := setup(t, r, true)
	// The hang is within the documented overrun: a copy that an ended
	// term left in a handler holds its key until its verdict, or
	// DispatchTimeout + LockTTL/2 (ordered; DispatchTimeout defaults to
	// 30 s) or CloseTimeout (WAL, 10 s here) after its term ended.
	const hang = 4 * time.Second
	var mu sync.Mutex
	hung := map[string]bool{}
	hanging := make(chan struct{}, 16)
	// The first delivery of each key's first row hangs, ignoring its
	// context; every other delivery is acked at once.
	h := func(_ context.Context, m *message.Message) error {
		k := m.Metadata.Get(schema.MetadataOrderingKey)
		mu.Lock()
		first := !hung[k]
		hung[k] = true
		mu.Unlock()
		if first {
			hanging <- struct{}{}
			e.wait(hang)
		}
		return nil
	}
	e.start("a", Options{CloseTimeout: 10 * time.Second}, h)
	var evs []event
	for range 4 {
		evs = append(evs, e.enqueue(topicA, "c1", "c2", "c3", "c4")...)
	}
	select {
	case <-hanging:
	case <-time.After(within):
		t.Fatal("no message delivered")
	}
	if r.EndTerm != nil {
		if err := r.EndTerm(context.Background(), e.pool, e.tbl); err != nil {
			t.Fatalf("end the relay's term: %v", err)
		}
	}
	e.waitAcked(within, evs...)
	reportAll(t, "one copy per key within a relay", e.overlapsInRelays())
	e.rec.checkOrder(t)
}

// TestPauseAndResume checks that a paused topic's rows stay pending, with no attempt
// counted, while other topics flow; in a keyed mode a key whose next row
// is paused waits whatever its later rows' topics; after the resume they
// are delivered (in order, per key). docs/OPERATIONS.md "Pausing a
// topic", docs/ORDERING.md "Paused topics".
func TestPauseAndResume(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	seen := &pauseLog{topic: topicA, ch: make(chan struct{})}
	if r.Mode != ModeWAL {
		// The relay is at work (listening for wake-ups) before the pause.
		e.start("a", Options{Logger: seen}, nil)
		e.waitAcked(within, e.enqueue(topicA, "")...)
	}
	_, err := runbook.New(e.pool, e.tbl).PauseTopic(ctx, topicA, "relaytest", false)
	if r.Mode == ModeWAL {
		if !errors.Is(err, runbook.ErrPauseWAL) {
			t.Fatalf("PauseTopic on a WAL table: %v, want runbook.ErrPauseWAL", err)
		}
		t.Skipf("the %s relay cannot pause a topic (its slot would retain WAL while paused): PauseTopic refuses with runbook.ErrPauseWAL, as docs/OPERATIONS.md says", r.Name)
	}
	if err != nil {
		t.Fatalf("pause %s: %v", topicA, err)
	}
	// The promise holds from the wake-up that tells the relay of the pause
	// (or its next PollInterval): wait until it has read the pause.
	select {
	case <-seen.ch:
	case <-time.After(within):
		t.Fatalf("the relay did not read the pause of %s within %s", topicA, within)
	}
	const topicB = "org.relaytest.b.v1"
	heldA := e.enqueue(topicA, "p1", "", "") // p1's first row and two unkeyed rows of A
	behind := e.enqueue(topicB, "p1")        // p1's second row, of a topic that flows
	flowing := e.enqueue(topicB, "p2", "p2", "", "")
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	paused := heldA
	if r.keyed() {
		paused = append(paused, behind...)
	}
	for _, ev := range paused {
		if n := e.rec.delivered(ev); n > 0 {
			t.Errorf("row %s (topic %s) delivered %d times while %s is paused", ev, ev.Topic, n, topicA)
		}
	}
	for _, ev := range heldA {
		if s := e.row(ev.ID); !s.Found || s.Published || s.Delivered || s.Dead() || s.Attempts != 0 || s.HoldAttempts != 0 {
			t.Errorf("paused row %s is %s, want pending with no attempt counted", ev, s)
		}
	}
	if _, err := runbook.New(e.pool, e.tbl).ResumeTopic(ctx, topicA, false); err != nil {
		t.Fatalf("resume %s: %v", topicA, err)
	}
	e.waitAcked(within, append(heldA, behind...)...)
	e.rec.checkOrder(t)
}

// TestSkipHeld checks that a dead row holds its key (its later rows wait, other keys
// flow); SkipEvent drops it: the key goes on with its next rows, in
// order, and the skipped row is never delivered again. docs/ORDERING.md
// "Operating held keys", docs/WAL.md "Skip".
func TestSkipHeld(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: a dead row blocks nothing, so there is nothing to skip (runbook's SkipEvent refuses with ErrNotHeld)", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	key := e.enqueue(topicA, "s", "s", "s")
	bad := newFailing(key[0])
	e.start("a", Options{MaxAttempts: 3}, permanentFor(bad))
	flow := e.enqueue(topicA, "free", "free")
	e.waitAcked(within, flow...)
	e.waitHold(within, key[0], runbook.HoldDead)
	e.wait(quietSpell)
	for _, ev := range key[1:] {
		if e.rec.delivered(ev) > 0 {
			t.Fatalf("row %s delivered while the dead row %s holds its key", ev, key[0])
		}
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, key[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", key[0], err)
	}
	bad.fix(key[0]) // a redelivery would now be acked, and seen
	e.waitAcked(within, key[1:]...)
	e.wait(quietSpell)
	if e.rec.acked(key[0]) {
		t.Errorf("the skipped row %s was delivered again", key[0])
	}
	e.rec.checkOrder(t)
}

// TestOneHoldsTable checks that the keyed relays keep their holds in one
// table of one shape, <table>_holds, each hold marked with the mode that
// wrote it, and that the state the runbook reports is that table's state
// column, through a hold's lifecycle: dead, skip requested (asked while no
// relay runs), then no open hold once a relay applied the skip.
// docs/ARCHITECTURE.md "The keyed core", docs/ORDERING.md "Switching
// modes", docs/WAL.md "Upgrading from <table>_wal_holds".
func TestOneHoldsTable(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: it writes no hold", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	mode := map[Mode]string{ModeOrdered: "ordered", ModeWAL: "wal"}[r.Mode]
	key := e.enqueue(topicA, "h", "h")
	bad := newFailing(key[0])
	a := e.start("a", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitHold(within, key[0], runbook.HoldDead)
	check := func(want runbook.HoldState) {
		t.Helper()
		var m, state string
		if err := e.pool.QueryRow(ctx, `SELECT mode, state FROM `+e.tbl.HoldsTable()+` WHERE ordering_key = 'h'`).Scan(&m, &state); err != nil {
			t.Fatalf("read the hold of key h from %s: %v", e.tbl.HoldsTable(), err)
		}
		st, held := e.holdState(key[0])
		if m != mode || state != want.String() || !held || st != want {
			t.Errorf("hold of key h: %s has mode %q and state %q, the runbook says held=%t %s; want mode %q, state %s in both",
				e.tbl.HoldsTable(), m, state, held, st, mode, want)
		}
	}
	check(runbook.HoldDead)
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, key[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", key[0], err)
	}
	check(runbook.HoldSkipRequested)
	e.start("b", Options{MaxAttempts: 1}, nil)
	e.waitAcked(within, key[1])
	e.eventually(within, func() bool {
		var open, others int
		var legacy bool
		err := e.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE resolved_at IS NULL), count(*) FILTER (WHERE mode <> $1),
  to_regclass($2) IS NOT NULL FROM `+e.tbl.HoldsTable(), mode, sqlq.LegacyWALHoldsTable(e.tbl)).Scan(&open, &others, &legacy)
		return err == nil && open == 0 && others == 0 && !legacy
	}, func() string {
		return "after the skip, an open hold, a hold of another mode or a second holds table is left: " + e.rowStates(key)
	})
	if e.rec.acked(key[0]) {
		t.Errorf("the skipped row %s was delivered", key[0])
	}
}

// TestSkippedIsAState checks that a skip is recorded as a state of the row,
// the same in every mode: once the skip is applied (at once by the runbook
// for a row that holds no key: every row of a default table, an unkeyed row
// of an ordered table; by the relay that owns a held key), the row has
// skipped_at, is neither dead nor delivered (the runbook's Event says
// skipped; the dead count, the dead list and the backlog leave it out), is
// never delivered again, keeps the failure that made it dead as its
// last_error, and is not caught by a bulk replay of dead rows; a replay of
// that one row delivers it once, and it is then delivered, no longer
// skipped; the cleaner deletes a skipped row by the retention of delivered
// rows, never by the dead retention. docs/OPERATIONS.md "The row's
// states", docs/ORDERING.md "Operating held keys", docs/WAL.md "Skip",
// docs/ARCHITECTURE.md "skipped".
func TestSkippedIsAState(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	rb := runbook.New(e.pool, e.tbl)
	key := e.enqueue(topicA, "k", "k")
	other := e.enqueue(topicA, "c", "c")
	skipped := []event{key[0], other[0]}
	if r.Mode == ModeOrdered {
		// An unkeyed row of an ordered table is a default-mode row.
		skipped = append(skipped, e.enqueue(topicA, "")...)
	}
	bad := newFailing(skipped...)
	e.start("a", Options{MaxAttempts: 2}, permanentFor(bad))
	for _, ev := range skipped {
		if e.keys && ev.Key != "" {
			e.waitHold(within, ev, runbook.HoldDead)
			continue
		}
		e.eventually(within, func() bool { return e.row(ev.ID).Dead() }, func() string { return "the row did not die: " + e.rowStates([]event{ev}) })
	}
	cause := e.row(key[0].ID).RunbookError
	if !strings.Contains(cause, errBroken.Error()) {
		t.Fatalf("the dead row's last_error is %q, want the handler's error", cause)
	}
	for _, ev := range skipped {
		if _, err := rb.SkipEvent(ctx, ev.ID, false); err != nil {
			t.Fatalf("skip the dead row %s: %v", ev, err)
		}
	}
	e.waitAcked(within, key[1], other[1])
	skippedAt := func(ev event) (skipped, dead bool) {
		t.Helper()
		if err := e.pool.QueryRow(ctx, `SELECT skipped_at IS NOT NULL, dead_at IS NOT NULL FROM `+e.tbl.Sanitize()+` WHERE event_id = $1`, ev.ID).
			Scan(&skipped, &dead); err != nil {
			t.Fatalf("read skipped_at of %s: %v", ev, err)
		}
		return skipped, dead
	}
	for _, ev := range skipped {
		e.eventually(within, func() bool {
			s := e.row(ev.ID)
			col, dead := skippedAt(ev)
			return s.Skipped && !s.Delivered && !s.Dead() && col && !dead
		}, func() string { return "the skipped row is not recorded as skipped: " + e.rowStates([]event{ev}) })
	}
	if s := e.row(key[0].ID); s.RunbookError != cause {
		t.Errorf("the skipped row's last_error is %q, want the failure that made it dead, %q", s.RunbookError, cause)
	}
	// The holds resolve once the keys' next rows are acked (ordered mode
	// writes that a moment after the ack); a skipped row counted dead
	// would stay so.
	var st runbook.TableStats
	e.eventually(within, func() bool {
		var err error
		st, err = rb.Stats(ctx)
		return err == nil && st.Dead == 0 && st.HeldKeys == 0
	}, func() string {
		return fmt.Sprintf("after the skips the stats count %d dead rows and %d held keys, want none (a skipped row is not dead)", st.Dead, st.HeldKeys)
	})
	dead, err := rb.Dead(ctx, runbook.DeadFilter{})
	if err != nil {
		t.Fatalf("list the dead rows: %v", err)
	}
	backlog, err := rb.Backlog(ctx, runbook.BacklogOptions{})
	if err != nil {
		t.Fatalf("list the backlog: %v", err)
	}
	for _, row := range append(dead, backlog...) {
		for _, ev := range skipped {
			if row.EventID == ev.ID {
				t.Errorf("the skipped row %s is listed dead or pending (dead list %d rows, backlog %d rows)", ev, len(dead), len(backlog))
			}
		}
	}
	tries := map[uuid.UUID]int{} // the attempts that made each dead
	for _, ev := range skipped {
		tries[ev.ID] = e.rec.delivered(ev)
	}
	rep, err := rb.ReplayDead(ctx, runbook.DeadFilter{AllTopics: true}, false)
	if err != nil {
		t.Fatalf("bulk replay of the dead rows: %v", err)
	}
	if rep.Rows != 0 {
		t.Errorf("a bulk replay of the dead rows replayed %d rows, want 0: the skipped rows are not dead", rep.Rows)
	}
	e.wait(quietSpell)
	for _, ev := range skipped {
		if n := e.rec.delivered(ev); n != tries[ev.ID] {
			t.Fatalf("the skipped row %s was delivered again after the skip (%d deliveries, %d before)", ev, n, tries[ev.ID])
		}
	}
	bad.fix(key[0])
	err = retry(within, func() error {
		_, err := rb.ReplayEvent(ctx, key[0].ID, runbook.ReplayOptions{})
		return err
	}, func(err error) bool {
		return errors.Is(err, runbook.ErrLocked) || errors.Is(err, runbook.ErrNotRelayedYet)
	})
	if err != nil {
		t.Fatalf("replay the skipped row %s: %v", key[0], err)
	}
	e.waitAcked(within, key[0])
	e.eventually(within, func() bool {
		s := e.row(key[0].ID)
		col, _ := skippedAt(key[0])
		return !s.Skipped && s.Delivered && !col
	}, func() string { return "the replayed skipped row is not delivered: " + e.rowStates(key[:1]) })
	e.wait(quietSpell)
	if n := e.rec.delivered(key[0]); n != tries[key[0].ID]+1 {
		t.Errorf("the replay of the skipped row %s delivered it %d times, want once", key[0], n-tries[key[0].ID])
	}
	// The cleaner deletes a skipped row like a delivered one (its
	// retention), never by the dead retention.
	rest := skipped[1:]
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Hour, DeadRetention: time.Nanosecond}, nil)
	if err != nil {
		t.Fatalf("cleaner: %v", err)
	}
	if _, n, err := cl.CleanOnce(ctx); err != nil || n != 0 {
		t.Errorf("the cleaner's dead retention deleted %d rows (%v), want none: a skipped row is not dead", n, err)
	}
	for _, ev := range rest {
		if !e.row(ev.ID).Found {
			t.Errorf("the cleaner's dead retention deleted the skipped row %s", ev)
		}
	}
	cl, err = cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, DeadRetention: time.Hour}, nil)
	if err != nil {
		t.Fatalf("cleaner: %v", err)
	}
	for _, ev := range rest {
		e.eventually(within, func() bool {
			_, _, err := cl.CleanOnce(ctx)
			return err == nil && !e.row(ev.ID).Found
		}, func() string { return "the cleaner does not delete the skipped row: " + e.rowStates([]event{ev}) })
	}
}

// TestHandlerPastDispatchTimeout checks one rule for every relay: a handler
// that keeps a message past DispatchTimeout and ignores its context has
// overrun once the relay's margin passed (the table relays: LockTTL/2; the
// WAL relay: CloseTimeout): the message's context has ended, the attempt
// counts as failed and the row is delivered again (attempts 2), before the
// later rows of its key in the keyed relays; other keys flow meanwhile.
// README "Which relay?", docs/RELIABILITY.md, docs/WAL.md
// "DispatchTimeout".
func TestHandlerPastDispatchTimeout(t *testing.T, r Relay) {
	e := setup(t, r, true)
	key := e.enqueue(topicA, "o", "o")
	gate := make(chan struct{})
	t.Cleanup(func() { close(gate) })
	var mu sync.Mutex
	var first context.Context
	var attempts []string
	h := func(ctx context.Context, m *message.Message) error {
		if m.UUID != key[0].ID.String() {
			return nil
		}
		mu.Lock()
		attempts = append(attempts, m.Metadata.Get(schema.MetadataAttempts))
		hang := first == nil
		if hang {
			first = ctx
		}
		mu.Unlock()
		if hang {
			e.block(gate) // ignores its context
		}
		return nil
	}
	e.start("a", Options{MaxAttempts: 5, DispatchTimeout: 300 * time.Millisecond, CloseTimeout: 300 * time.Millisecond, Backoff: 10 * time.Millisecond}, h)
	e.eventually(within, func() bool { return e.rec.delivered(key[0]) > 0 }, func() string { return "the row was not delivered: " + e.rowStates(key[:1]) })
	free := e.enqueue(topicA, "free")
	e.waitAcked(within, free...)
	e.waitAcked(within, key...)
	mu.Lock()
	defer mu.Unlock()
	if first.Err() == nil {
		t.Error("the overrun handler's message context has not ended")
	}
	if len(attempts) < 2 || attempts[0] != "1" || attempts[1] != "2" {
		t.Errorf("deliveries of the overrun row carried attempts %v, want 1 then 2 (the overrun counted a failed attempt)", attempts)
	}
	if r.keyed() {
		e.rec.checkOrder(t)
	}
}

// TestReplayDead checks that a row that failed for good is dead (kept, never retried
// on its own); ReplayEvent delivers it again, and in a keyed mode before
// the rest of its key. README "Dead rows", docs/ORDERING.md, docs/WAL.md
// "Replay".
func TestReplayDead(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	key := e.enqueue(topicA, "r", "r")
	unkeyed := e.enqueue(topicA, "")
	bad := newFailing(key[0], unkeyed[0])
	e.start("a", Options{MaxAttempts: 2}, permanentFor(bad))
	e.eventually(within, func() bool { return e.row(key[0].ID).Dead() && e.row(unkeyed[0].ID).Dead() }, func() string {
		return "the failing rows are not dead: " + e.rowStates(append(key[:1], unkeyed...))
	})
	if r.keyed() {
		e.wait(quietSpell)
		if e.rec.delivered(key[1]) > 0 {
			t.Fatalf("row %s delivered while the dead row %s holds its key", key[1], key[0])
		}
	} else {
		e.waitAcked(within, key[1])
	}
	bad.fix(key[0], unkeyed[0])
	for _, ev := range []event{key[0], unkeyed[0]} {
		err := retry(within, func() error {
			_, err := runbook.New(e.pool, e.tbl).ReplayEvent(ctx, ev.ID, runbook.ReplayOptions{})
			return err
		}, func(err error) bool {
			return errors.Is(err, runbook.ErrLocked) || errors.Is(err, runbook.ErrNotRelayedYet)
		})
		if err != nil {
			t.Fatalf("replay the dead row %s: %v", ev, err)
		}
	}
	e.waitAcked(within, append(key, unkeyed...)...)
	if r.keyed() {
		e.rec.mu.Lock()
		order := append([]int64(nil), e.rec.ackOrder["r"]...)
		e.rec.mu.Unlock()
		if len(order) != 2 || order[0] != key[0].Seq {
			t.Errorf("key r acked %v, want the replayed row %d first, then %d", order, key[0].Seq, key[1].Seq)
		}
	}
}

// TestBulkReplayWhileHoldDrains checks that a bulk replay (runbook.Runbook.ReplayDead) that
// catches a held key's skipped dead row while the key's next rows are
// being delivered (WAL: the hold drains) is refused or delivered, never
// lost: the row ends delivered, or still dead — never "not dead and never
// delivered". In the default mode, with no hold, the replayed row is
// delivered. docs/WAL.md "A replay while a hold drains is refused".
func TestBulkReplayWhileHoldDrains(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	key := e.enqueue(topicA, "b", "b", "b")
	bad := newFailing(key[0])
	gate := make(chan struct{})
	h := func(ctx context.Context, m *message.Message) error {
		switch m.UUID {
		case key[1].ID.String():
			e.block(gate)
		}
		return permanentFor(bad)(ctx, m)
	}
	e.start("a", Options{MaxAttempts: 1}, h)
	e.eventually(within, func() bool { return e.row(key[0].ID).Dead() }, func() string { return e.rowStates(key[:1]) })
	if r.keyed() {
		e.waitHold(within, key[0], runbook.HoldDead)
		if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, key[0].ID, false); err != nil {
			t.Fatalf("skip the dead held row %s: %v", key[0], err)
		}
	}
	// The key's next row is in a handler: its hold drains (WAL) or has
	// moved on (ordered).
	e.eventually(within, func() bool { return e.rec.delivered(key[1]) > 0 }, func() string { return "the row after the held one was not delivered: " + e.rowStates(key) })
	if r.Mode == ModeWAL {
		if st, held := e.holdState(key[0]); !held || st != runbook.HoldDraining {
			t.Logf("hold of %s: held=%t state=%s (not draining at the bulk replay)", key[0], held, st)
		}
	}
	bad.fix(key[0])
	before := e.row(key[0].ID)
	rep, err := runbook.New(e.pool, e.tbl).ReplayDead(ctx, runbook.DeadFilter{AllTopics: true}, false)
	if err != nil {
		t.Logf("bulk replay refused: %v", err)
	}
	e.wait(quietSpell) // the replay reaches the relay (the WAL relay: its UPDATE is streamed) while the key's next row is in the handler
	close(gate)
	e.waitAcked(within, key[1:]...)
	defer func() {
		k := key[0].Key
		if !e.keys {
			k = "" // the rows were enqueued without their key
		}
		e.rec.mu.Lock()
		t.Logf("bulk replay: %d rows; deliveries of key %q: %v", rep.Rows, k, e.rec.trace[k])
		e.rec.mu.Unlock()
	}()
	if !r.keyed() {
		e.waitAcked(within, key[0])
		return
	}
	// Delivered, or refused: left as it was (dead, or skipped). Wait for
	// either.
	unchanged := func(s rowState) bool {
		return s.Found && s.Dead() == before.Dead() && s.LastError == before.LastError && s.Attempts == before.Attempts
	}
	deadline := time.Now().Add(within)
	for !e.rec.acked(key[0]) {
		s := e.row(key[0].ID)
		if unchanged(s) {
			e.wait(quietSpell)
			if s = e.row(key[0].ID); unchanged(s) || e.rec.acked(key[0]) {
				t.Logf("row %s left as it was: %s", key[0], s)
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("bulk replay (reported %d rows replayed) while %s's hold drained: row %s was %s, is now %s, and was never delivered since: lost",
				rep.Rows, key[0].Key, key[0], before, s)
		}
		e.wait(100 * time.Millisecond)
	}
}

// TestCleanerRacingReplays checks that the cleaner, with a tiny retention, deletes
// relayed rows while an operator replays the same old rows; no key is
// stranded: the key's next row is delivered. docs/ORDERING.md "Replay
// works on keyed rows", the cleaner's doc.
func TestCleanerRacingReplays(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	e.start("a", Options{}, nil)
	keys := make([]string, 60)
	for i := range keys {
		keys[i] = "c" + strconv.Itoa(i)
	}
	old := append(e.enqueue(topicA, keys...), e.enqueue(topicA, keys...)...)
	e.waitAcked(within, old...)
	// The relay has recorded them done (ordered: its floors passed them;
	// WAL: its progress), so the cleaner may delete them and an operator
	// replay them.
	e.eventually(within, func() bool {
		for _, ev := range old {
			if !e.row(ev.ID).Delivered {
				return false
			}
		}
		return true
	}, func() string { return "acked rows not recorded delivered: " + e.rowStates(old[len(old)-1:]) })
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, DeadRetention: time.Nanosecond, BatchSize: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		replayed int
		refused  = map[string]int{}
		done     = make(chan struct{})
	)
	for range 2 { // cleaners, a row per pass, oldest first, until the replays are over
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				if _, _, err := cl.CleanOnce(ctx); err != nil {
					t.Errorf("clean: %v", err)
					return
				}
				select {
				case <-done:
					return
				default:
				}
			}
		}()
	}
	var ops sync.WaitGroup
	const operators = 4
	for o := range operators { // operators replay the old rows, oldest first too, each a share
		ops.Add(1)
		go func() {
			defer ops.Done()
			for range 3 {
				for i := o; i < len(old); i += operators {
					_, err := runbook.New(e.pool, e.tbl).ReplayEvent(ctx, old[i].ID, runbook.ReplayOptions{})
					why := "accepted"
					if err != nil {
						why = err.Error()
						for _, sentinel := range []error{runbook.ErrEventNotFound, runbook.ErrNotRelayedYet, runbook.ErrNotHeld, runbook.ErrHoldRefused, runbook.ErrAlreadyPublished, runbook.ErrNotFailed, runbook.ErrLocked} {
							if errors.Is(err, sentinel) {
								why = sentinel.Error()
								break
							}
						}
					}
					mu.Lock()
					if err == nil {
						replayed++
					} else {
						refused[why]++
					}
					mu.Unlock()
				}
			}
		}()
	}
	ops.Wait()
	close(done)
	wg.Wait()
	t.Logf("%d replays accepted; refused: %v", replayed, refused)
	next := e.enqueue(topicA, keys...)
	e.eventually(within, func() bool { return len(e.rec.notAcked(next)) == 0 }, func() string {
		stranded := e.rec.notAcked(next)
		held, _ := runbook.New(e.pool, e.tbl).ListHolds(ctx, runbook.HoldsFilter{Resolved: true})
		var hs []string
		for _, h := range held {
			if h.Key == stranded[0].Key {
				hs = append(hs, fmt.Sprintf("%+v", h))
			}
		}
		var skipErr error
		if len(hs) > 0 {
			for _, h := range held {
				if h.Key != stranded[0].Key {
					continue
				}
				if id, err := uuid.Parse(h.EventID); err == nil {
					_, skipErr = runbook.New(e.pool, e.tbl).SkipEvent(ctx, id, true)
				} else {
					skipErr = fmt.Errorf("the held row is gone (event_id %q)", h.EventID)
				}
				break
			}
		}
		return fmt.Sprintf("%d keys stranded: key %s's next row %s is %s, never delivered; its holds %v; a dry-run skip of its hold: %v",
			len(stranded), stranded[0].Key, stranded[0], e.row(stranded[0].ID), hs, skipErr)
	})
}

// TestMaxInFlight checks that never more than MaxInFlight messages of a subscription
// are in handlers, keyed rows and unkeyed rows together; all are delivered
// once handlers answer. subscriber.Config.MaxInFlight,
// walrelay.Config.MaxInFlight.
func TestMaxInFlight(t *testing.T, r Relay) {
	e := setup(t, r, true)
	const limit = 4
	gate := make(chan struct{})
	e.start("a", Options{MaxInFlight: limit}, func(context.Context, *message.Message) error {
		e.block(gate)
		return nil
	})
	var evs []event
	keys := make([]string, 12)
	for i := range keys {
		keys[i] = "m" + strconv.Itoa(i)
	}
	evs = append(evs, e.enqueue(topicA, keys...)...)
	for i := range 12 { // unkeyed rows of topics of their own (the WAL relay orders unkeyed rows per topic)
		evs = append(evs, e.enqueue("org.relaytest.u"+strconv.Itoa(i)+".v1", "")...)
	}
	e.eventually(within, func() bool { return e.rec.openOf("a") >= limit }, func() string {
		return fmt.Sprintf("%d messages in handlers, want %d", e.rec.openOf("a"), limit)
	})
	e.wait(quietSpell) // room for more than the limit to show up
	close(gate)
	e.waitAcked(within, evs...)
	if n := e.rec.maxOpenOf("a"); n > limit {
		t.Errorf("%d messages in handlers at once, MaxInFlight is %d", n, limit)
	}
}

// TestBacklogBeforeSetUp checks that rows committed before the relay is set up are
// delivered, or the set-up refuses with an error saying what to do; they
// are never counted delivered and deleted. README "Nothing committed is
// lost", docs/WAL.md.
func TestBacklogBeforeSetUp(t *testing.T, r Relay) {
	e := setup(t, r, false)
	ctx := context.Background()
	backlog := e.enqueue(topicA, "k1", "k2", "k1", "k3", "k2")
	backlog = append(backlog, e.enqueue(topicA, "", "")...)
	if r.SetUp != nil {
		if err := r.SetUp(ctx, e.pool, e.tbl); err != nil {
			t.Logf("set-up refused with %d rows pending: %v", len(backlog), err)
			for _, ev := range backlog {
				if s := e.row(ev.ID); !s.Found || s.Published || s.Delivered || s.Dead() {
					t.Errorf("after the refused set-up, row %s is %s, want pending", ev, s)
				}
			}
			return
		}
	}
	e.start("a", Options{}, nil)
	deadline := time.Now().Add(within)
	for len(e.rec.notAcked(backlog)) > 0 {
		if time.Now().After(deadline) {
			missing := e.rec.notAcked(backlog)
			state := e.row(missing[0].ID)
			st, _ := runbook.New(e.pool, e.tbl).Stats(ctx)
			cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond}, nil)
			var deleted int64
			if err == nil {
				deleted, _, err = cl.CleanOnce(ctx)
			}
			t.Fatalf("%d of %d rows committed before the set-up never delivered (first %s: %s); runbook's Stats %+v; a cleaner pass deleted %d rows (%v)",
				len(missing), len(backlog), missing[0], state, st, deleted, err)
		}
		e.wait(50 * time.Millisecond)
	}
	e.rec.checkOrder(t)
}

// TestSwitchFromDefault checks that a table (every optional column) that a default
// relay ran on is switched to the relay under test: its dead rows stay
// dead and its published rows are not delivered again; new rows flow.
// docs/ORDERING.md "Switching modes".
func TestSwitchFromDefault(t *testing.T, r Relay) {
	e := setup(t, r, false, schema.WithAllColumns())
	published := e.enqueue(topicA, "w1", "w2", "w1", "w3", "")
	dead := e.enqueue(topicA, "d1", "d2", "d1", "")
	bad := newFailing(dead...)
	old, err := e.newDefault(false, Options{MaxAttempts: 1})
	if err != nil {
		t.Fatalf("the default relay: %v", err)
	}
	oldRelay, err := e.consume("old", old, permanentFor(bad))
	if err != nil {
		t.Fatal(err)
	}
	e.waitAcked(within, published...)
	e.eventually(within, func() bool {
		for _, ev := range dead {
			if !e.row(ev.ID).Dead() {
				return false
			}
		}
		return true
	}, func() string { return "dead rows: " + e.rowStates(dead) })
	if err := oldRelay.Close(); err != nil {
		t.Fatalf("close the default relay: %v", err)
	}
	bad.fix(dead...) // a delivery of a dead row would now be acked, and seen
	e.setUp()
	before := e.rec.deliveriesBy("old")
	e.startOnceOtherModeGone("new", Options{}, nil, within)
	fresh := e.enqueue(topicA, "w1", "w2", "w3", "n1", "")
	e.waitAcked(within, fresh...)
	e.wait(quietSpell)
	if n := e.rec.deliveriesBy("old"); n != before {
		t.Errorf("the closed default relay delivered %d more messages", n-before)
	}
	for _, ev := range published {
		if n := e.rec.delivered(ev); n > 1 {
			t.Errorf("published row %s delivered again after the switch to %s (%d deliveries in all)", ev, r.Name, n)
		}
	}
	for _, ev := range dead {
		if e.rec.acked(ev) {
			t.Errorf("dead row %s delivered after the switch to %s", ev, r.Name)
		}
		if s := e.row(ev.ID); !s.Dead() {
			t.Errorf("dead row %s is %s after the switch to %s, want dead", ev, s, r.Name)
		}
	}
}

// TestTwoModesOnOneTable checks that a default relay and an ordered relay do not run
// on one table at once: whichever starts second is refused for as long as
// both could run (an idle default relay with DisableSingleActive
// included), so that no key is delivered out of order nor twice at once;
// a stale lease left by a killed default relay blocks nothing, and a
// refusal names no default relay that does not run. README ("Relays of
// the default and ordered mode refuse to run beside each other"),
// schema.ErrRelayModeMix.
func TestTwoModesOnOneTable(t *testing.T, r Relay) {
	if r.Mode == ModeWAL {
		t.Skipf("the %s relay makes no promise about table relays beside it (docs/WAL.md does not say; it is not checked)", r.Name)
	}
	// A participant is a relay of one mode: made (New), then subscribed.
	type participant struct {
		name  string
		label string // the recorder's name of its deliveries
		make  func(e *env) (message.Subscriber, error)
	}
	underTest := participant{r.Mode.String() + " (under test)", "test", func(e *env) (message.Subscriber, error) {
		return e.newRelay(Options{DisableSingleActive: true})
	}}
	fixtureDefault := func(shared bool) participant {
		name := "default (single-active)"
		if shared {
			name = "default (DisableSingleActive)"
		}
		return participant{name, "fixture", func(e *env) (message.Subscriber, error) { return e.newDefault(shared, Options{}) }}
	}
	fixtureOrdered := participant{"ordered", "fixture", func(e *env) (message.Subscriber, error) { return e.newOrdered(Options{}) }}
	type pair struct {
		first, second participant
		// late: the first is made before the second starts and subscribes
		// only after it: a check at New alone cannot refuse it.
		late bool
	}
	var pairs []pair
	switch r.Mode {
	case ModeOrdered: // a default relay runs, the ordered one starts; and the other way round
		pairs = []pair{{fixtureDefault(true), underTest, false}, {fixtureDefault(false), underTest, false},
			{underTest, fixtureDefault(true), false}, {underTest, fixtureDefault(false), false},
			{underTest, fixtureDefault(true), true}, {fixtureDefault(true), underTest, true}}
	case ModeDefault:
		pairs = []pair{{fixtureOrdered, underTest, false}, {underTest, fixtureOrdered, false},
			{underTest, fixtureOrdered, true}, {fixtureOrdered, underTest, true}}
	}
	for _, p := range pairs {
		name := p.first.name + " then " + p.second.name
		if p.late {
			name = p.first.name + " made, " + p.second.name + " started, then the first subscribed"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e := setup(t, r, true, schema.WithAllColumns())
			h := func(context.Context, *message.Message) error { e.wait(30 * time.Millisecond); return nil }
			start := func(pt participant, sub message.Subscriber) error {
				var err error
				if sub == nil {
					if sub, err = pt.make(e); err != nil {
						return err
					}
				}
				_, err = e.consume(pt.label, sub, h)
				return err
			}
			var early message.Subscriber
			if p.late {
				var err error
				if early, err = p.first.make(e); err != nil {
					t.Fatalf("make the %s relay: %v", p.first.name, err)
				}
				t.Cleanup(func() { _ = early.Close() })
				if err := start(p.second, nil); err != nil {
					t.Fatalf("the %s relay, started alone: %v", p.second.name, err)
				}
			} else if err := start(p.first, nil); err != nil {
				t.Fatalf("the first relay (%s): %v", p.first.name, err)
			}
			// Let the running one be at work: leader, partitions owned, or
			// idle after a claim.
			e.waitAcked(within, e.enqueue(topicA, "")...)
			var err error
			if p.late {
				err = start(p.first, early)
			} else {
				err = start(p.second, nil)
			}
			if err != nil {
				if !errors.Is(err, schema.ErrRelayModeMix) {
					t.Errorf("the second relay failed with %v, want an error matching schema.ErrRelayModeMix", err)
				}
				return // refused: nothing can go wrong
			}
			var evs []event
			for range 4 {
				evs = append(evs, e.enqueue(topicA, "x1", "x2", "x3", "x4")...)
			}
			e.waitAcked(within, evs...)
			e.rec.mu.Lock()
			both := e.rec.byRelay["test"] > 0 && e.rec.byRelay["fixture"] > 0
			over := append([]string(nil), e.rec.overlaps...)
			e.rec.mu.Unlock()
			if both {
				t.Errorf("%s: relays of both modes delivered rows of the table at once", name)
			}
			for i, o := range over {
				if i == 3 {
					break
				}
				t.Error(o)
			}
			e.rec.checkOrder(t)
		})
	}
	if r.Mode != ModeOrdered {
		return
	}
	t.Run("stale lease of a killed default relay", func(t *testing.T) {
		t.Parallel()
		e := setup(t, r, true, schema.WithAllColumns())
		ctx := context.Background()
		evs := e.enqueue(topicA, "s1", "s1")
		// What a default relay killed an hour ago leaves: a keyed row
		// leased, never answered, never renewed (a renewal writes
		// available_at: a lease lasts LockTTL from the later of the two).
		if _, err := e.pool.Exec(ctx, `UPDATE `+e.tbl.Sanitize()+` SET locked_at = now() - interval '1 hour',
  available_at = now() - interval '1 hour', attempts = 1 WHERE event_id = $1`, evs[0].ID); err != nil {
			t.Fatal(err)
		}
		_, err := e.tryStart("test", Options{}, nil)
		if err != nil {
			msg := ""
			if strings.Contains(err.Error(), "a default-mode relay works") {
				msg = " (and it names a default relay that does not run)"
			}
			t.Fatalf("an ordered relay refused by a lease that expired an hour ago%s: %v", msg, err)
		}
		e.waitAcked(within, evs...)
		e.rec.checkOrder(t)
	})
}

// TestRetryAfterBackoffWhileIdle checks: a row whose handler nacks is delivered
// again Backoff after the nack even while the relay is idle, with its poll
// and every periodic tick 10 minutes away and no row committed after it,
// so that nothing but the relay's own wake-up for the retry can deliver
// it; never before Backoff has passed; and, for a keyed row, before its
// key's next row (committed with it). docs/ORDERING.md ("the key waits
// until the next try, Backoff after the nack, when the relay delivers the
// row again even if nothing else wakes it"), docs/WAL.md ("A nack retries
// the row after Backoff while the key's later rows wait"),
// subscriber.Config.Backoff ("the relay delivers a nacked row again that
// long after the nack, also while it sleeps"). The bound on the
// redelivery is generous (a minute, against 10 minutes to the next poll or
// tick), so a slow machine cannot fail the case; one where the relay is
// slow to fall asleep can only miss a relay that waits for its poll.
func TestRetryAfterBackoffWhileIdle(t *testing.T, r Relay) {
	const (
		backoff     = 100 * time.Millisecond
		retryWithin = time.Minute
	)
	const poll = 10 * time.Minute
	e := setup(t, r, true)
	evs := e.enqueue(topicA, "w", "w") // the row that is nacked, and its key's next row
	first, nack := make(chan struct{}), make(chan struct{})
	var (
		mu                sync.Mutex
		attempts          int
		nackedAt, againAt time.Time
		laterFirst        bool // the key's next row was delivered before the retry
	)
	e.start("a", Options{Backoff: backoff, PollInterval: poll}, func(_ context.Context, m *message.Message) error {
		switch m.UUID {
		case evs[0].ID.String():
			mu.Lock()
			attempts++
			n := attempts
			if n > 1 && againAt.IsZero() {
				againAt = time.Now()
			}
			mu.Unlock()
			if n > 1 {
				return nil
			}
			close(first)
			e.block(nack) // until the relay sleeps
			mu.Lock()
			nackedAt = time.Now()
			mu.Unlock()
			return errBroken
		case evs[1].ID.String():
			mu.Lock()
			if againAt.IsZero() {
				laterFirst = true
			}
			mu.Unlock()
		}
		return nil
	})
	select {
	case <-first:
	case <-time.After(within):
		t.Fatalf("row %s not delivered: %s", evs[0], e.rowStates(evs[:1]))
	}
	if r.Asleep != nil {
		// Nack only once the relay sleeps: nothing else wakes it for its
		// PollInterval. A relay that takes its idle lock looks once more
		// before it sleeps; let that pass (this only lets the case see a
		// relay that waits for its poll: with a wake-up at the retry's
		// time, the verdict is the same at any speed).
		asleep := func() bool {
			ok, err := r.Asleep(context.Background(), e.pool, e.tbl)
			if err != nil {
				t.Fatalf("does the %s relay sleep: %v", r.Name, err)
			}
			return ok
		}
		describe := func() string {
			return fmt.Sprintf("the %s relay, with a message in a handler and nothing else to do, never slept", r.Name)
		}
		e.eventually(2*time.Minute, asleep, describe)
		e.wait(500 * time.Millisecond)
		e.eventually(2*time.Minute, asleep, describe)
	}
	close(nack)
	e.eventually(retryWithin, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return !againAt.IsZero()
	}, func() string {
		return fmt.Sprintf("row %s, nacked while the %s relay was idle (nothing committed since, its poll and ticks %s away), was not delivered again (Backoff %s): the relay did not wake up for the retry; %s",
			evs[0], r.Name, poll, backoff, e.rowStates(evs))
	})
	mu.Lock()
	delay := againAt.Sub(nackedAt)
	mu.Unlock()
	t.Logf("row %s delivered again %s after its nack (Backoff %s, PollInterval %s)", evs[0], delay.Round(time.Millisecond), backoff, poll)
	if delay < backoff {
		t.Errorf("row %s delivered again %s after its nack, before its Backoff of %s", evs[0], delay, backoff)
	}
	e.waitAcked(within, evs...)
	if !r.keyed() {
		return
	}
	mu.Lock()
	early := laterFirst
	mu.Unlock()
	if early {
		t.Errorf("row %s of key %s delivered before the retry of the nacked row %s", evs[1], evs[1].Key, evs[0])
	}
	e.rec.checkOrder(t)
}

// pauseLog is a relay logger that closes ch when the relay logs that it
// read the pause of topic.
type pauseLog struct {
	watermill.NopLogger
	topic string
	once  sync.Once
	ch    chan struct{}
}

func (l *pauseLog) Info(msg string, fields watermill.LogFields) {
	if strings.HasPrefix(msg, "Topic paused") && fields["paused_topic"] == l.topic {
		l.once.Do(func() { close(l.ch) })
	}
}

func (l *pauseLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }
