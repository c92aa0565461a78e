package relaytest

// Crossings, seventh round (issue 56): the relays' own bounds and timers
// crossing each other: several retries coming due while the relay sleeps.
// Each case quotes the sentences of the docs it holds the relays to, and
// skips, with the reason, a relay that does not make the promise.

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// crossings7 are the cases of the seventh round; Run runs them with the
// others.
var crossings7 = []suiteCase{
	{"EveryRetryWakesAnIdleRelay", TestEveryRetryWakesAnIdleRelay},
	{"MaxInFlightCountsOverrunHandlers", TestMaxInFlightCountsOverrunHandlers},
}

// asleepNow waits until the relay under test sleeps (Relay.Asleep), twice
// with a pause between (a relay that takes its idle lock looks once more
// before it sleeps). A relay without the state returns at once.
func (e *env) asleepNow() {
	e.t.Helper()
	if e.r.Asleep == nil {
		return
	}
	asleep := func() bool {
		ok, err := e.r.Asleep(context.Background(), e.pool, e.tbl)
		if err != nil {
			e.t.Fatalf("does the %s relay sleep: %v", e.r.Name, err)
		}
		return ok
	}
	describe := func() string {
		return fmt.Sprintf("the %s relay, with its messages in handlers and nothing else to do, never slept", e.r.Name)
	}
	e.eventually(2*time.Minute, asleep, describe)
	e.wait(500 * time.Millisecond)
	e.eventually(2*time.Minute, asleep, describe)
}

// TestEveryRetryWakesAnIdleRelay checks: two rows (of two keys) are in
// their handlers while the relay sleeps, its poll and ticks ten minutes
// away. The first is nacked, and a second later the second, both with a
// Backoff of 3 s: each is delivered again once its Backoff ends, not at
// the poll. A relay that wakes only for the earliest retry asked for
// claims the first again and sleeps past the second.
//
// subscriber.Config.PollInterval: "A row this subscriber nacked is claimed
// again when its Backoff ends, without waiting for the poll"; docs/WAL.md
// and docs/ORDERING.md: a nacked row's key waits for its Backoff.
func TestEveryRetryWakesAnIdleRelay(t *testing.T, r Relay) {
	const (
		backoff     = 3 * time.Second
		gap         = time.Second // between the two nacks: more than the claims a ring sets off
		poll        = 10 * time.Minute
		retryWithin = time.Minute
	)
	e := setup(t, r, true)
	evs := e.enqueue(topicA, "x", "y")
	gates := map[string]chan struct{}{evs[0].ID.String(): make(chan struct{}), evs[1].ID.String(): make(chan struct{})}
	var (
		mu      sync.Mutex
		tries   = map[string]int{}
		nacked  = map[string]time.Time{}
		again   = map[string]time.Time{}
		inFirst = make(chan struct{}, 2)
	)
	e.start("a", Options{Backoff: backoff, PollInterval: poll}, func(_ context.Context, m *message.Message) error {
		mu.Lock()
		tries[m.UUID]++
		n := tries[m.UUID]
		if n > 1 && again[m.UUID].IsZero() {
			again[m.UUID] = time.Now()
		}
		mu.Unlock()
		gate, ok := gates[m.UUID]
		if !ok || n > 1 {
			return nil
		}
		inFirst <- struct{}{}
		e.block(gate)
		mu.Lock()
		nacked[m.UUID] = time.Now()
		mu.Unlock()
		return errBroken
	})
	for range 2 {
		select {
		case <-inFirst:
		case <-time.After(within):
			t.Fatalf("rows not both delivered: %s", e.rowStates(evs))
		}
	}
	e.asleepNow()
	close(gates[evs[0].ID.String()])
	e.wait(gap) // the nack is written meanwhile (its handler returned at once)
	close(gates[evs[1].ID.String()])
	e.eventually(retryWithin, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return !again[evs[0].ID.String()].IsZero() && !again[evs[1].ID.String()].IsZero()
	}, func() string {
		mu.Lock()
		defer mu.Unlock()
		return fmt.Sprintf("rows %s and %s, nacked %s apart while the %s relay slept (its poll and ticks %s away, Backoff %s), were not both delivered again: %s was %t, %s was %t; %s",
			evs[0], evs[1], gap, r.Name, poll, backoff, evs[0], !again[evs[0].ID.String()].IsZero(), evs[1], !again[evs[1].ID.String()].IsZero(), e.rowStates(evs))
	})
	mu.Lock()
	for _, ev := range evs {
		id := ev.ID.String()
		d := again[id].Sub(nacked[id])
		t.Logf("row %s delivered again %s after its nack (Backoff %s)", ev, d.Round(time.Millisecond), backoff)
		if d < backoff {
			t.Errorf("row %s delivered again %s after its nack, before its Backoff of %s", ev, d, backoff)
		}
	}
	mu.Unlock()
	e.waitAcked(within, evs...)
}

// TestMaxInFlightCountsOverrunHandlers checks: with MaxInFlight 1 and a
// DispatchTimeout of 300 ms, handlers that ignore their context (as a
// publish to a broker that hangs) keep every message until they are let
// go. The first message overruns: the relay gives up on it (its context
// ends, the attempt counts as failed), but its handler still runs, so the
// relay hands out nothing more until it returns: one message in handlers
// at a time, from the first delivery to the last ack. Then every row is
// delivered and acked.
//
// subscriber.Config.MaxInFlight and walrelay.Config.MaxInFlight: the bound
// counts each message from its delivery until its handler returns (acks
// or nacks it), an overrun one too.
func TestMaxInFlightCountsOverrunHandlers(t *testing.T, r Relay) {
	e := setup(t, r, true)
	gate := make(chan struct{})
	var (
		mu    sync.Mutex
		first context.Context
	)
	e.start("a", Options{MaxInFlight: 1, DispatchTimeout: 300 * time.Millisecond, CloseTimeout: 300 * time.Millisecond}, func(ctx context.Context, _ *message.Message) error {
		mu.Lock()
		if first == nil {
			first = ctx
		}
		mu.Unlock()
		e.block(gate) // ignores its context
		return nil
	})
	keys := make([]string, 4)
	for i := range keys {
		keys[i] = "f" + strconv.Itoa(i)
	}
	evs := e.enqueue(topicA, keys...)
	e.eventually(within, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return first != nil && first.Err() != nil
	}, func() string {
		return "the first message, in a handler that ignores its context, did not overrun: " + e.rowStates(evs)
	})
	e.wait(quietSpell) // room for a second message to be handed out beside the overrun one
	if n := e.rec.maxOpenOf("a"); n > 1 {
		t.Errorf("%d messages in handlers at once after an overrun, MaxInFlight is 1: the overrun message stopped counting while its handler ran", n)
	}
	close(gate)
	e.waitAcked(within, evs...)
	if n := e.rec.maxOpenOf("a"); n > 1 {
		t.Errorf("%d messages in handlers at once, MaxInFlight is 1", n)
	}
}
