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

// ErrNoSkippedAt is matched (errors.Is) by the error of SkipEvent on a
// table without the skipped_at column, where a skip is recorded: a
// default-mode table made by an earlier version. Nothing was changed; the
// error names the migration that adds the column.
var ErrNoSkippedAt = errors.New("outbox table has no skipped_at column")

// SkippedAtMigration names the shipped migration that adds skipped_at to
// a table without an ordering_key column (000012 adds it to keyed tables).
const SkippedAtMigration = "000013_add_<table>_skipped_at_every_table.up.sql"

// hasSkippedAt tells whether t has the skipped_at column.
func hasSkippedAt(ctx context.Context, db DB, t schema.Table) (bool, error) {
	var ok bool
	if err := db.QueryRow(ctx, sqlq.WALSkippedAtExists(t)).Scan(&ok); err != nil {
		return false, dbError(t, "look up the skipped_at column of", err)
	}
	return ok, nil
}

// skipRow is SkipEvent for a row that holds no ordering key, in a table
// whose mode records a skip in the row itself: every row of a default-mode
// table, the unkeyed rows of an ordered table and its keyed rows that died
// under the default relay before the switch (dead_at; no ordered relay
// reads them). The row's state must allow a skip by the row rules
// (RowState.Allows: pending, retrying or dead, not leased by a relay less
// than lockTTL ago); the skip is applied at once (skipped_at,
// EventSkip.Applied). A keyed row of an ordered table in any other state
// is refused with ErrNotHeld: it is skipped through its key's hold.
func skipRow(ctx context.Context, db DB, sq sqlq.StateQueries, eventID uuid.UUID, lockTTL time.Duration, dryRun bool) (EventSkip, error) {
	t := sq.Table
	ok, err := hasSkippedAt(ctx, db, t)
	if err != nil {
		return EventSkip{}, err
	}
	if !ok {
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w, where a skip is recorded; run `outbox migrate --table=%s` (schema.Migrate) "+
			"or apply the shipped %s, which adds it without a rewrite; nothing changed", eventID, t, ErrNoSkippedAt, t, SkippedAtMigration)
	}
	row, err := skipCheck(ctx, db, sq, eventID, lockTTL)
	if err != nil {
		return EventSkip{}, err
	}
	q := sqlq.NewRunbookQueries(t)
	res := EventSkip{Table: t.String(), Sequence: row.Sequence, Applied: true,
		Statement: Statement(q.SkipRow(eventID.String(), lockTTL, sq.Mode == schema.ModeOrdered))}
	if row.OrderingKey != nil {
		res.Key = *row.OrderingKey
	}
	if dryRun {
		res.DryRun, res.Applied = true, false
		return res, nil
	}
	var seq int64
	err = db.QueryRow(ctx, res.Statement.SQL, res.Statement.Args...).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		// The row changed between the look-up and the update: say how.
		if _, again := skipCheck(ctx, db, sq, eventID, lockTTL); again != nil {
			return EventSkip{}, again
		}
		return EventSkip{}, fmt.Errorf("runbook: cannot skip event %s of %s: the row changed while it was being skipped; nothing changed, look at it again and retry", eventID, t)
	}
	if err != nil {
		return EventSkip{}, dbError(t, "skip event "+eventID.String()+" of", err)
	}
	res.Changed = 1
	return res, nil
}

// skipCheck reads the row of eventID through the state reader sq and
// returns it when the row rules allow its skip; otherwise the refusal.
func skipCheck(ctx context.Context, db DB, sq sqlq.StateQueries, eventID uuid.UUID, lockTTL time.Duration) (Row, error) {
	t := sq.Table
	row, leased, err := eventLease(ctx, db, sq, eventID, lockTTL)
	if errors.Is(err, ErrEventNotFound) {
		return Row{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w: no row has this event_id; check the table name and the event_id; nothing changed", eventID, t, ErrEventNotFound)
	}
	if err != nil {
		return Row{}, err
	}
	s := row.State()
	if leased && s != RowDelivered && s != RowSkipped {
		s = RowInFlight
	}
	if sq.Mode == schema.ModeOrdered && row.OrderingKey != nil && s != RowDead && s != RowDelivered && s != RowSkipped {
		return Row{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w (a keyed row of an ordered table is skipped when it holds its key; list them with `outbox keys held`); nothing changed",
			eventID, t, ErrNotHeld)
	}
	if err := s.Allows(sq.Mode, OpSkip); err != nil {
		return Row{}, fmt.Errorf("runbook: cannot skip event %s of %s: %w; nothing changed", eventID, t, err)
	}
	return row, nil
}
