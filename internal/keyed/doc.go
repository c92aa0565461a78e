// Package keyed holds the parts of per-key delivery that every relay of the
// module shares, so that each rule is written once:
//
//   - Engine: the per-key engine both keyed relays (ordered mode and the
//     WAL relay) start their keys through: a key with one row out gets no
//     second, a failed head waits for its retry time, a key takes one of
//     the subscription's slots or waits in line for one, and the earliest
//     time a key is due wakes the relay. Each relay keeps a keyed.Key in
//     its per-key state; what a key's work is (the ordered relay's scan
//     and holds, the WAL relay's stream and drains) stays with the relay.
//   - Slots: MaxInFlight, counted once per subscription. Everything a
//     subscription has out counts against it: a claim loop's batches, the
//     keyed runners of ordered mode, the keys the WAL relay delivers, and
//     the copies that ended terms left in handlers (internal/term).
//   - Waiters: the keys that are ready and wait for a slot, served oldest
//     first, each key once.
//   - Policy and Failure: what a failed attempt leads to (the last_error
//     summary, retry with backoff, or dead), the same decision in the
//     default relay, ordered mode and the WAL relay.
//
// The delivery of one copy under a term (one copy per key, its context
// cancelled when its term ends, no write after the term) is internal/term.
//
// # Invariants
//
//   - One row of a key at a time: Engine.Start never starts a key that
//     holds a slot, nor one whose head is due later; a key that starts
//     holds exactly one slot until Finish, and a second Finish gives
//     nothing back; the keys that found no slot come back through Ready
//     oldest first, each once, and only while a slot is free
//     (TestEngineOneSlotPerKeyOldestFirst).
//   - Slots never hands out more than the limit, whatever mix of callers
//     reserves: Reserve takes what is free, at once, or nothing
//     (TestSlotsNeverExceedTheLimit).
//   - A waiting key is served once per Add, in the order keys were added
//     (TestWaitersOldestFirstOnce).
//   - A hold's next step is one rule: a requested skip moves on, a due
//     retry or replay is delivered, anything else waits (TestHoldNext).
//   - A failure is dead exactly when it is permanent or its attempts reached
//     MaxAttempts; the backoff is asked once per failed attempt; the
//     summary never holds the payload's text (TestJudge).
package keyed
