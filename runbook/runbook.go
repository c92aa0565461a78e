// Package runbook holds the operations an operator runs on one outbox table
// (docs/OPERATIONS.md): list the backlog, list dead rows, read the table's counters,
// replay one event and replay dead rows in bulk. The `outbox backlog`,
// `outbox dead list|replay` and `outbox stats` commands are thin wrappers
// around it.
//
// Each operation is a method of a Runbook, the handle of one table
// through one database handle:
//
//	rb := runbook.New(pool, table)
//	stats, err := rb.Stats(ctx)
//
// A row is dead when it is not published and its dead_at is set (the relay
// sets it when the last allowed attempt fails, on a permanent error, when
// the lease of the last attempt expires, or when the last attempt got no
// verdict before the relay stopped); it is failed when its last attempt
// left a last_error. No operation needs the relay's max_attempts. Replaying
// a row resets it (dead_at = NULL, attempts = 0, available_at = now(),
// locked_at = NULL, last_error = NULL) so that the relay delivers it again; delivery stays at
// least once, so consumers dedup on event_id. Rows that a relay is handling
// right now (leased less than the lock TTL ago) are never replayed.
//
// The statements live in package internal/sqlq (RunbookQueries, and
// StateQueries for the table's state in the mode it is relayed in,
// the one state reader internal/state chooses); the table name is always
// rendered with schema.Table.Sanitize and every value is a parameter.
package runbook

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// DB is what the runbook needs from a database handle: *pgxpool.Pool,
// *pgx.Conn and pgx.Tx satisfy it. Inside a caller's pgx.Tx, changes and
// the relays' wake-up take effect at commit.
type DB interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Runbook runs the operations on one outbox table through one database
// handle: build it with New, then call its methods, such as
//
//	rb := runbook.New(pool, table)
//	stats, err := rb.Stats(ctx)
//
// It holds no state of its own beyond the handle and the table, so it is
// cheap to build and safe for concurrent use when its DB is (a
// *pgxpool.Pool is; a *pgx.Conn or a pgx.Tx is not). Build one on a pgx.Tx
// to run its operations inside a transaction of the caller's.
type Runbook struct {
	db    DB
	table schema.Table
}

// New returns the runbook of table t through db. It checks nothing and
// touches no database: a nil db or a zero t is reported by each method.
func New(db DB, t schema.Table) *Runbook {
	return &Runbook{db: db, table: t}
}

// Table returns the table the runbook operates on.
func (r *Runbook) Table() schema.Table {
	if r == nil {
		return schema.Table{}
	}
	return r.table
}

// check refuses a runbook without a database handle or a table.
func (r *Runbook) check() error {
	if r == nil || isNil(r.db) {
		return errors.New("runbook: no database handle; build the runbook with runbook.New(pool, table), pool a *pgxpool.Pool, a *pgx.Conn or a pgx.Tx")
	}
	return checkTable(r.table)
}

// isNil tells whether db is nil, or a nil pointer in the interface (a nil
// *pgxpool.Pool), which would panic at the first query.
func isNil(db DB) bool {
	if db == nil {
		return true
	}
	v := reflect.ValueOf(db)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// DefaultLimit is the number of rows Backlog and Dead return when no limit
// is given.
const DefaultLimit = 100

// Row is one outbox row as the runbook shows it. The payload is left out on
// purpose: it may hold personal data and is not needed to operate the table.
type Row struct {
	// Sequence is the row's BIGSERIAL, the cursor of Dead.
	Sequence int64 `json:"sequence"`
	// EventID is the idempotency key of the event.
	EventID uuid.UUID `json:"event_id"`
	// Topic is the row's topic column.
	Topic string `json:"topic"`
	// TenantID is the tenant the event belongs to.
	TenantID uuid.UUID `json:"tenant_id"`
	// Attempts counts the deliveries tried so far.
	Attempts int `json:"attempts"`
	// CreatedAt is when the event was enqueued.
	CreatedAt time.Time `json:"created_at"`
	// AvailableAt is when the row is due for its next attempt, or nil for a
	// dead row (the relay parks dead rows at available_at = 'infinity').
	AvailableAt *time.Time `json:"available_at"`
	// LockedAt is when a relay leased the row, or nil.
	LockedAt *time.Time `json:"locked_at"`
	// PublishedAt is when the row was acked, or nil.
	PublishedAt *time.Time `json:"published_at"`
	// LastError is the summary of the last failed attempt, or nil.
	LastError *string `json:"last_error"`
	// DeadAt is when the row went dead, or nil when it is not dead.
	DeadAt *time.Time `json:"dead_at"`
	// OrderingKey is the row's ordering key, nil for an unkeyed row.
	OrderingKey *string `json:"ordering_key,omitempty"`
	// Delivered is true when the relay of the table's mode has delivered
	// the row: published_at set, or, for a keyed row of an ordered table, at
	// or below its partition's floor and not held, or, in a WAL table,
	// streamed (written before the recorded horizon and not parked behind
	// a held key). Read by Event; rows of Backlog and Dead are never
	// delivered.
	Delivered bool `json:"delivered"`
	// Skipped is true for a keyed row (ordered mode or the WAL relay) an
	// operator skipped, once the relay applied the skip (skipped_at): done
	// without delivery, not dead.
	Skipped bool `json:"skipped,omitempty"`
	// Held is true for the row its ordering key waits for (ordered: the
	// key's hold is at the row; Attempts, AvailableAt, LastError and DeadAt
	// are then the hold's; WAL: the dead row that holds its key).
	Held bool `json:"held,omitempty"`
	// WaitingBehind is the sequence of the held row of the same key that
	// this row waits behind, or nil.
	WaitingBehind *int64 `json:"waiting_behind,omitempty"`
	// SkipRequested is true for a held row an operator asked to skip; the
	// relay applies it at its next tick.
	SkipRequested bool `json:"skip_requested,omitempty"`
	// ReplayDue is true for a keyed row of an ordered table already
	// relayed that an operator replayed: the relay delivers it once more.
	ReplayDue bool `json:"replay_due,omitempty"`
}

func scanRow(s sqlq.Scanner, extra ...any) (Row, error) {
	var (
		r                 Row
		eventID, tenantID string
		attempts          int32
	)
	dest := append([]any{&r.Sequence, &eventID, &r.Topic, &tenantID, &attempts, &r.CreatedAt, &r.AvailableAt,
		&r.LockedAt, &r.PublishedAt, &r.LastError, &r.DeadAt}, extra...)
	if err := s.Scan(dest...); err != nil {
		return Row{}, err
	}
	r.Attempts = int(attempts)
	var err error
	if r.EventID, err = uuid.Parse(eventID); err != nil {
		return Row{}, fmt.Errorf("event_id %q of sequence %d: %w", eventID, r.Sequence, err)
	}
	if r.TenantID, err = uuid.Parse(tenantID); err != nil {
		return Row{}, fmt.Errorf("tenant_id %q of sequence %d: %w", tenantID, r.Sequence, err)
	}
	return r, nil
}

// dbError wraps a database error of operation op on t, turning a missing
// table into schema.ErrTableNotFound with what to do about it.
func dbError(t schema.Table, op string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42703" && strings.Contains(pgErr.Message, "dead_at") {
		return fmt.Errorf("runbook: %s %s: %w: add it with schema.Migrate or `outbox migrate --table=%s` (%w)",
			op, t, schema.ErrNoDeadAt, t, err)
	}
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return fmt.Errorf("runbook: %s %s: %w: check the table name, or create it with schema.Migrate or `outbox migrate --table=%s` (%w)",
			op, t, schema.ErrTableNotFound, t, err)
	}
	return fmt.Errorf("runbook: %s %s: %w", op, t, err)
}

func checkTable(t schema.Table) error {
	if t.IsZero() {
		return errors.New("runbook: no table; build one with schema.ParseTable, such as schema.ParseTable(\"public.org_outbox\")")
	}
	return nil
}

func checkLimit(n int) (int, error) {
	switch {
	case n < 0:
		return 0, fmt.Errorf("runbook: limit %d is negative; pass 0 for the default (%d) or a positive number", n, DefaultLimit)
	case n == 0:
		return DefaultLimit, nil
	}
	return n, nil
}

// BacklogOptions configures Backlog. The zero value lists the first
// DefaultLimit pending rows of every topic.
type BacklogOptions struct {
	// Limit bounds the rows returned. Defaults to DefaultLimit.
	Limit int
	// Topic keeps the rows of one topic. Defaults to every topic.
	Topic string
}

// Backlog lists the pending rows of the table (not delivered, not dead, in the
// table's mode: sqlq.StateQueries) oldest first, in the order the relay
// takes them (available_at, sequence). Rows waiting for a retry, rows
// leased by a relay and rows waiting behind a held key are included; their
// last_error, locked_at and WaitingBehind say so.
func (r *Runbook) Backlog(ctx context.Context, opts BacklogOptions) ([]Row, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	limit, err := checkLimit(opts.Limit)
	if err != nil {
		return nil, err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return nil, err
	}
	return queryStateRows(ctx, db, t, "backlog of", sq.Backlog(opts.Topic, limit))
}

// DeadFilter selects dead rows for Dead and ReplayDead. A zero field does
// not filter.
type DeadFilter struct {
	// Topic keeps the rows of one topic.
	Topic string
	// TenantID keeps the rows of one tenant.
	TenantID uuid.UUID
	// ErrorContains keeps the rows whose last_error contains it, ignoring
	// case.
	ErrorContains string
	// Cause keeps the rows whose normalised cause (sqlq.CauseOf their
	// last_error) equals it, as the console groups them. The expression
	// costs some 20 µs a row: on a large table, narrow by Topic too, or
	// run under a statement timeout.
	Cause string
	// Limit bounds the rows, taken in sequence order. For Dead it defaults
	// to DefaultLimit; for ReplayDead 0 means every matching row.
	Limit int
	// AfterSequence keeps the rows whose sequence is greater: pass the last
	// sequence of a page to read the next one.
	AfterSequence int64
	// LockTTL is a lower bound on the relays' lease duration; ReplayDead
	// leaves alone the rows leased less than the larger of LockTTL and the
	// LockTTL the table relays recorded (schema.ModeRecord.LockTTL) ago.
	// 0 judges by the recorded one alone (60s, the relays' default, when
	// none is recorded).
	LockTTL time.Duration
	// Expect, for ReplayDead, is the snapshot of its preview (a dry run's
	// BulkReplay.Snapshot): the replay then changes exactly the rows the
	// preview counted, up to its last sequence, or refuses with
	// ErrReplaySetChanged and changes nothing. Dead ignores it.
	Expect *ReplaySnapshot
	// AllTopics must be set for ReplayDead to replay every topic; it is
	// there so that a bulk replay without a Topic is never the default. It
	// cannot be combined with Topic. Dead ignores it.
	AllTopics bool
}

func (f DeadFilter) schemaFilter() (sqlq.RunbookFilter, error) {
	if f.AfterSequence < 0 {
		return sqlq.RunbookFilter{}, fmt.Errorf("runbook: after sequence %d is negative; pass 0 to start from the first row", f.AfterSequence)
	}
	if f.LockTTL < 0 {
		return sqlq.RunbookFilter{}, fmt.Errorf("runbook: lock TTL %s is negative; pass 0 to judge leases by the relays' recorded LockTTL", f.LockTTL)
	}
	sf := sqlq.RunbookFilter{
		Topic:         f.Topic,
		ErrorContains: f.ErrorContains,
		Cause:         f.Cause,
		AfterSequence: f.AfterSequence,
		Limit:         f.Limit,
		LockTTL:       f.LockTTL,
	}
	if f.TenantID != uuid.Nil {
		sf.TenantID = f.TenantID.String()
	}
	return sf, nil
}

// Dead lists the dead rows of the table matching f, in sequence order: rows
// with dead_at set and, in an ordered table, the keyed rows a dead hold
// holds (with the hold's attempts, last_error and dead_at). Page through
// them by passing the last Sequence returned as the next AfterSequence.
func (r *Runbook) Dead(ctx context.Context, f DeadFilter) ([]Row, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	var err error
	if f.Limit, err = checkLimit(f.Limit); err != nil {
		return nil, err
	}
	sf, err := f.schemaFilter()
	if err != nil {
		return nil, err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return nil, err
	}
	return queryStateRows(ctx, db, t, "list dead rows of", sq.Dead(sf))
}

// TableStats are the counters of one outbox table, read in the table's
// relay mode (sqlq.StateQueries; docs/OPERATIONS.md says what each means
// in each mode).
type TableStats struct {
	// Table is the table, as given.
	Table string `json:"table"`
	// Mode is the table's relay mode: default, ordered or wal.
	Mode schema.Mode `json:"mode"`
	// ModeInferred is true when no mode is recorded for the table (a table
	// migrated by an earlier version, on which no relay of this version
	// started yet): Mode is then inferred from the tables that exist.
	// `outbox migrate --mode=...` records it.
	ModeInferred bool `json:"mode_inferred,omitempty"`
	// Pending counts the rows not delivered and not dead, rows waiting
	// behind a held key included.
	Pending int64 `json:"pending"`
	// Retrying counts the pending rows whose last attempt failed (in an
	// ordered table, keyed rows whose key's hold is at them and not dead).
	Retrying int64 `json:"retrying"`
	// Locked counts the rows leased by a relay (locked_at set): in flight.
	// Keyed rows of an ordered table and rows of a WAL table are never
	// leased: their in-flight messages are not recorded in the database.
	Locked int64 `json:"locked"`
	// Dead counts the dead rows: dead_at set, or, in an ordered table, the
	// keyed rows held by a dead hold.
	Dead int64 `json:"dead"`
	// WaitingBehindHeldKeys counts the pending rows that wait behind the
	// held row of their key (included in Pending).
	WaitingBehindHeldKeys int64 `json:"waiting_behind_held_keys"`
	// HeldKeys counts the ordering keys held (ordered: holds not resolved,
	// replays included; WAL: holds not released).
	HeldKeys int64 `json:"held_keys"`
	// DeadHeldKeys counts the held keys whose held row is dead.
	DeadHeldKeys int64 `json:"dead_held_keys"`
	// ReplaysDue counts the operator replays of keyed rows already relayed
	// that the ordered relay has not delivered yet.
	ReplaysDue int64 `json:"replays_due"`
	// SkipsRequested counts the held rows an operator asked to skip that
	// the relay has not applied yet.
	SkipsRequested int64 `json:"skips_requested"`
	// OldestPendingCreatedAt is the created_at of the oldest pending row, or
	// nil when nothing is pending.
	OldestPendingCreatedAt *time.Time `json:"oldest_pending_created_at"`
	// OldestPendingAgeSeconds is the age of the oldest pending row, 0 when
	// nothing is pending.
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
	// PublishedLastHour counts the rows published (published_at set) in
	// the last hour. The ordered relay's keyed rows and the WAL relay's
	// rows carry no delivery time and are not counted: see
	// DeliveryTimesKnown.
	PublishedLastHour int64 `json:"published_last_hour"`
	// PublishedLastMinute counts the rows published in the last minute:
	// the delivery rate, with the same limit as PublishedLastHour.
	PublishedLastMinute int64 `json:"published_last_minute"`
	// DeliveryTimesKnown is false when the table's mode delivers rows
	// without recording when (ordered: keyed rows; WAL: every streamed
	// row): PublishedLastHour and PublishedLastMinute then count only the
	// rows that have published_at, and a delivery rate must come from the
	// relay's outbox_dispatch_total counter.
	DeliveryTimesKnown bool `json:"delivery_times_known"`
	// StreamedUnpublished counts, in a table the WAL relay streams, the
	// rows it delivered: they keep published_at NULL and are not counted
	// in Pending.
	StreamedUnpublished int64 `json:"streamed,omitempty"`
	// PausedTopics counts the topics an operator paused (PauseTopic; list
	// them with PausedTopics): their rows stay pending until resumed.
	PausedTopics int64 `json:"paused_topics"`
}

// OldestPendingAge is OldestPendingAgeSeconds as a time.Duration.
func (s TableStats) OldestPendingAge() time.Duration {
	return time.Duration(s.OldestPendingAgeSeconds * float64(time.Second))
}

// Stats reads the counters of the table in its relay mode.
func (r *Runbook) Stats(ctx context.Context) (TableStats, error) {
	if err := r.check(); err != nil {
		return TableStats{}, err
	}
	db, t := r.db, r.table
	sq, err := readerOf(ctx, db, t)
	if err != nil {
		return TableStats{}, err
	}
	s := TableStats{Table: t.String(), Mode: sq.Mode, ModeInferred: sq.Record == nil, DeliveryTimesKnown: sq.Mode == schema.ModeDefault}
	err = db.QueryRow(ctx, sq.Stats()).Scan(&s.Pending, &s.Retrying, &s.Locked, &s.Dead,
		&s.OldestPendingCreatedAt, &s.OldestPendingAgeSeconds, &s.WaitingBehindHeldKeys, &s.StreamedUnpublished,
		&s.PublishedLastHour, &s.PublishedLastMinute, &s.HeldKeys, &s.DeadHeldKeys, &s.ReplaysDue, &s.SkipsRequested)
	if err != nil {
		return TableStats{}, dbError(t, "stats of", err)
	}
	paused, err := r.PausedTopics(ctx)
	if err != nil {
		return TableStats{}, err
	}
	s.PausedTopics = int64(len(paused))
	return s, nil
}

// TopicBacklog is the backlog of one topic.
type TopicBacklog struct {
	// Topic is the topic column.
	Topic string `json:"topic"`
	// Pending counts the rows not delivered and not dead.
	Pending int64 `json:"pending"`
	// Retrying counts the pending rows whose last attempt failed.
	Retrying int64 `json:"retrying"`
	// Dead counts the dead rows.
	Dead int64 `json:"dead"`
	// OldestPendingAgeSeconds is the age of the topic's oldest pending row,
	// 0 when none.
	OldestPendingAgeSeconds float64 `json:"oldest_pending_age_seconds"`
	// Paused is true when an operator paused the topic (PauseTopic).
	Paused bool `json:"paused"`
}

// Topics lists the backlog of the table by topic, the largest first, at most
// limit topics (DefaultLimit when 0), in the table's relay mode. Delivered
// rows are not counted. Paused topics are marked, and listed after the
// others (with zero counts, within the limit) when nothing of theirs is
// pending.
func (r *Runbook) Topics(ctx context.Context, limit int) ([]TopicBacklog, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	limit, err := checkLimit(limit)
	if err != nil {
		return nil, err
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return nil, err
	}
	st := sq.TopicBacklog(limit)
	rows, err := db.Query(ctx, st.SQL, st.Args...)
	if err != nil {
		return nil, dbError(t, "count the backlog by topic of", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (TopicBacklog, error) {
		var b TopicBacklog
		return b, r.Scan(&b.Topic, &b.Pending, &b.Retrying, &b.Dead, &b.OldestPendingAgeSeconds)
	})
	if err != nil {
		return nil, dbError(t, "count the backlog by topic of", err)
	}
	paused, err := r.PausedTopics(ctx)
	if err != nil {
		return nil, err
	}
	listed := map[string]int{}
	for i, b := range out {
		listed[b.Topic] = i
	}
	for _, p := range paused {
		if i, ok := listed[p.Topic]; ok {
			out[i].Paused = true
		} else if len(out) < limit {
			out = append(out, TopicBacklog{Topic: p.Topic, Paused: true})
		}
	}
	return out, nil
}

// Session is a database session, as pg_stat_activity shows it.
type Session struct {
	// PID is the server process id.
	PID int32 `json:"pid"`
	// ApplicationName is the session's application_name.
	ApplicationName string `json:"application_name"`
	// ClientAddr is the client's address, empty for a Unix socket.
	ClientAddr string `json:"client_addr,omitempty"`
	// BackendStart is when the session started.
	BackendStart time.Time `json:"backend_start"`
}

// Leader returns the session of the relay that holds the table's single-active
// lock, or nil when none does (no relay runs, or they all run with
// DisableSingleActive). Reading other sessions' client address needs the
// pg_read_all_stats role or superuser; otherwise it is empty.
func (r *Runbook) Leader(ctx context.Context) (*Session, error) {
	if err := r.check(); err != nil {
		return nil, err
	}
	db, t := r.db, r.table
	st := sqlq.NewRunbookQueries(t).Leader()
	var (
		s         Session
		app, addr *string
		start     *time.Time
	)
	err := db.QueryRow(ctx, st.SQL, st.Args...).Scan(&s.PID, &app, &addr, &start)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, dbError(t, "find the active relay of", err)
	}
	if app != nil {
		s.ApplicationName = *app
	}
	if addr != nil {
		s.ClientAddr = *addr
	}
	if start != nil {
		s.BackendStart = *start
	}
	return &s, nil
}

// Statement is the SQL an action runs (or, in a dry run, would run), for
// people and audit logs: the SQL text with placeholders and their values.
type Statement struct {
	// SQL is the statement text; values are placeholders ($1, $2, ...).
	SQL string
	// Args are the values of the placeholders, in order.
	Args []any
}

// String renders the statement: the SQL followed by one comment line per
// argument, such as "-- $1 = 25".
func (s Statement) String() string { return sqlq.Statement(s).String() }

// ListState is the state of the rows ListRows lists (ListFilter.State).
type ListState string

// The states ListRows selects, with the classification of Stats.
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
func (s ListState) Valid() bool { return sqlq.ListState(s).Valid() }

// ErrNoPausedTopics is matched (errors.Is) by the runbook's error when the
// table of paused topics of an outbox table does not exist: migration
// 000007 (schema.Migrate, `outbox migrate`) creates it. Relays treat a
// missing table as "nothing is paused".
var ErrNoPausedTopics = errors.New("the table of paused topics does not exist (migration 000007)")

// ErrNoReplayJobs is matched (errors.Is) by the runbook's error when the
// table of replay jobs of an outbox table does not exist: migration 000008
// (schema.Migrate, `outbox migrate`) creates it.
var ErrNoReplayJobs = errors.New("the table of replay jobs does not exist (migration 000008)")
