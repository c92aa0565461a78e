// Package pgmeta holds what package schema (migrations, mode switches) and
// the relays (through internal/sqlq) both need to know of a table, so that
// each is written once: its advisory-lock keys and notification channel,
// derived from its qualified name; the session holding an advisory lock; the
// default of a column.
package pgmeta

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// maxIdentifierBytes is PostgreSQL's limit on a name, channels included.
const maxIdentifierBytes = 63

// Leader is the table's single-active lock: FNV-64a of "outbox:" + the
// qualified name.
func Leader(qualified string) int64 { return key("outbox:" + qualified) }

// Idle is the lock of the table's wake-up handshake (docs/ARCHITECTURE.md,
// "Wake-up"): a relay with nothing to claim holds it exclusively, and an
// enqueue sends NOTIFY only when it cannot take it in shared mode.
func Idle(qualified string) int64 { return key("outbox-idle:" + qualified) }

// OrderedIdle is the idle lock of the table's ordered relays: writers of
// keyed rows try it instead of Idle, so that an idle claim loop (for
// unkeyed rows) does not make every keyed commit notify, and the reverse.
func OrderedIdle(qualified string) int64 { return key("outbox-idle-ordered:" + qualified) }

// RelayMode is the lock every relay of one mode (ordered, or the default
// mode) holds in shared mode while it has a subscription on the table, so
// that a relay of the other mode, and a mode switch, see it.
func RelayMode(qualified string, ordered bool) int64 {
	if ordered {
		return key("outbox-relay-ordered:" + qualified)
	}
	return key("outbox-relay-default:" + qualified)
}

// WALRelay is the lock every WAL relay of the table holds in shared mode
// while it is subscribed, streaming or standing by, so that a mode switch
// sees it between two sessions too (its slot is active only while a
// session streams).
func WALRelay(qualified string) int64 { return key("outbox-relay-wal:" + qualified) }

// Migrate serialises concurrent migrations of the same table.
func Migrate(qualified string) int64 { return key("outbox-migrate:" + qualified) }

// LegacyOrderingClass is the class writers of versions before the OID class
// took for the ordering-key locks: a hash of the qualified name.
func LegacyOrderingClass(qualified string) int32 {
	return int32(sum("outbox-order:"+qualified) & 0x7fffffff)
}

// NotifyChannel is the LISTEN/NOTIFY channel on which enqueues of the table
// wake relays: "outbox:" + the qualified name, or, when that exceeds the 63
// bytes PostgreSQL allows for a channel, "outbox:" followed by the
// hexadecimal Leader key.
func NotifyChannel(qualified string) string {
	ch := "outbox:" + qualified
	if len(ch) <= maxIdentifierBytes {
		return ch
	}
	return "outbox:" + strconv.FormatUint(sum("outbox:"+qualified), 16)
}

// WALSlot is the 32-bit hash that ends the table's default replication
// slot name, so that two tables never share a slot.
func WALSlot(qualified string) uint32 { return uint32(sum("outbox-wal:"+qualified) & 0xffffffff) }

// WALFence is the lock of a replication slot's write fence: the WAL relay's
// writes take it shared, a new session takes and releases it exclusively.
func WALFence(slot string) int64 { return key("outbox-wal-fence:" + slot) }

func key(s string) int64 {
	return int64(sum(s)) //nolint:gosec // the key is a bit pattern; wrapping to negative values is intended
}

func sum(s string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(s))
	return h.Sum64()
}

// Querier runs one query returning one row.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Holder names another session holding the session-level advisory lock key
// of the current database ("session pid N, application_name X"), or returns
// "" when none does.
func Holder(ctx context.Context, q Querier, key int64) (string, error) {
	var pid, app string
	err := q.QueryRow(ctx, `SELECT l.pid::text, coalesce(a.application_name, '') FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = $1::bigint
LIMIT 1`, key).Scan(&pid, &app)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return "", nil
	case err != nil:
		return "", err
	case app == "":
		return "session pid " + pid, nil
	}
	return fmt.Sprintf("session pid %s, application_name %q", pid, app), nil
}

// ClaimBoundDefault is the default of available_at that the default relay's
// bounded claim needs (migration 000009): the time a row is formed.
const ClaimBoundDefault = "clock_timestamp()"

// ColumnDefault returns the default expression of column of the table
// (sanitized name) as PostgreSQL prints it ("now()", "clock_timestamp()"),
// or "" when it has none.
func ColumnDefault(ctx context.Context, q Querier, table, column string) (string, error) {
	var def string
	err := q.QueryRow(ctx, `SELECT COALESCE(pg_get_expr(d.adbin, d.adrelid), '')
FROM pg_attribute AS a LEFT JOIN pg_attrdef AS d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
WHERE a.attrelid = $1::text::regclass AND a.attname = $2 AND NOT a.attisdropped`, table, column).Scan(&def)
	return def, err
}

// legacySkippedPrefix starts the last_error that ordered relays of earlier
// versions wrote on a row an operator skipped.
const legacySkippedPrefix = "skipped by an operator"

// SkippedAt is the DDL that adds skipped_at to the keyed outbox table tbl
// (sanitized), idempotently and without a rewrite (the column is nullable
// without a default), and marks skipped the rows that earlier versions
// recorded as skipped in their last_error: migration 000012, which
// walrelay.Setup also runs. skipped_at is the time a keyed relay (ordered
// mode or the WAL relay) applied an operator's skip to the row: the key went
// on without it; it is done, not dead and not delivered, and never
// delivered again unless an operator replays it.
func SkippedAt(tbl string) []string {
	return []string{
		`ALTER TABLE ` + tbl + ` ADD COLUMN IF NOT EXISTS skipped_at TIMESTAMPTZ NULL`,
		`UPDATE ` + tbl + ` SET skipped_at = now()
WHERE skipped_at IS NULL AND published_at IS NULL AND ordering_key IS NOT NULL AND last_error LIKE '` + legacySkippedPrefix + `%'`,
	}
}

// InferMode is the relay mode of a table without a recorded one, from what
// exists of it: a table the WAL relay streams (its progress table and a
// publication of it) is a WAL table ("wal"); one with the ordering column
// and ordered mode's companion tables an ordered table ("ordered"); any
// other a default-mode table ("default"). schema's switch and the state
// reader (internal/sqlq) both decide by it.
func InferMode(walProgress, published, orderedTables, orderingKey bool) string {
	switch {
	case walProgress && published:
		return "wal"
	case orderedTables && orderingKey:
		return "ordered"
	}
	return "default"
}
