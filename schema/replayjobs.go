package schema

import (
	"context"
	"errors"
	"fmt"
)

// suffixReplayJobs names the companion table of bulk replay jobs.
const suffixReplayJobs = "_replay_jobs"

// ReplayJobTextMaxBytes bounds each text of a replay job's record: the
// filter's topic, error text and cause, who asked and from where (a CHECK
// of the replay jobs' table; the runbook shortens longer texts first).
const ReplayJobTextMaxBytes = 500

// ReplayJobIDMaxBytes bounds a replay job's id (the console's are 16 hex
// digits).
const ReplayJobIDMaxBytes = 64

// ErrNoReplayJobs is matched (errors.Is) by the runbook's error when the
// table of replay jobs of an outbox table does not exist: migration 000008
// (schema.Migrate, `outbox migrate`) creates it.
var ErrNoReplayJobs = errors.New("the table of replay jobs does not exist (migration 000008)")

// ReplayJobsTable names the companion table of the bulk replays started
// from the console (runbook.SaveReplayJob), sanitized for SQL.
func (t Table) ReplayJobsTable() string { return t.companion(suffixReplayJobs) }

// replayJobsStatement creates the replay jobs' table of t, idempotently.
// It does not lock t.
func replayJobsStatement(t Table) string {
	text := func(col string) string {
		return fmt.Sprintf("%-14s TEXT        NOT NULL DEFAULT '' CHECK (octet_length(%s) <= %d)", col, col, ReplayJobTextMaxBytes)
	}
	return `CREATE TABLE IF NOT EXISTS ` + t.ReplayJobsTable() + ` (
  id             TEXT        NOT NULL PRIMARY KEY CHECK (octet_length(id) BETWEEN 1 AND ` + itoa(ReplayJobIDMaxBytes) + `),
  created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
  ` + text("topic") + `,
  ` + text("error_contains") + `,
  ` + text("cause") + `,
  row_count      BIGINT      NOT NULL CHECK (row_count >= 0),
  event_ids      UUID[]      NOT NULL,
  ` + text("requested_by") + `,
  ` + text("remote") + `
)`
}

// ReplayJobsUpSQL returns the DDL that creates the table of replay jobs of
// an existing table t (idempotent; the shipped migration 000008).
func ReplayJobsUpSQL(t Table) string { return replayJobsStatement(t) + ";\n" }

// ReplayJobsDownSQL reverts ReplayJobsUpSQL: the records of past bulk
// replays are lost (the replayed rows are not).
func ReplayJobsDownSQL(t Table) string {
	return `DROP TABLE IF EXISTS ` + t.ReplayJobsTable() + ";\n"
}

// ReplayJobsExist reports whether the table of replay jobs of t exists.
func ReplayJobsExist(ctx context.Context, q Querier, t Table) (bool, error) {
	var ok bool
	if err := q.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, t.ReplayJobsTable()).Scan(&ok); err != nil {
		return false, fmt.Errorf("look up the replay jobs of %s: %w", t, err)
	}
	return ok, nil
}

// ReplayJobsQueries are the statements on the table of replay jobs of one
// outbox table.
type ReplayJobsQueries struct {
	// Insert records a job and deletes the oldest ones beyond the newest
	// keep, the new one included. Args: id, topic, error_contains, cause,
	// row_count, event_ids (a text array of canonical UUIDs), requested_by,
	// remote, keep (at least 1). Returns created_at.
	Insert string
	// Get returns one job: created_at, topic, error_contains, cause, row_count,
	// event_ids (text array), requested_by, remote. Args: id.
	Get string
	// Count counts the recorded jobs. Args: none.
	Count string
}

// NewReplayJobsQueries returns the statements on the replay jobs of t.
func NewReplayJobsQueries(t Table) ReplayJobsQueries {
	tbl := t.ReplayJobsTable()
	return ReplayJobsQueries{
		// The DELETE does not see the row the CTE inserts: it keeps the
		// newest keep-1 earlier jobs.
		Insert: `WITH ins AS (
  INSERT INTO ` + tbl + ` (id, topic, error_contains, cause, row_count, event_ids, requested_by, remote)
  VALUES ($1, $2, $3, $4, $5, $6::uuid[], $7, $8) RETURNING created_at
), old AS (
  DELETE FROM ` + tbl + ` WHERE id IN (
    SELECT id FROM ` + tbl + ` ORDER BY created_at DESC, id DESC OFFSET GREATEST($9::int - 1, 0))
)
SELECT created_at FROM ins`,
		Get:   `SELECT created_at, topic, error_contains, cause, row_count, event_ids::text[], requested_by, remote FROM ` + tbl + ` WHERE id = $1`,
		Count: `SELECT count(*) FROM ` + tbl,
	}
}
