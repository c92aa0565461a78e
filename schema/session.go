package schema

import "github.com/jackc/pgx/v5"

// Statements that are not tied to one table's columns: the relay's
// single-active lock, the wake-up channel and the cleaner's vacuum. They live
// here with the rest of the project's SQL so that one package holds every
// statement the relay runs.
const (
	// TryLeaderLock tries the session-level advisory lock that makes one relay
	// the active one for a table. Args: the table's lock key
	// (Table.LockKey). Returns: whether the lock was taken.
	TryLeaderLock = `SELECT pg_try_advisory_lock($1)`

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
