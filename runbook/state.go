package runbook

import (
	"context"
	"errors"
	"fmt"

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
