package runbook

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/state"
	"github.com/outboxkit/watermill-outbox/schema"
)

// stateOf returns the state statements of t in the mode it is relayed in
// (internal/state: the recorded mode, or for a table without a record the
// inferred one; sqlq.StateQueries, the one place that knows each mode's
// state).
func stateOf(ctx context.Context, db DB, t schema.Table) (sqlq.StateQueries, error) {
	r, err := readerOf(ctx, db, t)
	return r.StateQueries, err
}

// readerOf is stateOf with the mode's record (nil when inferred).
func readerOf(ctx context.Context, db DB, t schema.Table) (state.Reader, error) {
	r, err := state.Of(ctx, db, t)
	switch {
	case errors.Is(err, schema.ErrTableNotFound):
		return state.Reader{}, fmt.Errorf("runbook: read %s: %w: check the table name, or create it with schema.Migrate or `outbox migrate --table=%s`",
			t, schema.ErrTableNotFound, t)
	case err != nil:
		return state.Reader{}, dbError(t, "find the relay mode of", err)
	}
	return r, nil
}

// Mode tells how the table is relayed: the mode recorded for it (by `outbox
// migrate --ordered|--wal|--mode`, schema.WithMode, or the relay that
// started on it last) or, for a table without a record, the mode inferred
// from what exists: schema.ModeWAL for a table the WAL relay streams,
// schema.ModeOrdered for a table with ordered mode's column and companion
// tables, schema.ModeDefault otherwise.
func (r *Runbook) Mode(ctx context.Context) (schema.Mode, error) {
	if err := r.check(); err != nil {
		return "", err
	}
	db, t := r.db, r.table
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return "", err
	}
	return sq.Mode, nil
}

// scanState reads a row of sqlq.StateColumns (then extra).
func scanState(s sqlq.Scanner, extra ...any) (Row, error) {
	var (
		r    Row
		done bool
	)
	row, err := scanRow(s, append([]any{&r.OrderingKey, &done, &r.Skipped, &r.Held, &r.WaitingBehind, &r.SkipRequested, &r.ReplayDue}, extra...)...)
	if err != nil {
		return Row{}, err
	}
	row.OrderingKey, row.Skipped, row.Held, row.WaitingBehind, row.SkipRequested, row.ReplayDue = r.OrderingKey, r.Skipped, r.Held, r.WaitingBehind, r.SkipRequested, r.ReplayDue
	row.Delivered = done && !r.Skipped
	return row, nil
}

func queryStateRows(ctx context.Context, db DB, t schema.Table, op string, st sqlq.Statement) ([]Row, error) {
	rows, err := db.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, dbError(t, op, err)
	}
	defer rows.Close()
	out := []Row{}
	for rows.Next() {
		r, err := scanState(rows)
		if err != nil {
			return nil, fmt.Errorf("runbook: %s %s: read row: %w", op, t, err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, dbError(t, op, err)
	}
	return out, nil
}

// RowState is where one event is in the row-state machine, the same in
// every mode (docs/OPERATIONS.md, "The row's states"); each mode keeps it
// where it keeps a row's state (the default relay in the row's columns,
// ordered mode in floors and holds, the WAL relay in its confirmed position
// and holds) and skipped_at in every mode. Row.State reads it; RowState.Allows
// says which operator action it accepts. It encodes as its word.
type RowState string

// The row states.
const (
	// RowPending: committed, not delivered yet; the relay delivers it when
	// it is due.
	RowPending RowState = "pending"
	// RowInFlight: a relay leased the row and a copy may be in a handler.
	RowInFlight RowState = "in_flight"
	// RowRetrying: its last attempt failed; it is due again later.
	RowRetrying RowState = "retrying"
	// RowDead: it failed for good and is kept for an operator.
	RowDead RowState = "dead"
	// RowDelivered: a handler acked it.
	RowDelivered RowState = "delivered"
	// RowSkipped: an operator set it aside (skipped_at): done, never
	// delivered again unless replayed.
	RowSkipped RowState = "skipped"
)

// rowStates are the row states in the order of the rules table.
var rowStates = []RowState{RowPending, RowInFlight, RowRetrying, RowDead, RowDelivered, RowSkipped}

// State returns where the row is in the row-state machine, as the state
// reader of its table's mode classified it (Event): skipped, delivered,
// dead, in flight (a relay leased it: LockedAt; ReplayEvent and SkipEvent
// judge whether the lease is still live with their LockTTL), retrying (its
// last attempt failed: LastError) or pending. A row of Backlog or Dead is
// never delivered nor skipped.
func (r Row) State() RowState {
	switch {
	case r.Skipped:
		return RowSkipped
	case r.Delivered || r.PublishedAt != nil:
		return RowDelivered
	case r.DeadAt != nil:
		return RowDead
	case r.LockedAt != nil:
		return RowInFlight
	case r.LastError != nil:
		return RowRetrying
	}
	return RowPending
}

// ErrAlreadySkipped is matched (errors.Is) by the error of SkipEvent for a
// row an operator's skip already set aside: it stays skipped, nothing
// changed.
var ErrAlreadySkipped = errors.New("event already skipped")

// RowRuleError is why a row's state refuses an operator's action in a
// mode, and what to do instead. It unwraps to the sentinel that names the
// reason (ErrNotFailed, ErrLocked, ErrAlreadyPublished, ErrAlreadySkipped).
type RowRuleError struct {
	// State is the row's state, Op the action refused.
	State RowState
	Op    HoldOp
	// Why says why, Do what to do instead.
	Why, Do string
	// Reason is the sentinel error.
	Reason error
}

// Error says the state, why the action is refused and what to do.
func (e *RowRuleError) Error() string {
	return fmt.Sprintf("the row is %s, which refuses %s: %s; %s", e.State, e.Op, e.Why, e.Do)
}

// Unwrap returns Reason.
func (e *RowRuleError) Unwrap() error { return e.Reason }

// rowRule is one refusal of the row rules table; modes, when not nil,
// are the only modes it applies in.
type rowRule struct {
	why, do string
	reason  error
	modes   []schema.Mode
}

// rowRefusals is the rules table of the row-state machine: every (state,
// action) pair not in it, or whose modes leave the mode out, is allowed.
// Replay: dead, retrying, skipped or (ordered mode, by choice) delivered ->
// pending, never in flight. Skip: dead, retrying or pending -> skipped,
// never in flight; final once applied. A keyed row of a keyed table is
// skipped through its key's hold (HoldState.Allows) while it holds one.
var rowRefusals = map[RowState]map[HoldOp]rowRule{
	RowPending: {
		OpReplay: {why: "it has not failed", do: "the relay delivers it when it is due", reason: ErrNotFailed},
	},
	RowInFlight: {
		OpSkip:   {why: "a relay leased it and a copy may be in a handler", do: "wait until the relay answers or the lease (LockTTL) ends, and look again", reason: ErrLocked},
		OpReplay: {why: "a relay leased it and a copy may be in a handler", do: "wait until the relay answers or the lease (LockTTL) ends, and look again", reason: ErrLocked},
	},
	RowDelivered: {
		OpSkip: {why: "it was delivered", do: "nothing to skip", reason: ErrAlreadyPublished},
		OpReplay: {why: "it was delivered", do: "replay re-delivers dead, failed or skipped rows", reason: ErrAlreadyPublished,
			modes: []schema.Mode{schema.ModeDefault, schema.ModeWAL}},
	},
	RowSkipped: {
		OpSkip: {why: "it was skipped already and stays skipped", do: "nothing to do; replay it to deliver it once more", reason: ErrAlreadySkipped},
	},
}

// Allows returns nil when a row in state s of a table relayed in mode m
// accepts the action op, and otherwise a *RowRuleError that says why not
// and what to do:
//
//	state      skip     replay
//	pending    yes      no (not failed)
//	in_flight  no       no
//	retrying   yes      yes
//	dead       yes      yes
//	delivered  no       a keyed row of an ordered table only (a replay hold)
//	skipped    no       yes
func (s RowState) Allows(m schema.Mode, op HoldOp) error {
	if !slices.Contains(rowStates, s) {
		return &RowRuleError{State: s, Op: op, Why: "the state is unknown", Do: "upgrade the outbox command or library", Reason: ErrHoldRefused}
	}
	r, ok := rowRefusals[s][op]
	if !ok || (r.modes != nil && !slices.Contains(r.modes, m)) {
		return nil
	}
	return &RowRuleError{State: s, Op: op, Why: r.why, Do: r.do, Reason: r.reason}
}

// rowRulesTable renders the row rules as the Markdown table that
// docs/OPERATIONS.md carries (a test checks that it does).
func rowRulesTable() string {
	var b strings.Builder
	b.WriteString("| state | skip | replay | replay of a keyed row, ordered mode |\n|---|---|---|---|\n")
	cell := func(err error) string {
		var re *RowRuleError
		if errors.As(err, &re) {
			return "refused: " + re.Why
		}
		return "allowed"
	}
	for _, s := range rowStates {
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", s, cell(s.Allows(schema.ModeDefault, OpSkip)),
			cell(s.Allows(schema.ModeDefault, OpReplay)), cell(s.Allows(schema.ModeOrdered, OpReplay)))
	}
	return b.String()
}
