package sqlq

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
)

// modeTable names the companion table that records t's relay mode
// (<table>_mode, migration 000010), as package schema names it, sanitized
// for SQL.
func modeTable(t schema.Table) string { return companion(t, "_mode") }

// companion names t's companion table with suffix as package schema names
// its companion tables (t's name plus the suffix, in t's schema),
// sanitized for SQL: for those whose name schema does not export.
func companion(t schema.Table, suffix string) string {
	if t.Schema() == "" {
		return pgx.Identifier{t.Name() + suffix}.Sanitize()
	}
	return pgx.Identifier{t.Schema(), t.Name() + suffix}.Sanitize()
}

// RecordLockTTL records ttl, the lease duration (LockTTL) a table relay of
// t runs with, in lock_ttl_ms of t's mode table (migration 000014), where
// every operator surface reads it (schema.ModeRecord.LockTTL): the runbook
// leaves alone a row leased less than the larger of it and the caller's
// own LockTTL ago. The default and ordered relays call it when they start,
// once they switched t to their mode; the last one to start wins. It is
// rounded up to the millisecond. ok is false, and nothing is recorded,
// when t has nowhere to record it: no mode table, no mode recorded yet, or
// a mode table without lock_ttl_ms (before migration 000014; schema.Migrate
// adds it).
func RecordLockTTL(ctx context.Context, q schema.Querier, t schema.Table, ttl time.Duration) (ok bool, err error) {
	if ttl <= 0 {
		return false, errors.New("record the lock TTL of " + t.String() + ": " + ttl.String() + " is not a positive duration")
	}
	err = q.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute
WHERE attrelid = to_regclass($1) AND attname = 'lock_ttl_ms' AND NOT attisdropped)`, modeTable(t)).Scan(&ok)
	if err != nil || !ok {
		return false, wrapLockTTL(t, err)
	}
	ms := int64((ttl + time.Millisecond - 1) / time.Millisecond)
	// The UPDATE runs whether or not the SELECT reads it; the SELECT
	// tells whether a mode is recorded (the row the UPDATE may change).
	err = q.QueryRow(ctx, `WITH u AS (
  UPDATE `+modeTable(t)+` SET lock_ttl_ms = $1::bigint WHERE lock_ttl_ms IS DISTINCT FROM $1::bigint RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM `+modeTable(t)+`)`, ms).Scan(&ok)
	if err != nil {
		return false, wrapLockTTL(t, err)
	}
	return ok, nil
}

func wrapLockTTL(t schema.Table, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("record the lock TTL of %s: %w", t, err)
}
