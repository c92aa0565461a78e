// Package state chooses the one state reader of an outbox table: the
// statements of schema.StateQueries in the mode the table is relayed in.
// The runbook (and so the CLI and the console), the cleaner and the relay's
// gauges all read a table through it, so that they agree on where a row's
// state lives.
//
// The mode is the one recorded for the table (schema.RecordedMode: written
// by migrate's explicit steps and by every relay that starts on the
// table); a table without a record (nothing recorded yet, or migrated by
// an earlier version) falls back to the mode inferred from what exists
// (schema.ModeProbe, schema.DecideMode).
package state

import (
	"context"
	"errors"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrModeTablesMissing is matched (errors.Is) by the error of Of when the
// recorded mode's tables are missing (an ordered table without its
// companion tables, a WAL table without its progress table).
var ErrModeTablesMissing = errors.New("the tables of the recorded relay mode are missing")

// Reader is the state reader of one table.
type Reader struct {
	schema.StateQueries
	// Record is the table's mode record, nil when the mode was inferred.
	Record *schema.ModeRecord
}

// Of returns the state reader of t in its mode. It fails with
// schema.ErrTableNotFound (wrapped) when t does not exist, and with
// ErrModeTablesMissing when the recorded mode's tables are missing.
func Of(ctx context.Context, q schema.Querier, t schema.Table) (Reader, error) {
	cols, err := schema.DetectColumns(ctx, q, t)
	if err != nil {
		return Reader{}, err
	}
	var walProgress, published, ordered, walHolds bool
	if err := q.QueryRow(ctx, schema.ModeProbe(t)).Scan(&walProgress, &published, &ordered, &walHolds); err != nil {
		return Reader{}, fmt.Errorf("find the relay mode of %s: %w", t, err)
	}
	rec, recorded, err := schema.RecordedMode(ctx, q, t)
	if err != nil {
		return Reader{}, err
	}
	mode := schema.DecideMode(walProgress, published, ordered, cols)
	var r Reader
	if recorded {
		mode, r.Record = rec.Mode, &rec
		switch {
		case mode == schema.ModeOrdered && (!ordered || !cols.OrderingKey):
			return Reader{}, fmt.Errorf("%s is recorded as relayed in ordered mode (by %s at %s), but its ordering column or companion tables are missing: %w; run `outbox migrate --ordered --table=%s`",
				t, rec.RecordedBy, rec.RecordedAt.UTC().Format("2006-01-02 15:04:05Z"), ErrModeTablesMissing, t)
		case mode == schema.ModeWAL && !walProgress:
			return Reader{}, fmt.Errorf("%s is recorded as relayed by the WAL relay (by %s at %s), but its progress table is missing: %w; run `outbox migrate --wal --table=%s`",
				t, rec.RecordedBy, rec.RecordedAt.UTC().Format("2006-01-02 15:04:05Z"), ErrModeTablesMissing, t)
		}
	}
	if mode == schema.ModeWAL && !walHolds {
		cols.OrderingKey = false // a WAL set-up without a holds table: no key is held
	}
	r.StateQueries = schema.NewStateQueries(t, mode, cols)
	return r, nil
}
