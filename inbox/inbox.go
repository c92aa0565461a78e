// Package inbox makes a Watermill consumer's database effects happen once per
// event although delivery is at least once.
//
// Inbox.Middleware opens a pgx transaction, records (consumer, key) in the
// inbox table with INSERT ... ON CONFLICT DO NOTHING, and runs the handler
// with that transaction in the message's context (Tx(msg.Context())). The
// BEGIN and the record go to the server in one round trip (a pipeline of
// two prepared statements), so the inbox adds a row to the handler's
// transaction but no round trip; the transaction is a pgx.Tx of the inbox's
// own over a pooled connection, which behaves as pgx's (Begin makes a
// savepoint, LargeObjects works, Commit reports pgx.ErrTxCommitRollback).
// The handler writes its effects, and may enqueue new outbox events with
// publisher.Enqueue, through that transaction:
//
//   - handler success commits the record and the effects together, then the
//     message is acked (and the messages the handler returned are published
//     by the router, after the commit; a duplicate returns none, so messages
//     whose publish failed after the commit are lost: enqueue the next event
//     in the transaction with publisher.Enqueue instead);
//   - a handler error rolls both back and the error is returned: the
//     message is nacked and redelivered;
//   - a handler panic rolls both back and the panic continues (it is
//     re-raised, not turned into an error), so that Watermill's
//     middleware.Recoverer, added before the inbox middleware, turns it into
//     an error with its stack trace and the message is nacked;
//   - a key this consumer already committed is acked without running the
//     handler (a duplicate).
//
// Two copies of one event handled at the same moment commit the effects once.
// By default (Concurrency Wait) the second copy's INSERT waits on the first
// copy's transaction: if it commits, the second copy is a duplicate; if it
// rolls back, the second copy does the work. With FailFast the second copy
// does not wait: it fails at once with ErrInProgress (the message is nacked
// and redelivered later, when it is normally a duplicate).
//
// The handler must write through the pgx.Tx of Tx(msg.Context()). A
// *sql.DB opened on the same pool (stdlib.OpenDBFromPool) hands out other
// connections, whose writes commit on their own, outside the inbox's
// transaction; there is no safe way to turn the pgx.Tx into a *sql.Tx.
// Data-access code generated for pgx (sqlc's DBTX, for example) accepts the
// pgx.Tx as it is.
//
// Processed keys are kept for Config.Retention; Cleanup deletes older ones in
// bounded batches, and Config.CleanupInterval runs it in the background.
// A duplicate that arrives after its key was deleted runs the handler again:
// the retention is the idempotency window. See docs/CONSUMERS.md.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Defaults of Config.
const (
	// RetentionDefault is how long processed keys are kept by default: 30
	// days, longer than the outbox keeps published rows (168h) so that a
	// replay of a recent event is still recognised.
	RetentionDefault = 30 * 24 * time.Hour
	// CleanupBatchDefault is the default number of keys one DELETE removes.
	CleanupBatchDefault = 1000
	// MaxKeyBytes is the longest key accepted.
	MaxKeyBytes = 512
)

// Concurrency says what a copy does when another copy of the same event is
// being handled at the same moment.
type Concurrency int

const (
	// Wait (the default) makes the copy wait for the other copy's transaction;
	// it is then a duplicate (the other committed) or does the work (the
	// other rolled back). A copy holds a connection while it waits.
	Wait Concurrency = iota
	// FailFast makes the copy fail at once with ErrInProgress and be nacked, to
	// be redelivered later. It uses a transaction-level advisory lock on
	// (table, consumer, key); do not mix Wait and FailFast for one consumer.
	FailFast
)

// String names the mode.
func (c Concurrency) String() string {
	switch c {
	case Wait:
		return "wait"
	case FailFast:
		return "fail-fast"
	default:
		return fmt.Sprintf("Concurrency(%d)", int(c))
	}
}

var (
	// ErrInvalidKey is matched (errors.Is) by the error of a message whose
	// key is missing or unusable; the handler did not run and the message
	// is nacked.
	ErrInvalidKey = errors.New("inbox: invalid message key")
	// ErrInProgress is matched by the error of a copy refused under
	// FailFast because another copy of the same event is being handled. It
	// is transient: redelivery resolves it.
	ErrInProgress = errors.New("inbox: another copy of this event is being handled now; retry later")
	// ErrClosed is returned by Cleanup after Close.
	ErrClosed = errors.New("inbox: closed")
)

// KeyFunc returns the dedup key of a message: a non-empty valid UTF-8 string
// without NUL bytes, at most MaxKeyBytes long.
type KeyFunc func(msg *message.Message) (string, error)

// DefaultKey is the default KeyFunc: the event_id metadata
// (schema.MetadataEventID, a header on Kafka and AMQP) when present, else the
// message UUID, which the outbox sets to the event_id.
func DefaultKey(msg *message.Message) (string, error) {
	if v := msg.Metadata.Get(schema.MetadataEventID); v != "" {
		return v, nil
	}
	if msg.UUID != "" {
		return msg.UUID, nil
	}
	return "", errors.New("the message has neither event_id metadata nor a UUID")
}

// Config configures an Inbox.
type Config struct {
	// Table is the inbox table, created by Migrate. Required.
	Table schema.Table
	// Consumer is the handler's name; each consumer handles an event once,
	// independently of other consumers sharing the table. Required.
	Consumer string
	// Retention is how long processed keys are kept, the idempotency
	// window: a duplicate arriving later runs the handler again. Defaults
	// to RetentionDefault (30 days).
	Retention time.Duration
	// CleanupInterval, when positive, runs Cleanup in the background at this
	// interval until Close. Defaults to 0: no background loop (call Cleanup
	// yourself, from a cron job or one process).
	CleanupInterval time.Duration
	// CleanupBatch is the number of keys one DELETE removes. Defaults to
	// CleanupBatchDefault (1000).
	CleanupBatch int
	// Key returns the dedup key of a message. Defaults to DefaultKey.
	Key KeyFunc
	// Concurrency chooses between waiting on a concurrent copy and failing
	// fast. Defaults to Wait.
	Concurrency Concurrency
	// Metrics records processed messages, duplicates and handler failures.
	// Defaults to nil (no metrics).
	Metrics *Metrics
	// Logger logs duplicates (debug), failures and cleanup. Defaults to
	// watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *Config) setDefaults() {
	if c.Retention == 0 {
		c.Retention = RetentionDefault
	}
	if c.CleanupBatch == 0 {
		c.CleanupBatch = CleanupBatchDefault
	}
	if c.Key == nil {
		c.Key = DefaultKey
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

func (c *Config) validate() error {
	switch {
	case c.Table.IsZero():
		return errors.New("inbox: invalid config: Table is empty; set it to the inbox table (schema.ParseTable), created with inbox.Migrate")
	case c.Consumer == "":
		return errors.New("inbox: invalid config: Consumer is empty; set it to the handler's name, e.g. \"billing.create-account\"")
	case !utf8.ValidString(c.Consumer) || len(c.Consumer) > MaxKeyBytes || containsNUL(c.Consumer):
		return fmt.Errorf("inbox: invalid config: Consumer must be valid UTF-8 without NUL bytes, at most %d bytes", MaxKeyBytes)
	case c.Retention < 0:
		return fmt.Errorf("inbox: invalid config: Retention is %s; leave it 0 for the 30-day default or set a positive duration", c.Retention)
	case c.CleanupInterval < 0:
		return fmt.Errorf("inbox: invalid config: CleanupInterval is %s; leave it 0 for no background cleanup or set a positive interval", c.CleanupInterval)
	case c.CleanupBatch < 0:
		return fmt.Errorf("inbox: invalid config: CleanupBatch is %d; leave it 0 for the default (%d) or set a positive number", c.CleanupBatch, CleanupBatchDefault)
	case c.Concurrency != Wait && c.Concurrency != FailFast:
		return fmt.Errorf("inbox: invalid config: Concurrency is %d; use inbox.Wait or inbox.FailFast", int(c.Concurrency))
	}
	return nil
}

func containsNUL(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return true
		}
	}
	return false
}

// Inbox is the middleware of one consumer on one inbox table. It is safe for
// concurrent use.
type Inbox struct {
	pool   *pgxpool.Pool
	cfg    Config
	q      *sqlq.InboxQueries
	labels [2]string

	closeOnce sync.Once
	closed    chan struct{}
	loopDone  chan struct{}
}

// Migrate creates the inbox table t (consumer, key, processed_at, primary key
// (consumer, key) and an index for retention). It is idempotent and safe when
// several processes call it at once, like schema.Migrate. Print the DDL for a
// migration tool with schema.InboxUpSQL. A missing schema is an error
// (schema.ErrSchemaNotFound) unless opts has schema.WithCreateSchema().
func Migrate(ctx context.Context, db schema.DB, t schema.Table, opts ...schema.MigrateOption) error {
	if err := schema.MigrateInbox(ctx, db, t, opts...); err != nil {
		return fmt.Errorf("inbox: %w", err)
	}
	return nil
}

// New returns the Inbox of cfg.Consumer on cfg.Table. It checks that the
// table exists. Close it when Config.CleanupInterval is set (Close is always
// safe to call).
func New(pool *pgxpool.Pool, cfg Config) (*Inbox, error) {
	if pool == nil {
		return nil, errors.New("inbox: invalid config: nil pool; pass the *pgxpool.Pool of the consumer's database")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	q := sqlq.NewInboxQueries(cfg.Table)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var exists bool
	if err := pool.QueryRow(ctx, q.Exists, cfg.Table.Sanitize()).Scan(&exists); err != nil {
		return nil, fmt.Errorf("inbox: look up table %s: %w", cfg.Table, err)
	}
	if !exists {
		return nil, fmt.Errorf("inbox: table %s does not exist; create it with inbox.Migrate (or the DDL of schema.InboxUpSQL)", cfg.Table)
	}
	i := &Inbox{
		pool: pool, cfg: cfg, q: q,
		labels: [2]string{cfg.Table.Qualified(), cfg.Consumer},
		closed: make(chan struct{}), loopDone: make(chan struct{}),
	}
	if cfg.CleanupInterval > 0 {
		go i.cleanupLoop()
	} else {
		close(i.loopDone)
	}
	return i, nil
}

// Close stops the background cleanup loop, if any, and waits for it. It is
// idempotent. The middleware keeps working after Close; only Cleanup refuses.
func (i *Inbox) Close() error {
	i.closeOnce.Do(func() { close(i.closed) })
	<-i.loopDone
	return nil
}

type txKey struct{}

// Tx returns the transaction of the message being handled by the inbox
// middleware: call it with msg.Context() inside the handler. The handler must
// not commit or roll it back, with its methods or with a COMMIT or ROLLBACK
// statement sent through it; the middleware does, and a handler that ended
// the transaction gets an error (the message is nacked). Writes sent after
// such a statement ran outside the transaction and stay.
func Tx(ctx context.Context) (pgx.Tx, bool) {
	tx, ok := ctx.Value(txKey{}).(pgx.Tx)
	return tx, ok
}

// key returns the message's validated key.
func (i *Inbox) key(msg *message.Message) (string, error) {
	k, err := i.cfg.Key(msg)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	switch {
	case k == "":
		return "", fmt.Errorf("%w: the key function returned an empty key", ErrInvalidKey)
	case len(k) > MaxKeyBytes:
		return "", fmt.Errorf("%w: the key is %d bytes, at most %d are allowed; key on an event id", ErrInvalidKey, len(k), MaxKeyBytes)
	case !utf8.ValidString(k) || containsNUL(k):
		return "", fmt.Errorf("%w: the key is not valid UTF-8 text without NUL bytes", ErrInvalidKey)
	}
	return k, nil
}

// Middleware wraps h so that its effects commit once per event; it is a
// message.HandlerMiddleware (router.AddMiddleware, or per handler with
// handler.AddMiddleware). Add middleware.Recoverer before it (outside) to
// turn a handler panic into a nack: the inbox rolls back and re-panics. Add
// middleware.Retry before it too (Watermill runs middleware in the order it
// was added, router-wide and per handler alike): each attempt then has a
// transaction of its own, whereas a Retry added after it runs every attempt
// in one transaction, and a failed attempt's writes commit with the retry's.
//
// Errors: a message without a usable key (ErrInvalidKey), a database failure
// (begin, record, commit; a closed pool included) and ErrInProgress
// (FailFast) nack the message without acking it; the handler's own error is
// returned as it is.
func (i *Inbox) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) (out []*message.Message, err error) {
		key, err := i.key(msg)
		if err != nil {
			i.cfg.Metrics.failed(i.labels)
			return nil, err
		}
		origCtx := msg.Context()
		conn, tx, inserted, err := i.begin(origCtx, key)
		if err != nil {
			i.cfg.Metrics.failed(i.labels)
			return nil, err
		}
		if !inserted {
			// Already committed by an earlier copy: ack without running
			// the handler; begin ended the transaction.
			i.cfg.Metrics.duplicate(i.labels)
			i.cfg.Logger.Debug("inbox: duplicate skipped", watermill.LogFields{"consumer": i.cfg.Consumer, "key": key, "message_uuid": msg.UUID})
			return nil, nil
		}
		committed := false
		defer func() {
			defer conn.Release() // after the rollback below
			if committed {
				return
			}
			// Also runs while a panic unwinds; the panic continues after.
			rbCtx, cancel := context.WithTimeout(context.WithoutCancel(origCtx), 5*time.Second)
			defer cancel()
			if rbErr := tx.Rollback(rbCtx); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) && err != nil {
				err = errors.Join(err, fmt.Errorf("inbox: rollback: %w", rbErr))
			}
			msg.SetContext(origCtx)
			i.cfg.Metrics.failed(i.labels)
		}()

		msg.SetContext(context.WithValue(origCtx, txKey{}, tx))
		out, err = h(msg)
		if err != nil {
			return nil, err
		}
		if err = tx.Commit(origCtx); err != nil {
			if errors.Is(err, pgx.ErrTxClosed) {
				err = fmt.Errorf("inbox: the handler ended the inbox transaction itself; never commit or roll back inbox.Tx: %w", err)
			} else {
				err = fmt.Errorf("inbox: commit %s for consumer %s: %w", key, i.cfg.Consumer, err)
			}
			return nil, err
		}
		committed = true
		msg.SetContext(origCtx)
		i.cfg.Metrics.processed(i.labels)
		return out, nil
	}
}

// begin opens the message's transaction with (consumer, key) recorded in
// it, and reports whether the key is new. For a key already committed it
// ends the transaction itself and reports false (tx nil); so does an error.
//
// It costs one round trip: on a connection taken from the pool, BEGIN and
// the record (the prepared Record statement, or RecordNoWait with its
// advisory lock under FailFast) go out in one pipeline (pgx.Batch), and the
// transaction is a connTx over that connection. Under Wait, a copy in flight
// makes the INSERT wait on that copy's transaction, as before. conn must be
// released after tx ends.
func (i *Inbox) begin(ctx context.Context, key string) (conn *pgxpool.Conn, tx pgx.Tx, inserted bool, err error) {
	conn, err = i.pool.Acquire(ctx)
	if err != nil {
		return nil, nil, false, fmt.Errorf("inbox: begin the transaction of %s for consumer %s: %w", key, i.cfg.Consumer, err)
	}
	b := &pgx.Batch{}
	b.Queue("begin")
	failFast := i.cfg.Concurrency == FailFast
	if failFast {
		b.Queue(i.q.RecordNoWait, i.cfg.Consumer, key)
	} else {
		b.Queue(i.q.Record, i.cfg.Consumer, key)
	}
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	locked := true
	if err == nil {
		if failFast {
			err = br.QueryRow().Scan(&locked, &inserted)
		} else {
			var tag pgconn.CommandTag
			tag, err = br.Exec()
			inserted = tag.RowsAffected() == 1
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	t := &connTx{conn: conn.Conn()}
	if err == nil && inserted {
		return conn, t, true, nil
	}
	// Nothing to do in this transaction: end it and give the connection
	// back (one left inside a transaction is closed, not reused).
	if conn.Conn().PgConn().TxStatus() != 'I' {
		if rbErr := t.Rollback(context.WithoutCancel(ctx)); rbErr != nil {
			i.cfg.Logger.Debug("inbox: rollback failed", watermill.LogFields{"error": rbErr.Error()})
		}
	}
	conn.Release()
	switch {
	case err != nil:
		return nil, nil, false, fmt.Errorf("inbox: record %s for consumer %s: %w", key, i.cfg.Consumer, err)
	case !locked:
		return nil, nil, false, fmt.Errorf("%w (consumer %s, key %s)", ErrInProgress, i.cfg.Consumer, key)
	}
	// Already committed by an earlier copy. Nothing was written.
	return nil, nil, false, nil
}

// Cleanup deletes this consumer's keys processed more than Retention ago, in
// batches of CleanupBatch rows (one short transaction each), and returns how
// many it deleted. Run it from one place (the background loop of one
// process, or a cron job); concurrent runs are safe but redundant.
func (i *Inbox) Cleanup(ctx context.Context) (int64, error) {
	var total int64
	for {
		select {
		case <-i.closed:
			return total, ErrClosed
		default:
		}
		tag, err := i.pool.Exec(ctx, i.q.DeleteExpired, i.cfg.Consumer, i.cfg.Retention.Microseconds(), i.cfg.CleanupBatch)
		if err != nil {
			return total, fmt.Errorf("inbox: cleanup of %s for consumer %s: %w", i.cfg.Table, i.cfg.Consumer, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(i.cfg.CleanupBatch) {
			return total, nil
		}
	}
}

func (i *Inbox) cleanupLoop() {
	defer close(i.loopDone)
	// ctx ends at Close, so that Close interrupts a DELETE in flight.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		select {
		case <-i.closed:
			cancel()
		case <-ctx.Done():
		}
	}()
	defer wg.Wait()
	defer cancel()
	tick := time.NewTicker(i.cfg.CleanupInterval)
	defer tick.Stop()
	for {
		select {
		case <-i.closed:
			return
		case <-tick.C:
		}
		n, err := i.Cleanup(ctx)
		switch {
		case err != nil && !errors.Is(err, ErrClosed) && ctx.Err() == nil:
			i.cfg.Logger.Error("inbox: cleanup failed; retrying at the next interval", err, watermill.LogFields{"table": i.labels[0], "consumer": i.cfg.Consumer})
		case n > 0:
			i.cfg.Logger.Info("inbox: deleted expired keys", watermill.LogFields{"table": i.labels[0], "consumer": i.cfg.Consumer, "deleted": n})
		}
	}
}
