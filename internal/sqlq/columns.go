package sqlq

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
	// ColumnDeadAt is when the row went dead; NULL while it is not dead.
	ColumnDeadAt      = "dead_at"
	ColumnTraceParent = "traceparent"
	ColumnTraceState  = "tracestate"
	ColumnHeaders     = "headers"
	// ColumnOrderingKey is the optional key of ordered mode (docs/ORDERING.md).
	ColumnOrderingKey = "ordering_key"
)
