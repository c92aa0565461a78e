package runbook

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Event reads the row whose event_id is eventID; the error matches
// ErrEventNotFound (errors.Is) when there is none.
func Event(ctx context.Context, db DB, t schema.Table, eventID uuid.UUID) (Row, error) {
	if err := checkTable(t); err != nil {
		return Row{}, err
	}
	st := schema.NewRunbookQueries(t).Event(eventID.String(), schema.LockTTLDefault)
	var dead, leased bool
	row, err := scanRow(db.QueryRow(ctx, st.SQL, st.Args...), &dead, &leased)
	if errors.Is(err, pgx.ErrNoRows) {
		return Row{}, fmt.Errorf("runbook: event %s of %s: %w", eventID, t, ErrEventNotFound)
	}
	if err != nil {
		return Row{}, dbError(t, "look up event "+eventID.String()+" in", err)
	}
	return row, nil
}
