package schema

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Metadata keys set on every message that comes out of an outbox table.
const (
	MetadataEventID     = "event_id"
	MetadataTenantID    = "tenant_id"
	MetadataTopic       = "topic"
	MetadataSequence    = "sequence"
	MetadataAttempts    = "attempts"
	MetadataTable       = "table"
	MetadataTraceParent = "traceparent"
	MetadataTraceState  = "tracestate"
	// MetadataOrderingKey is set on every message whose row has an
	// ordering key.
	MetadataOrderingKey = "ordering_key"
)

// ReservedMetadata reports whether key is one of the metadata keys the outbox
// sets from its own columns; such keys are never stored in the headers column.
func ReservedMetadata(key string) bool {
	switch key {
	case MetadataEventID, MetadataTenantID, MetadataTopic, MetadataSequence,
		MetadataAttempts, MetadataTable, MetadataTraceParent, MetadataTraceState, MetadataOrderingKey:
		return true
	}
	return false
}

// Columns says which optional columns a table has.
type Columns struct {
	// TraceContext is true when the table has both traceparent and tracestate.
	TraceContext bool
	// Headers is true when the table has the headers column.
	Headers bool
	// OrderingKey is true when the table has the ordering_key column (and
	// the ordering_partition column derived from it) of ordered mode.
	OrderingKey bool
	// SkippedAt is true when the table has the skipped_at column of a keyed
	// table (migration 000012), where a keyed relay records a skip: every
	// claim then leaves skipped rows out (a skipped row is done, never
	// delivered again unless replayed).
	SkippedAt bool
	// DeadNotices is true when the table has its companion table of death
	// notices (<table>_dead_notices, migration 000015): the table relays
	// then record each row that goes dead outside the router (its lease
	// expired on its last allowed attempt) there, in the statement that
	// parks it.
	DeadNotices bool
}

// ErrTableNotFound is returned (wrapped) by DetectColumns when the table does
// not exist.
var ErrTableNotFound = errors.New("outbox table not found")

// Querier runs a query returning one row; pgx.Tx, *pgx.Conn and
// *pgxpool.Pool satisfy it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DetectColumns looks up which optional columns table t has. A table with
// only the standard columns is valid. It fails with ErrTableNotFound when the
// table does not exist (run Migrate first).
func DetectColumns(ctx context.Context, q Querier, t Table) (Columns, error) {
	c, _, err := detectColumns(ctx, q, t)
	return c, err
}

// ErrNoDeadAt is returned (wrapped) by CheckDeadAt when the table predates
// the dead_at column.
var ErrNoDeadAt = errors.New("outbox table has no dead_at column")

// CheckDeadAt fails with ErrNoDeadAt when table t has no dead_at column,
// which the relay, the cleaner and the runbook read: the table was created
// by an older version and needs its migration (schema.Migrate, `outbox
// migrate`, or the shipped 000004 migration), which adds the column without
// rewriting the table.
func CheckDeadAt(ctx context.Context, q Querier, t Table) error {
	_, facts, err := detectColumns(ctx, q, t)
	if err != nil {
		return err
	}
	if !facts.deadAt {
		return fmt.Errorf("%w: %s (add it with schema.Migrate or `outbox migrate --table=%s`; it does not rewrite the table)", ErrNoDeadAt, t, t)
	}
	return nil
}

// tableFacts are what detectColumns finds besides the optional columns:
// whether t has dead_at (migration 000004) and skipped_at (000012).
type tableFacts struct {
	deadAt, skippedAt bool
}

func detectColumns(ctx context.Context, q Querier, t Table) (Columns, tableFacts, error) {
	var (
		found                bool
		parent, state, heads bool
		okey, notices        bool
		f                    tableFacts
	)
	err := q.QueryRow(ctx, `
SELECT to_regclass($1) IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'traceparent' AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'tracestate'  AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'headers'     AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'ordering_partition' AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'dead_at' AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'skipped_at' AND NOT attisdropped),
       to_regclass($2) IS NOT NULL`,
		t.Sanitize(), t.deadNoticesTable()).Scan(&found, &parent, &state, &heads, &okey, &f.deadAt, &f.skippedAt, &notices)
	if err != nil {
		return Columns{}, tableFacts{}, fmt.Errorf("detect columns of %s: %w", t, err)
	}
	if !found {
		return Columns{}, tableFacts{}, fmt.Errorf("%w: %s (create it with schema.Migrate or `outbox migrate`)", ErrTableNotFound, t)
	}
	return Columns{TraceContext: parent && state, Headers: heads, OrderingKey: okey, SkippedAt: f.skippedAt, DeadNotices: notices}, f, nil
}
