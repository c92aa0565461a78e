// Package state chooses the one state reader of an outbox table: the
// statements of sqlq.StateQueries in the mode the table is relayed in.
// The runbook (and so the CLI and the console), the cleaner and the relay's
// gauges all read a table through it, so that they agree on where a row's
// state lives.
//
// The mode is the one recorded for the table (schema.RecordedMode: written
// by migrate's explicit steps and by every relay that starts on the
// table); a table without a record (nothing recorded yet, or migrated by
// an earlier version) falls back to the mode inferred from what exists
// (sqlq.ModeProbe, sqlq.DecideMode).
package state

import (
	"context"
	"fmt"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Reader is the state reader of one table.
type Reader struct {
	sqlq.StateQueries
	// Record is the table's mode record, nil when the mode was inferred.
	Record *schema.ModeRecord
}

// Of returns the state reader of t in its mode. It fails with
// schema.ErrTableNotFound (wrapped) when t does not exist. A recorded mode
// whose tables are gone (an ordered table whose companion tables were
// dropped, a WAL table after walrelay.Teardown) is not read: the mode is
// then inferred, as for a table without a record, until a relay or
// migrate records another.
func Of(ctx context.Context, q schema.Querier, t schema.Table) (Reader, error) {
	cols, err := schema.DetectColumns(ctx, q, t)
	if err != nil {
		return Reader{}, err
	}
	var walProgress, published, ordered, walHolds bool
	if err := q.QueryRow(ctx, sqlq.ModeProbe(t)).Scan(&walProgress, &published, &ordered, &walHolds); err != nil {
		return Reader{}, fmt.Errorf("find the relay mode of %s: %w", t, err)
	}
	rec, recorded, err := schema.RecordedMode(ctx, q, t)
	if err != nil {
		return Reader{}, err
	}
	mode := sqlq.DecideMode(walProgress, published, ordered, cols)
	var r Reader
	if recorded {
		switch rec.Mode {
		case schema.ModeOrdered:
			recorded = ordered && cols.OrderingKey
		case schema.ModeWAL:
			recorded = walProgress
		}
	}
	if recorded {
		mode, r.Record = rec.Mode, &rec
	}
	if mode == schema.ModeWAL && !walHolds {
		cols.OrderingKey = false // a WAL set-up without a holds table: no key is held
	}
	r.StateQueries = sqlq.NewStateQueries(t, mode, cols)
	return r, nil
}
