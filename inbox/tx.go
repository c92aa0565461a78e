package inbox

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// connTx is the inbox's transaction: a pgx.Tx over a connection whose
// BEGIN was sent in one pipeline with the record's INSERT (Inbox.begin), so
// that the record costs no round trip of its own. It behaves as pgx's own
// transaction: Commit reports pgx.ErrTxCommitRollback when the server rolled
// back, every method after Commit or Rollback returns pgx.ErrTxClosed, Begin
// starts a savepoint (pseudo nested transaction), and a failed Commit or
// Rollback leaves a connection that the pool closes instead of reusing. One
// difference: Commit refuses a transaction that a statement sent through it
// already ended (errEndedBySQL), where pgx's would return nil.
type connTx struct {
	conn         *pgx.Conn
	closed       bool
	savepointNum int64
	largeObjects *pgx.LargeObjects
}

var _ pgx.Tx = (*connTx)(nil)

// Begin starts a pseudo nested transaction (a savepoint).
func (tx *connTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	tx.savepointNum++
	name := "sp_" + strconv.FormatInt(tx.savepointNum, 10)
	if _, err := tx.conn.Exec(ctx, "savepoint "+name); err != nil {
		return nil, err
	}
	return &savepointTx{parent: tx, name: name}, nil
}

// errEndedBySQL is Commit's error when a statement sent through the
// transaction (ROLLBACK, COMMIT, END, ABORT) already ended it.
var errEndedBySQL = fmt.Errorf("the transaction was ended by a statement sent through it: %w", pgx.ErrTxClosed)

// Commit commits the transaction. Unlike pgx's, it refuses (an error
// matching pgx.ErrTxClosed) when the connection is no longer in a
// transaction because a statement sent through it ended it: PostgreSQL would
// only warn that there is no transaction in progress, and writes made after
// that statement committed on their own.
func (tx *connTx) Commit(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	if tx.conn.PgConn().TxStatus() == 'I' {
		tx.closed = true
		return errEndedBySQL
	}
	tag, err := tx.conn.Exec(ctx, "commit")
	tx.closed = true
	if err != nil {
		if tx.conn.PgConn().TxStatus() != 'I' {
			_ = tx.conn.Close(ctx) // already have an error to return
		}
		return err
	}
	if tag.String() == "ROLLBACK" {
		return pgx.ErrTxCommitRollback
	}
	return nil
}

// Rollback rolls the transaction back. It returns pgx.ErrTxClosed after
// Commit or Rollback, so a deferred Rollback is safe.
func (tx *connTx) Rollback(ctx context.Context) error {
	if tx.closed {
		return pgx.ErrTxClosed
	}
	_, err := tx.conn.Exec(ctx, "rollback")
	tx.closed = true
	if err != nil {
		// The connection's state is unknown: close it (the pool then
		// drops it).
		_ = tx.conn.Close(context.WithoutCancel(ctx))
		return err
	}
	return nil
}

// CopyFrom delegates to the connection.
func (tx *connTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if tx.closed {
		return 0, pgx.ErrTxClosed
	}
	return tx.conn.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

// SendBatch delegates to the connection.
func (tx *connTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if tx.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return tx.conn.SendBatch(ctx, b)
}

// LargeObjects returns the large objects of the transaction. pgx builds
// them only from a transaction of its own, so the first call opens one
// over this transaction with a savepoint (one round trip); in a transaction
// that already failed, that is impossible and the LargeObjects returned
// cannot be used.
func (tx *connTx) LargeObjects() pgx.LargeObjects {
	if tx.largeObjects == nil && !tx.closed {
		tx.savepointNum++
		if inner, err := tx.conn.BeginTx(context.Background(), pgx.TxOptions{BeginQuery: "savepoint sp_" + strconv.FormatInt(tx.savepointNum, 10)}); err == nil {
			lo := inner.LargeObjects()
			tx.largeObjects = &lo
		}
	}
	if tx.largeObjects == nil {
		return pgx.LargeObjects{}
	}
	return *tx.largeObjects
}

// Prepare delegates to the connection.
func (tx *connTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if tx.closed {
		return nil, pgx.ErrTxClosed
	}
	return tx.conn.Prepare(ctx, name, sql)
}

// Exec delegates to the connection.
func (tx *connTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if tx.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return tx.conn.Exec(ctx, sql, arguments...)
}

// Query delegates to the connection.
func (tx *connTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if tx.closed {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return tx.conn.Query(ctx, sql, args...)
}

// QueryRow delegates to the connection.
func (tx *connTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if tx.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return tx.conn.QueryRow(ctx, sql, args...)
}

// Conn returns the connection of the transaction.
func (tx *connTx) Conn() *pgx.Conn { return tx.conn }

// savepointTx is a pseudo nested transaction of a connTx.
type savepointTx struct {
	parent *connTx
	name   string
	closed bool
}

func (sp *savepointTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.parent.Begin(ctx)
}

func (sp *savepointTx) Commit(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "release savepoint "+sp.name)
	sp.closed = true
	return err
}

func (sp *savepointTx) Rollback(ctx context.Context) error {
	if sp.closed {
		return pgx.ErrTxClosed
	}
	_, err := sp.Exec(ctx, "rollback to savepoint "+sp.name)
	sp.closed = true
	return err
}

func (sp *savepointTx) CopyFrom(ctx context.Context, tableName pgx.Identifier, columnNames []string, rowSrc pgx.CopyFromSource) (int64, error) {
	if sp.closed {
		return 0, pgx.ErrTxClosed
	}
	return sp.parent.CopyFrom(ctx, tableName, columnNames, rowSrc)
}

func (sp *savepointTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if sp.closed {
		return pgx.FailedBatchResults(b, pgx.ErrTxClosed)
	}
	return sp.parent.SendBatch(ctx, b)
}

func (sp *savepointTx) LargeObjects() pgx.LargeObjects { return sp.parent.LargeObjects() }

func (sp *savepointTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if sp.closed {
		return nil, pgx.ErrTxClosed
	}
	return sp.parent.Prepare(ctx, name, sql)
}

func (sp *savepointTx) Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error) {
	if sp.closed {
		return pgconn.CommandTag{}, pgx.ErrTxClosed
	}
	return sp.parent.Exec(ctx, sql, arguments...)
}

func (sp *savepointTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if sp.closed {
		return errRows{pgx.ErrTxClosed}, pgx.ErrTxClosed
	}
	return sp.parent.Query(ctx, sql, args...)
}

func (sp *savepointTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if sp.closed {
		return errRow{pgx.ErrTxClosed}
	}
	return sp.parent.QueryRow(ctx, sql, args...)
}

func (sp *savepointTx) Conn() *pgx.Conn { return sp.parent.Conn() }

// errRow is a pgx.Row whose Scan returns err.
type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// errRows is closed pgx.Rows carrying err, as pgx returns after a
// transaction ended (so that a deferred rows.Close() is safe).
type errRows struct{ err error }

func (r errRows) Close()                                       {}
func (r errRows) Err() error                                   { return r.err }
func (r errRows) CommandTag() pgconn.CommandTag                { return pgconn.CommandTag{} }
func (r errRows) FieldDescriptions() []pgconn.FieldDescription { return nil }
func (r errRows) Next() bool                                   { return false }
func (r errRows) Scan(...any) error                            { return r.err }
func (r errRows) Values() ([]any, error)                       { return nil, r.err }
func (r errRows) RawValues() [][]byte                          { return nil }
func (r errRows) Conn() *pgx.Conn                              { return nil }
func (r errRows) TypeMap() *pgtype.Map                         { return nil }
