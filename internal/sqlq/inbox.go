package sqlq

import "github.com/outboxkit/watermill-outbox/schema"

// InboxQueries are the statements of an inbox table (package inbox): one row
// per (consumer, key) a consumer has handled, committed in the same
// transaction as the handler's effects.
type InboxQueries struct {
	// Exists selects whether the table exists ($1: the sanitized name).
	Exists string
	// Record inserts (consumer $1, key $2). It affects one row for a new
	// key and none for a key already committed; a copy in flight makes it
	// wait on that copy's transaction.
	Record string
	// RecordNoWait is Record that never waits: it first tries a
	// transaction-level advisory lock on (consumer, key) and inserts only
	// when it got it. It returns (locked bool, inserted bool); locked false
	// means another transaction is handling the same key now.
	RecordNoWait string
	// DeleteExpired deletes at most $3 rows of consumer $1 processed before
	// now() - $2 microseconds.
	DeleteExpired string
	// Count counts the rows of consumer $1 (tests and the runbook).
	Count string
}

// NewInboxQueries renders the inbox statements for table t.
func NewInboxQueries(t schema.Table) *InboxQueries {
	tbl := t.Sanitize()
	// The advisory-lock key: 64 bits of hashtextextended over the table, the
	// consumer (length-prefixed, so that no two pairs render alike) and the
	// key. The table name keeps two inbox tables apart.
	lockKey := `hashtextextended(` + quoteLiteral("inbox:"+t.Qualified()+":") + ` || length($1)::text || ':' || $1 || $2, 0)`
	return &InboxQueries{
		Exists: `SELECT to_regclass($1) IS NOT NULL`,
		Record: `INSERT INTO ` + tbl + ` (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
		RecordNoWait: `WITH l AS MATERIALIZED (SELECT pg_try_advisory_xact_lock(` + lockKey + `) AS locked),
ins AS (INSERT INTO ` + tbl + ` (consumer, key) SELECT $1, $2 FROM l WHERE l.locked ON CONFLICT DO NOTHING RETURNING 1)
SELECT (SELECT locked FROM l), EXISTS (SELECT 1 FROM ins)`,
		DeleteExpired: `DELETE FROM ` + tbl + ` WHERE ctid = ANY (ARRAY(
  SELECT ctid FROM ` + tbl + ` WHERE consumer = $1 AND processed_at < now() - $2::bigint * interval '1 microsecond'
  ORDER BY processed_at LIMIT $3))`,
		Count: `SELECT count(*) FROM ` + tbl + ` WHERE consumer = $1`,
	}
}

// quoteLiteral renders s as a SQL string literal. s comes from a validated
// schema.Table, but quote anyway.
func quoteLiteral(s string) string {
	out := []byte{'\''}
	for i := 0; i < len(s); i++ {
		if s[i] == '\'' {
			out = append(out, '\'')
		}
		out = append(out, s[i])
	}
	return string(append(out, '\''))
}
