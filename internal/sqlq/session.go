package sqlq

import (
	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Statements that are not tied to one table's columns: the relay's
// single-active lock, the wake-up channel and the cleaner's vacuum. They live
// here with the rest of the project's SQL so that one package holds every
// statement the relay runs.
const (
	// TryLeaderLock tries the session-level advisory lock that makes one relay
	// the active one for a table and, in the same statement when it got the
	// lock, sets the session's TCP keepalive (idle, interval, count, seconds)
	// and TCP_USER_TIMEOUT (milliseconds), so that the server ends the
	// session, and frees the lock, soon after the leader's host goes silent,
	// instead of after the operating system's keepalive (about two hours on
	// Linux). One statement, so that a reply lost on the way never leaves a
	// lock on a session without the settings. The settings apply to TCP
	// connections (not Unix sockets). Args: the table's lock key
	// (schema.Table.LockKey), keepalive idle, interval and count, user timeout, as
	// text. Returns: whether the lock was taken, then four values to ignore.
	TryLeaderLock = `SELECT l.got,
	CASE WHEN l.got THEN set_config('tcp_keepalives_idle', $2::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_keepalives_interval', $3::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_keepalives_count', $4::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_user_timeout', $5::text, false) END
FROM (SELECT pg_try_advisory_lock($1) AS got OFFSET 0) AS l`

	// LeaderUnlock releases TryLeaderLock. Args: the table's lock key.
	LeaderUnlock = `SELECT pg_advisory_unlock($1)`

	// UnlockAll releases every session-level advisory lock of the
	// connection (the leader lock and the idle lock), before it goes back
	// to a pool.
	UnlockAll = `SELECT pg_advisory_unlock_all()`

	// TryIdleLock tries the session-level idle lock of the wake-up
	// handshake, in exclusive mode: a relay holds it while it has nothing to
	// claim, so that enqueues send NOTIFY. It fails while an enqueueing
	// transaction is open (they hold it in shared mode until they end) or
	// another relay holds it. Args: schema.Table.IdleLockKey. Returns: whether the
	// lock was taken.
	TryIdleLock = `SELECT pg_try_advisory_lock($1)`

	// TryIdleLockOrHolder tries the idle lock like TryIdleLock and, when it
	// fails, tells whether another session holds it exclusively (a relay
	// asleep: writers notify) rather than only writers in shared mode.
	// Args: the lock key. Returns: got, held exclusively by another session.
	TryIdleLockOrHolder = `SELECT got, NOT got AND EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND ((classid::bigint << 32) | objid::bigint) = $1 AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid())
FROM (SELECT pg_try_advisory_lock($1) AS got) AS t`

	// IdleUnlockNotify releases the idle lock and notifies the table's
	// channel, so that relays that slept covered by this lock go through the
	// handshake again. Args: the lock key, the channel.
	IdleUnlockNotify = `SELECT pg_advisory_unlock($1), pg_notify($2, '')`

	// IdleLock waits for the idle lock (exclusive). While it waits, enqueues
	// already see it and send NOTIFY (a queued exclusive request makes their
	// shared try fail). Args: schema.Table.IdleLockKey.
	IdleLock = `SELECT pg_advisory_lock($1)`

	// IdleUnlock releases the idle lock: the relay is busy again and
	// enqueues stop sending NOTIFY. Args: schema.Table.IdleLockKey. Returns:
	// whether it was held.
	IdleUnlock = `SELECT pg_advisory_unlock($1)`

	// IdleLockQueued tells whether the backend pid holds or waits for the
	// idle lock. Args: pid, schema.Table.IdleLockKey.
	IdleLockQueued = `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = $1
  AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = $2 AND mode = 'ExclusiveLock')`
)

// Horizon reads what holds back the xmin horizon, for the ordered relay's
// choice of how often to write its floors: the oldest running transaction id
// of the server's snapshot and the next one (xid8, as text; equal when no
// transaction with an id runs), and how long the oldest other transaction
// that holds a snapshot has been open, in seconds (0 when none is visible:
// without pg_read_all_stats, other roles' sessions are not). No args.
const Horizon = `SELECT pg_snapshot_xmin(s)::text, pg_snapshot_xmax(s)::text,
  COALESCE((SELECT extract(epoch FROM now() - min(xact_start)) FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()), 0)::float8
FROM pg_current_snapshot() AS s`

// ListenStatement is the LISTEN statement for a notification channel
// (schema.Table.NotifyChannel), quoted as an identifier.
func ListenStatement(channel string) string {
	return `LISTEN ` + pgx.Identifier{channel}.Sanitize()
}

// UnlistenStatement is the UNLISTEN statement for a notification channel.
func UnlistenStatement(channel string) string {
	return `UNLISTEN ` + pgx.Identifier{channel}.Sanitize()
}

// VacuumStatement is the cleaner's optional VACUUM (ANALYZE) of table t, for
// servers whose autovacuum is off. It cannot run inside a transaction.
func VacuumStatement(t schema.Table) string {
	return `VACUUM (ANALYZE) ` + t.Sanitize()
}
