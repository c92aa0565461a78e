package schema

import "github.com/jackc/pgx/v5"

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
	// (Table.LockKey), keepalive idle, interval and count, user timeout, as
	// text. Returns: whether the lock was taken, then four values to ignore.
	TryLeaderLock = `SELECT l.got,
	CASE WHEN l.got THEN set_config('tcp_keepalives_idle', $2::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_keepalives_interval', $3::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_keepalives_count', $4::text, false) END,
	CASE WHEN l.got THEN set_config('tcp_user_timeout', $5::text, false) END
FROM (SELECT pg_try_advisory_lock($1) AS got OFFSET 0) AS l`

	// LeaderUnlock releases TryLeaderLock. Args: the table's lock key.
	LeaderUnlock = `SELECT pg_advisory_unlock($1)`
)

// ListenStatement is the LISTEN statement for a notification channel
// (Table.NotifyChannel), quoted as an identifier.
func ListenStatement(channel string) string {
	return `LISTEN ` + pgx.Identifier{channel}.Sanitize()
}

// UnlistenStatement is the UNLISTEN statement for a notification channel.
func UnlistenStatement(channel string) string {
	return `UNLISTEN ` + pgx.Identifier{channel}.Sanitize()
}

// VacuumStatement is the cleaner's optional VACUUM (ANALYZE) of table t, for
// servers whose autovacuum is off. It cannot run inside a transaction.
func VacuumStatement(t Table) string {
	return `VACUUM (ANALYZE) ` + t.Sanitize()
}
