package schema

// The holds table <table>_holds is one table for both keyed modes: ordered
// mode (package subscriber) and the WAL relay (package walrelay) keep there,
// per ordering key, the row that holds the key back (a failing, dead or
// skipped row) and the hold's state. A row of it belongs to the mode that
// wrote it (mode); a switch between the keyed modes is refused while the
// other mode's holds are open, so one table only ever has one mode's open
// holds.

// suffixHoldsMode names the check of a hold's mode.
const suffixHoldsMode = "_holds_mode"

// holdStateExpr is the expression of the generated column state of
// <table>_holds: one of resolved (a tombstone: the key's rows up to the
// hold's sequence are done), draining (the WAL relay delivers the rows the
// hold kept back), skip_requested, retrying (the held row failed and waits
// for its retry; for the WAL relay also: its key's backlog was spilled to
// the table), dead, replay (an operator's replay of the held row is due),
// in that order of precedence. The statements of both modes write the
// hold's facts (resolved_at, draining, skip_requested_at, spilled, dead_at,
// replay); the state follows from them by this one rule, so that no reader
// derives it on its own.
const holdStateExpr = `CASE WHEN resolved_at IS NOT NULL THEN 'resolved'
  WHEN draining THEN 'draining'
  WHEN skip_requested_at IS NOT NULL THEN 'skip_requested'
  WHEN spilled THEN 'retrying'
  WHEN dead_at IS NOT NULL THEN 'dead'
  WHEN replay THEN 'replay'
  ELSE 'retrying' END`

// holdsTableStatements create the holds table of t in this version's shape,
// or bring one made by an older version to it, idempotently.
func holdsTableStatements(t Table) []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.HoldsTable() + ` (
  ordering_key      TEXT        NOT NULL,
  partition         SMALLINT    NOT NULL,
  sequence          BIGINT      NOT NULL,
  attempts          INT         NOT NULL DEFAULT 0,
  available_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
  last_error        TEXT        NULL,
  dead_at           TIMESTAMPTZ NULL,
  skip_requested_at TIMESTAMPTZ NULL,
  created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
  CONSTRAINT ` + t.ident(suffixHolds+suffixPkey) + ` PRIMARY KEY (ordering_key)
)`,
		`CREATE INDEX IF NOT EXISTS ` + t.ident(suffixHoldsByPartition) + ` ON ` + t.HoldsTable() + ` (partition)`,
		holdsStateStatement(t),
		holdsOneTableStatement(t),
		holdsStateColumnStatement(t),
	}
}

// HoldsTableSQL returns the DDL that creates the holds table of t, or
// brings one made by an older version to this version's shape
// (idempotent): the WAL relay's set-up runs it for a table without ordered
// mode.
func HoldsTableSQL(t Table) string { return joinStatements(holdsTableStatements(t)) }

// holdsOneTableStatement adds the columns of the WAL relay's holds to a
// holds table made by an older version: the mode that wrote the hold, the
// held row's event_id, whether the WAL relay drains the hold or spilled its
// key's backlog to the table, the last sequence a drain read (through) and
// the WAL position its rows were read at (until_lsn).
func holdsOneTableStatement(t Table) string {
	return `ALTER TABLE ` + t.HoldsTable() + ` ADD COLUMN IF NOT EXISTS mode TEXT NOT NULL DEFAULT 'ordered'
    CONSTRAINT ` + t.ident(suffixHoldsMode) + ` CHECK (mode IN ('ordered', 'wal')),
  ADD COLUMN IF NOT EXISTS event_id UUID NULL,
  ADD COLUMN IF NOT EXISTS draining BOOLEAN NOT NULL DEFAULT false,
  ADD COLUMN IF NOT EXISTS spilled BOOLEAN NOT NULL DEFAULT false,
  ADD COLUMN IF NOT EXISTS through BIGINT NOT NULL DEFAULT 0,
  ADD COLUMN IF NOT EXISTS until_lsn PG_LSN NULL`
}

// holdsStateColumnStatement adds the generated state column
// (holdStateExpr); it rewrites the (small) holds table once.
func holdsStateColumnStatement(t Table) string {
	return `ALTER TABLE ` + t.HoldsTable() + ` ADD COLUMN IF NOT EXISTS state TEXT GENERATED ALWAYS AS (` + holdStateExpr + `) STORED`
}

// oneHoldsTableUpSQL returns the DDL of migration 000011: the holds table of
// an ordered table t takes the shape both keyed modes share.
func oneHoldsTableUpSQL(t Table) string {
	return holdsOneTableStatement(t) + ";\n" + holdsStateColumnStatement(t) + ";\n"
}

// oneHoldsTableDownSQL reverts oneHoldsTableUpSQL (the WAL relay's holds,
// if any, lose their columns).
func oneHoldsTableDownSQL(t Table) string {
	return `ALTER TABLE ` + t.HoldsTable() + ` DROP COLUMN IF EXISTS state, DROP COLUMN IF EXISTS mode, DROP COLUMN IF EXISTS event_id,
  DROP COLUMN IF EXISTS draining, DROP COLUMN IF EXISTS spilled, DROP COLUMN IF EXISTS through, DROP COLUMN IF EXISTS until_lsn;` + "\n"
}
