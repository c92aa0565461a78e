package schema

import "github.com/outboxkit/watermill-outbox/internal/pgmeta"

// skippedAtStatements add skipped_at to a keyed table t and mark skipped
// the rows earlier versions recorded as skipped (pgmeta.SkippedAt).
func skippedAtStatements(t Table) []string { return pgmeta.SkippedAt(t.Sanitize()) }

// skippedAtUpSQL is the DDL of migration 000012.
func skippedAtUpSQL(t Table) string { return joinStatements(skippedAtStatements(t)) }

// skippedAtDownSQL reverts skippedAtUpSQL: skipped rows then read as
// delivered.
func skippedAtDownSQL(t Table) string {
	return joinStatements([]string{`ALTER TABLE ` + t.Sanitize() + ` DROP COLUMN IF EXISTS skipped_at`})
}

// skippedNote heads the skipped_at migration.
const skippedNote = "-- Keyed tables only (skip it for a table without ordering_key): adds skipped_at, the time a keyed\n" +
	"-- relay applied an operator's skip to the row (done, not dead, never delivered again unless replayed),\n" +
	"-- without rewriting the table, and marks skipped the rows earlier versions recorded as skipped in\n" +
	"-- last_error: one pass over the table while the ALTER's lock is held (writers wait), so on a large\n" +
	"-- table apply it in a quiet moment. Keyed relays of this version refuse a table without it.\n"
