package sqlq

import "github.com/outboxkit/watermill-outbox/schema"

// HotLease leases to the hot path (package subscriber, HotPath), in the
// writer's transaction, the rows of table t just enqueued with event ids
// $1 (text[]) as a claim would: attempts + 1 and locked_at set (the
// fence of the ack, the nack and the renewals, as for a claimed row), so no
// claim takes them while the lease lasts, and after it a claim does (the
// claim's lease rules: a crash between commit and publish is redelivered
// like any crash). Only rows the enqueue wrote and nobody leased are
// taken: not published, not dead, not skipped, not leased. clock_timestamp
// (not now()) starts the lease when the row is leased, not when the
// writer's transaction began. Returns the claim's columns
// (ClaimedRow.ScanClaim), parked false.
func HotLease(t schema.Table, c schema.Columns) string {
	skipped := ``
	if c.SkippedAt {
		skipped = ` AND o.skipped_at IS NULL`
	}
	return `UPDATE ` + t.Sanitize() + ` AS o SET locked_at = clock_timestamp(), attempts = o.attempts + 1
WHERE o.event_id = ANY($1::text[]::uuid[]) AND o.published_at IS NULL AND o.dead_at IS NULL AND o.locked_at IS NULL` + skipped + `
RETURNING ` + claimReturning(c) + `, false AS parked`
}
