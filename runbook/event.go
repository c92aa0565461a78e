package runbook

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// Event reads the row whose event_id is eventID and its state in the
// table's relay mode (delivered, held, waiting behind a held key, skipped,
// replay due; for a held keyed row of an ordered table, the hold's
// attempts, last_error and dead_at); the error matches ErrEventNotFound
// (errors.Is) when there is none.
func (r *Runbook) Event(ctx context.Context, eventID uuid.UUID) (Row, error) {
	if err := r.check(); err != nil {
		return Row{}, err
	}
	db, t := r.db, r.table
	rd, err := readerOf(ctx, db, t)
	if err != nil {
		return Row{}, err
	}
	return eventState(ctx, db, rd.StateQueries, eventID, leaseTTL(rd, 0))
}

// eventState reads one event's row through the state statements sq,
// judging its lease by lockTTL.
func eventState(ctx context.Context, db DB, sq sqlq.StateQueries, eventID uuid.UUID, lockTTL time.Duration) (Row, error) {
	row, _, err := eventLease(ctx, db, sq, eventID, lockTTL)
	return row, err
}

// eventLease is eventState, and whether a relay's lease on the row is live
// (taken less than lockTTL ago).
func eventLease(ctx context.Context, db DB, sq sqlq.StateQueries, eventID uuid.UUID, lockTTL time.Duration) (Row, bool, error) {
	t := sq.Table
	st := sq.Event(eventID.String(), lockTTL.Seconds())
	var dead, leased bool
	row, err := scanState(db.QueryRow(ctx, st.SQL, st.Args...), &dead, &leased)
	if errors.Is(err, pgx.ErrNoRows) {
		return Row{}, false, fmt.Errorf("runbook: event %s of %s: %w", eventID, t, ErrEventNotFound)
	}
	if err != nil {
		return Row{}, false, dbError(t, "look up event "+eventID.String()+" in", err)
	}
	return row, leased, nil
}
