package sqlq

import (
	"context"
	"fmt"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ReplayJobsExist reports whether the table of replay jobs of t exists.
func ReplayJobsExist(ctx context.Context, q schema.Querier, t schema.Table) (bool, error) {
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
func NewReplayJobsQueries(t schema.Table) ReplayJobsQueries {
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
