package keyed

import (
	"time"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// HoldState is where a key's hold is in its lifecycle, in both keyed
// relays. Its values and their order are runbook.HoldState's, which the
// runbook, the CLI and the console read from the one holds table's state
// column, generated with the same precedence (schema's holdStateExpr).
type HoldState uint8

// The hold states.
const (
	// Retrying: the held row failed and is delivered again at DueAt; the
	// key's later rows wait.
	Retrying HoldState = iota + 1
	// Dead: the held row failed for good; the key waits for an operator.
	Dead
	// SkipRequested: an operator asked to skip the held row; the relay
	// moves the hold on (ordered) or drains the key (WAL).
	SkipRequested
	// Replayed: an operator replayed the held row; it is delivered again.
	Replayed
	// Draining (WAL): the held row went through; the key's parked rows are
	// delivered from the table, then the hold is resolved.
	Draining
	// Resolved: a tombstone; the key's rows up to the hold are done.
	Resolved
)

var holdWords = [...]string{"unknown", sqlq.HoldWordRetrying, sqlq.HoldWordDead, sqlq.HoldWordSkipRequested,
	sqlq.HoldWordReplay, sqlq.HoldWordDraining, sqlq.HoldWordResolved}

// String is the state's word (sqlq.HoldWord*), as the runbook writes it.
func (s HoldState) String() string {
	if int(s) < len(holdWords) {
		return holdWords[s]
	}
	return holdWords[0]
}

// StateOf is the state of an ordered relay's hold from its facts, with the
// holds table's state column's precedence (ordered mode neither drains nor
// spills): resolved, then a requested skip, then dead, then a replay, else
// retrying.
func StateOf(dead, skip, replay, resolved bool) HoldState {
	switch {
	case resolved:
		return Resolved
	case skip:
		return SkipRequested
	case dead:
		return Dead
	case replay:
		return Replayed
	}
	return Retrying
}

// Hold is a key's hold as a relay keeps it in memory: the row that holds
// the key, its failed attempts, when it is due again, and its state.
type Hold struct {
	Seq      int64
	Attempts int
	DueAt    time.Time // local clock
	State    HoldState
}

// Open reports whether the hold keeps the key's later rows back: every
// state but Resolved.
func (h *Hold) Open() bool { return h.State != Resolved }

// Due reports whether the relay delivers the held row again at now: it is
// retrying or replayed, and its time has come.
func (h *Hold) Due(now time.Time) bool {
	return (h.State == Retrying || h.State == Replayed) && !now.Before(h.DueAt)
}

// Waits reports whether the held row is retrying or replayed and its time
// has not come at now: the relay wakes for it at DueAt (Engine.At).
func (h *Hold) Waits(now time.Time) bool {
	return (h.State == Retrying || h.State == Replayed) && now.Before(h.DueAt)
}

// Step is what a relay does next with an open hold.
type Step uint8

// The steps of a hold (Hold.Next).
const (
	// Wait: the hold waits: for an operator (dead), for the relay's own
	// work (draining), or for its DueAt (retrying, replayed).
	Wait Step = iota
	// Deliver: the held row is delivered again, with its attempts
	// (retrying or replayed, and due).
	Deliver
	// MoveOn: an operator asked to skip the held row: the key moves on
	// without delivering it.
	MoveOn
)

// Next is the hold's next step at now, the same rule in both keyed relays:
// a requested skip moves on, a due retry or replay is delivered, anything
// else waits.
func (h *Hold) Next(now time.Time) Step {
	switch {
	case h.State == SkipRequested:
		return MoveOn
	case h.Due(now):
		return Deliver
	}
	return Wait
}
