package runbook

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrNotHeld is returned (wrapped) by SkipEvent when the event's row does
// not hold its ordering key: only the row a key waits for can be skipped.
var ErrNotHeld = errors.New("runbook: event does not hold its ordering key")

// HeldKey is one ordering key held back by a failing, dead or skipped row
// (ordered mode, docs/ORDERING.md).
type HeldKey struct {
	// Key is the ordering key.
	Key string `json:"ordering_key"`
	// Partition is the key's partition.
	Partition int `json:"partition"`
	// Sequence is the sequence of the row the key waits for.
	Sequence int64 `json:"sequence"`
	// EventID and Topic are the held row's, empty when the row is gone.
	EventID string `json:"event_id,omitempty"`
	Topic   string `json:"topic,omitempty"`
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
	// Replay is true for an operator's replay of a row already relayed:
	// the row is delivered once more before the key's next row.
	Replay bool `json:"replay,omitempty"`
}

// orderedQueries returns the ordered-mode statements of t, or nil when t
// is not relayed in ordered mode: it has no ordered-mode tables, or it is
// streamed by the WAL relay (named in a publication), whose keyed rows
// live in the outbox table alone.
func orderedQueries(ctx context.Context, db DB, t schema.Table) (*schema.OrderedQueries, error) {
	ok, err := schema.OrderedTablesExist(ctx, db, t)
	if err != nil {
		return nil, dbError(t, "look up the ordered-mode tables of", err)
	}
	if !ok {
		return nil, nil
	}
	var wal bool
	if err := db.QueryRow(ctx, schema.WALPublished, t.Sanitize()).Scan(&wal); err != nil {
		return nil, dbError(t, "look up the publications of", err)
	}
	if wal {
		return nil, nil
	}
	cols, err := schema.DetectColumns(ctx, db, t)
	if err != nil {
		return nil, dbError(t, "detect the columns of", err)
	}
	return schema.NewOrderedQueries(t, cols), nil
}

// HeldKeys lists up to limit (DefaultLimit when 0) held keys of the ordered
// table t, oldest hold first. A table without ordered mode has none.
func HeldKeys(ctx context.Context, db DB, t schema.Table, limit int) ([]HeldKey, error) {
	if err := checkTable(t); err != nil {
		return nil, err
	}
	limit, err := checkLimit(limit)
	if err != nil {
		return nil, err
	}
	oq, err := orderedQueries(ctx, db, t)
	if err != nil {
		return nil, err
	}
	list := ""
	if oq != nil {
		list = oq.ListHolds
	} else if wal, err := walHolds(ctx, db, t); err != nil || !wal {
		return nil, err
	} else {
		list = schema.WALListHolds(t)
	}
	rows, err := db.Query(ctx, list, limit)
	if err != nil {
		return nil, dbError(t, "list held keys of", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (HeldKey, error) {
		var (
			h            HeldKey
			event, topic *string
		)
		err := r.Scan(&h.Key, &h.Partition, &h.Sequence, &h.Attempts, &h.AvailableAt, &h.LastError, &h.DeadAt, &h.SkipRequestedAt, &event, &topic, &h.Replay)
		if event != nil {
			h.EventID = *event
		}
		if topic != nil {
			h.Topic = *topic
		}
		return h, err
	})
	if err != nil {
		return nil, dbError(t, "list held keys of", err)
	}
	return out, nil
}

// holdOf returns the hold of the event's row, or ok = false when the table
// is not ordered or the row holds no key.
func holdOf(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID) (oq *schema.OrderedQueries, key string, seq int64, dead bool, ok bool, err error) {
	if oq, err = orderedQueries(ctx, db, t); err != nil || oq == nil {
		return nil, "", 0, false, false, err
	}
	st := oq.HoldOfEventStatement(eventID.String())
	var attempts int
	err = db.QueryRow(ctx, st.SQL, st.Args...).Scan(&key, &seq, &dead, &attempts)
	if errors.Is(err, pgx.ErrNoRows) {
		return oq, "", 0, false, false, nil
	}
	if err != nil {
		return nil, "", 0, false, false, dbError(t, "look up the hold of event "+eventID.String()+" in", err)
	}
	return oq, key, seq, dead, true, nil
}

// replayHeld is ReplayEvent for a row that holds its ordering key: it
// clears the hold's dead_at and attempts and makes it due, so that the relay
// delivers the row first and the rest of its key after it.
func replayHeld(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (EventReplay, bool, error) {
	oq, key, seq, dead, ok, err := holdOf(ctx, db, t, eventID)
	if err != nil || !ok {
		return EventReplay{}, false, err
	}
	q := schema.NewRunbookQueries(t)
	// The row as the state layer reads it: a held row shows its hold's
	// attempts, last_error and dead_at.
	row, err := eventState(ctx, db, schema.NewStateQueries(t, schema.ModeOrdered, oq.Columns), eventID)
	if err != nil {
		return EventReplay{}, true, err
	}
	res := EventReplay{Table: t.String(), Row: row, Dead: dead,
		Statement: schema.Statement{SQL: oq.RetryHold, Args: []any{key, seq}}}
	if dryRun {
		res.DryRun = true
		return res, true, nil
	}
	tag, err := db.Exec(ctx, res.Statement.SQL, res.Statement.Args...)
	if err != nil {
		return EventReplay{}, true, dbError(t, "replay event "+eventID.String()+" of", err)
	}
	res.Changed = tag.RowsAffected()
	wake(ctx, db, q)
	return res, true, nil
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
func replayKeyed(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (EventReplay, bool, error) {
	oq, err := orderedQueries(ctx, db, t)
	if err != nil || oq == nil {
		return EventReplay{}, false, err
	}
	var keyed bool
	if err := db.QueryRow(ctx, oq.Keyed, eventID.String()).Scan(&keyed); errors.Is(err, pgx.ErrNoRows) || (err == nil && !keyed) {
		return EventReplay{}, false, nil
	} else if err != nil {
		return EventReplay{}, true, dbError(t, "look up event "+eventID.String()+" in", err)
	}
	q := schema.NewRunbookQueries(t)
	// The row as the state layer reads it: a held row shows its hold's
	// attempts, last_error and dead_at.
	row, err := eventState(ctx, db, schema.NewStateQueries(t, schema.ModeOrdered, oq.Columns), eventID)
	if err != nil {
		return EventReplay{}, true, err
	}
	res := EventReplay{Table: t.String(), Row: row, Statement: schema.Statement{SQL: oq.ReplayDone, Args: []any{eventID.String()}}}
	if dryRun {
		res.DryRun = true
		return res, true, nil
	}
	var (
		inserted, above bool
		held            *int64
	)
	if err := db.QueryRow(ctx, oq.ReplayDone, eventID.String()).Scan(&inserted, &above, &held); err != nil {
		return EventReplay{}, true, dbError(t, "replay event "+eventID.String()+" of", err)
	}
	switch {
	case inserted:
		res.Changed = 1
		wake(ctx, db, q)
		return res, true, nil
	case held != nil:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: its ordering key is held at sequence %d; replay or skip that row first (`outbox keys held`); nothing changed: %w",
			eventID, t, *held, ErrNotHeld)
	case above:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: the relay has not recorded it as done yet (it is above its partition's floor) and will deliver it; if it was just acked or skipped, try again after one relay tick; nothing changed: %w",
			eventID, t, ErrNotRelayedYet)
	default:
		return EventReplay{}, true, fmt.Errorf("runbook: cannot replay event %s of %s: its key's last hold is not cleaned yet; try again after one relay tick; nothing changed: %w",
			eventID, t, ErrNotRelayedYet)
	}
}

// EventSkip reports a SkipEvent.
type EventSkip struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Key and Sequence name the held row that is skipped.
	Key      string `json:"ordering_key"`
	Sequence int64  `json:"sequence"`
	// Statement is the statement that records the skip.
	Statement schema.Statement `json:"-"`
	// Changed is 1, or 0 for a dry run.
	Changed int64 `json:"changed"`
	// DryRun is true when nothing was changed on purpose.
	DryRun bool `json:"dry_run"`
}

// SkipEvent drops the row whose event_id is eventID from its ordering key's
// order, in an ordered table: the row must hold its key (failing or dead);
// the relay then continues the key with its next row and never delivers
// the skipped row again. The row stays in the table, its last_error
// recording the skip. Any other row is refused with ErrNotHeld.
func SkipEvent(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (EventSkip, error) {
	if err := checkTable(t); err != nil {
		return EventSkip{}, err
	}
	if wal, err := walHolds(ctx, db, t); err != nil {
		return EventSkip{}, err
	} else if wal {
		return skipWAL(ctx, db, t, eventID, dryRun)
	}
	oq, key, seq, _, ok, err := holdOf(ctx, db, t, eventID)
	if err != nil {
		return EventSkip{}, err
	}
	if !ok {
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w (skip applies to the row a held key waits for; list them with `outbox keys held`); nothing changed",
			eventID, t, ErrNotHeld)
	}
	res := EventSkip{Table: t.String(), Key: key, Sequence: seq, Statement: schema.Statement{SQL: oq.SkipHold, Args: []any{key, seq}}}
	if dryRun {
		res.DryRun = true
		return res, nil
	}
	var done bool
	if err := db.QueryRow(ctx, oq.SkipHold, key, seq).Scan(&done); err != nil {
		return EventSkip{}, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	if !done {
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: the hold moved on meanwhile; nothing changed, look again", eventID, t)
	}
	res.Changed = 1
	wake(ctx, db, schema.NewRunbookQueries(t))
	return res, nil
}

// OrderedRelays counts the ordered relays at work on t: those owning a
// partition whose lease has not expired. A table without ordered mode has
// none.
func OrderedRelays(ctx context.Context, db DB, t schema.Table) (int, error) {
	if err := checkTable(t); err != nil {
		return 0, err
	}
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

// walHolds tells whether t is streamed by the WAL relay (it has a WAL
// holds table).
func walHolds(ctx context.Context, db DB, t schema.Table) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, schema.WALHoldsTableExists(t)).Scan(&ok); err != nil {
		return false, dbError(t, "look up the WAL holds table of", err)
	}
	return ok, nil
}

// skipWAL is SkipEvent for a table the WAL relay streams: it records the
// skip request on the hold; the active relay applies it at its next tick.
func skipWAL(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID, dryRun bool) (EventSkip, error) {
	st := schema.Statement{SQL: schema.WALSkipHold(t), Args: []any{eventID.String()}}
	res := EventSkip{Table: t.String(), Statement: st, DryRun: dryRun}
	if dryRun {
		return res, nil
	}
	err := db.QueryRow(ctx, st.SQL, st.Args...).Scan(&res.Key, &res.Sequence)
	if errors.Is(err, pgx.ErrNoRows) {
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w (skip applies to the dead row a held key waits for; list them with `outbox keys held`); nothing changed",
			eventID, t, ErrNotHeld)
	}
	if err != nil {
		return EventSkip{}, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	res.Changed = 1
	return res, nil
}
