package runbook

import (
	"context"
	"errors"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// stateOf returns the state statements of t in the mode it is relayed in
// (schema.StateQueries, the one place that knows each mode's state).
func stateOf(ctx context.Context, db DB, t schema.Table) (schema.StateQueries, error) {
	var walProgress, published, ordered, walHolds bool
	if err := db.QueryRow(ctx, schema.ModeProbe(t)).Scan(&walProgress, &published, &ordered, &walHolds); err != nil {
		return schema.StateQueries{}, dbError(t, "find the relay mode of", err)
	}
	cols, err := schema.DetectColumns(ctx, db, t)
	if errors.Is(err, schema.ErrTableNotFound) {
		return schema.StateQueries{}, fmt.Errorf("runbook: read %s: %w: check the table name, or create it with schema.Migrate or `outbox migrate --table=%s`",
			t, schema.ErrTableNotFound, t)
	}
	if err != nil {
		return schema.StateQueries{}, dbError(t, "detect the columns of", err)
	}
	mode := schema.DecideMode(walProgress, published, ordered, cols)
	if mode == schema.ModeWAL && !walHolds {
		cols.OrderingKey = false // a WAL set-up without a holds table: no key is held
	}
	return schema.NewStateQueries(t, mode, cols), nil
}

// Mode tells how t is relayed: schema.ModeWAL for a table the WAL relay
// streams, schema.ModeOrdered for a table with ordered mode's column and
// companion tables, schema.ModeDefault otherwise.
func Mode(ctx context.Context, db DB, t schema.Table) (schema.Mode, error) {
	if err := checkTable(t); err != nil {
		return "", err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return "", err
	}
	return sq.Mode, nil
}

// scanState reads a row of schema.StateColumns (then extra).
func scanState(s schema.Scanner, extra ...any) (Row, error) {
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

func queryStateRows(ctx context.Context, db DB, t schema.Table, op string, st schema.Statement) ([]Row, error) {
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
