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
	"errors"
	"fmt"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrNotMigrated is matched (errors.Is) by the error of Of for a keyed
// table whose holds this version cannot read yet; the error names the step
// to run.
var ErrNotMigrated = errors.New("the table's holds are not migrated to this version")

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
	var walProgress, published, ordered, holdsShaped, legacy, skippedAt bool
	if err := q.QueryRow(ctx, sqlq.ModeProbe(t)).Scan(&walProgress, &published, &ordered, &holdsShaped, &legacy, &skippedAt); err != nil {
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
	switch {
	case mode == schema.ModeWAL && legacy && cols.OrderingKey:
		// Its holds are where this version does not read them: reading
		// the table as holding no key would let the cleaner delete the rows
		// they park, and replays pass their rule.
		return Reader{}, fmt.Errorf("%w: the WAL relay's holds of %s are in %s, kept by an older version; this version reads them from %s: "+
			"stop the older WAL relays and run `outbox migrate --wal --table=%s` (walrelay.Setup) once, which moves them", ErrNotMigrated, t,
			sqlq.LegacyWALHoldsTable(t), t.HoldsTable(), t)
	case mode == schema.ModeWAL && !holdsShaped:
		cols.OrderingKey = false // a WAL set-up without a holds table: no key is held
	case mode == schema.ModeOrdered && !holdsShaped:
		return Reader{}, fmt.Errorf("%w: the holds table %s of %s has no state column; apply migration 000011 (`outbox migrate --ordered --table=%s`, "+
			"or the shipped 000011_add_<table>_one_holds_table.up.sql)", ErrNotMigrated, t.HoldsTable(), t, t)
	case mode == schema.ModeWAL && cols.OrderingKey && !skippedAt:
		// A skipped row would read as dead or delivered.
		return Reader{}, fmt.Errorf("%w: %s has no skipped_at column, where this version records a skip; stop the older WAL relays and run "+
			"`outbox migrate --wal --table=%s` (walrelay.Setup) once", ErrNotMigrated, t, t)
	case mode == schema.ModeOrdered && cols.OrderingKey && !skippedAt:
		return Reader{}, fmt.Errorf("%w: %s has no skipped_at column, where this version records a skip; apply migration 000012 "+
			"(`outbox migrate --ordered --table=%s`, or the shipped 000012_add_<table>_skipped_at.up.sql)", ErrNotMigrated, t, t)
	}
	r.StateQueries = sqlq.NewStateQueries(t, mode, cols)
	return r, nil
}
