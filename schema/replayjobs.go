package schema

import (
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

// ReplayJobsTable names the companion table of the bulk replays started
// from the console (runbook.Runbook.SaveReplayJob), sanitized for SQL.
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
func replayJobsUpSQL(t Table) string { return replayJobsStatement(t) + ";\n" }

// ReplayJobsDownSQL reverts ReplayJobsUpSQL: the records of past bulk
// replays are lost (the replayed rows are not).
func replayJobsDownSQL(t Table) string {
	return `DROP TABLE IF EXISTS ` + t.ReplayJobsTable() + ";\n"
}
