package relaytest

// Crossings, second round: a switch between the keyed modes beside a held
// key; a handler that overruns beside an operator's skip; Close while a
// hold drains; bulk replays (with a preview's snapshot) racing the relay's
// own dead-marking; MaxAttempts lowered between two runs; several table
// relays beside a paused topic and retries; the cleaner racing a skip.
// Each case quotes the sentences of the docs it holds the relays to, and
// skips, with the reason, a relay that does not make the promise.

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

// ---- helpers of the second round ----

// counter counts deliveries per (relay, event) and the copies of each event
// in handlers at once.
type counter struct {
	mu      sync.Mutex
	by      map[[2]string]int // (relay, event_id) -> deliveries
	inHand  map[string]int    // event_id -> copies in handlers now
	doubled []string          // an event in two handlers at once
}

func newCounter() *counter {
	return &counter{by: map[[2]string]int{}, inHand: map[string]int{}}
}

// wrap counts h's deliveries as relay's.
func (c *counter) wrap(relay string, h handler) handler {
	return func(ctx context.Context, m *message.Message) error {
		c.mu.Lock()
		c.by[[2]string{relay, m.UUID}]++
		c.inHand[m.UUID]++
		if c.inHand[m.UUID] > 1 {
			c.doubled = append(c.doubled, fmt.Sprintf("event %s (key %q): %d copies in handlers at once (relay %s took the last)",
				m.UUID, m.Metadata.Get(schema.MetadataOrderingKey), c.inHand[m.UUID], relay))
		}
		c.mu.Unlock()
		defer func() {
			c.mu.Lock()
			c.inHand[m.UUID]--
			c.mu.Unlock()
		}()
		if h == nil {
			return nil
		}
		return h(ctx, m)
	}
}

func (c *counter) of(relay string, ev event) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.by[[2]string{relay, ev.ID.String()}]
}

// firstFails fails the first delivery of each event of topic (permanently
// when permanent) and acks every later one; other topics are acked.
type firstFails struct {
	mu        sync.Mutex
	topic     string
	permanent bool
	seen      map[string]int
}

func (f *firstFails) handle(_ context.Context, m *message.Message) error {
	if m.Metadata.Get(schema.MetadataTopic) != f.topic {
		return nil
	}
	f.mu.Lock()
	f.seen[m.UUID]++
	n := f.seen[m.UUID]
	f.mu.Unlock()
	if n > 1 {
		return nil
	}
	if f.permanent {
		return subscriber.Permanent(errBroken)
	}
	return errBroken
}

// overlapsOfRelays returns the recorder's keys with two copies in one
// relay's handlers at once.
func (e *env) overlapsInRelays() []string {
	e.rec.mu.Lock()
	defer e.rec.mu.Unlock()
	return append([]string(nil), e.rec.overlapsOf...)
}

// holdsOf describes the holds of key, resolved ones included.
func (e *env) holdsOf(key string) string {
	hs, err := runbook.New(e.pool, e.tbl).ListHolds(context.Background(), runbook.HoldsFilter{Resolved: true})
	if err != nil {
		return "(list holds: " + err.Error() + ")"
	}
	out := ""
	for _, h := range hs {
		if h.Key == key {
			out += fmt.Sprintf("%+v ", h)
		}
	}
	if out == "" {
		return "none"
	}
	return out
}

func reportAll(t *testing.T, what string, list []string) {
	t.Helper()
	for i, o := range list {
		if i == 3 {
			t.Errorf("... and %d more", len(list)-3)
			break
		}
		t.Errorf("%s: %s", what, o)
	}
}

// ---- the cases ----

// TestSwitchKeyedModesWithHeldKey checks: key k is held by a dead row k1 with two
// rows parked behind it when the table is switched between the two keyed
// modes, both ways (ordered mode to the WAL relay, and the WAL relay to
// ordered mode). The relay of the new mode keeps the dead row dead and
// the key held (its later rows, parked and new, are not delivered) or the
// switch is refused with an error; after the operator skips k1 in the new
// mode, k's rows are delivered in order and k1 never.
//
// README, "Guarantees": "Dead rows are never retried on their own: they
// are kept until an operator replays them [...], skips them (ordered and
// WAL modes: the row a held key waits for)"; "Which relay?": "a failing or
// dead row holds back its own key only". docs/ORDERING.md, "The promises":
// "Order. A row is first delivered only after every lower-sequence row of
// its key was acked or skipped"; "Dead rows wait for an operator. A dead
// row keeps its key held until it is replayed [...] or skipped".
// docs/WAL.md, "Failures hold only their key": "The key's later rows are
// parked"; "Holds survive a relay restart". README: "switching a table
// between them is in docs/ORDERING.md#switching-modes"; docs/WAL.md: Setup
// and New "record wal as the table's mode".
func TestSwitchKeyedModesWithHeldKey(t *testing.T, r Relay) {
	if r.Mode != ModeWAL {
		t.Skipf("the switch between the keyed modes needs the WAL relay (wal_level=logical, not the shared server's): the wal run of this case switches both ways, with an ordered relay as the other mode")
	}
	for _, dir := range []string{"ordered to wal", "wal to ordered"} {
		t.Run(dir, func(t *testing.T) {
			t.Parallel()
			toWAL := dir == "ordered to wal"
			e := setup(t, r, !toWAL, schema.WithAllColumns())
			ctx := context.Background()
			done := e.enqueue(topicA, "a", "b")
			k := e.enqueue(topicA, "k", "k", "k")
			bad := newFailing(k[0])
			// startOrdered starts an ordered relay once relays of the other
			// mode are gone (it fails the case on any other refusal).
			startOrdered := func(name string, h handler) *relay {
				deadline := time.Now().Add(within)
				for {
					sub, err := e.newOrdered(Options{MaxAttempts: 1})
					var rl *relay
					if err == nil {
						rl, err = e.consume(name, sub, h)
					}
					if err == nil {
						return rl
					}
					if !errors.Is(err, schema.ErrRelayModeMix) || time.Now().After(deadline) {
						t.Fatalf("start the ordered relay %s: %v", name, err)
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			// startOld starts a relay of the mode the table is switched from.
			startOld := func(name string) *relay {
				if toWAL {
					return startOrdered(name, permanentFor(bad))
				}
				return e.startOnceOtherModeGone(name, Options{MaxAttempts: 1}, permanentFor(bad), within)
			}
			old := startOld("old")
			e.waitAcked(within, done...)
			e.waitDead(k[0])
			e.eventually(within, func() bool { return e.row(done[0].ID).Delivered && e.row(done[1].ID).Delivered },
				func() string { return "acked rows not recorded delivered: " + e.rowStates(done) })
			e.wait(quietSpell)
			e.notDeliveredBeyond(0, "its key is held by a dead row (before the switch)", k[1:]...)
			if err := old.Close(); err != nil {
				t.Fatalf("close the old relay: %v", err)
			}
			before := e.rec.deliveriesBy("old")
			refused := func(what string, err error) {
				if err.Error() == "" {
					t.Errorf("%s refused with an empty error", what)
				}
				t.Logf("%s refused with key k held by a dead row: %v", what, err)
				if s := e.row(k[0].ID); !s.Found || !s.Dead() {
					t.Errorf("after the refused switch the dead row %s is %s, want dead", k[0], s)
				}
				e.notDeliveredBeyond(1, "the switch was refused", k[0])
				e.notDeliveredBeyond(0, "the switch was refused", k[1:]...)
				if !errors.Is(err, schema.ErrKeysHeld) {
					t.Errorf("%s refused with %v, want schema.ErrKeysHeld", what, err)
				}
				// What the refusal says to do: resolve the hold with the old
				// mode's relay running (a skip), then switch.
				again := startOld("old2")
				if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, k[0].ID, false); err != nil {
					t.Fatalf("skip the dead held row %s with the old mode's relay running: %v", k[0], err)
				}
				e.waitAcked(within, k[1:]...)
				e.ackedInOrder("k", k[1:]...)
				e.eventually(within, func() bool {
					held, err := runbook.New(e.pool, e.tbl).HeldKeys(ctx, 10)
					return err == nil && len(held) == 0
				}, func() string { return "key k still held after the skip: " + e.rowStates(k) })
				if err := again.Close(); err != nil {
					t.Fatalf("close the old mode's relay: %v", err)
				}
				if toWAL {
					if err := r.SetUp(ctx, e.pool, e.tbl); err != nil {
						t.Fatalf("walrelay.Setup once no key is held: %v", err)
					}
					e.startOnceOtherModeGone("new", Options{MaxAttempts: 1}, nil, within)
				} else {
					startOrdered("new", nil)
				}
				more := e.enqueue(topicA, "k", "k")
				e.waitAcked(within, more...)
				e.ackedInOrder("k", append(append([]event(nil), k[1:]...), more...)...)
				if e.rec.acked(k[0]) {
					t.Errorf("the skipped row %s was delivered after the switch", k[0])
				}
				e.wait(quietSpell)
				// walrelay.Setup marks published what ordered mode is done
				// with (docs/ORDERING.md, "Switching modes"); the way from the
				// WAL relay delivers its settled keyed rows again (documented).
				for _, ev := range done {
					if n := e.rec.delivered(ev); n > 1 && toWAL {
						t.Errorf("row %s, delivered by ordered mode before the switch, was delivered again by the WAL relay (%d deliveries)", ev, n)
					} else if n > 1 {
						t.Logf("row %s, delivered before the switch (%s), was delivered again after it (%d deliveries)", ev, dir, n)
					}
				}
			}
			if toWAL {
				if err := r.SetUp(ctx, e.pool, e.tbl); err != nil {
					refused("walrelay.Setup", err)
					return
				}
				if _, err := e.startOnceOtherModeGoneTry("new", Options{MaxAttempts: 1}, permanentFor(bad), within); err != nil {
					refused("the start of the WAL relay", err)
					return
				}
			} else {
				deadline := time.Now().Add(within)
				for {
					sub, err := e.newOrdered(Options{MaxAttempts: 1})
					if err == nil {
						_, err = e.consume("new", sub, permanentFor(bad))
					}
					if err == nil {
						break
					}
					if !errors.Is(err, schema.ErrRelayModeMix) || time.Now().After(deadline) {
						refused("the start of the ordered relay", err)
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
			more := e.enqueue(topicA, "k")
			fresh := e.enqueue(topicA, "n1", "")
			e.waitAcked(within, fresh...)
			e.wait(quietSpell)
			if n := e.rec.deliveriesBy("old"); n != before {
				t.Errorf("the closed relay delivered %d more messages", n-before)
			}
			for _, ev := range done {
				if n := e.rec.delivered(ev); n > 1 {
					t.Logf("row %s, delivered before the switch, was delivered again after it (%d deliveries)", ev, n)
				}
			}
			parked := append(append([]event(nil), k[1:]...), more...)
			if s := e.row(k[0].ID); !s.Found || !s.Dead() {
				t.Errorf("the dead row %s is %s after the switch (%s), want dead: a switch revived it", k[0], s, dir)
			}
			e.notDeliveredBeyond(1, "it is dead: the switch ("+dir+") delivered it again", k[0])
			e.notDeliveredBeyond(0, "its key is held by the dead row "+k[0].String()+": the relay after the switch ("+dir+") did not honour the hold", parked...)
			if t.Failed() {
				return
			}
			if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, k[0].ID, false); err != nil {
				t.Fatalf("skip the dead held row %s after the switch (%s): %v; %s", k[0], dir, err, e.rowStates(k))
			}
			bad.fix(k[0])
			e.waitAcked(within, parked...)
			e.wait(quietSpell)
			if e.rec.acked(k[0]) {
				t.Errorf("the skipped row %s was delivered after the switch", k[0])
			}
			e.ackedInOrder("k", parked...)
			e.rec.checkOrder(t)
		})
	}
}

// TestOverrunWhileSkipped checks: key k is held by a dead row k1 with rows parked
// behind it; the operator replays k1, and its handler keeps the redelivery
// past its context (past DispatchTimeout, where the relay has it) and then
// nacks it. While it hangs the operator skips k1. The skip is final: k1 is
// not delivered again after that copy; k's later rows are delivered in
// order; and (WAL) not while k1's copy is still in the handler.
//
// docs/ORDERING.md, "The promises": "A skip is final. A skipped row is not
// delivered again, also after a handover, and a skip asked while a retry is
// in flight is honoured when that retry fails"; "A handler that has not
// answered DispatchTimeout plus LockTTL/2 after delivery counts as a failed
// attempt in the same way (handler overran)". docs/WAL.md, "Dispatch
// timeout": "the relay hands the key's next message out only after the
// verdict (one copy per key), so a handler that ignores its context keeps
// its key until it answers"; docs/OPERATIONS.md, "Hold states": a skip of
// a replay "does not recall a copy already in a handler".
func TestOverrunWhileSkipped(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: there is nothing to skip (runbook's SkipEvent refuses with ErrNotHeld), and a leased row cannot be replayed (ErrLocked)", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	const hang = 5 * time.Second // past DispatchTimeout (1 s) + LockTTL/2 of the ordered relay
	k := e.enqueue(topicA, "k", "k", "k")
	inHand := make(chan struct{})
	var (
		mu       sync.Mutex
		n1       int
		skipped  bool
		afterSkp int // deliveries of k1 that began after the skip was accepted
	)
	h := func(ctx context.Context, m *message.Message) error {
		if m.UUID != k[0].ID.String() {
			return nil
		}
		mu.Lock()
		n1++
		n := n1
		if skipped {
			afterSkp++
		}
		mu.Unlock()
		switch n {
		case 1:
			return subscriber.Permanent(errBroken)
		case 2:
			close(inHand)
			e.wait(hang) // ignores its context
			return errBroken
		}
		return errBroken
	}
	e.start("a", Options{MaxAttempts: 1000, DispatchTimeout: time.Second, CloseTimeout: 10 * time.Second}, h)
	e.waitDead(k[0])
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", k[1:]...)
	if err := e.replayRetrying(k[0]); err != nil {
		t.Fatalf("replay the dead held row %s: %v", k[0], err)
	}
	select {
	case <-inHand:
	case <-time.After(within):
		t.Fatalf("the replayed row %s was not delivered: %s", k[0], e.rowStates(k[:1]))
	}
	st, held := e.holdState(k[0])
	err := retry(within, func() error {
		_, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, k[0].ID, false)
		return err
	}, func(err error) bool { return errors.Is(err, runbook.ErrHoldRefused) })
	if err != nil {
		t.Fatalf("skip %s while its replay is in the handler (hold held=%t state=%s): %v", k[0], held, st, err)
	}
	mu.Lock()
	skipped = true
	mu.Unlock()
	t.Logf("skip of %s accepted; its hold was %s when the copy was in the handler", k[0], st)
	more := e.enqueue(topicA, "k")
	rest := append(append([]event(nil), k[1:]...), more...)
	e.eventually(within, func() bool { return len(e.rec.notAcked(rest)) == 0 }, func() string {
		missing := e.rec.notAcked(rest)
		return fmt.Sprintf("%d of %d rows of k behind the skipped row never acked, first %s; %s; holds of k: %s; deliveries of k: %s",
			len(missing), len(rest), missing[0], e.rowStates(append(k[:1:1], missing[0])), e.holdsOf("k"), e.traceOf(k[0]))
	})
	e.wait(quietSpell)
	mu.Lock()
	after := afterSkp
	mu.Unlock()
	if after > 0 {
		t.Errorf("the skipped row %s was delivered %d more times after the skip (the skip is final); deliveries of k: %s", k[0], after, e.traceOf(k[0]))
	}
	if e.rec.acked(k[0]) {
		t.Errorf("the skipped row %s was acked", k[0])
	}
	e.ackedInOrder("k", rest...)
	e.rec.checkOrder(t)
	if over := e.overlapsInRelays(); len(over) > 0 {
		if r.Mode == ModeWAL {
			reportAll(t, "a handler that ignores its context keeps its key until it answers", over)
		} else {
			t.Logf("ordered: key k in two handlers once the overrun counted the attempt failed (allowed): %v", over[0])
		}
	}
}

// TestCloseWhileHoldsDrain checks: key d is held by a dead row that the operator
// skips, key p by a dead row that the operator replays; each has rows
// parked behind it. While each key's fourth row is in a handler (the hold
// drains, or has moved on) relay a is closed, with more rows of both keys
// committed; relay b starts. Every parked row is delivered, first
// deliveries and first acks in order per key, the replayed row acked
// before its key's next rows, the skipped row never.
//
// docs/WAL.md, "Replay"/"Skip": "Holds survive a relay restart: the next
// relay reads the holds table and parks the key's rows again; a hold that
// was draining drains again from the start"; docs/ORDERING.md, "The
// promises": "A skip is final [...] also after a handover"; "Dead rows wait
// for an operator. A dead row keeps its key held until it is replayed
// (delivered first, then the rest of the key) or skipped"; "Nothing
// committed is lost".
func TestCloseWhileHoldsDrain(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: no hold drains", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	keys := func(k string, n int) []string {
		out := make([]string, n)
		for i := range out {
			out[i] = k
		}
		return out
	}
	d := e.enqueue(topicA, keys("d", 8)...)
	p := e.enqueue(topicA, keys("p", 8)...)
	bad := newFailing(d[0], p[0])
	var mu sync.Mutex
	blocked := map[string]bool{}
	inHand := make(chan string, 4)
	h := func(ctx context.Context, m *message.Message) error {
		if m.UUID == d[3].ID.String() || m.UUID == p[3].ID.String() {
			mu.Lock()
			first := !blocked[m.UUID]
			blocked[m.UUID] = true
			mu.Unlock()
			if first {
				inHand <- m.UUID
				select { // until Close ends its context
				case <-ctx.Done():
				case <-e.stop:
				}
				return errBroken
			}
		}
		return permanentFor(bad)(ctx, m)
	}
	a := e.start("a", Options{MaxAttempts: 1, CloseTimeout: 2 * time.Second}, h)
	e.waitDead(d[0], p[0])
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its key is held by a dead row", append(append([]event(nil), d[1:]...), p[1:]...)...)
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, d[0].ID, false); err != nil {
		t.Fatalf("skip the dead held row %s: %v", d[0], err)
	}
	bad.fix(p[0])
	if err := e.replayRetrying(p[0]); err != nil {
		t.Fatalf("replay the dead held row %s: %v", p[0], err)
	}
	bad.fix(d[0]) // a redelivery would now be acked, and seen
	for range 2 {
		select {
		case <-inHand:
		case <-time.After(within):
			t.Fatalf("the fourth rows of d and p were not both delivered: %s %s", e.rowStates(d[:4]), e.rowStates(p[:4]))
		}
	}
	moreD, moreP := e.enqueue(topicA, "d", "d"), e.enqueue(topicA, "p", "p")
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a while the holds drain: %v", err)
	}
	e.start("b", Options{MaxAttempts: 1}, permanentFor(bad))
	restD := append(append([]event(nil), d[1:]...), moreD...)
	restP := append(append([]event(nil), p...), moreP...)
	e.waitAcked(within, append(append([]event(nil), restD...), restP...)...)
	e.wait(quietSpell)
	if e.rec.acked(d[0]) {
		t.Errorf("the skipped row %s was delivered after the restart: %s", d[0], e.traceOf(d[0]))
	}
	e.ackedInOrder("d", restD...)
	e.ackedInOrder("p", restP...)
	e.rec.checkOrder(t)
	reportAll(t, "one copy per key within a relay", e.overlapsInRelays())
}

// TestBulkReplayWithPreview checks: a bulk replay given its preview's snapshot
// changes exactly the previewed rows or nothing. Rows of a failing topic
// go dead (their first delivery fails for good; a replay is acked). (1) A
// previewed row replayed by itself meanwhile makes the bulk replay refuse
// (runbook.ErrReplaySetChanged), changing nothing; (2) a row that went dead
// after the preview (a higher sequence) is left alone by a replay that
// changes exactly the previewed rows; (3) then, while a producer keeps
// committing rows that go dead, an operator previews and replays with the
// snapshot in a loop: each replay changes exactly its preview's count or
// refuses. Every row is delivered in the end, first deliveries and first
// acks in order per key.
//
// docs/OPERATIONS.md, "Replaying safely": "A bulk replay changes exactly
// the rows its preview counted or nothing: the statement locks the
// matching rows up to the preview's last sequence (rows that went dead
// later are left for the next replay) and resets them only if their count
// and digest are the preview's; otherwise it refuses with "the dead rows
// changed since the preview" and nothing changes"; docs/RELIABILITY.md: "a
// previewed row replayed meanwhile, or an older row gone dead, makes it
// refuse"; docs/ORDERING.md: a replay "clears its dead_at and attempts:
// the relay delivers it first, then the rest of its key".
func TestBulkReplayWithPreview(t *testing.T, r Relay) {
	e := setup(t, r, true)
	ctx := context.Background()
	const topicFail = "org.relaytest.crossing.fail.v1"
	ff := &firstFails{topic: topicFail, permanent: true, seen: map[string]int{}}
	e.start("a", Options{MaxAttempts: 1}, ff.handle)
	rb := runbook.New(e.pool, e.tbl)
	all := runbook.DeadFilter{AllTopics: true}
	// (1) a previewed row changes before the replay.
	first := e.enqueue(topicFail, "k1", "k2", "")
	e.waitDead(first...)
	prev, err := rb.ReplayDead(ctx, all, true)
	if err != nil {
		t.Fatalf("preview: %v", err)
	}
	if prev.Rows != int64(len(first)) {
		t.Fatalf("preview counts %d rows, want %d: %s", prev.Rows, len(first), e.rowStates(first))
	}
	if err := e.replayRetrying(first[0]); err != nil {
		t.Fatalf("replay %s alone: %v", first[0], err)
	}
	f := all
	f.Expect = &prev.Snapshot
	rep, err := rb.ReplayDead(ctx, f, false)
	if !errors.Is(err, runbook.ErrReplaySetChanged) {
		t.Errorf("bulk replay with a preview one of whose rows was replayed meanwhile: %+v, %v; want runbook.ErrReplaySetChanged", rep.Rows, err)
	}
	e.waitAcked(within, first[0])
	for _, ev := range first[1:] {
		if s := e.row(ev.ID); !s.Dead() {
			t.Errorf("after the refused bulk replay row %s is %s, want dead as it was", ev, s)
		}
	}
	// (2) a row goes dead after the preview.
	prev, err = rb.ReplayDead(ctx, all, true)
	if err != nil {
		t.Fatalf("preview: %v", err)
	}
	later := e.enqueue(topicFail, "k3")
	e.waitDead(later...)
	f.Expect = &prev.Snapshot
	rep, err = rb.ReplayDead(ctx, f, false)
	if err != nil {
		t.Errorf("bulk replay of the previewed rows, a row gone dead since with a higher sequence: %v", err)
	} else if rep.Rows != prev.Rows {
		t.Errorf("bulk replay changed %d rows, its preview counted %d", rep.Rows, prev.Rows)
	}
	e.waitAcked(within, first...)
	e.wait(quietSpell)
	if s := e.row(later[0].ID); !s.Dead() {
		t.Errorf("row %s, dead after the preview, is %s after the replay of the previewed rows, want dead (left for the next replay)", later[0], s)
	}
	e.notDeliveredBeyond(1, "it went dead after the preview: the replay must leave it alone", later...)
	// (3) previews and replays while rows keep going dead.
	var (
		wg       sync.WaitGroup
		produced []event
		pmu      sync.Mutex
		stop     = make(chan struct{})
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 25 {
			evs := e.enqueue(topicFail, "k"+strconv.Itoa(1+i%4), "k"+strconv.Itoa(1+(i+1)%4), "")
			pmu.Lock()
			produced = append(produced, evs...)
			pmu.Unlock()
			select {
			case <-time.After(40 * time.Millisecond):
			case <-e.stop:
				return
			}
		}
	}()
	var replays, changed, refusedN int
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			case <-e.stop:
				return
			default:
			}
			prev, err := rb.ReplayDead(ctx, all, true)
			if err != nil {
				t.Errorf("preview: %v", err)
				return
			}
			if prev.Rows == 0 {
				time.Sleep(20 * time.Millisecond)
				continue
			}
			f := all
			f.Expect = &prev.Snapshot
			rep, err := rb.ReplayDead(ctx, f, false)
			replays++
			switch {
			case errors.Is(err, runbook.ErrReplaySetChanged):
				refusedN++
			case err != nil:
				t.Errorf("bulk replay with its preview's snapshot: %v", err)
				return
			case rep.Rows != prev.Rows:
				t.Errorf("bulk replay changed %d rows, its preview counted %d (snapshot %+v)", rep.Rows, prev.Rows, prev.Snapshot)
			default:
				changed += int(rep.Rows)
			}
		}
	}()
	want := func() []event {
		pmu.Lock()
		defer pmu.Unlock()
		return append(append([]event(nil), later...), produced...)
	}
	e.eventually(3*within, func() bool {
		pmu.Lock()
		n := len(produced)
		pmu.Unlock()
		return n == 75 && len(e.rec.notAcked(want())) == 0
	}, func() string {
		missing := e.rec.notAcked(want())
		if len(missing) == 0 {
			return "the producer did not finish"
		}
		return fmt.Sprintf("%d rows never acked, first %s: %s", len(missing), missing[0], e.rowStates(missing[:1]))
	})
	close(stop)
	wg.Wait()
	t.Logf("racing replays: %d, rows changed %d, refused (set changed) %d", replays, changed, refusedN)
	if e.keys && r.keyed() {
		byKey := map[string][]event{}
		for _, ev := range append(append([]event(nil), first...), want()...) {
			if ev.Key != "" {
				byKey[ev.Key] = append(byKey[ev.Key], ev)
			}
		}
		for key, evs := range byKey {
			e.ackedInOrder(key, evs...)
		}
	}
	e.rec.checkOrder(t)
}

// TestMaxAttemptsLoweredBetweenRuns checks: a keyed row and an unkeyed row fail
// (transiently) under relay a with MaxAttempts 1000 until each was tried
// three times; a is closed and relay b starts with MaxAttempts 2. b tries
// each row again before it is dead (lowering MaxAttempts does not kill a
// retrying row), at most twice, and then they are dead; the keyed row's
// key waits behind it; after the fix and a replay both are delivered, the
// key's next row after its dead row.
//
// docs/RELIABILITY.md: "Raising MaxAttempts does not revive dead rows;
// lowering it does not kill retrying rows"; README, "Guarantees", and
// subscriber.Config.MaxAttempts: "after how many failed attempts a row is
// dead"; docs/WAL.md, "Limits": "a relay restart resets its attempt
// count"; docs/ORDERING.md: "At MaxAttempts [...] the hold gets dead_at
// and the key stays held".
func TestMaxAttemptsLoweredBetweenRuns(t *testing.T, r Relay) {
	e := setup(t, r, true)
	evs := e.enqueue(topicA, "k", "")
	k1, u := evs[0], evs[1]
	k2 := e.enqueue(topicA, "k")[0]
	bad := newFailing(k1, u)
	transient := func(_ context.Context, m *message.Message) error {
		if bad.has(m.UUID) {
			return errBroken
		}
		return nil
	}
	c := newCounter()
	a := e.start("a", Options{MaxAttempts: 1000, Backoff: 50 * time.Millisecond}, c.wrap("a", transient))
	e.eventually(within, func() bool { return c.of("a", k1) >= 3 && c.of("a", u) >= 3 }, func() string {
		return fmt.Sprintf("relay a tried %s %d times and %s %d times, want 3: %s", k1, c.of("a", k1), u, c.of("a", u), e.rowStates(evs))
	})
	if err := a.Close(); err != nil {
		t.Fatalf("close relay a: %v", err)
	}
	for _, ev := range evs {
		if s := e.row(ev.ID); s.Dead() {
			t.Fatalf("row %s is dead under MaxAttempts 1000 after %d tries: %s", ev, c.of("a", ev), s)
		}
	}
	e.start("b", Options{MaxAttempts: 2, Backoff: 50 * time.Millisecond}, c.wrap("b", transient))
	e.waitDead(evs...)
	for _, ev := range evs {
		if n := c.of("b", ev); n < 1 {
			t.Errorf("row %s, retrying when relay b started with a lower MaxAttempts, went dead without b trying it: lowering MaxAttempts killed a retrying row; %s", ev, e.row(ev.ID))
		} else if n > 2 {
			t.Errorf("relay b (MaxAttempts 2) tried row %s %d times before it was dead", ev, n)
		}
	}
	e.wait(quietSpell)
	if e.heldByKey(k2) {
		e.notDeliveredBeyond(0, "its key is held by the dead row "+k1.String(), k2)
	} else {
		e.waitAcked(within, k2)
	}
	bad.fix(evs...)
	for _, ev := range evs {
		if err := e.replayRetrying(ev); err != nil {
			t.Fatalf("replay %s: %v", ev, err)
		}
	}
	e.waitAcked(within, k1, u, k2)
	if e.heldByKey(k2) {
		e.ackedInOrder("k", k1, k2)
	}
	e.rec.checkOrder(t)
}

// TestSharedRelaysPausedAndRetrying checks: three table relays share a table (the
// default relay with DisableSingleActive; ordered relays share it by
// partition leases) while topic A is paused and rows of topic B fail twice
// before they are acked. No relay delivers a row of A (nor, ordered, the
// row of A's key behind it) before the resume; no row is in two handlers
// at once; every row is delivered, (default) an acked row never again and a
// row nacked twice three times; after the resume, A's rows, and the key
// goes on in order.
//
// docs/OPERATIONS.md, "Pausing a topic": "the relays read the paused topics
// at that wake-up and every PollInterval, and from then on claim no row of
// the topic"; subscriber.Config.DisableSingleActive: "lets several
// subscribers share the table through SKIP LOCKED alone"; README, "Which
// relay?": "at least once, no order (retries reorder)", "or several
// sharing rows with DisableSingleActive"; docs/ORDERING.md, "Scale-out"
// and "Paused topics".
func TestSharedRelaysPausedAndRetrying(t *testing.T, r Relay) {
	e := setup(t, r, true)
	skipIfNoPause(t, e)
	e.pause(topicA, nil) // before the relays start: each reads it before its first claim
	var mu sync.Mutex
	nacks := map[string]int{}
	h := func(_ context.Context, m *message.Message) error {
		if m.Metadata.Get(schema.MetadataTopic) == topicB && hashOf(m.UUID)%3 == 0 {
			mu.Lock()
			defer mu.Unlock()
			if nacks[m.UUID] < 2 {
				nacks[m.UUID]++
				return errBroken
			}
		}
		return nil
	}
	c := newCounter()
	for _, name := range []string{"a", "b", "c"} {
		e.start(name, Options{DisableSingleActive: true}, c.wrap(name, h))
	}
	heldA := e.enqueue(topicA, "p1", "", "")
	behind := e.enqueue(topicB, "p1")
	var flowing []event
	for range 4 {
		flowing = append(flowing, e.enqueue(topicB, "x1", "x2", "x3", "x4", "", "")...)
	}
	e.waitAcked(within, flowing...)
	e.wait(quietSpell)
	e.notDeliveredBeyond(0, "its topic is paused (three relays share the table)", heldA...)
	if e.heldByKey(behind[0]) {
		e.notDeliveredBeyond(0, "its key waits behind a row of a paused topic", behind...)
	}
	e.resume(topicA)
	e.waitAcked(within, append(heldA, behind...)...)
	e.wait(quietSpell)
	c.mu.Lock()
	doubled := append([]string(nil), c.doubled...)
	c.mu.Unlock()
	reportAll(t, "a row in two handlers at once", doubled)
	if r.Mode == ModeDefault {
		for _, ev := range append(append(flowing, heldA...), behind...) {
			want := 1
			mu.Lock()
			if n := nacks[ev.ID.String()]; n > 0 {
				want = n + 1
			}
			mu.Unlock()
			if n := e.rec.delivered(ev); n != want {
				t.Errorf("row %s delivered %d times by the shared default relays, want %d (nacked %d times, then acked once): %s", ev, n, want, want-1, e.traceOf(ev))
			}
		}
	}
	if e.heldByKey(behind[0]) {
		e.ackedInOrder("p1", heldA[0], behind[0])
	}
	e.rec.checkOrder(t)
}

// TestSkipRacingCleaner checks: key d is held by a dead row with twelve rows
// parked behind it, and rows of other keys are done; two cleaners with a
// retention of a nanosecond (dead rows too) run in a loop while the
// operator skips d's dead row and the relay delivers d's parked rows. No
// row of d is deleted before it was delivered: every one is acked, in
// order, and the skipped row is never delivered.
//
// cleaner's cleanKeyed: it deletes "the keyed rows at or below their
// partition's floor [...] that are older than Retention, never a row a held
// key still waits for or any row after it"; docs/OPERATIONS.md: the
// cleaner "deletes keyed rows only when delivered (at or below the floor,
// not held) and never a WAL row parked behind a held key"; docs/ORDERING.md:
// "A skip is final"; "Nothing committed is lost".
func TestSkipRacingCleaner(t *testing.T, r Relay) {
	if !r.keyed() {
		t.Skipf("the %s relay holds no key: there is nothing to skip", r.Name)
	}
	e := setup(t, r, true)
	ctx := context.Background()
	ks := make([]string, 13)
	for i := range ks {
		ks[i] = "d"
	}
	d := e.enqueue(topicA, ks...)
	bad := newFailing(d[0])
	e.start("a", Options{MaxAttempts: 1, MaxInFlight: 2}, func(ctx context.Context, m *message.Message) error {
		e.wait(5 * time.Millisecond) // the drain takes a while: the cleaners run beside it
		return permanentFor(bad)(ctx, m)
	})
	e.waitDead(d[0])
	others := make([]string, 20)
	for i := range others {
		others[i] = "o" + strconv.Itoa(i)
	}
	done := e.enqueue(topicA, others...)
	e.waitAcked(within, done...)
	cl, err := cleaner.New(e.pool, cleaner.Config{Table: e.tbl, Retention: time.Nanosecond, DeadRetention: time.Nanosecond, BatchSize: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var deleted, deadDeleted int64
	var cmu sync.Mutex
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				n, dd, err := cl.CleanOnce(ctx)
				if err != nil {
					t.Errorf("clean: %v", err)
					return
				}
				cmu.Lock()
				deleted, deadDeleted = deleted+n, deadDeleted+dd
				cmu.Unlock()
				select {
				case <-stop:
					return
				case <-e.stop:
					return
				case <-time.After(5 * time.Millisecond):
				}
			}
		}()
	}
	if _, err := runbook.New(e.pool, e.tbl).SkipEvent(ctx, d[0].ID, false); err != nil {
		close(stop)
		wg.Wait()
		t.Fatalf("skip the dead held row %s: %v", d[0], err)
	}
	bad.fix(d[0])
	more := e.enqueue(topicA, "d", "d")
	rest := append(append([]event(nil), d[1:]...), more...)
	deadline := time.Now().Add(within)
	for len(e.rec.notAcked(rest)) > 0 && time.Now().Before(deadline) {
		// a row of d deleted before it was acked is lost
		for _, ev := range e.rec.notAcked(rest) {
			if !e.row(ev.ID).Found && !e.rec.acked(ev) {
				close(stop)
				wg.Wait()
				t.Fatalf("the cleaner deleted row %s of the key d before it was delivered (deliveries of d: %s)", ev, e.traceOf(ev))
			}
		}
		e.wait(20 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	e.waitAcked(within, rest...)
	t.Logf("the cleaners deleted %d done rows and %d dead rows", deleted, deadDeleted)
	e.wait(quietSpell)
	if e.rec.acked(d[0]) {
		t.Errorf("the skipped row %s was delivered", d[0])
	}
	e.ackedInOrder("d", rest...)
	e.rec.checkOrder(t)
}
