package schema

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Column names of the outbox table.
const (
	ColumnID          = "id"
	ColumnTenantID    = "tenant_id"
	ColumnTopic       = "topic"
	ColumnPayload     = "payload"
	ColumnEventID     = "event_id"
	ColumnSequence    = "sequence"
	ColumnCreatedAt   = "created_at"
	ColumnPublishedAt = "published_at"
	ColumnAttempts    = "attempts"
	ColumnAvailableAt = "available_at"
	ColumnLockedAt    = "locked_at"
	ColumnLastError   = "last_error"
	ColumnTraceParent = "traceparent"
	ColumnTraceState  = "tracestate"
	ColumnHeaders     = "headers"
	// ColumnOrderingKey is the optional key of ordered mode (docs/ORDERING.md).
	ColumnOrderingKey = "ordering_key"
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
	var (
		found                bool
		parent, state, heads bool
		okey                 bool
	)
	err := q.QueryRow(ctx, `
SELECT to_regclass($1) IS NOT NULL,
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'traceparent' AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'tracestate'  AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'headers'     AND NOT attisdropped),
       EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'ordering_partition' AND NOT attisdropped)`,
		t.Sanitize()).Scan(&found, &parent, &state, &heads, &okey)
	if err != nil {
		return Columns{}, fmt.Errorf("detect columns of %s: %w", t, err)
	}
	if !found {
		return Columns{}, fmt.Errorf("%w: %s (create it with schema.Migrate or `outbox migrate`)", ErrTableNotFound, t)
	}
	return Columns{TraceContext: parent && state, Headers: heads, OrderingKey: okey}, nil
}
