package schema

// suffixDeadNotices names the companion table of the death notices a relay
// owes the router.
const suffixDeadNotices = "_dead_notices"

// deadNoticesTable names the companion table of the death notices of t
// (migration 000015; sqlq.DeadNoticesTable names it too), sanitized for
// SQL: one row per dead row that died
// without its failure reaching the router (its lease expired on its last
// allowed attempt: its relay was killed, hung or cut off during that
// attempt, or stopped before the handler answered). A table relay that
// forwards to a router (forwarder.Forwarder.AddTo) hands each such row to
// the router once more, refused, so that the router's poison queue copies
// it, and deletes the notice when the router has answered
// (docs/ARCHITECTURE.md, "Dead rows and the poison queue").
func (t Table) deadNoticesTable() string { return t.companion(suffixDeadNotices) }

// deadNoticesStatement creates the death notices' table of t,
// idempotently. It does not lock t. dead_at is the row's dead_at when the
// notice was written: a notice whose row is no longer dead of that death
// (replayed, skipped, published, deleted, dead again since) is stale and
// dropped, never delivered. due_at is when the notice is delivered next; a
// delivery leases it until due_at (LockTTL ahead), and tries counts its
// deliveries.
func deadNoticesStatement(t Table) string {
	return `CREATE TABLE IF NOT EXISTS ` + t.deadNoticesTable() + ` (
  id      UUID        NOT NULL PRIMARY KEY,
  dead_at TIMESTAMPTZ NOT NULL,
  due_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
  tries   INT         NOT NULL DEFAULT 0 CHECK (tries >= 0)
)`
}

// deadNoticesNote heads migration 000015.
const deadNoticesNote = "-- Adds <table>_dead_notices, the rows that went dead without their failure reaching the router (the\n" +
	"-- lease of their last allowed attempt expired, or their relay stopped before the handler answered):\n" +
	"-- a relay behind forwarder.AddTo hands each to the router once more, refused, so that its poison queue\n" +
	"-- copies it. Relays without it park such rows dead with no copy. Does not lock the outbox table.\n"

// deadNoticesUpSQL is the DDL of migration 000015.
func deadNoticesUpSQL(t Table) string { return deadNoticesStatement(t) + ";\n" }

// deadNoticesDownSQL reverts deadNoticesUpSQL: the notices not delivered
// yet are lost (their rows stay dead, listed by `outbox dead list`).
func deadNoticesDownSQL(t Table) string {
	return `DROP TABLE IF EXISTS ` + t.deadNoticesTable() + ";\n"
}
