package sqlq

import (
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Death notices (DeadNoticesTable, migration 000015). A row
// that goes dead without its failure reaching the router (the lease of its
// last allowed attempt expired, or its relay stopped before the handler
// answered) is recorded there by the statement that parks it, so that a
// relay behind forwarder.AddTo hands it to the router once more, refused,
// for the router's poison queue to copy. A notice belongs to one death: it
// keeps the row's dead_at, and a notice whose row is no longer dead of that
// death (replayed, skipped, published, deleted, dead again since) is stale
// and dropped by the next claim of notices, never delivered.

// DeadNoticesTable names the death notices' table of t
// (<table>_dead_notices, migration 000015), as package schema names it,
// sanitized for SQL.
func DeadNoticesTable(t schema.Table) string { return companion(t, "_dead_notices") }

// NoticeTries is how many times a death notice is delivered at most: a
// delivery whose verdict does not come back (its relay was killed, or
// stopped past CloseTimeout) counts, as a crash counts as an attempt of a
// row, so a notice whose handling kills the relay does not make it loop.
const NoticeTries = 3

// recordNotices renders the CTE that records a death notice for each row of
// the relation source (an earlier CTE) for which cond holds, with the id
// expression id: the death the same statement wrote (dead_at = now()). An
// older notice of the row is replaced.
func recordNotices(t schema.Table, source, id, cond string) string {
	return `noticed AS (
  INSERT INTO ` + DeadNoticesTable(t) + ` AS n (id, dead_at) SELECT ` + id + `, now() FROM ` + source + ` WHERE ` + cond + `
  ON CONFLICT (id) DO UPDATE SET dead_at = EXCLUDED.dead_at, due_at = EXCLUDED.due_at, tries = 0
)`
}

// renderNotices renders the statements of the death notices of t into q.
func (q *Queries) renderNotices(t schema.Table, c schema.Columns) {
	if !c.DeadNotices {
		return
	}
	tbl, n := t.Sanitize(), DeadNoticesTable(t)
	claim := func(topicFilter string) string {
		return `WITH due AS (
  SELECT n.id, n.dead_at, n.tries FROM ` + n + ` AS n
  WHERE n.due_at <= now()` + topicFilter + `
  ORDER BY n.due_at, n.id
  LIMIT $3
  FOR UPDATE OF n SKIP LOCKED
), live AS (
  SELECT d.id AS nid, d.tries, r.* FROM due AS d CROSS JOIN LATERAL (
    SELECT ` + claimReturning(c) + `, COALESCE(o.last_error, '') AS cause FROM ` + tbl + ` AS o
    WHERE o.id = d.id AND o.dead_at = d.dead_at AND o.published_at IS NULL
    LIMIT 1) AS r
), dropped AS (
  DELETE FROM ` + n + ` AS n USING due AS d
  WHERE n.id = d.id AND (d.tries >= $1::int OR NOT EXISTS (SELECT 1 FROM live AS l WHERE l.nid = d.id))
), leased AS (
  UPDATE ` + n + ` AS n SET due_at = clock_timestamp() + make_interval(secs => $2::float8), tries = n.tries + 1
  FROM live AS l WHERE n.id = l.nid AND l.tries < $1::int
  RETURNING n.id, n.due_at
)
SELECT ` + claimColumns(c) + `, false AS parked, l.cause, le.due_at, l.tries
FROM live AS l LEFT JOIN leased AS le ON le.id = l.nid
ORDER BY l.c6`
	}
	q.ClaimNotices = claim("")
	q.ClaimNoticesTopic = claim("\n    AND EXISTS (SELECT 1 FROM " + tbl + " AS o WHERE o.id = n.id AND o.topic = $4)")
	q.NoticeDone = `DELETE FROM ` + n + ` WHERE id = $1::uuid AND due_at = $2::timestamptz`
	q.NoticeRenew = `UPDATE ` + n + ` SET due_at = clock_timestamp() + make_interval(secs => $3::float8)
WHERE id = $1::uuid AND due_at = $2::timestamptz
RETURNING due_at`
	q.NoticeGiveBack = `UPDATE ` + n + ` SET due_at = now(), tries = GREATEST(tries - 1, 0)
WHERE id = $1::uuid AND due_at = $2::timestamptz`
}

// ClaimedNotice is one death notice a claim of notices returned: the dead
// row (read as a claim reads it), the row's last_error (why it died), the
// lease of this delivery, and the deliveries counted so far.
type ClaimedNotice struct {
	Row ClaimedRow
	// Cause is the row's last_error: why it died.
	Cause string
	// Lease is the notice's due_at after this claim, its fence token; nil
	// when the notice was spent (NoticeTries deliveries without a verdict)
	// and dropped by this claim instead of being leased.
	Lease *time.Time
	// Tries is the deliveries counted before this claim.
	Tries int
}

// ScanNotice reads a row of Queries.ClaimNotices or ClaimNoticesTopic for
// a table with columns c.
func (n *ClaimedNotice) ScanNotice(s Scanner, c schema.Columns) error {
	return n.Row.ScanClaim(s, c, &n.Cause, &n.Lease, &n.Tries)
}
