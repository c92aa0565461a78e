package schema

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
)

// Names of the table's derived objects are the table name plus these
// suffixes.
const (
	suffixPkey              = "_pkey"
	suffixEventIDKey        = "_event_id_key"
	suffixAttemptsCheck     = "_attempts_nonnegative"
	suffixPendingIndex      = "_pending_by_available"
	suffixPublishedIndex    = "_published_by_time"
	suffixTenantIndex       = "_tenant_published"
	longestSuffix           = suffixPendingIndex
	migrationTemplateTable  = "app_outbox"
	migrationTemplateSchema = "public"
)

// Migrations holds the shipped migration files, written for the table
// public.app_outbox: golang-migrate/atlas style pairs under migrations/ and a
// goose file under migrations/goose/. Copy them and rename app_outbox to your
// table, or print them for any table with UpSQL and DownSQL (the CLI's
// `outbox migrate --print`). The down migrations drop the table and every
// event in it: they are destructive.
//
//go:embed migrations
var Migrations embed.FS

// MigrateOption selects optional columns for Migrate and UpSQL, and whether
// Migrate may create a missing schema.
type MigrateOption func(*migrateOptions)

type migrateOptions struct {
	columns      Columns
	createSchema bool
	rewrite      bool
	lockWait     time.Duration // 0: MigrateLockWaitDefault
	mode         Mode          // "": not asked (WithMode)
}

// MigrateLockWaitDefault is how long Migrate keeps trying to take the locks
// it needs, by default (WithLockWait).
const migrateLockWaitDefault = time.Minute

// migrateLockTimeout bounds each try's wait for a lock: while a statement
// of Migrate waits for its lock, every writer of the table queues behind it.
const migrateLockTimeout = 200 * time.Millisecond

// WithLockWait bounds how long Migrate keeps trying, in tries that each
// wait at most 200 ms for a lock, when a long transaction holds the table
// (a REPEATABLE READ report that has read it, an idle transaction). Between
// tries writers proceed. Defaults to MigrateLockWaitDefault (1 minute); the
// context's deadline also ends it.
func WithLockWait(d time.Duration) MigrateOption {
	return func(o *migrateOptions) { o.lockWait = d }
}

// ErrSchemaNotFound is returned by Migrate and MigrateInbox when the table's
// schema does not exist and WithCreateSchema was not given: a typo in the
// schema name must not create a new schema silently.
var ErrSchemaNotFound = errors.New("schema does not exist")

// WithCreateSchema lets Migrate and MigrateInbox create the table's schema
// when it does not exist (CREATE SCHEMA IF NOT EXISTS), and makes UpSQL print
// that statement. Without it a missing schema is ErrSchemaNotFound.
func WithCreateSchema() MigrateOption { return func(o *migrateOptions) { o.createSchema = true } }

// WithTraceColumns adds the optional traceparent and tracestate columns (W3C
// Trace Context).
func WithTraceColumns() MigrateOption {
	return func(o *migrateOptions) { o.columns.TraceContext = true }
}

// WithHeadersColumn adds the optional headers column (extra string metadata).
func WithHeadersColumn() MigrateOption { return func(o *migrateOptions) { o.columns.Headers = true } }

// WithOrderingKeyColumn adds the ordering_key column of ordered mode, the
// ordering_partition column derived from it and their indexes
// (docs/ORDERING.md). It does not choose the table's mode: ordered mode's
// companion tables (<table>_partitions, <table>_relays, <table>_holds) come
// with the switch to ordered mode (WithMode(ModeOrdered), `outbox migrate
// --mode=ordered`, or the start of an ordered relay), which needs the
// columns. Adding the columns to an existing table rewrites it
// (ordering_partition is a stored generated column) under an ACCESS
// EXCLUSIVE lock: Migrate does it for a table of at most
// OrderedRewriteMaxRows rows, and for a larger one only with
// WithTableRewrite; otherwise it returns ErrTableRewrite with the SQL to run.
func WithOrderingKeyColumn() MigrateOption {
	return func(o *migrateOptions) { o.columns.OrderingKey = true }
}

// WithTableRewrite lets Migrate add the ordering columns
// (WithOrderingKeyColumn, WithAllColumns) to an existing table of any size,
// which rewrites the table and blocks its readers and writers meanwhile
// (`outbox migrate --ordered --rewrite`). Without it Migrate refuses a table
// of more than OrderedRewriteMaxRows rows with ErrTableRewrite.
func WithTableRewrite() MigrateOption { return func(o *migrateOptions) { o.rewrite = true } }

// OrderedRewriteMaxRows is the largest existing table to which Migrate adds
// the ordering columns without WithTableRewrite: rewriting it takes well
// under a second.
const orderedRewriteMaxRows = 10000

// ErrTableRewrite is returned (wrapped) by Migrate when adding the ordering
// columns to an existing table of more than OrderedRewriteMaxRows rows
// would rewrite it and WithTableRewrite was not given. The error carries the
// SQL to run (OrderedUpgradeSQL); nothing was changed.
var ErrTableRewrite = errors.New("adding the ordering columns rewrites the table")

// OrderedUpgradeSQL returns the DDL that takes an existing default-mode
// table t to ordered mode: the ordering columns (the ALTER TABLE rewrites
// the table under an ACCESS EXCLUSIVE lock), their indexes and the
// companion tables, idempotently. Existing rows keep ordering_key NULL and
// are relayed as in the default mode (docs/ORDERING.md, "Switching modes").
func OrderedUpgradeSQL(t Table) string {
	return joinStatements(append(append(orderedColumnStatements(t), orderedCompanionStatements(t)...), skippedAtStatements(t)...))
}

// WithMode records m as the relay mode of the table (in <table>_mode,
// migration 000010): the explicit step that chooses or switches a table's
// mode (`outbox migrate --ordered`, `--mode=default`). ModeOrdered also
// adds what WithOrderingKeyColumn adds, and the switch adds ordered mode's
// companion tables. When the recorded mode changes, Migrate switches it
// first, before adding anything, by SwitchMode (the one switch of every
// path: refused with ErrRelayModeMix while a relay of another mode works
// on the table, with ErrKeysHeld while a hold is open; the rows the old
// mode delivered are marked published). ModeWAL is
// recorded by walrelay.Setup (`outbox migrate --wal`), which creates the
// WAL relay's objects; Migrate refuses it.
//
// Without WithMode, Migrate records ModeDefault for a table it creates and
// leaves the record of an existing table as it is; a relay that starts on
// the table records its own mode.
func WithMode(m Mode) MigrateOption {
	return func(o *migrateOptions) {
		o.mode = m
		if m == ModeOrdered {
			o.columns.OrderingKey = true
		}
	}
}

// WithAllColumns adds every optional column (trace context, headers and
// the ordering columns). It does not choose the table's mode (WithMode): a
// table Migrate creates is recorded as a default-mode table, with the
// companion tables the default relay and the operator surfaces need and
// none of the keyed modes'; the relay that starts on it records its own
// mode, and a keyed relay's switch adds its mode's tables then.
func WithAllColumns() MigrateOption {
	return func(o *migrateOptions) {
		o.columns.TraceContext, o.columns.Headers, o.columns.OrderingKey = true, true, true
	}
}

func optionsOf(opts []MigrateOption) migrateOptions {
	var o migrateOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return o
}

func columnsOf(opts []MigrateOption) Columns { return optionsOf(opts).columns }

// createSchemaStatement creates t's schema; empty for an unqualified table.
func createSchemaStatement(t Table) []string {
	if t.schema == "" {
		return nil
	}
	return []string{`CREATE SCHEMA IF NOT EXISTS ` + pgx.Identifier{t.schema}.Sanitize()}
}

// ensureSchema checks that t's schema exists and, when create is set,
// creates it. CREATE SCHEMA IF NOT EXISTS checks the CREATE privilege even
// when the schema exists, so it looks first.
func ensureSchema(ctx context.Context, tx pgx.Tx, t Table, create bool, what string) error {
	if t.schema == "" {
		return nil
	}
	var exists bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, t.schema).Scan(&exists); err != nil {
		return fmt.Errorf("schema: %s %s: look up schema: %w", what, t, err)
	}
	if exists {
		return nil
	}
	if !create {
		return fmt.Errorf("schema: %s %s: %w: %q; check the name, create it first, or pass schema.WithCreateSchema() (outbox migrate --create-schema)",
			what, t, ErrSchemaNotFound, t.schema)
	}
	if _, err := tx.Exec(ctx, createSchemaStatement(t)[0]); err != nil {
		return fmt.Errorf("schema: %s %s: create schema: %w", what, t, err)
	}
	return nil
}

// createTableStatement is the CREATE TABLE of the table contract (docs/ARCHITECTURE.md).
func createTableStatement(t Table) string {
	return `CREATE TABLE IF NOT EXISTS ` + t.Sanitize() + ` (
  id           UUID        NOT NULL DEFAULT gen_random_uuid(),
  tenant_id    UUID        NOT NULL,
  topic        TEXT        NOT NULL,
  payload      JSONB       NOT NULL,
  event_id     UUID        NOT NULL,
  sequence     BIGSERIAL   NOT NULL,
  created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
  published_at TIMESTAMPTZ NULL,
  attempts     INT         NOT NULL DEFAULT 0,
  available_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  locked_at    TIMESTAMPTZ NULL,
  last_error   TEXT        NULL,
  dead_at      TIMESTAMPTZ NULL,
  CONSTRAINT ` + t.ident(suffixPkey) + ` PRIMARY KEY (id),
  CONSTRAINT ` + t.ident(suffixEventIDKey) + ` UNIQUE (event_id),
  CONSTRAINT ` + t.ident(suffixAttemptsCheck) + ` CHECK (attempts >= 0)
)`
}

type indexDef struct {
	suffix, stmt string
}

// indexes lists the secondary indexes of the table contract.
func indexes(t Table) []indexDef {
	tbl := t.Sanitize()
	return []indexDef{
		{suffixPendingIndex, `CREATE INDEX IF NOT EXISTS ` + t.ident(suffixPendingIndex) + ` ON ` + tbl + ` (available_at, sequence) WHERE published_at IS NULL`},
		{suffixPublishedIndex, `CREATE INDEX IF NOT EXISTS ` + t.ident(suffixPublishedIndex) + ` ON ` + tbl + ` (published_at, sequence) WHERE published_at IS NOT NULL`},
		{suffixTenantIndex, `CREATE INDEX IF NOT EXISTS ` + t.ident(suffixTenantIndex) + ` ON ` + tbl + ` (tenant_id, published_at, sequence)`},
	}
}

// indexRegclass names index suffix of t for to_regclass.
func (t Table) indexRegclass(suffix string) string {
	if t.schema == "" {
		return pgx.Identifier{t.name + suffix}.Sanitize()
	}
	return pgx.Identifier{t.schema, t.name + suffix}.Sanitize()
}

// UpStatements is the DDL that creates table t with the optional columns c,
// one statement each and idempotent (IF NOT EXISTS throughout): what Migrate
// runs for a table it creates, and what the watermill-sql adapters (packages
// schema/sqlv3 and schema/sqlv4) run as their schema initialisation. It
// creates the companion tables of the default mode, not those of the keyed
// modes, which the switch to them adds (SwitchMode).
func UpStatements(t Table, c Columns) []string {
	stmts := []string{createTableStatement(t)}
	for _, ix := range indexes(t) {
		stmts = append(stmts, ix.stmt)
	}
	stmts = append(stmts, pausedTopicsStatement(t), replayJobsStatement(t), availableAtStatement(t), modeStatement(t), deadNoticesStatement(t))
	stmts = append(stmts, optionalColumnStatements(t, c)...)
	stmts = append(stmts, skippedAtEveryTableStatements(t)...)
	return stmts
}

// legacyDeadAttempts is the attempts count at or above which the migration
// that adds dead_at marks an unpublished, unleased row dead: the default
// max_attempts of the versions that read dead as attempts >= max_attempts.
// Rows those versions parked (available_at = 'infinity') are marked dead
// whatever their attempts. A relay that ran with a higher MaxAttempts should
// edit the number in the migration file (or run its UPDATE itself) before
// applying it.
const legacyDeadAttempts = 25

// deadAtStatements add the dead_at column to an existing table (no rewrite:
// the column is nullable without a default) and mark dead, and park, the
// rows that older versions considered dead. Both are idempotent.
func deadAtStatements(t Table) []string {
	tbl := t.Sanitize()
	return []string{
		`ALTER TABLE ` + tbl + ` ADD COLUMN IF NOT EXISTS dead_at TIMESTAMPTZ NULL`,
		`UPDATE ` + tbl + ` SET dead_at = now(), available_at = 'infinity', locked_at = NULL
WHERE published_at IS NULL AND dead_at IS NULL
  AND (available_at = 'infinity' OR (attempts >= ` + itoa(legacyDeadAttempts) + ` AND locked_at IS NULL))`,
	}
}

// DeadAtUpSQL returns the DDL that adds the dead_at column to an existing
// table t and marks dead the rows that versions without it considered dead
// (parked at available_at = 'infinity', or attempts >= legacyDeadAttempts
// and not leased), idempotently.
func deadAtUpSQL(t Table) string { return joinStatements(deadAtStatements(t)) }

// DeadAtDownSQL returns the DDL that drops the dead_at column. Dead rows
// stay parked at available_at = 'infinity' but are no longer marked dead:
// code that reads dead_at must not run on the table afterwards.
func deadAtDownSQL(t Table) string {
	return joinStatements([]string{`ALTER TABLE ` + t.Sanitize() + ` DROP COLUMN IF EXISTS dead_at`})
}

func optionalColumnStatements(t Table, c Columns) []string {
	var stmts []string
	if c.TraceContext {
		stmts = append(stmts, `ALTER TABLE `+t.Sanitize()+` ADD COLUMN IF NOT EXISTS traceparent TEXT NULL, ADD COLUMN IF NOT EXISTS tracestate TEXT NULL`)
	}
	if c.Headers {
		stmts = append(stmts, `ALTER TABLE `+t.Sanitize()+` ADD COLUMN IF NOT EXISTS headers JSONB NULL`)
	}
	if c.OrderingKey {
		stmts = append(stmts, orderedColumnStatements(t)...)
	}
	return stmts
}

// UpSQL returns the idempotent DDL that creates t (and the optional columns
// opts ask for) as one script, for migration tools. With WithMode it also
// records the mode (unchecked: stop the relays of another mode first), and
// with WithMode(ModeOrdered) creates ordered mode's companion tables.
func UpSQL(t Table, opts ...MigrateOption) string {
	o := optionsOf(opts)
	var stmts []string
	if o.createSchema {
		stmts = createSchemaStatement(t)
	}
	stmts = append(stmts, UpStatements(t, o.columns)...)
	if o.mode == ModeOrdered {
		stmts = append(stmts, orderedCompanionStatements(t)...)
	}
	if o.mode == ModeDefault || o.mode == ModeOrdered {
		stmts = append(stmts, recordModeStatement(t, o.mode))
	}
	return joinStatements(stmts)
}

// DownSQL returns the DDL that drops t. It is destructive: every event in the
// table, published or not, is lost.
func DownSQL(t Table) string {
	drops := append(orderedCompanionDrops(t), `DROP TABLE IF EXISTS `+t.PausedTopicsTable(), `DROP TABLE IF EXISTS `+t.ReplayJobsTable(),
		`DROP TABLE IF EXISTS `+t.modeTable(), `DROP TABLE IF EXISTS `+t.deadNoticesTable())
	return joinStatements(append(drops, `DROP TABLE IF EXISTS `+t.Sanitize()))
}

func joinStatements(stmts []string) string {
	return strings.Join(stmts, ";\n\n") + ";\n"
}

// DB is what Migrate needs: *pgxpool.Pool and *pgx.Conn satisfy it.
type DB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate creates the outbox table t with its constraints and indexes, and
// the optional columns that opts ask for; on an existing table it adds what
// is missing, including the dead_at column (marking dead the rows older
// versions considered dead, see MigrationFiles, step 000004). It records the relay mode of
// a table it creates (ModeDefault, or WithMode's) in <table>_mode, which
// every reader of the table's state reads, and leaves the record of an
// existing table alone unless WithMode asks. The companion tables follow
// the mode: every table gets those of the default mode (<table>_mode,
// _paused_topics, _dead_notices, _replay_jobs), and a table in a keyed
// mode those of its mode (ordered: _partitions, _relays, _holds; WAL:
// _holds), which the switch to the mode creates (SwitchMode) and Migrate
// keeps in this version's shape. It is idempotent and safe when
// several processes call it at once: the statements run in one transaction
// serialised by a transaction-level advisory lock on the table.
//
// A statement that locks an existing table (ALTER TABLE, CREATE INDEX)
// waits for its lock behind every transaction that holds the table, and
// every writer of the table waits behind it meanwhile. So each try waits
// at most 200 ms for a lock (lock_timeout) and gives up; Migrate tries
// again after a backoff with jitter (writers proceed in between) until
// WithLockWait's bound (1 minute by default) or ctx's deadline. When it
// gives up, its error is a *LockWaitError naming the sessions that held
// the table (pid, application_name, state, transaction age): end them, or
// migrate when they are done.
//
// gen_random_uuid() is built in from PostgreSQL 13; on PostgreSQL 12 run
// CREATE EXTENSION pgcrypto first.
func Migrate(ctx context.Context, db DB, t Table, opts ...MigrateOption) error {
	if t.IsZero() {
		return errors.New("migrate: zero Table; build it with schema.ParseTable")
	}
	if db == nil {
		return errors.New("migrate: nil DB; pass a *pgxpool.Pool or *pgx.Conn")
	}
	wait := optionsOf(opts).lockWait
	if wait <= 0 {
		wait = migrateLockWaitDefault
	}
	return migrateTx(ctx, db, t, wait, opts)
}

// LockWaitError is returned by Migrate when it gave up waiting for a lock
// on the table, or for another migration of the table that waits for one
// (Tries 0): Holders are the sessions that held a lock on it when it gave
// up (none when they ended meanwhile).
type LockWaitError struct {
	Table   Table
	Tries   int
	Waited  time.Duration
	Holders []LockHolder
	Err     error // the last try's error, or the context's
}

// LockHolder is a session that holds a lock on a table.
type LockHolder struct {
	PID             int
	ApplicationName string
	User            string
	State           string        // pg_stat_activity.state: "active", "idle in transaction", ...
	Mode            string        // the lock held: AccessShareLock, RowExclusiveLock, ...
	XactAge         time.Duration // how long its transaction has been open (0: unknown)
}

func (e *LockWaitError) Error() string {
	var b strings.Builder
	if e.Tries == 0 {
		fmt.Fprintf(&b, "migrate %s: gave up after %s behind another migration of the table, which waits for the table's lock",
			e.Table, e.Waited.Round(time.Millisecond))
	} else {
		fmt.Fprintf(&b, "migrate %s: gave up after %d tries in %s: each try waits at most %s for the table's lock, so as not to stall its writers",
			e.Table, e.Tries, e.Waited.Round(time.Millisecond), migrateLockTimeout)
	}
	if len(e.Holders) == 0 {
		b.WriteString("; no session holds the table now (try again)")
	} else {
		b.WriteString("; held by ")
		for i, h := range e.Holders {
			if i > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "pid %d (application_name %q, user %q, state %q, %s, transaction open %s)",
				h.PID, h.ApplicationName, h.User, h.State, h.Mode, h.XactAge.Round(time.Millisecond))
		}
		b.WriteString("; end those transactions (pg_terminate_backend) or migrate once they are done")
	}
	fmt.Fprintf(&b, ": %v", e.Err)
	return b.String()
}

func (e *LockWaitError) Unwrap() error { return e.Err }

// lockBackoff is the pause after the n-th try (1-based) that gave up
// waiting for a lock: 50 ms doubling to 2 s, plus a jitter of up to half.
func lockBackoff(n int) time.Duration {
	d := min(50*time.Millisecond<<min(n-1, 6), 2*time.Second)
	return d + time.Duration(rand.Int64N(int64(d/2)+1)) //nolint:gosec // jitter, not a secret
}

// lockHolders reads the sessions that hold a granted lock on t, for the
// error of a migration that gave up (best effort: nil when it cannot).
func lockHolders(ctx context.Context, db DB, t Table) []LockHolder {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil
	}
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, `SELECT l.pid, COALESCE(a.application_name, ''), COALESCE(a.usename::text, ''), COALESCE(a.state, ''),
  string_agg(DISTINCT l.mode, '+'), COALESCE(extract(epoch FROM now() - a.xact_start)::float8, 0)
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'relation' AND l.relation = to_regclass($1) AND l.granted AND l.pid IS DISTINCT FROM pg_backend_pid()
GROUP BY l.pid, a.application_name, a.usename, a.state, a.xact_start
ORDER BY a.xact_start NULLS FIRST
LIMIT 10`, t.Sanitize())
	if err != nil {
		return nil
	}
	defer rows.Close()
	var out []LockHolder
	for rows.Next() {
		var (
			h   LockHolder
			pid *int32
			age float64
		)
		if err := rows.Scan(&pid, &h.ApplicationName, &h.User, &h.State, &h.Mode, &age); err != nil {
			return out
		}
		if pid != nil {
			h.PID = int(*pid)
		} else {
			h.State = "prepared transaction"
		}
		h.XactAge = time.Duration(age * float64(time.Second))
		out = append(out, h)
	}
	return out
}

// migrateTx runs the migration in one transaction that holds the table's
// migration lock (advisory) throughout: each try runs under a savepoint,
// waits at most migrateLockTimeout for a lock, and is rolled back to the
// savepoint when it gives up (releasing what it took); the backoff between
// tries is spent holding the migration lock and no lock on the table, so
// writers proceed, and other processes that migrate at the same moment
// wait for the migration lock instead of queueing their own tries behind
// this one's (which would stall writers for several tries in a row).
func migrateTx(ctx context.Context, db DB, t Table, wait time.Duration, opts []MigrateOption) (err error) {
	start := time.Now()
	deadline := start.Add(wait)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("migrate %s: begin: %w", t, err)
	}
	rolledBack := false
	defer func() {
		if err != nil && !rolledBack {
			if rbErr := tx.Rollback(ctx); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
				err = errors.Join(err, fmt.Errorf("rollback: %w", rbErr))
			}
		}
	}()
	if _, err = tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, t.migrateLockKey()); err != nil {
		if ctx.Err() != nil {
			// Another migration of t held the migration lock until the
			// deadline: it waits for the table's lock, so name who holds
			// that.
			return &LockWaitError{Table: t, Waited: time.Since(start), Holders: lockHolders(ctx, db, t),
				Err: fmt.Errorf("waiting for another migration of the table: %w", err)}
		}
		return fmt.Errorf("migrate %s: lock: %w", t, err)
	}
	if _, err = tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", migrateLockTimeout.Milliseconds())); err != nil {
		return fmt.Errorf("migrate %s: set lock_timeout: %w", t, err)
	}
	for n := 1; ; n++ {
		if _, err = tx.Exec(ctx, `SAVEPOINT outbox_migrate_try`); err != nil {
			return fmt.Errorf("migrate %s: savepoint: %w", t, err)
		}
		err = migrateTry(ctx, tx, t, opts)
		var pgErr *pgconn.PgError
		if err == nil {
			if err = tx.Commit(ctx); err != nil {
				return fmt.Errorf("migrate %s: commit: %w", t, err)
			}
			return nil
		}
		if (!errors.As(err, &pgErr) || pgErr.Code != "55P03") && ctx.Err() == nil { // not lock_not_available
			return err
		}
		sleep := lockBackoff(n)
		if ctx.Err() == nil && time.Now().Add(sleep+migrateLockTimeout).Before(deadline) {
			if _, rerr := tx.Exec(ctx, `ROLLBACK TO SAVEPOINT outbox_migrate_try`); rerr != nil {
				return errors.Join(err, fmt.Errorf("migrate %s: rollback to savepoint: %w", t, rerr))
			}
			select {
			case <-ctx.Done():
			case <-time.After(sleep):
				continue
			}
		}
		// Give up: end the transaction first (a *pgx.Conn cannot begin
		// another), then read who holds the table.
		if ctx.Err() != nil {
			err = errors.Join(err, ctx.Err())
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_ = tx.Rollback(rctx)
		cancel()
		rolledBack = true
		return &LockWaitError{Table: t, Tries: n, Waited: time.Since(start), Holders: lockHolders(ctx, db, t), Err: err}
	}
}

// migrateTry plans and runs the statements of one try in tx.
func migrateTry(ctx context.Context, tx pgx.Tx, t Table, opts []MigrateOption) (err error) {
	if err = ensureSchema(ctx, tx, t, optionsOf(opts).createSchema, "migrate"); err != nil {
		return err
	}
	// Run only what is missing: CREATE INDEX IF NOT EXISTS and ALTER TABLE
	// lock the table even when there is nothing to do, which would stall
	// (or deadlock with) live traffic when every process migrates at start.
	exists := func(name string) (bool, error) {
		var ok bool
		err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, name).Scan(&ok)
		return ok, err
	}
	o := optionsOf(opts)
	switch {
	case o.mode == ModeWAL:
		return fmt.Errorf("migrate %s: the WAL relay's mode is recorded by walrelay.Setup (`outbox migrate --wal`), which creates its publication and slot; nothing changed", t)
	case o.mode != "" && !o.mode.Valid():
		return fmt.Errorf("migrate %s: unknown mode %q; use %s or %s (%s: walrelay.Setup); nothing changed", t, o.mode, ModeDefault, ModeOrdered, ModeWAL)
	}
	var stmts []string
	ok, err := exists(t.Sanitize())
	if err != nil {
		return fmt.Errorf("migrate %s: look up table: %w", t, err)
	}
	created := !ok
	if o.mode != "" && !created {
		// The switch first (SwitchMode: it settles the old mode into the
		// rows' columns and records the new one), so that a refusal
		// changes nothing (adding the ordering columns rewrites the
		// table). A table without the mode table gets it below, and the
		// mode then.
		if ok, err := modeTableExists(ctx, tx, t); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		} else if ok {
			if err := SwitchMode(ctx, tx, t, o.mode, "migrate"); err != nil {
				return fmt.Errorf("migrate %s: cannot record mode %s: %w", t, o.mode, err)
			}
		}
	}
	if !ok {
		stmts = UpStatements(t, columnsOf(opts))
	} else {
		for _, ix := range indexes(t) {
			if ok, err = exists(t.indexRegclass(ix.suffix)); err != nil {
				return fmt.Errorf("migrate %s: look up index: %w", t, err)
			}
			if !ok {
				stmts = append(stmts, ix.stmt)
			}
		}
		have, facts, err := detectColumns(ctx, tx, t)
		if err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
		if !facts.deadAt {
			stmts = append(stmts, deadAtStatements(t)...)
		}
		// The paused topics' table (migration 000007) does not lock t.
		if ok, err = exists(t.PausedTopicsTable()); err != nil {
			return fmt.Errorf("migrate %s: look up the paused topics: %w", t, err)
		}
		if !ok {
			stmts = append(stmts, pausedTopicsStatement(t))
		}
		// The replay jobs' table (migration 000008) does not lock t either.
		if ok, err = exists(t.ReplayJobsTable()); err != nil {
			return fmt.Errorf("migrate %s: look up the replay jobs: %w", t, err)
		}
		if !ok {
			stmts = append(stmts, replayJobsStatement(t))
		}
		// The death notices' table (migration 000015) does not lock t
		// either.
		if ok, err = exists(t.deadNoticesTable()); err != nil {
			return fmt.Errorf("migrate %s: look up the death notices: %w", t, err)
		}
		if !ok {
			stmts = append(stmts, deadNoticesStatement(t))
		}
		// The mode table (migration 000010) does not lock t either.
		if ok, err = modeTableExists(ctx, tx, t); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
		if !ok {
			stmts = append(stmts, modeStatement(t))
		} else if ok, err = hasLockTTLColumn(ctx, tx, t); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		} else if !ok {
			// The relays' lock TTL (migration 000014): a column of the
			// one-row mode table, added only when missing.
			stmts = append(stmts, lockTTLStatements(t)...)
		}
		// The default the bounded claim needs (migration 000009): set only
		// when it differs, since the ALTER locks t.
		def, err := availableAtDefaultOf(ctx, tx, t)
		if err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
		if def != pgmeta.ClaimBoundDefault {
			stmts = append(stmts, availableAtStatement(t))
		}
		want := columnsOf(opts)
		stmts = append(stmts, optionalColumnStatements(t, Columns{
			TraceContext: want.TraceContext && !have.TraceContext,
			Headers:      want.Headers && !have.Headers,
		})...)
		if want.OrderingKey && !have.OrderingKey {
			if err := checkRewrite(ctx, tx, t, optionsOf(opts).rewrite); err != nil {
				return err
			}
			stmts = append(stmts, orderedColumnStatements(t)...)
		}
		// The companion tables of the table's keyed mode (the mode asked,
		// else the one recorded, else the one inferred), when it lacks them
		// or has them in an older version's shape: they come with the
		// mode, not with a column option (modetables.go). They do not lock
		// the outbox table.
		keyed, err := keyedTablesOfMode(ctx, tx, t, o.mode)
		if err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
		stmts = append(stmts, keyed...)
		// skipped_at (migration 000012) is added without a rewrite, and
		// only when missing (the ALTER locks t).
		if want.OrderingKey && !facts.skippedAt {
			stmts = append(stmts, skippedAtStatements(t)...)
		}
		// skipped_at of every table (migration 000013), where an
		// operator's skip is recorded in every mode: added without a
		// rewrite, and only when missing.
		if !want.OrderingKey && !facts.skippedAt {
			stmts = append(stmts, skippedAtEveryTableStatements(t)...)
		}
	}
	for _, stmt := range stmts {
		if _, err = tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("migrate %s: %w", t, err)
		}
	}
	mode := o.mode
	if mode == "" && created {
		mode = ModeDefault
	}
	if mode != "" {
		if err := SwitchMode(ctx, tx, t, mode, "migrate"); err != nil {
			return fmt.Errorf("migrate %s: cannot record mode %s: %w; nothing changed", t, mode, err)
		}
	}
	return nil
}

// checkRewrite refuses, unless rewrite is set, to add the ordering columns
// to an existing table t of more than OrderedRewriteMaxRows rows.
func checkRewrite(ctx context.Context, tx pgx.Tx, t Table, rewrite bool) error {
	if rewrite {
		return nil
	}
	var n int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM (SELECT 1 FROM `+t.Sanitize()+` LIMIT `+itoa(orderedRewriteMaxRows+1)+`) AS s`).Scan(&n); err != nil {
		return fmt.Errorf("migrate %s: count rows: %w", t, err)
	}
	if n <= orderedRewriteMaxRows {
		return nil
	}
	return fmt.Errorf("migrate %s: %w: it has more than %d rows, and adding ordering_key and the stored generated column ordering_partition "+
		"rewrites it under an ACCESS EXCLUSIVE lock (no reads or writes until it is done); nothing was changed. "+
		"Pass schema.WithTableRewrite() (outbox migrate --ordered --rewrite) in a quiet moment, or run this SQL yourself:\n%s",
		t, ErrTableRewrite, orderedRewriteMaxRows, OrderedUpgradeSQL(t))
}

// OptionalColumnsUpSQL returns the DDL that adds the optional columns opts
// ask for to an existing table t, idempotently.
func optionalColumnsUpSQL(t Table, opts ...MigrateOption) string {
	return joinStatements(optionalColumnStatements(t, columnsOf(opts)))
}

// OptionalColumnsDownSQL returns the DDL that drops the optional columns opts
// name. It is destructive: trace context and headers stored in them are lost.
func optionalColumnsDownSQL(t Table, opts ...MigrateOption) string {
	c := columnsOf(opts)
	var stmts []string
	if c.TraceContext {
		stmts = append(stmts, `ALTER TABLE `+t.Sanitize()+` DROP COLUMN IF EXISTS traceparent, DROP COLUMN IF EXISTS tracestate`)
	}
	if c.Headers {
		stmts = append(stmts, `ALTER TABLE `+t.Sanitize()+` DROP COLUMN IF EXISTS headers`)
	}
	if c.OrderingKey {
		stmts = append(stmts, orderedDownStatements(t)...)
	}
	return joinStatements(stmts)
}

// deadAtNote heads the dead_at migration.
const deadAtNote = "-- Adds dead_at (no table rewrite) and marks dead the rows older versions considered dead:\n" +
	"-- parked at available_at = 'infinity', or attempts >= 25 and not leased. If your relay ran with\n" +
	"-- OUTBOX_RELAY_MAX_ATTEMPTS above 25, put its value in place of 25 before applying it.\n"

// holdStatesNote heads the hold-states migration.
const holdStatesNote = "-- Ordered tables only (skip it for a table without ordered mode): adds the hold states of\n" +
	"-- this version to <table>_holds (resolved holds kept until the floor passes them, operator replays).\n"

// termNote heads the partition-term migration.
const termNote = "-- Ordered tables only (skip it for a table without ordered mode): adds the lease term (epoch) to\n" +
	"-- <table>_partitions; relays of this version fence every write of progress and holds on it.\n"

// pausedNote heads the paused-topics migration.
const pausedNote = "-- Adds <table>_paused_topics, the topics an operator paused (outbox topics pause); relays\n" +
	"-- without it relay every topic.\n"

// availableAtNote heads the available_at default migration.
const availableAtNote = "-- Makes available_at default to clock_timestamp(), the time a row is formed (after its writer\n" +
	"-- holds the table's lock): the default relay's bounded claim needs it, and claims without a bound\n" +
	"-- (walking the dead entries a pinned xmin leaves) until it is applied. A catalog change only, under\n" +
	"-- a brief ACCESS EXCLUSIVE lock: run it with a lock_timeout if long transactions read the table.\n"

// replayJobsNote heads the replay-jobs migration.
const replayJobsNote = "-- Adds <table>_replay_jobs, the console's record of its last bulk replays (their filter and\n" +
	"-- event ids), so that a replay's progress page survives a restart of the console.\n"

// modeNote heads the mode migration.
const modeNote = "-- Adds <table>_mode, the relay mode the table is relayed in (default, ordered or wal), written by\n" +
	"-- outbox migrate --ordered|--wal|--mode and by every relay that starts on the table, and read by the\n" +
	"-- runbook, the console, the cleaner and the gauges. Without a record they infer the mode from what exists.\n"

// oneHoldsNote heads the one-holds-table migration.
const oneHoldsNote = "-- Ordered tables only (skip it for a table without ordered mode): gives <table>_holds the shape\n" +
	"-- both keyed modes share (the WAL relay's hold columns, and state, generated from the hold's facts).\n" +
	"-- Ordered relays of this version refuse a holds table without it. Rewrites the (small) holds table once.\n" +
	"-- A table the WAL relay streams is brought to it by `outbox migrate --wal` (walrelay.Setup), which also\n" +
	"-- moves the holds of <table>_wal_holds into it.\n"

// MigrationFiles renders the migration files for table t, by path (as
// Migrations holds them for public.app_outbox): numbered up and down files
// under migrations/ for golang-migrate and similar tools, and one file per
// step under migrations/goose/ for goose. Hand them to your migration tool
// when it, not Migrate, owns the schema.
func MigrationFiles(t Table) map[string]string {
	const header = "-- Outbox table %s, generated by schema.MigrationFiles. Rename %s to your table\n-- (or print the SQL for it with `outbox migrate --print --table=<name>`).\n"
	const destructive = "-- DESTRUCTIVE: this down migration deletes data, published or not.\n"
	name := t.Name()
	h := fmt.Sprintf(header, t, name)
	// 000001 stays as shipped: later objects come with their own files.
	up1 := joinStatements(UpStatements(t, Columns{})[:1+len(indexes(t))])
	down1 := joinStatements(append(orderedCompanionDrops(t), `DROP TABLE IF EXISTS `+t.Sanitize()))
	up2 := optionalColumnsUpSQL(t, WithTraceColumns(), WithHeadersColumn())
	down2 := optionalColumnsDownSQL(t, WithTraceColumns(), WithHeadersColumn())
	// 000003 creates ordered mode's companion tables with its columns, as
	// shipped (the later steps of ordered tables alter them); Migrate
	// creates them with the switch to ordered mode instead.
	up3 := joinStatements(append(orderedColumnStatements(t), orderedCompanionStatements(t)...))
	down3 := optionalColumnsDownSQL(t, WithOrderingKeyColumn())
	up4 := deadAtUpSQL(t)
	down4 := deadAtDownSQL(t)
	up5 := holdsStateUpSQL(t)
	down5 := holdsStateDownSQL(t)
	up6 := termUpSQL(t)
	down6 := termDownSQL(t)
	up7 := pausedTopicsUpSQL(t)
	down7 := pausedTopicsDownSQL(t)
	up8 := replayJobsUpSQL(t)
	down8 := replayJobsDownSQL(t)
	up9 := availableAtUpSQL(t)
	down9 := availableAtDownSQL(t)
	up10 := modeUpSQL(t)
	down10 := modeDownSQL(t)
	up11 := oneHoldsTableUpSQL(t)
	down11 := oneHoldsTableDownSQL(t)
	up12 := skippedAtUpSQL(t)
	down12 := skippedAtDownSQL(t)
	up13 := skippedAtEveryTableUpSQL(t)
	down13 := skippedAtEveryTableDownSQL(t)
	up14 := lockTTLUpSQL(t)
	down14 := lockTTLDownSQL(t)
	up15 := deadNoticesUpSQL(t)
	down15 := deadNoticesDownSQL(t)
	return map[string]string{
		"migrations/000001_create_" + name + ".up.sql":                       h + "\n" + up1,
		"migrations/000001_create_" + name + ".down.sql":                     h + destructive + "\n" + down1,
		"migrations/000002_add_" + name + "_optional_columns.up.sql":         h + "\n" + up2,
		"migrations/000002_add_" + name + "_optional_columns.down.sql":       h + destructive + "\n" + down2,
		"migrations/000003_add_" + name + "_ordering.up.sql":                 h + "\n" + up3,
		"migrations/000003_add_" + name + "_ordering.down.sql":               h + destructive + "\n" + down3,
		"migrations/000004_add_" + name + "_dead_at.up.sql":                  h + deadAtNote + "\n" + up4,
		"migrations/000004_add_" + name + "_dead_at.down.sql":                h + "\n" + down4,
		"migrations/000005_add_" + name + "_hold_states.up.sql":              h + holdStatesNote + "\n" + up5,
		"migrations/000005_add_" + name + "_hold_states.down.sql":            h + "\n" + down5,
		"migrations/000006_add_" + name + "_partition_term.up.sql":           h + termNote + "\n" + up6,
		"migrations/000006_add_" + name + "_partition_term.down.sql":         h + "\n" + down6,
		"migrations/000007_add_" + name + "_paused_topics.up.sql":            h + pausedNote + "\n" + up7,
		"migrations/000007_add_" + name + "_paused_topics.down.sql":          h + "\n" + down7,
		"migrations/000008_add_" + name + "_replay_jobs.up.sql":              h + replayJobsNote + "\n" + up8,
		"migrations/000008_add_" + name + "_replay_jobs.down.sql":            h + "\n" + down8,
		"migrations/000009_set_" + name + "_available_at_default.up.sql":     h + availableAtNote + "\n" + up9,
		"migrations/000009_set_" + name + "_available_at_default.down.sql":   h + "\n" + down9,
		"migrations/000010_add_" + name + "_mode.up.sql":                     h + modeNote + "\n" + up10,
		"migrations/000010_add_" + name + "_mode.down.sql":                   h + "\n" + down10,
		"migrations/000011_add_" + name + "_one_holds_table.up.sql":          h + oneHoldsNote + "\n" + up11,
		"migrations/000011_add_" + name + "_one_holds_table.down.sql":        h + "\n" + down11,
		"migrations/000012_add_" + name + "_skipped_at.up.sql":               h + skippedNote + "\n" + up12,
		"migrations/000012_add_" + name + "_skipped_at.down.sql":             h + "\n" + down12,
		"migrations/000013_add_" + name + "_skipped_at_every_table.up.sql":   h + skippedEveryTableNote + "\n" + up13,
		"migrations/000013_add_" + name + "_skipped_at_every_table.down.sql": h + "\n" + down13,
		"migrations/000014_add_" + name + "_mode_lock_ttl.up.sql":            h + lockTTLNote + "\n" + up14,
		"migrations/000014_add_" + name + "_mode_lock_ttl.down.sql":          h + "\n" + down14,
		"migrations/000015_add_" + name + "_dead_notices.up.sql":             h + deadNoticesNote + "\n" + up15,
		"migrations/000015_add_" + name + "_dead_notices.down.sql":           h + "\n" + down15,
		"migrations/goose/00001_create_" + name + ".sql": h + "\n-- +goose Up\n" + up1 + "\n" + up2 + "\n" + up3 +
			"\n-- +goose Down\n" + destructive + down1,
		"migrations/goose/00002_add_" + name + "_dead_at.sql": h + deadAtNote + "\n-- +goose Up\n" + up4 +
			"\n-- +goose Down\n" + down4,
		"migrations/goose/00003_add_" + name + "_hold_states.sql": h + holdStatesNote + "\n-- +goose Up\n" + up5 +
			"\n-- +goose Down\n" + down5,
		"migrations/goose/00004_add_" + name + "_partition_term.sql": h + termNote + "\n-- +goose Up\n" + up6 +
			"\n-- +goose Down\n" + down6,
		"migrations/goose/00005_add_" + name + "_paused_topics.sql": h + pausedNote + "\n-- +goose Up\n" + up7 +
			"\n-- +goose Down\n" + down7,
		"migrations/goose/00006_add_" + name + "_replay_jobs.sql": h + replayJobsNote + "\n-- +goose Up\n" + up8 +
			"\n-- +goose Down\n" + down8,
		"migrations/goose/00007_set_" + name + "_available_at_default.sql": h + availableAtNote + "\n-- +goose Up\n" + up9 +
			"\n-- +goose Down\n" + down9,
		"migrations/goose/00008_add_" + name + "_mode.sql": h + modeNote + "\n-- +goose Up\n" + up10 +
			"\n-- +goose Down\n" + down10,
		"migrations/goose/00009_add_" + name + "_one_holds_table.sql": h + oneHoldsNote + "\n-- +goose Up\n" + up11 +
			"\n-- +goose Down\n" + down11,
		"migrations/goose/00010_add_" + name + "_skipped_at.sql": h + skippedNote + "\n-- +goose Up\n" + up12 +
			"\n-- +goose Down\n" + down12,
		"migrations/goose/00011_add_" + name + "_skipped_at_every_table.sql": h + skippedEveryTableNote + "\n-- +goose Up\n" + up13 +
			"\n-- +goose Down\n-- +goose StatementBegin\n" + down13 + "-- +goose StatementEnd\n",
		"migrations/goose/00012_add_" + name + "_mode_lock_ttl.sql": h + lockTTLNote + "\n-- +goose Up\n" + up14 +
			"\n-- +goose Down\n" + down14,
		"migrations/goose/00013_add_" + name + "_dead_notices.sql": h + deadNoticesNote + "\n-- +goose Up\n" + up15 +
			"\n-- +goose Down\n" + down15,
	}
}
