package schema

import "strings"

// skippedAtEveryTableStatements add skipped_at to table t whatever its mode
// (migration 000013): where an operator's skip is recorded in every mode
// (runbook.Runbook.SkipEvent), the default mode included. It is a no-op on
// a keyed table, which 000012 gave the column; a nullable column without a
// default is added without a rewrite. Nothing is backfilled: no earlier
// version skipped a row of a table without ordering_key.
func skippedAtEveryTableStatements(t Table) []string {
	return []string{`ALTER TABLE ` + t.Sanitize() + ` ADD COLUMN IF NOT EXISTS skipped_at TIMESTAMPTZ NULL`}
}

// skippedAtEveryTableUpSQL is the DDL of migration 000013.
func skippedAtEveryTableUpSQL(t Table) string {
	return joinStatements(skippedAtEveryTableStatements(t))
}

// skippedAtEveryTableDownSQL reverts skippedAtEveryTableUpSQL on a table
// without ordering_key (a keyed table keeps the column of 000012, whose
// down migration drops it): skipped rows then read as pending again, and
// the relay delivers them.
func skippedAtEveryTableDownSQL(t Table) string {
	lit := "'" + strings.ReplaceAll(t.Sanitize(), "'", "''") + "'"
	return joinStatements([]string{`DO $$
BEGIN
  IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(` + lit + `) AND attname = 'ordering_key' AND NOT attisdropped) THEN
    ALTER TABLE ` + t.Sanitize() + ` DROP COLUMN IF EXISTS skipped_at;
  END IF;
END $$`})
}

// skippedEveryTableNote heads migration 000013.
const skippedEveryTableNote = "-- Every table (a no-op on a keyed table, which 000012 gave the column): adds skipped_at, where an\n" +
	"-- operator's skip is recorded in every mode (`outbox dead skip`, runbook.Runbook.SkipEvent, the console),\n" +
	"-- the default mode included: the row is then done, not dead, never delivered again unless replayed.\n" +
	"-- A nullable column without a default: no rewrite, only a brief lock of the table.\n"
