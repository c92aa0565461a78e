package schema

import (
	"context"
	"fmt"
)

// The lease duration of the table relays is recorded with the table's relay
// mode, in lock_ttl_ms of <table>_mode (migration 000014): every default
// and ordered relay writes the LockTTL it runs with when it starts, after
// it switched the table to its mode (sqlq.RecordLockTTL), and every
// operator surface (the runbook, and through it the `outbox` CLI and the
// console) judges a row's lease by it (ModeRecord.LockTTL), not by a
// setting of its own.

// lockTTLColumn names the column of the mode table that records the table
// relays' lease duration, in milliseconds.
const lockTTLColumn = "lock_ttl_ms"

// lockTTLStatements add lock_ttl_ms to the mode table of t (migration
// 000014): a nullable column without a default, added without a rewrite to
// a one-row table; t itself is not locked. Nothing is backfilled: the next
// table relay to start records its LockTTL.
func lockTTLStatements(t Table) []string {
	return []string{`ALTER TABLE ` + t.modeTable() + ` ADD COLUMN IF NOT EXISTS ` + lockTTLColumn + ` BIGINT NULL`}
}

// lockTTLUpSQL is the DDL of migration 000014.
func lockTTLUpSQL(t Table) string { return joinStatements(lockTTLStatements(t)) }

// lockTTLDownSQL reverts lockTTLUpSQL: operator surfaces then judge leases
// by their own LockTTL again (60s by default).
func lockTTLDownSQL(t Table) string {
	return joinStatements([]string{`ALTER TABLE ` + t.modeTable() + ` DROP COLUMN IF EXISTS ` + lockTTLColumn})
}

// lockTTLNote heads migration 000014.
const lockTTLNote = "-- Adds lock_ttl_ms to <table>_mode (migration 000010): the lease duration (OUTBOX_RELAY_LOCK_TTL,\n" +
	"-- subscriber.Config.LockTTL) the default or ordered relay that started last runs with, written by each such\n" +
	"-- relay at start. The runbook, `outbox dead replay|skip` and the console judge a row's lease by it (or by\n" +
	"-- their own lock TTL when larger): a row a relay holds is never replayed or skipped under it.\n" +
	"-- Locks only the one-row mode table, briefly.\n"

// hasLockTTLColumn reports whether the mode table of t exists and has
// lock_ttl_ms.
func hasLockTTLColumn(ctx context.Context, q Querier, t Table) (bool, error) {
	var ok bool
	err := q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attname = '`+lockTTLColumn+`' AND NOT attisdropped)`, t.modeTable()).Scan(&ok)
	if err != nil {
		return false, fmt.Errorf("look up the recorded lock TTL of %s: %w", t, err)
	}
	return ok, nil
}
