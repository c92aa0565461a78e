package schema

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Suffix of the inbox table's retention index.
const suffixInboxProcessedIndex = "_by_processed"

// inboxUpStatements is the idempotent DDL of an inbox table.
func inboxUpStatements(t Table) []string {
	tbl := t.Sanitize()
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + tbl + ` (
  consumer     TEXT        NOT NULL,
  key          TEXT        NOT NULL,
  processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  CONSTRAINT ` + t.ident(suffixPkey) + ` PRIMARY KEY (consumer, key)
)`,
		`CREATE INDEX IF NOT EXISTS ` + t.ident(suffixInboxProcessedIndex) + ` ON ` + tbl + ` (consumer, processed_at)`,
	}
}

// InboxUpSQL returns the idempotent DDL that creates the inbox table t, for
// migration tools.
func InboxUpSQL(t Table) string { return joinStatements(inboxUpStatements(t)) }

// InboxDownSQL returns the DDL that drops the inbox table t. It is
// destructive: every processed key is forgotten, so every redelivered event
// runs its handler again.
func InboxDownSQL(t Table) string {
	return joinStatements([]string{`DROP TABLE IF EXISTS ` + t.Sanitize()})
}

// MigrateInbox creates the inbox table t and its retention index. A missing
// schema is ErrSchemaNotFound unless opts has WithCreateSchema (the only
// option it reads). It is
// idempotent and safe when several processes call it at once (one
// transaction, serialised by a transaction-level advisory lock on t).
func MigrateInbox(ctx context.Context, db DB, t Table, opts ...MigrateOption) (err error) {
	if t.IsZero() {
		return errors.New("schema: migrate inbox: zero Table; build it with schema.ParseTable")
	}
	if db == nil {
		return errors.New("schema: migrate inbox: nil DB; pass a *pgxpool.Pool or *pgx.Conn")
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("schema: migrate inbox %s: begin: %w", t, err)
	}
	defer func() {
		if err != nil {
			if rbErr := tx.Rollback(ctx); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
				err = errors.Join(err, fmt.Errorf("rollback: %w", rbErr))
			}
		}
	}()
	if _, err = tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, t.migrateLockKey()); err != nil {
		return fmt.Errorf("schema: migrate inbox %s: lock: %w", t, err)
	}
	exists := func(name string) (bool, error) {
		var ok bool
		err := tx.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, name).Scan(&ok)
		return ok, err
	}
	if err = ensureSchema(ctx, tx, t, optionsOf(opts).createSchema, "migrate inbox"); err != nil {
		return err
	}
	// Run only what is missing: CREATE INDEX IF NOT EXISTS locks the table
	// even when the index exists, which would stall live handlers.
	stmts := inboxUpStatements(t)
	ok, err := exists(t.Sanitize())
	if err != nil {
		return fmt.Errorf("schema: migrate inbox %s: look up table: %w", t, err)
	}
	if ok {
		stmts = stmts[1:]
		if ok, err = exists(t.indexRegclass(suffixInboxProcessedIndex)); err != nil {
			return fmt.Errorf("schema: migrate inbox %s: look up index: %w", t, err)
		}
		if ok {
			stmts = nil
		}
	}
	for _, stmt := range stmts {
		if _, err = tx.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("schema: migrate inbox %s: %w", t, err)
		}
	}
	if err = tx.Commit(ctx); err != nil {
		return fmt.Errorf("schema: migrate inbox %s: commit: %w", t, err)
	}
	return nil
}
