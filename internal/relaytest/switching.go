package relaytest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The one switch (schema.SwitchMode) for every pair of modes.

// allModes are the relay modes a table can be switched between.
var allModes = []schema.Mode{schema.ModeDefault, schema.ModeOrdered, schema.ModeWAL}

// TestSwitchEveryPair checks the one mode switch for each ordered pair of
// modes: a table relayed in the first mode holds delivered, dead, skipped
// and held rows (a key held by a dead row in the keyed modes); the switch
// is refused while the key is held (schema.ErrKeysHeld), nothing changed;
// once the operator skips the held row, the switch goes through and every
// row reads, through the runbook, as it did before it (delivered,
// skipped, dead), and in its own columns: the rows the old mode delivered
// are published, the dead ones dead and not published, the skipped ones
// skipped. The relay of the new mode then delivers the new rows and none of
// the old ones again.
//
// docs/OPERATIONS.md, "Switching modes": "one command for every pair";
// "the rows the old mode delivered are marked published, its dead rows stay
// dead and are never marked published, its skipped rows stay skipped".
func TestSwitchEveryPair(t *testing.T, r Relay) {
	if r.Mode != ModeWAL {
		t.Skipf("the switch between every pair of modes needs the WAL relay (wal_level=logical, not the shared server's): the wal run of this case switches every pair")
	}
	for _, from := range allModes {
		for _, to := range allModes {
			if from == to {
				continue
			}
			t.Run(fmt.Sprintf("%s to %s", from, to), func(t *testing.T) {
				t.Parallel()
				switchPair(t, r, from, to)
			})
		}
	}
}

// keyedMode reports whether m holds a key behind its failing row.
func keyedMode(m schema.Mode) bool { return m != schema.ModeDefault }

// switchTo records mode m on e's table by the documented path: Setup for
// the WAL relay, Migrate's WithMode for the others. A refusal because the
// old relay's session has not ended yet on the server is tried again.
func (e *env) switchTo(m schema.Mode) error {
	op := func() error {
		if m == schema.ModeWAL {
			return e.r.SetUp(context.Background(), e.pool, e.tbl)
		}
		return schema.Migrate(context.Background(), e.pool, e.tbl, schema.WithAllColumns(), schema.WithMode(m))
	}
	return retry(within, op, func(err error) bool { return errors.Is(err, schema.ErrRelayModeMix) })
}

// startIn starts a relay of mode m on e's table (the WAL relay is the relay
// under test), once relays of another mode are gone.
func (e *env) startIn(m schema.Mode, name string, o Options, h handler) *relay {
	e.t.Helper()
	var rl *relay
	err := retry(within, func() error {
		var sub message.Subscriber
		var err error
		switch m {
		case schema.ModeDefault:
			sub, err = e.newDefault(false, o)
		case schema.ModeOrdered:
			sub, err = e.newOrdered(o)
		default:
			sub, err = e.r.New(context.Background(), e.pool, e.tbl, o.withDefaults())
		}
		if err == nil {
			rl, err = e.consume(name, sub, h)
		}
		return err
	}, func(err error) bool { return errors.Is(err, schema.ErrRelayModeMix) })
	if err != nil {
		e.t.Fatalf("start a relay of %s mode: %v", m, err)
	}
	return rl
}

// deadUnderDefault enqueues one row with ordering key key on e's new table
// and has a default relay (MaxAttempts 1) fail it for good: the row is
// dead, left by a relay that holds no key.
func (e *env) deadUnderDefault(key string) []event {
	e.t.Helper()
	x := e.enqueue(topicA, key)
	first := e.startIn(schema.ModeDefault, "first", Options{MaxAttempts: 1}, permanentFor(newFailing(x...)))
	e.eventually(within, func() bool { return e.row(x[0].ID).Dead() }, func() string { return "not dead: " + e.rowStates(x) })
	if err := first.Close(); err != nil {
		e.t.Fatalf("close the first default relay: %v", err)
	}
	return x
}

// restState is how the runbook reads a row at rest.
func restState(s rowState) string {
	switch {
	case !s.Found:
		return "gone"
	case s.Skipped:
		return "skipped"
	case s.Delivered:
		return "delivered"
	case s.Dead():
		return "dead"
	}
	return "pending"
}

func switchPair(t *testing.T, r Relay, from, to schema.Mode) {
	e := setup(t, r, false, schema.WithAllColumns())
	ctx := context.Background()
	// A keyed row that went dead under the default relay (docs/ORDERING.md
	// says dead rows stay dead across a switch): its key's next row is
	// delivered by the keyed mode, so the dead row ends below its
	// partition's floor.
	x := e.deadUnderDefault("x")
	if from != schema.ModeDefault {
		if err := e.switchTo(from); err != nil {
			t.Fatalf("switch the new table to %s mode: %v", from, err)
		}
	}
	x = append(x, e.enqueue(topicA, "x")...)
	delivered := e.enqueue(topicA, "a", "", "a")
	d := e.enqueue(topicA, "d", "d") // d[0] dies and holds d in the keyed modes
	s := e.enqueue(topicA, "s", "s") // s[0] dies and is skipped in the keyed modes
	ud := e.enqueue(topicA, "")      // an unkeyed row that dies
	bad := newFailing(d[0], s[0], ud[0])
	old := e.startIn(from, "old", Options{MaxAttempts: 1}, permanentFor(bad))
	e.waitAcked(within, append(delivered, x[1])...)
	e.eventually(within, func() bool {
		for _, ev := range append(delivered, x[1]) {
			if !e.row(ev.ID).Delivered {
				return false
			}
		}
		return e.row(d[0].ID).Dead() && e.row(s[0].ID).Dead() && e.row(ud[0].ID).Dead()
	}, func() string { return "rows not dead: " + e.rowStates([]event{d[0], s[0], ud[0]}) })
	rb := runbook.New(e.pool, e.tbl)
	if keyedMode(from) {
		e.waitHold(within, s[0], runbook.HoldDead)
		e.waitHold(within, d[0], runbook.HoldDead)
		if _, err := rb.SkipEvent(ctx, s[0].ID, false); err != nil {
			t.Fatalf("skip %s: %v", s[0], err)
		}
		e.waitAcked(within, s[1])
		e.eventually(within, func() bool { return e.row(s[0].ID).Skipped && e.row(s[1].ID).Delivered },
			func() string { return "skip not applied: " + e.rowStates(s) })
		e.wait(quietSpell)
		e.notDeliveredBeyond(0, "its key is held by a dead row", d[1])
	} else {
		e.waitAcked(within, d[1], s[1])
		e.eventually(within, func() bool { return e.row(d[1].ID).Delivered && e.row(s[1].ID).Delivered },
			func() string { return "acked rows not read delivered: " + e.rowStates([]event{d[1], s[1]}) })
	}
	if err := old.Close(); err != nil {
		t.Fatalf("close the %s relay: %v", from, err)
	}
	if keyedMode(from) {
		err := e.switchTo(to)
		if !errors.Is(err, schema.ErrKeysHeld) {
			t.Fatalf("switch from %s to %s with key d held by a dead row: %v, want schema.ErrKeysHeld", from, to, err)
		}
		if to != schema.ModeWAL {
			// A relay of the new mode starting is the same switch (the WAL
			// relay's start needs Setup, refused above).
			var sub message.Subscriber
			if to == schema.ModeDefault {
				sub, err = e.newDefault(false, Options{})
			} else {
				sub, err = e.newOrdered(Options{})
			}
			if err == nil {
				var rl *relay
				if rl, err = e.consume("refused", sub, nil); err == nil {
					_ = rl.Close()
				}
			}
			if !errors.Is(err, schema.ErrKeysHeld) {
				t.Fatalf("a %s relay started on the %s table with key d held by a dead row: %v, want schema.ErrKeysHeld", to, from, err)
			}
		}
		if rec, ok, _ := schema.RecordedMode(ctx, e.pool, e.tbl); !ok || rec.Mode != from {
			t.Fatalf("after the refused switch the recorded mode is %q (recorded %t), want %s", rec.Mode, ok, from)
		}
		e.notDeliveredBeyond(1, "the switch was refused", d[0])
		e.notDeliveredBeyond(0, "the switch was refused", d[1])
		// Resolve the hold as the refusal says: skip the held row with the
		// old mode's relay running.
		old = e.startIn(from, "old2", Options{MaxAttempts: 1}, permanentFor(bad))
		if _, err := rb.SkipEvent(ctx, d[0].ID, false); err != nil {
			t.Fatalf("skip %s: %v", d[0], err)
		}
		e.waitAcked(within, d[1])
		e.eventually(within, func() bool {
			_, held := e.holdState(d[0])
			return e.row(d[0].ID).Skipped && !held && e.row(d[1].ID).Delivered
		}, func() string { return "skip not applied: " + e.rowStates(d) })
		if err := old.Close(); err != nil {
			t.Fatalf("close the %s relay: %v", from, err)
		}
	}
	all := append(append(append(append(append([]event{}, delivered...), d...), s...), ud...), x...)
	before := map[event]string{}
	for _, ev := range all {
		before[ev] = restState(e.row(ev.ID))
	}
	deliveries := map[event]int{}
	for _, ev := range all {
		deliveries[ev] = e.rec.delivered(ev)
	}
	if err := e.switchTo(to); err != nil {
		t.Fatalf("switch from %s to %s: %v", from, to, err)
	}
	if rec, ok, err := schema.RecordedMode(ctx, e.pool, e.tbl); err != nil || !ok || rec.Mode != to {
		t.Fatalf("after the switch the recorded mode is %q (recorded %t, %v), want %s", rec.Mode, ok, err, to)
	}
	checkAtRest := func(when string) {
		t.Helper()
		for _, ev := range all {
			st := e.row(ev.ID)
			if got := restState(st); got != before[ev] {
				t.Errorf("%s: row %s reads %s, was %s before the switch from %s to %s: %s", when, ev, got, before[ev], from, to, st)
			}
			switch before[ev] {
			case "delivered":
				if !st.Published {
					t.Errorf("%s: row %s was delivered in %s mode and is not marked published: %s", when, ev, from, st)
				}
			case "dead", "skipped":
				if st.Published {
					t.Errorf("%s: row %s was %s and is marked published: %s", when, ev, before[ev], st)
				}
			}
		}
	}
	checkAtRest("after the switch")
	fresh := e.enqueue(topicA, "a", "", "d", "s", "x")
	e.startIn(to, "new", Options{MaxAttempts: 1}, nil)
	e.waitAcked(within, fresh...)
	e.wait(quietSpell)
	for _, ev := range all {
		if n := e.rec.delivered(ev); n != deliveries[ev] {
			t.Errorf("row %s (%s before the switch) delivered %d more time(s) by the %s relay after the switch from %s", ev, before[ev], n-deliveries[ev], to, from)
		}
	}
	checkAtRest("after the new relay ran")
	// Every row dead before the switch is replayable after it, and its
	// replay is delivered by the new mode's relay (the dead row of the
	// default relay's era in a keyed table included).
	var replayed []event
	for _, ev := range all {
		if before[ev] != "dead" {
			continue
		}
		if _, err := rb.ReplayEvent(ctx, ev.ID, runbook.ReplayOptions{}); err != nil {
			t.Fatalf("replay %s, dead before the switch from %s to %s: %v", ev, from, to, err)
		}
		replayed = append(replayed, ev)
	}
	e.waitAcked(within, replayed...)
	e.eventually(within, func() bool {
		for _, ev := range replayed {
			if !e.row(ev.ID).Delivered {
				return false
			}
		}
		return true
	}, func() string { return "replays not read delivered: " + e.rowStates(replayed) })
	if !t.Failed() {
		t.Logf("%s to %s: %d rows kept their state; 1 refusal while a key was held: %t", from, to, len(all), keyedMode(from))
	}
}

// TestReplayedBelowTheFloor checks that a switch into ordered mode hands
// the ordered relays every keyed row that is pending then, also one below
// its partition's floor: a row that went dead under the default relay, was
// passed by ordered mode (its key's next row delivered, the floor above
// it), then replayed while the table was relayed in another mode and not
// delivered before the switch back. Ordered mode reads only rows above the
// floors, its state reader reads a keyed row at or below the floor as
// delivered, its cleaner deletes it, and the next switch away marks it
// published: the event was lost. docs/ORDERING.md, "Switching modes": the
// relay of the new mode delivers exactly the rows that were pending.
// Through the default mode in every run; through the WAL relay too in its
// run (Setup needs wal_level=logical).
func TestReplayedBelowTheFloor(t *testing.T, r Relay) {
	via := []schema.Mode{schema.ModeDefault}
	if r.Mode == ModeWAL {
		via = append(via, schema.ModeWAL)
	}
	for _, m := range via {
		t.Run("via "+string(m), func(t *testing.T) {
			t.Parallel()
			replayedBelowTheFloor(t, r, m)
		})
	}
}

func replayedBelowTheFloor(t *testing.T, r Relay, via schema.Mode) {
	e := setup(t, r, false, schema.WithAllColumns())
	ctx := context.Background()
	x := e.deadUnderDefault("x")
	if err := e.switchTo(schema.ModeOrdered); err != nil {
		t.Fatalf("switch to ordered mode: %v", err)
	}
	x = append(x, e.enqueue(topicA, "x")...)
	ordered := e.startIn(schema.ModeOrdered, "ordered", Options{}, nil)
	e.waitAcked(within, x[1])
	e.eventually(within, func() bool { return e.row(x[1].ID).Delivered }, func() string { return "not read delivered: " + e.rowStates(x) })
	if err := ordered.Close(); err != nil {
		t.Fatalf("close the ordered relay: %v", err)
	}
	if err := e.switchTo(via); err != nil {
		t.Fatalf("switch to %s mode: %v", via, err)
	}
	rb := runbook.New(e.pool, e.tbl)
	if _, err := rb.ReplayEvent(ctx, x[0].ID, runbook.ReplayOptions{}); err != nil {
		t.Fatalf("replay %s in %s mode: %v", x[0], via, err)
	}
	// No relay of that mode ran: the replayed row is pending at the switch back.
	if err := e.switchTo(schema.ModeOrdered); err != nil {
		t.Fatalf("switch from %s back to ordered mode: %v", via, err)
	}
	if got := restState(e.row(x[0].ID)); got != "pending" {
		t.Fatalf("after the switch back to ordered mode the replayed row %s reads %s, want pending (it was never delivered): %s", x[0], got, e.row(x[0].ID))
	}
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := cl.CleanOnce(ctx); err != nil {
		t.Fatalf("cleaner pass: %v", err)
	}
	if !e.row(x[0].ID).Found {
		t.Fatalf("the cleaner deleted the replayed row %s, pending below its partition's floor, before any delivery", x[0])
	}
	e.startIn(schema.ModeOrdered, "ordered again", Options{}, nil)
	e.waitAcked(within, x[0])
}

// TestReplayQueuedBehindADyingRow checks that an operator's replay of a
// keyed row that went dead under the default relay (it holds no key) is
// delivered when it arrives while a later row of its key is in a handler,
// and that later row then fails for good (holding the key in the keyed
// modes). The replay is of an earlier row: new work, whatever the key's
// later rows do. The WAL relay parked it with the key's queued rows, and
// the hold's drains read only rows after the held one: the event was lost
// (make switch_history; walrelay's TestWALReplayQueuedBehindARowThatDiesIsDelivered).
// Ordered mode refuses that replay while the later row holds the floor
// below it, and the case checks the refusal changes nothing.
func TestReplayQueuedBehindADyingRow(t *testing.T, r Relay) {
	e := setup(t, r, false, schema.WithAllColumns())
	ctx := context.Background()
	x := e.deadUnderDefault("k")
	before := e.rec.delivered(x[0]) // the default relay's failed attempt
	e.setUp()
	y := e.enqueue(topicA, "k")
	inHandler, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	sub, err := e.newRelay(Options{MaxAttempts: 1})
	if err != nil {
		t.Fatalf("the %s relay: %v", r.Name, err)
	}
	if _, err := e.consume("relay", sub, func(_ context.Context, m *message.Message) error {
		if m.UUID != y[0].ID.String() {
			return nil
		}
		once.Do(func() { close(inHandler) })
		<-release
		return subscriber.Permanent(errBroken)
	}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inHandler:
	case <-time.After(within):
		t.Fatalf("the later row %s was not delivered", y[0])
	}
	rb := runbook.New(e.pool, e.tbl)
	_, err = rb.ReplayEvent(ctx, x[0].ID, runbook.ReplayOptions{})
	switch {
	case err == nil:
		e.wait(quietSpell) // the relay reads the replay while the later row is in its handler
	case r.Mode == ModeOrdered && errors.Is(err, runbook.ErrNotRelayedYet):
		// Ordered mode's rule (docs/OPERATIONS.md): a keyed row above its
		// partition's floor is refused, nothing changed, until the floor
		// passes it, which the later row in the handler holds back. No
		// replay can be queued behind it: the row stays dead, undelivered.
		close(release)
		e.eventually(within, func() bool { return e.row(y[0].ID).Dead() }, func() string { return "the later row is not dead: " + e.rowStates(y) })
		e.notDeliveredBeyond(before, "its replay was refused", x[0])
		if !e.row(x[0].ID).Dead() {
			t.Fatalf("the refused replay changed %s: %s", x[0], e.rowStates(x))
		}
		return
	default:
		close(release)
		t.Fatalf("replay %s: %v", x[0], err)
	}
	close(release)
	e.eventually(within, func() bool { return e.row(y[0].ID).Dead() }, func() string { return "the later row is not dead: " + e.rowStates(y) })
	e.waitAcked(within, x[0])
}
