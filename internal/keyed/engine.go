package keyed

import "time"

// Key is one ordering key's place in the per-key engine; a relay keeps one
// in each key's state (the WAL relay's key queue, the ordered relay's
// keyState) and passes it to its Engine. The zero value is an idle key that
// is due now.
type Key struct {
	// out: the key holds one of the subscription's slots, because one of
	// its rows is in the relay's hands (handed out, or being read or
	// written for delivery). A key has at most one.
	out bool
	// RetryAt is when the key's head, which failed, is due again; zero or
	// past: now.
	RetryAt time.Time
}

// Out reports whether the key holds a slot (Engine.Start returned Started
// and Engine.Finish has not followed).
func (k *Key) Out() bool { return k.out }

// Start is what Engine.Start did with a key.
type Start uint8

// The answers of Engine.Start.
const (
	// Busy: the key holds a slot already (one row of a key at a time).
	Busy Start = iota + 1
	// Later: the key's head is due at its RetryAt; the engine's Due
	// includes that time.
	Later
	// Waiting: no slot is free; the key waits in line and Ready hands it
	// back, oldest first, once one is.
	Waiting
	// Started: the key took a slot. Deliver its row; Finish gives the
	// slot back.
	Started
)

// Engine is the per-key delivery engine of the keyed relays (ordered mode
// and the WAL relay): it decides, with one rule for both, whether a key
// with work is started now, and keeps the subscription's MaxInFlight
// (Slots, shared with the subscription's other loops), the keys that wait
// for a slot, oldest first (Waiters), and the earliest time a key's head is
// due (Due). It is not safe for concurrent use: its relay calls it from its
// owner (the WAL relay's loop, the ordered relay under its mutex).
//
// What a key's work is stays with the relay: the ordered relay's scan,
// floors and holds, the WAL relay's stream and its drains. The engine sees
// a key only through its Key.
type Engine struct {
	slots   *Slots
	waiters Waiters
	due     time.Time
}

// NewEngine returns an Engine whose keys take their slots from slots.
func NewEngine(slots *Slots) *Engine { return &Engine{slots: slots} }

// Start applies the per-key rule to key name, whose state is k, at now: a
// key with a slot gets nothing more (Busy); a head due later waits for its
// time (Later); otherwise the key takes a slot (Started) or, when none is
// free, waits in line for one (Waiting).
func (e *Engine) Start(name string, k *Key, now time.Time) Start {
	switch {
	case k.out:
		return Busy
	case now.Before(k.RetryAt):
		e.At(k.RetryAt)
		return Later
	case e.slots.Reserve(1) == 0:
		e.waiters.Add(name)
		return Waiting
	}
	k.out = true
	return Started
}

// Finish gives back the slot k holds, if any: its row was settled, or its
// runner ended.
func (e *Engine) Finish(k *Key) {
	if k.out {
		k.out = false
		e.slots.Unreserve(1)
	}
}

// Ready takes the key that has waited longest for a slot, while a slot is
// free; the relay starts it again (Start), or drops it when it has nothing
// to do any more.
func (e *Engine) Ready() (string, bool) {
	if e.slots.Full() {
		return "", false
	}
	return e.waiters.Pop()
}

// At asks for a wake-up at t: Due reports the earliest time asked for.
// It reports whether t is that time now (the relay arms its timer again).
func (e *Engine) At(t time.Time) bool {
	if e.due.IsZero() || t.Before(e.due) {
		e.due = t
		return true
	}
	return false
}

// Due is the earliest wake-up asked for (At, a key started Later) and not
// taken yet; zero when none.
func (e *Engine) Due() time.Time { return e.due }

// Woke takes the wake-up: the relay woke at or after Due and starts the
// keys that are due. Later starts ask again.
func (e *Engine) Woke() { e.due = time.Time{} }
