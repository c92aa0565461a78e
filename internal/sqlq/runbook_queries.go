package sqlq

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Statement is one SQL statement with its arguments, as the runbook runs it
// and shows it to an operator before changing rows.
type Statement struct {
	// SQL is the statement text; values are placeholders ($1, $2, ...).
	SQL string
	// Args are the values of the placeholders, in order.
	Args []any
}

// String renders the statement for people: the SQL followed by one comment
// line per argument, such as "-- $1 = 25".
func (s Statement) String() string {
	var b strings.Builder
	b.WriteString(s.SQL)
	for i, a := range s.Args {
		b.WriteString("\n-- $")
		b.WriteString(strconv.Itoa(i + 1))
		b.WriteString(" = ")
		b.WriteString(literal(a))
	}
	return b.String()
}

// literal renders an argument the way psql would show it.
func literal(a any) string {
	switch v := a.(type) {
	case nil:
		return "NULL"
	case string:
		return stringLiteral(v)
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	default:
		return fmt.Sprint(v)
	}
}

// stringLiteral renders s as an SQL string literal on one line: a plain
// '...' literal when s holds only printable characters, otherwise an escape
// string E'...' in which a newline, carriage return, tab, backslash and
// every other character that is not printable (or a byte that is not
// UTF-8) is escaped, so that an argument never shows as a line of SQL of
// its own.
func stringLiteral(s string) string {
	plain := utf8.ValidString(s) && strings.IndexFunc(s, func(r rune) bool { return !unicode.IsPrint(r) && r != ' ' }) < 0
	if plain {
		return "'" + strings.ReplaceAll(s, "'", "''") + "'"
	}
	var b strings.Builder
	b.WriteString("E'")
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		switch {
		case r == utf8.RuneError && n <= 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case r == '\'':
			b.WriteString(`''`)
		case r == '\\':
			b.WriteString(`\\`)
		case r == '\n':
			b.WriteString(`\n`)
		case r == '\r':
			b.WriteString(`\r`)
		case r == '\t':
			b.WriteString(`\t`)
		case r == ' ' || unicode.IsPrint(r):
			b.WriteRune(r)
		case r <= 0xFFFF:
			fmt.Fprintf(&b, `\u%04X`, r)
		default:
			fmt.Fprintf(&b, `\U%08X`, r)
		}
		i += n
	}
	b.WriteString("'")
	return b.String()
}

// RunbookColumns is the select list of every runbook statement that returns
// rows (Backlog, Dead, Event), in this order: sequence, event_id (text),
// topic, tenant_id (text), attempts, created_at, available_at (NULL for a
// dead row, parked at 'infinity'), locked_at, published_at, last_error,
// dead_at.
const RunbookColumns = "sequence, event_id::text, topic, tenant_id::text, attempts, created_at, NULLIF(available_at, 'infinity'), locked_at, published_at, last_error, dead_at"

// CauseOf returns the SQL expression of the normalised cause of an error
// text column (such as "last_error"): the text without the relay's own
// wrapping prefix ("publish event <uuid> to "<topic>": ", possibly
// repeated), with uuids and long hex strings masked as <id>, numbers (with
// their unit: 30s, 10.0.0.1:9092) as <n>, quoted values as "…" or '…',
// whitespace collapsed, cut at 300 characters; "" for NULL. The console
// groups dead rows by it, and a bulk replay of one cause
// (RunbookFilter.Cause) selects its rows by it, so both see the same
// groups. It costs some 20 µs a row (8 regular expressions): run it under
// a statement timeout on large tables.
func CauseOf(column string) string {
	return `left(btrim(regexp_replace(
  regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
    regexp_replace(COALESCE(` + column + `, ''), '^(?:publish event [^ ]+ to (?:"(?:[^"\\]|\\.)*"|[^ :]+): )+', ''),
    '[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}', '<id>', 'g'),
    '"(?:[^"\\]|\\.)*"', '"…"', 'g'),
    '(?<![[:alnum:]])''[^'']*''', '''…''', 'g'),
    '\m0x[0-9a-fA-F]+\M', '<id>', 'g'),
    '\m[0-9a-fA-F]{16,}\M', '<id>', 'g'),
    '\m[0-9]+(?:[.:,][0-9]+)*[a-zA-Zµ]{0,3}\M', '<n>', 'g'),
  '\s{2,}|[\t\n\r]', ' ', 'g')), 300)`
}

// RunbookFilter selects dead rows (not published, dead_at set) for the
// runbook statements Dead, CountReplayDead and ReplayDead. A zero field does
// not filter.
type RunbookFilter struct {
	// Topic keeps the rows whose topic column equals it.
	Topic string
	// TenantID keeps the rows of one tenant; a canonical UUID string.
	TenantID string
	// ErrorContains keeps the rows whose last_error contains it, ignoring
	// case.
	ErrorContains string
	// Cause keeps the rows whose normalised cause (CauseOf their
	// last_error) equals it: exactly the rows of one group of the
	// console's dead rows page.
	Cause string
	// AfterSequence keeps the rows whose sequence is greater (a cursor).
	AfterSequence int64
	// MaxSequence, when positive, keeps the rows whose sequence is at most
	// it: a bulk replay caps its rows at the last sequence its preview saw.
	// ReplayDeadExpecting always applies it, 0 included.
	MaxSequence int64
	// Limit bounds the number of rows, taken in sequence order. 0 means no
	// limit.
	Limit int
	// LockTTL is used by the replay statements only: rows leased less than
	// LockTTL ago (a relay is handling them right now) are left alone.
	// Values below 1ns mean LockTTLDefault.
	LockTTL time.Duration
	// WALReplay, for a WAL table with an ordering_key column, makes the
	// replay statements (ReplayDead, ReplayDeadExpecting, CountReplayDead)
	// leave alone the dead rows whose key's hold refuses their replay by
	// the rule (WALReplayAllowsSQL). ReplayDead and ReplayDeadExpecting
	// lock the holds they read (FOR SHARE) and decide on them as locked.
	// Nil: no hold rule (other tables).
	WALReplay *WALReplayRule

	capped bool // apply MaxSequence even when 0
}

// lockHolds is the CTE that locks the WAL holds of a replay statement
// (WALReplayRule.lockHolds), "" without a hold rule.
func (f RunbookFilter) lockHolds() string {
	if f.WALReplay == nil {
		return ""
	}
	return f.WALReplay.lockHolds()
}

// heldReplayed is the CTE that marks replayed the WAL holds whose held row
// is among the rows of rel (a relation with event_id) a bulk replay resets
// (walHeldReplayed), "" without a hold rule.
func (f RunbookFilter) heldReplayed(rel string) string {
	if f.WALReplay == nil {
		return ""
	}
	return `, hr AS (
  ` + walHeldReplayed(f.WALReplay.Table, rel) + `
)`
}

func lockTTLSeconds(d time.Duration) float64 {
	if d <= 0 {
		d = LockTTLDefault
	}
	return d.Seconds()
}

// RunbookQueries renders the statements of the runbook operations (package
// runbook and the `outbox backlog|dead|stats` commands) for one table. As
// everywhere in this package, only the sanitized table name is spliced into
// the SQL; every value is a parameter with an explicit cast.
type RunbookQueries struct {
	// schema.Table is the outbox table the statements work on.
	Table schema.Table
}

// NewRunbookQueries returns the runbook statements of table t.
func NewRunbookQueries(t schema.Table) RunbookQueries { return RunbookQueries{Table: t} }

// conds renders f's topic, tenant, error text and sequence conditions on
// the columns of row alias prefix ("" or "s."), each value through arg
// (which appends it to the statement's arguments and returns $n with cast).
func (f RunbookFilter) conds(prefix string, arg func(v any, cast string) string) []string {
	var out []string
	if f.Topic != "" {
		out = append(out, prefix+"topic = "+arg(f.Topic, "::text"))
	}
	if f.TenantID != "" {
		out = append(out, prefix+"tenant_id = "+arg(f.TenantID, "::uuid"))
	}
	if f.ErrorContains != "" {
		out = append(out, "strpos(lower("+prefix+"last_error), lower("+arg(f.ErrorContains, "::text")+")) > 0")
	}
	if f.Cause != "" {
		out = append(out, CauseOf(prefix+"last_error")+" = "+arg(f.Cause, "::text"))
	}
	if f.AfterSequence > 0 {
		out = append(out, prefix+"sequence > "+arg(f.AfterSequence, "::bigint"))
	}
	return out
}

// deadWhere renders the predicate of the dead rows matching f, appending
// the values to args, one condition a line after indent. With replay it also
// skips rows under a live lease.
func deadWhere(f RunbookFilter, args []any, replay, lock bool, indent string) (string, []any) {
	arg := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + cast
	}
	conds := []string{"published_at IS NULL", "dead_at IS NOT NULL"}
	if replay {
		conds = append(conds, "NOT "+LeaseLiveWithin(arg(lockTTLSeconds(f.LockTTL), "::float8")))
	}
	conds = append(conds, f.conds("", arg)...)
	if f.MaxSequence > 0 || f.capped {
		conds = append(conds, "sequence <= "+arg(f.MaxSequence, "::bigint"))
	}
	if replay && f.WALReplay != nil {
		conds = append(conds, f.WALReplay.guard(arg, lock))
	}
	return strings.Join(conds, "\n"+indent+"AND "), args
}

// deadTarget renders the ordered, optionally limited selection of the dead
// rows matching f, ready to be listed or wrapped by a count or an update.
// With replay, rows whose lease has not expired are left out; with lock, the
// selected rows are locked FOR UPDATE.
func deadTarget(tbl string, f RunbookFilter, cols string, replay, lock bool) (string, []any) {
	where, args := deadWhere(f, nil, replay, lock, "    ")
	sql := `SELECT ` + cols + ` FROM ` + tbl + ` AS o
  WHERE ` + where + `
  ORDER BY sequence`
	if f.Limit > 0 {
		args = append(args, f.Limit)
		sql += `
  LIMIT $` + strconv.Itoa(len(args)) + `::int`
	}
	if lock {
		sql += `
  FOR UPDATE`
	}
	return sql, args
}

// CountReplayDead takes the snapshot of the rows ReplayDead would change
// with the same filter, changing nothing. Returns: count, the greatest
// sequence (0 when none), and a digest of the sequences (md5 of their
// ordered list, "" when none), which ReplayDeadExpecting checks.
func (q RunbookQueries) CountReplayDead(f RunbookFilter) Statement {
	target, args := deadTarget(q.Table.Sanitize(), f, "sequence", true, false)
	return Statement{SQL: `SELECT count(*), COALESCE(max(sequence), 0), ` + sequenceDigest + ` FROM (
  ` + target + `
) AS target`, Args: args}
}

// sequenceDigest is the digest of the sequences of a relation "target".
const sequenceDigest = `COALESCE(md5(string_agg(target.sequence::text, ',' ORDER BY target.sequence)), '')`

// ReplayDeadExpecting is ReplayDead guarded by the snapshot of a preview
// (CountReplayDead): it takes the rows matching f up to maxSequence, locks
// them, and resets them only when they are exactly the rows the preview
// counted (same count and digest); otherwise it changes nothing. Returns:
// the rows matched now, their digest, the rows changed (0 or all), and the
// event_ids (text) of the rows changed, so that a caller can follow their
// delivery (ReplayProgress).
func (q RunbookQueries) ReplayDeadExpecting(f RunbookFilter, maxSequence, rows int64, digest string) Statement {
	tbl := q.Table.Sanitize()
	f.MaxSequence, f.capped = maxSequence, true
	target, args := deadTarget(tbl, f, "id, sequence", true, true)
	args = append(args, rows, digest)
	n := strconv.Itoa(len(args))
	m := strconv.Itoa(len(args) - 1)
	return Statement{SQL: `WITH ` + f.lockHolds() + `target AS (
  ` + target + `
), snap AS (
  SELECT count(*) AS n, ` + sequenceDigest + ` AS digest FROM target
), upd AS (
  UPDATE ` + tbl + ` AS o SET dead_at = NULL, attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL
  FROM target, snap WHERE o.id = target.id AND snap.n = $` + m + `::bigint AND snap.digest = $` + n + `::text
  RETURNING o.event_id
)` + f.heldReplayed("upd") + `
SELECT snap.n, snap.digest, (SELECT count(*) FROM upd), ARRAY(SELECT event_id::text FROM upd) FROM snap`, Args: args}
}

// ReplayDead resets the dead rows matching f, except those leased by a
// relay right now, so that the relay delivers them again: dead_at = NULL,
// attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL. The rows are
// locked in sequence order first, so a Limit takes the oldest. Command tag:
// the rows changed.
func (q RunbookQueries) ReplayDead(f RunbookFilter) Statement {
	tbl := q.Table.Sanitize()
	cols := "id"
	if f.WALReplay != nil {
		cols = "id, event_id"
	}
	target, args := deadTarget(tbl, f, cols, true, true)
	return Statement{SQL: `WITH ` + f.lockHolds() + `target AS (
  ` + target + `
)` + f.heldReplayed("target") + `
UPDATE ` + tbl + ` AS o SET dead_at = NULL, attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL
FROM target WHERE o.id = target.id`, Args: args}
}

// Event looks up one row by event_id (canonical UUID string) and classifies
// it for a replay. Returns RunbookColumns, then dead (dead_at IS NOT NULL)
// and leased (claimed or renewed within lockTTL, LeaseLiveWithin).
func (q RunbookQueries) Event(eventID string, lockTTL time.Duration) Statement {
	return Statement{SQL: `SELECT ` + RunbookColumns + `,
  dead_at IS NOT NULL,
  ` + LeaseLiveWithin("$2::float8") + `
FROM ` + q.Table.Sanitize() + `
WHERE event_id = $1::uuid`, Args: []any{eventID, lockTTLSeconds(lockTTL)}}
}

// ReplayEvent resets one row, by event_id (canonical UUID string), so that
// the relay delivers it again: dead_at = NULL, attempts = 0, available_at =
// now(), locked_at = NULL, last_error = NULL. It changes the row only when
// it is not published, dead or failed (dead_at or last_error set), and not
// leased by a relay right now (not LeaseLiveWithin lockTTL).
// Returns: sequence, for the row changed.
func (q RunbookQueries) ReplayEvent(eventID string, lockTTL time.Duration) Statement {
	return Statement{SQL: `UPDATE ` + q.Table.Sanitize() + ` SET dead_at = NULL, attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL
WHERE event_id = $1::uuid
  AND published_at IS NULL
  AND (dead_at IS NOT NULL OR last_error IS NOT NULL)
  AND NOT ` + LeaseLiveWithin("$2::float8") + `
RETURNING sequence`, Args: []any{eventID, lockTTLSeconds(lockTTL)}}
}

// ReplayEventSkipped is ReplayEvent for a table with skipped_at (a skip
// is recorded in the row): it also replays a skipped row, whether or not
// it failed, and clears skipped_at: the row is pending again, so that a
// later skip marks it skipped again (docs/OPERATIONS.md, "The row's
// states"). Returns: sequence, for the row changed.
func (q RunbookQueries) ReplayEventSkipped(eventID string, lockTTL time.Duration) Statement {
	return Statement{SQL: `UPDATE ` + q.Table.Sanitize() + ` SET dead_at = NULL, skipped_at = NULL, attempts = 0, available_at = now(), locked_at = NULL, last_error = NULL
WHERE event_id = $1::uuid
  AND published_at IS NULL
  AND (dead_at IS NOT NULL OR last_error IS NOT NULL OR skipped_at IS NOT NULL)
  AND NOT ` + LeaseLiveWithin("$2::float8") + `
RETURNING sequence`, Args: []any{eventID, lockTTLSeconds(lockTTL)}}
}

// SkipRow sets aside, in a table with skipped_at, the row whose event_id
// is $1 (canonical UUID string): skipped_at = now(), dead_at = NULL,
// locked_at = NULL and available_at = 'infinity' (parked: no claim takes
// it, whatever its filter on skipped_at), attempts and last_error kept as
// the record of what failed. It changes the row only when it is not
// published, not skipped already and not leased by a relay right now (not
// LeaseLiveWithin lockTTL): a skip is never applied while a copy may be in
// a handler, and a relay's late ack or nack of an expired lease is fenced
// by the cleared locked_at. With heldKeys (an ordered table, whose relay
// reads keyed rows without a lease), a keyed row is changed only when it
// is dead in its own columns (dead_at: it died under the default relay
// before the switch), which no ordered relay reads; a keyed row that holds
// its key is skipped through its hold (OrderedQueries.SkipHoldIn).
// Returns: sequence, for the row changed.
func (q RunbookQueries) SkipRow(eventID string, lockTTL time.Duration, heldKeys bool) Statement {
	keyed := ``
	if heldKeys {
		keyed = `
  AND (ordering_key IS NULL OR dead_at IS NOT NULL)`
	}
	return Statement{SQL: `UPDATE ` + q.Table.Sanitize() + ` SET skipped_at = now(), dead_at = NULL, locked_at = NULL, available_at = 'infinity'
WHERE event_id = $1::uuid
  AND published_at IS NULL
  AND skipped_at IS NULL
  AND NOT ` + LeaseLiveWithin("$2::float8") + keyed + `
RETURNING sequence`, Args: []any{eventID, lockTTLSeconds(lockTTL)}}
}

// Leader finds the session that holds the table's single-active lock
// (schema.Table.LockKey): the active relay. Args: the lock key. Returns one row
// when a relay holds it: pid, application_name, client address (text,
// NULL for a Unix socket), backend start; none otherwise.
func (q RunbookQueries) Leader() Statement {
	return Statement{SQL: `SELECT a.pid, a.application_name, host(a.client_addr), a.backend_start
FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
  AND ((l.classid::bigint << 32) | l.objid::bigint) = $1::bigint
LIMIT 1`, Args: []any{LockKey(q.Table)}}
}

// Wake notifies the table's relays (NotifyChannel) that rows are due, so a
// replay is delivered at once rather than at the next poll.
func (q RunbookQueries) Wake() Statement {
	return Statement{SQL: `SELECT pg_notify($1::text, '')`, Args: []any{NotifyChannel(q.Table)}}
}

// DB runs statements: a pool, a connection or a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Exec runs the statement on db.
func (s Statement) Exec(ctx context.Context, db DB) (pgconn.CommandTag, error) {
	return db.Exec(ctx, s.SQL, s.Args...)
}

// QueryRow runs the statement on db for one row.
func (s Statement) QueryRow(ctx context.Context, db DB) pgx.Row {
	return db.QueryRow(ctx, s.SQL, s.Args...)
}
