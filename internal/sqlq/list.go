package sqlq

import (
	"strconv"
	"strings"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ListState is the state of the rows StateQueries.ListRows and CountRows
// select.
type ListState string

// The states a row list selects, with the classification of StateQueries.
const (
	// ListPending: not done and not dead (rows waiting behind a held key
	// and rows waiting for a retry included), oldest first.
	ListPending ListState = "pending"
	// ListRetrying: pending rows whose last attempt failed, oldest first.
	ListRetrying ListState = "retrying"
	// ListDead: dead rows, oldest first.
	ListDead ListState = "dead"
	// ListDelivered: delivered rows (published_at set or, in ordered and
	// WAL mode, done without it; skipped rows left out), newest first.
	ListDelivered ListState = "delivered"
	// ListAll: every row, whatever its state, oldest first: a search.
	ListAll ListState = "all"
)

// Valid reports whether s is one of the list states.
func (s ListState) Valid() bool {
	switch s {
	case ListPending, ListRetrying, ListDead, ListDelivered, ListAll:
		return true
	}
	return false
}

// NewestFirst reports whether the rows of s are listed newest first
// (descending sequence): the delivered ones.
func (s ListState) NewestFirst() bool { return s == ListDelivered }

// RowListFilter selects rows for StateQueries.ListRows and CountRows. A
// zero field does not filter.
type RowListFilter struct {
	// State is the rows' state; required.
	State ListState
	// Topic keeps the rows of one topic.
	Topic string
	// EventID keeps the row of one event (canonical UUID text).
	EventID string
	// TenantID keeps the rows of one tenant (canonical UUID text).
	TenantID string
	// OrderingKey keeps the rows of one ordering key; a table without the
	// column has none.
	OrderingKey string
	// CreatedFrom and CreatedTo keep the rows created at or after From and
	// before To.
	CreatedFrom, CreatedTo time.Time
	// ErrorContains keeps the rows whose last_error (a held row's: its
	// hold's) contains it, ignoring case.
	ErrorContains string
	// Cause keeps the rows whose normalised cause (CauseOf their
	// last_error) equals it. It costs some 20 µs a row: narrow by State
	// and Topic, or run under a statement timeout.
	Cause string
}

// rowListWhere renders f's conditions on the classified relation s,
// appending their values to args.
func (q StateQueries) rowListWhere(f RowListFilter, args []any) (string, []any) {
	arg := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + cast
	}
	var conds []string
	switch f.State {
	case ListPending:
		conds = append(conds, "NOT s.done AND NOT s.dead")
	case ListRetrying:
		conds = append(conds, "NOT s.done AND NOT s.dead AND s.last_error IS NOT NULL")
	case ListDead:
		conds = append(conds, "s.dead")
	case ListDelivered:
		conds = append(conds, "s.done AND NOT s.skipped")
	default:
		conds = append(conds, "true")
	}
	if f.Topic != "" {
		conds = append(conds, "s.topic = "+arg(f.Topic, "::text"))
	}
	if f.EventID != "" {
		conds = append(conds, "s.event_id = "+arg(f.EventID, "::uuid"))
	}
	if f.TenantID != "" {
		conds = append(conds, "s.tenant_id = "+arg(f.TenantID, "::uuid"))
	}
	if f.OrderingKey != "" {
		if q.Columns.OrderingKey {
			conds = append(conds, "s.ordering_key = "+arg(f.OrderingKey, "::text"))
		} else {
			conds = append(conds, "false")
		}
	}
	if !f.CreatedFrom.IsZero() {
		conds = append(conds, "s.created_at >= "+arg(f.CreatedFrom, "::timestamptz"))
	}
	if !f.CreatedTo.IsZero() {
		conds = append(conds, "s.created_at < "+arg(f.CreatedTo, "::timestamptz"))
	}
	if f.ErrorContains != "" {
		conds = append(conds, "strpos(lower(s.last_error), lower("+arg(f.ErrorContains, "::text")+")) > 0")
	}
	if f.Cause != "" {
		conds = append(conds, CauseOf("s.last_error")+" = "+arg(f.Cause, "::text"))
	}
	return strings.Join(conds, " AND "), args
}

// rowListSource is the classified relation a list of f reads: the rows
// that may not be done (open) for the pending, retrying and dead rows; for
// the others the table's rows, narrowed in the scan by event id, tenant,
// key and, for the delivered rows of a default-mode table, published_at.
func (q StateQueries) rowListSource(f RowListFilter, args []any) (string, []any) {
	switch f.State {
	case ListPending, ListRetrying, ListDead:
		return q.open(), args
	}
	arg := func(v any, cast string) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + cast
	}
	conds := []string{"true"}
	if f.State == ListDelivered && q.Mode == schema.ModeDefault {
		conds = append(conds, "k.published_at IS NOT NULL")
	}
	if f.EventID != "" {
		conds = append(conds, "k.event_id = "+arg(f.EventID, "::uuid"))
	}
	if f.TenantID != "" {
		conds = append(conds, "k.tenant_id = "+arg(f.TenantID, "::uuid"))
	}
	if f.OrderingKey != "" && q.Columns.OrderingKey {
		conds = append(conds, "k.ordering_key = "+arg(f.OrderingKey, "::text"))
	}
	return q.classified(`SELECT k.*, k.xmin AS row_xmin FROM ` + q.Table.Sanitize() + ` AS k WHERE ` + strings.Join(conds, " AND ")), args
}

// ListRows lists up to limit rows matching f, in sequence order (newest
// first for the delivered rows: ListState.NewestFirst), after the sequence
// after (0: from the first), or, when before > 0, the rows just before the
// sequence before, in the reverse order. Returns StateColumns.
func (q StateQueries) ListRows(f RowListFilter, after, before int64, limit int) Statement {
	src, args := q.rowListSource(f, nil)
	where, args := q.rowListWhere(f, args)
	desc := f.State.NewestFirst()
	if before > 0 {
		desc = !desc
	}
	// "after" is further along the list's own order; "before" back.
	cmp, cursor := ">", after
	if f.State.NewestFirst() {
		cmp = "<"
	}
	if before > 0 {
		cursor = before
		if cmp == ">" {
			cmp = "<"
		} else {
			cmp = ">"
		}
	}
	if cursor > 0 {
		args = append(args, cursor)
		where += " AND s.sequence " + cmp + " $" + strconv.Itoa(len(args)) + "::bigint"
	}
	order := "ASC"
	if desc {
		order = "DESC"
	}
	args = append(args, limit)
	return Statement{SQL: `WITH s AS (
  ` + src + `
)
SELECT ` + StateColumns + ` FROM s
WHERE ` + where + `
ORDER BY s.sequence ` + order + `
LIMIT $` + strconv.Itoa(len(args)) + `::int`, Args: args}
}

// CountRows counts the rows matching f, and those that come before the
// row with sequence first in the list's order (ListRows). Returns: total,
// before.
func (q StateQueries) CountRows(f RowListFilter, first int64) Statement {
	src, args := q.rowListSource(f, nil)
	where, args := q.rowListWhere(f, args)
	cmp := "<"
	if f.State.NewestFirst() {
		cmp = ">"
	}
	args = append(args, first)
	return Statement{SQL: `WITH s AS (
  ` + src + `
)
SELECT count(*), count(*) FILTER (WHERE s.sequence ` + cmp + ` $` + strconv.Itoa(len(args)) + `::bigint) FROM s
WHERE ` + where, Args: args}
}

// RelayApplicationPrefix starts the application_name of the sessions of
// the `outbox relay` daemon: "outbox-relay <host> <pid> <version>".
const RelayApplicationPrefix = "outbox-relay "

// RelaySessions lists, by application_name, the database sessions of relay
// processes: those whose application_name starts with
// RelayApplicationPrefix, and the session holding t's single-active lock
// whatever its name. Returns: application_name, sessions, the earliest
// backend_start, the client addresses (comma-separated, "" when unknown or
// hidden), whether one of them holds the lock, the pid of the session
// holding it (else of the oldest one). The leader first.
func RelaySessions(t schema.Table) Statement {
	return Statement{SQL: `SELECT COALESCE(a.application_name, ''), count(*), min(a.backend_start),
  COALESCE(string_agg(DISTINCT host(a.client_addr), ', '), ''),
  bool_or(l.pid IS NOT NULL),
  (array_agg(a.pid ORDER BY l.pid IS NULL, a.backend_start))[1]
FROM pg_stat_activity AS a
LEFT JOIN pg_locks AS l ON l.pid = a.pid AND l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND l.mode = 'ExclusiveLock'
  AND ((l.classid::bigint << 32) | l.objid::bigint) = $1::bigint
WHERE a.application_name LIKE '` + RelayApplicationPrefix + `%' OR l.pid IS NOT NULL
GROUP BY 1
ORDER BY bool_or(l.pid IS NOT NULL) DESC, min(a.backend_start)`, Args: []any{LockKey(t)}}
}

// PartitionOwners lists the owners of t's ordered partitions
// (<t>_partitions): owner, the partitions it owns (int array), its latest
// lease end, whether every lease is live. The live owners first.
func PartitionOwners(t schema.Table) string {
	return `SELECT owner, array_agg(partition ORDER BY partition), max(lease_until), bool_and(lease_until > now())
FROM ` + t.PartitionsTable() + `
WHERE owner IS NOT NULL
GROUP BY owner
ORDER BY bool_and(lease_until > now()) DESC, owner`
}

// WALSlotReader reads the replication slot $1 and the session reading it:
// slot name, active, active_pid, that session's application_name and
// client address ("" when none or hidden). No row when the slot does not
// exist.
const WALSlotReader = `SELECT s.slot_name::text, s.active, s.active_pid, COALESCE(a.application_name, ''), COALESCE(host(a.client_addr), '')
FROM pg_replication_slots AS s LEFT JOIN pg_stat_activity AS a ON a.pid = s.active_pid
WHERE s.slot_name = $1`
