package runbook

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrNotHeld is returned (wrapped) by SkipEvent when the event's row does
// not hold its ordering key: only the row a key waits for can be skipped.
var ErrNotHeld = errors.New("runbook: event does not hold its ordering key")

// HeldKey is one ordering key held back by its hold (ordered mode,
// docs/ORDERING.md; the WAL relay, docs/WAL.md), or a resolved hold's
// tombstone when ListHolds was asked for them.
type HeldKey struct {
	// Key is the ordering key.
	Key string `json:"ordering_key"`
	// Partition is the key's partition (0 in a WAL table).
	Partition int `json:"partition"`
	// Sequence is the sequence of the row the key waits for.
	Sequence int64 `json:"sequence"`
	// EventID and Topic are the held row's, empty when the row is gone.
	EventID string `json:"event_id,omitempty"`
	Topic   string `json:"topic,omitempty"`
	// State is where the hold is in its lifecycle; State.Allows says
	// whether the row can be skipped or replayed now.
	State HoldState `json:"state"`
	// Attempts counts the failed attempts of the held row.
	Attempts int `json:"attempts"`
	// AvailableAt is when the held row is tried again; nil when dead.
	AvailableAt *time.Time `json:"available_at,omitempty"`
	// LastError is the redacted error of the last attempt.
	LastError *string `json:"last_error,omitempty"`
	// DeadAt is set when the held row is dead: the key waits for an
	// operator (ReplayEvent or SkipEvent).
	DeadAt *time.Time `json:"dead_at,omitempty"`
	// SkipRequestedAt is set when an operator asked to skip the row.
	SkipRequestedAt *time.Time `json:"skip_requested_at,omitempty"`
	// Replay is true for an ordered table's replay hold (an operator's
	// replay of a row already relayed), also once it is dead.
	Replay bool `json:"replay,omitempty"`
}

// CanSkip is true when the hold's state accepts a skip and the row is still
// in the table (SkipEvent names it by its event_id).
func (h HeldKey) CanSkip() bool { return h.EventID != "" && h.State.Allows(OpSkip) == nil }

// CanReplay is true when the hold's state accepts a replay and the row is
// still in the table.
func (h HeldKey) CanReplay() bool { return h.EventID != "" && h.State.Allows(OpReplay) == nil }

// orderedQueries returns the ordered-mode statements of t, or nil when t
// is not relayed in ordered mode (its state reader's mode: stateOf).
func orderedQueries(ctx context.Context, db DB, t schema.Table) (*sqlq.OrderedQueries, error) {
	sq, err := stateOf(ctx, db, t)
	if err != nil || sq.Mode != schema.ModeOrdered {
		return nil, err
	}
	return sqlq.NewOrderedQueries(t, sq.Columns), nil
}

// HeldKeys lists up to limit (DefaultLimit when 0) held keys of the keyed
// table (ordered mode or the WAL relay), oldest hold first, each with its
// State. Resolved holds (tombstones, which hold nothing) are not listed:
// use ListHolds with Resolved for them. A table without keyed holds has
// none.
func (r *Runbook) HeldKeys(ctx context.Context, limit int) ([]HeldKey, error) {
	return r.ListHolds(ctx, HoldsFilter{Limit: limit})
}

// HoldsFilter selects the holds ListHolds returns.
type HoldsFilter struct {
	// Limit bounds the holds returned (DefaultLimit when 0).
	Limit int
	// Resolved includes the resolved holds (tombstones kept until the
	// relay's progress passes them), which HeldKeys leaves out.
	Resolved bool
}

// ListHolds is HeldKeys with the resolved holds too when f.Resolved.
func (r *Runbook) ListHolds(ctx context.Context, f HoldsFilter) ([]HeldKey, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	limit, err := checkLimit(f.Limit)
	if err != nil {
		return nil, err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return nil, err
	}
	var list string
	switch {
	case sq.Mode == schema.ModeOrdered:
		list = sqlq.NewOrderedQueries(t, sq.Columns).HoldList()
	case walKeyed(sq):
		list = sqlq.WALHoldList(t)
	default:
		return nil, nil
	}
	rows, err := db.Query(ctx, list, limit, f.Resolved)
	if err != nil {
		return nil, dbError(t, "list held keys of", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (HeldKey, error) {
		var (
			h                   HeldKey
			event, topic, state *string
		)
		err := r.Scan(&h.Key, &h.Partition, &h.Sequence, &h.Attempts, &h.AvailableAt, &h.LastError, &h.DeadAt, &h.SkipRequestedAt, &event, &topic, &h.Replay, &state)
		if err != nil {
			return h, err
		}
		if event != nil {
			h.EventID = *event
		}
		if topic != nil {
			h.Topic = *topic
		}
		if state != nil {
			h.State, err = parseHoldState(*state)
		}
		return h, err
	})
	if err != nil {
		return nil, dbError(t, "list held keys of", err)
	}
	return out, nil
}

// eventHold is the hold at one event's row.
type eventHold struct {
	key   string
	seq   int64
	dead  bool
	state HoldState
}

// holdOf returns the hold at the event's row of an ordered table (nil
// when the row holds no key), resolved holds included.
func holdOf(ctx context.Context, db DB, oq *sqlq.OrderedQueries, eventID uuid.UUID) (*eventHold, error) {
	var (
		h    eventHold
		word string
	)
	err := db.QueryRow(ctx, oq.HoldOfEvent(), eventID.String()).Scan(&h.key, &h.seq, &h.dead, &word)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError(oq.Table, "look up the hold of event "+eventID.String()+" in", err)
	}
	if h.state, err = parseHoldState(word); err != nil {
		return nil, err
	}
	return &h, nil
}

// walHoldOf returns the WAL relay's hold of the event's row of a WAL
// table with keyed holds (walKeyed; released ones included), or nil when
// the row holds no key.
func walHoldOf(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID) (*eventHold, error) {
	var (
		h    eventHold
		word string
	)
	err := db.QueryRow(ctx, sqlq.WALHoldOfEvent(t), eventID.String()).Scan(&h.key, &h.seq, &word)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError(t, "look up the hold of event "+eventID.String()+" in", err)
	}
	if h.state, err = parseHoldState(word); err != nil {
		return nil, err
	}
	h.dead = h.state == HoldDead
	return &h, nil
}

// HoldOfEvent returns the state of the hold at the row of the table whose
// event_id is eventID, in either keyed mode, resolved holds included; held
// is false when the row holds no key (or the table has no keyed holds). The
// console's event page offers Replay by its Allows.
func (r *Runbook) HoldOfEvent(ctx context.Context, eventID uuid.UUID) (state HoldState, held bool, err error) {
	if err := r.check(); err != nil {
		return 0, false, err
	}
	db, t := r.db, r.table
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return 0, false, err
	}
	var h *eventHold
	switch {
	case sq.Mode == schema.ModeOrdered:
		h, err = holdOf(ctx, db, sqlq.NewOrderedQueries(t, sq.Columns), eventID)
	case walKeyed(sq):
		h, err = walHoldOf(ctx, db, t, eventID)
	}
	if err != nil || h == nil {
		return 0, false, err
	}
	return h.state, true, nil
}

// refusal is the error of a hold rule that refused op on eventID.
func refusal(op HoldOp, eventID uuid.UUID, t schema.Table, err error) error {
	return fmt.Errorf("runbook: cannot %s event %s of %s: %w; nothing changed", op, eventID, t, err)
}

// replayHeld is ReplayEvent for a row that holds its ordering key in an
// ordered table: when the hold's state allows a replay, it clears the
// hold's dead_at and attempts and makes it due, so that the relay delivers
// the row first and the rest of its key after it. ok is false when the row
// holds no key or its hold is resolved (replayKeyed then decides).
func replayHeld(ctx context.Context, db DB, oq *sqlq.OrderedQueries, eventID uuid.UUID, lockTTL time.Duration, dryRun bool) (EventReplay, bool, error) {
	t := oq.Table
	h, err := holdOf(ctx, db, oq, eventID)
	if err != nil || h == nil || h.state == HoldResolved {
		return EventReplay{}, false, err
	}
	if err := h.state.Allows(OpReplay); err != nil {
		return EventReplay{}, true, refusal(OpReplay, eventID, t, err)
	}
	q := sqlq.NewRunbookQueries(t)
	// The row as the state layer reads it: a held row shows its hold's
	// attempts, last_error and dead_at.
	row, err := eventState(ctx, db, sqlq.NewStateQueries(t, schema.ModeOrdered, oq.Columns), eventID, lockTTL)
	if err != nil {
		return EventReplay{}, true, err
	}
	res := EventReplay{Table: t.String(), Row: row, Dead: h.dead,
		Statement: Statement{SQL: oq.RetryHoldIn(), Args: []any{h.key, h.seq, statesAllowing(OpReplay)}}}
	if dryRun {
		res.DryRun = true
		return res, true, nil
	}
	tag, err := db.Exec(ctx, res.Statement.SQL, res.Statement.Args...)
	if err != nil {
		return EventReplay{}, true, dbError(t, "replay event "+eventID.String()+" of", err)
	}
	if tag.RowsAffected() == 0 {
		return EventReplay{}, true, movedOn(ctx, db, t, eventID, OpReplay)
	}
	res.Changed = tag.RowsAffected()
	wake(ctx, db, q)
	return res, true, nil
}

// movedOn is the error of an action whose guarded statement found the hold
// changed since it was read: the new state's refusal when it refuses op,
// else a plain "look again".
func movedOn(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, op HoldOp) error {
	if st, held, err := New(db, t).HoldOfEvent(ctx, eventID); err == nil && held {
		if rerr := st.Allows(op); rerr != nil {
			return refusal(op, eventID, t, rerr)
		}
	}
	return fmt.Errorf("runbook: cannot %s event %s of %s: its hold changed meanwhile (%w); nothing changed, look again", op, eventID, t, ErrHoldRefused)
}

// ErrNotRelayedYet is returned (wrapped) by ReplayEvent for a keyed row of
// an ordered table that its relay has not recorded as done yet: it will be
// delivered anyway.
var ErrNotRelayedYet = errors.New("runbook: keyed event not relayed yet")

// replayKeyed is ReplayEvent for a keyed row of an ordered table that does
// not hold its key: a row already relayed (acked or skipped, at or below
// its partition's written floor) becomes a replay hold, delivered once more
// before the key's next row. ok is false when the row is not keyed or the
// table is not ordered.
func replayKeyed(ctx context.Context, db DB, oq *sqlq.OrderedQueries, eventID uuid.UUID, lockTTL time.Duration, dryRun bool) (EventReplay, bool, error) {
	t := oq.Table
	var keyed bool
	if err := db.QueryRow(ctx, oq.Keyed, eventID.String()).Scan(&keyed); errors.Is(err, pgx.ErrNoRows) || (err == nil && !keyed) {
		return EventReplay{}, false, nil
	} else if err != nil {
		return EventReplay{}, true, dbError(t, "look up event "+eventID.String()+" in", err)
	}
	q := sqlq.NewRunbookQueries(t)
	// The row as the state layer reads it: a held row shows its hold's
	// attempts, last_error and dead_at.
	row, err := eventState(ctx, db, sqlq.NewStateQueries(t, schema.ModeOrdered, oq.Columns), eventID, lockTTL)
	if err != nil {
		return EventReplay{}, true, err
	}
	res := EventReplay{Table: t.String(), Row: row, Statement: Statement{SQL: oq.ReplayDone, Args: []any{eventID.String()}}}
	var (
		inserted, above bool
		held            *int64
	)
	if dryRun {
		// What ReplayDone decides on, read without writing: the dry run
		// refuses what the replay would.
		var done, free bool
		if err := db.QueryRow(ctx, keyedReplayCheck(t), eventID.String()).Scan(&done, &free, &held); err != nil {
			return EventReplay{}, true, dbError(t, "look up event "+eventID.String()+" in", err)
		}
		inserted, above = done && free, !done
		res.DryRun = true
	} else if err := db.QueryRow(ctx, oq.ReplayDone, eventID.String()).Scan(&inserted, &above, &held); err != nil {
		return EventReplay{}, true, dbError(t, "replay event "+eventID.String()+" of", err)
	}
	switch {
	case inserted && dryRun:
		return res, true, nil
	case inserted:
		res.Changed = 1
		wake(ctx, db, q)
		return res, true, nil
	case held != nil:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: its ordering key is held at sequence %d; replay or skip that row first (`outbox keys held`); nothing changed: %w",
			eventID, t, *held, ErrNotHeld)
	case above:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: the relay has not recorded it as done yet (it is above its partition's floor) and will deliver it; if it was just acked or skipped, try again in a few seconds (the relay writes its floors every tick, every LockTTL/10 while a long transaction pins the xmin horizon); nothing changed: %w",
			eventID, t, ErrNotRelayedYet)
	default:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: its key's last hold is not cleaned yet; try again in a few seconds (the relay writes its floors every tick, every LockTTL/10 while a long transaction pins the xmin horizon); nothing changed: %w",
			eventID, t, ErrNotRelayedYet)
	}
}

// keyedReplayCheck reads, for the keyed row of the ordered table t whose
// event_id is $1, what sqlq.OrderedQueries.ReplayDone decides on, without
// writing: whether the row is at or below its partition's written floor
// (done), whether its key is free (no hold but a resolved one at or below
// that floor), and the sequence its key is held at (NULL when none).
func keyedReplayCheck(t schema.Table) string {
	return `SELECT COALESCE(o.sequence <= p.floor_sequence, false),
  p.partition IS NOT NULL AND NOT EXISTS (SELECT 1 FROM ` + t.HoldsTable() + ` AS h WHERE h.ordering_key = o.ordering_key
    AND NOT (h.resolved_at IS NOT NULL AND h.sequence <= p.floor_sequence)),
  (SELECT h.sequence FROM ` + t.HoldsTable() + ` AS h WHERE h.ordering_key = o.ordering_key AND h.resolved_at IS NULL)
FROM ` + t.Sanitize() + ` AS o LEFT JOIN ` + t.PartitionsTable() + ` AS p ON p.partition = o.ordering_partition
WHERE o.event_id = $1::uuid AND o.ordering_key IS NOT NULL`
}

// EventSkip reports a SkipEvent.
type EventSkip struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Key and Sequence name the held row that is skipped.
	Key      string `json:"ordering_key"`
	Sequence int64  `json:"sequence"`
	// Statement is the statement that records the skip.
	Statement Statement `json:"-"`
	// Changed is 1, or 0 for a dry run.
	Changed int64 `json:"changed"`
	// DryRun is true when nothing was changed on purpose.
	DryRun bool `json:"dry_run"`
	// Applied is true when the skip was recorded on the row at once
	// (skipped_at: a row that holds no key, in the default mode or an
	// ordered table); false when it was requested of the relay that owns
	// the row's held key, which marks the row skipped when it applies it.
	Applied bool `json:"applied"`
}

// SkipEvent sets aside the row whose event_id is eventID: it is then
// skipped (skipped_at; done, not dead, not delivered, never delivered
// again unless replayed; it stays in the table). A skip is final once
// applied, whatever replay came before it (docs/OPERATIONS.md, "The row's
// states").
//
// A row that holds its ordering key (ordered mode or the WAL relay) is
// dropped from its key's order: its hold's state must allow a skip
// (HoldState.Allows: retrying, dead or replay, else a *HoldRuleError,
// ErrHoldRefused); the relay that owns the key applies the skip at its next
// tick, continues the key with its next row and marks the row skipped,
// with the failure that held the key as its last_error. Any other keyed
// row of a keyed table is refused with ErrNotHeld, but for a keyed row of
// an ordered table that died under the default relay before the switch,
// and a dead keyed row of a WAL table with no hold at it (a failed replay
// of a row its key went past, which holds only its own row), skipped at
// once (EventSkip.Applied).
//
// Every other row (every row of a default-mode table, the unkeyed rows of
// an ordered table) is skipped at once (EventSkip.Applied) when its state
// allows it (RowState.Allows: pending, retrying or dead, and not leased by
// a relay; else a *RowRuleError matching ErrLocked, ErrAlreadyPublished or
// ErrAlreadySkipped); the table needs the skipped_at column
// (ErrNoSkippedAt otherwise, naming the migration). Nothing is changed
// when the skip is refused.
func (r *Runbook) SkipEvent(ctx context.Context, eventID uuid.UUID, dryRun bool) (EventSkip, error) {
	if err := r.check(); err != nil {
		return EventSkip{}, err
	}
	db, t := r.db, r.table
	rd, err := readerOf(ctx, db, t)
	if err != nil {
		return EventSkip{}, err
	}
	sq := rd.StateQueries
	if walKeyed(sq) {
		return skipWAL(ctx, db, t, eventID, dryRun)
	}
	var (
		oq *sqlq.OrderedQueries
		h  *eventHold
	)
	if sq.Mode == schema.ModeOrdered {
		oq = sqlq.NewOrderedQueries(t, sq.Columns)
		if h, err = holdOf(ctx, db, oq, eventID); err != nil {
			return EventSkip{}, err
		}
	}
	if h == nil && sq.Mode == schema.ModeWAL {
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w (skip applies to the row a held key waits for; list them with `outbox keys held`); nothing changed",
			eventID, t, ErrNotHeld)
	}
	if h == nil {
		return skipRow(ctx, db, sq, eventID, leaseTTL(rd, 0), dryRun)
	}
	if err := h.state.Allows(OpSkip); err != nil {
		return EventSkip{}, refusal(OpSkip, eventID, t, err)
	}
	res := EventSkip{Table: t.String(), Key: h.key, Sequence: h.seq,
		Statement: Statement{SQL: oq.SkipHoldIn(), Args: []any{h.key, h.seq, statesAllowing(OpSkip)}}}
	if dryRun {
		res.DryRun = true
		return res, nil
	}
	var done bool
	if err := db.QueryRow(ctx, res.Statement.SQL, res.Statement.Args...).Scan(&done); err != nil {
		return EventSkip{}, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	if !done {
		return EventSkip{}, movedOn(ctx, db, t, eventID, OpSkip)
	}
	res.Changed = 1
	wake(ctx, db, sqlq.NewRunbookQueries(t))
	return res, nil
}

// OrderedRelays counts the ordered relays at work on the table: those owning a
// partition whose lease has not expired. A table without ordered mode has
// none.
func (r *Runbook) OrderedRelays(ctx context.Context) (int, error) {
	if err := r.check(); err != nil {
		return 0, err
	}
	db, t := r.db, r.table
	oq, err := orderedQueries(ctx, db, t)
	if err != nil || oq == nil {
		return 0, err
	}
	var n int
	if err := db.QueryRow(ctx, oq.LiveOwners).Scan(&n); err != nil {
		return 0, dbError(t, "count the ordered relays of", err)
	}
	return n, nil
}

// walKeyed tells whether the table of sq is streamed by the WAL relay
// with keyed holds (its mode is WAL, and it has the ordering column and
// the WAL holds table: internal/state).
func walKeyed(sq sqlq.StateQueries) bool {
	return sq.Mode == schema.ModeWAL && sq.Columns.OrderingKey
}

// skipWAL is SkipEvent for a table the WAL relay streams: it records the
// skip request on the hold, when its state allows it; the active relay
// applies it at its next tick. A dead keyed row with no hold at it (a
// failed replay, once its key's tombstone is gone) is skipped on the row
// at once (skipWALDeadRow).
func skipWAL(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (EventSkip, error) {
	h, err := walHoldOf(ctx, db, t, eventID)
	if err != nil {
		return EventSkip{}, err
	}
	if h == nil {
		if res, ok, err := skipWALDeadRow(ctx, db, t, eventID, dryRun); err != nil || ok {
			return res, err
		}
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w (skip applies to the dead row a held key waits for; list them with `outbox keys held`); nothing changed",
			eventID, t, ErrNotHeld)
	}
	if err := h.state.Allows(OpSkip); err != nil {
		return EventSkip{}, refusal(OpSkip, eventID, t, err)
	}
	st := Statement{SQL: sqlq.WALSkipHoldIn(t), Args: []any{eventID.String(), statesAllowing(OpSkip)}}
	res := EventSkip{Table: t.String(), Key: h.key, Sequence: h.seq, Statement: st, DryRun: dryRun}
	if dryRun {
		return res, nil
	}
	err = db.QueryRow(ctx, st.SQL, st.Args...).Scan(&res.Key, &res.Sequence)
	if errors.Is(err, pgx.ErrNoRows) {
		return EventSkip{}, movedOn(ctx, db, t, eventID, OpSkip)
	}
	if err != nil {
		return EventSkip{}, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	res.Changed = 1
	return res, nil
}
