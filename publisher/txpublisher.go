package publisher

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrPublisherClosed is returned by Publish after Close.
var ErrPublisherClosed = errors.New("outbox tx publisher is closed")

// TxPublisherConfig configures a TxPublisher.
type TxPublisherConfig struct {
	// Table is the outbox table. Required.
	Table schema.Table
	// DefaultTenantID is used for messages without a tenant_id metadata
	// entry. Defaults to none: such messages are refused.
	DefaultTenantID uuid.UUID
	// Enqueuer writes the rows, with its topic validation, payload limit,
	// wake-up and metrics (EnqueuerConfig). A TxPublisher lives for one
	// transaction: build the Enqueuer once and share it. Defaults to an
	// Enqueuer with the zero EnqueuerConfig.
	Enqueuer *Enqueuer
}

// TxPublisher is a Watermill message.Publisher bound to one transaction:
// Publish(topic, msgs...) enqueues the messages into the outbox table inside
// that transaction, so they commit or roll back with it. Create one per
// transaction; it is cheap.
//
// Each message's UUID must be a UUID (it becomes event_id), its tenant comes
// from metadata tenant_id or DefaultTenantID, its payload must be JSON, and
// its other metadata is stored in the headers column (the table must have
// it when metadata is present). The topic is stored in the topic column, so
// subscriber.Subscribe(ctx, topic) receives it.
//
// TxPublisher never runs DDL: create the table beforehand with
// schema.Migrate, never inside a business transaction.
type TxPublisher struct {
	tx     Tx
	cfg    TxPublisherConfig
	closed atomic.Bool
}

var _ message.Publisher = (*TxPublisher)(nil)

// setDefaults fills Enqueuer and checks Table.
func (c *TxPublisherConfig) setDefaults() error {
	if c.Table.IsZero() {
		return errors.New("publisher: invalid config: Table is not set; build it with schema.ParseTable")
	}
	if c.Enqueuer == nil {
		c.Enqueuer = defaultEnqueuer
	}
	return nil
}

// NewTxPublisher binds a publisher to tx, a transaction: a pool or a
// connection does not compile here (see Tx).
func NewTxPublisher(tx Tx, cfg TxPublisherConfig) (*TxPublisher, error) {
	if tx == nil {
		return nil, errors.New("publisher: invalid config: nil Tx; pass the transaction that writes the business rows")
	}
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	return &TxPublisher{tx: tx, cfg: cfg}, nil
}

// Publish enqueues msgs into the outbox table inside the bound transaction,
// in one statement. The trace context is taken from the first message's
// context.
func (p *TxPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return ErrPublisherClosed
	}
	if len(msgs) == 0 {
		return nil
	}
	out := make([]Message, len(msgs))
	for i, m := range msgs {
		conv, err := p.convert(i, topic, m)
		if err != nil {
			return err
		}
		out[i] = conv
	}
	ctx := msgs[0].Context()
	if ctx == nil {
		ctx = context.Background()
	}
	if _, err := p.cfg.Enqueuer.EnqueueBatch(ctx, p.tx, p.cfg.Table, out); err != nil {
		return fmt.Errorf("publish to outbox %s: %w", p.cfg.Table, err)
	}
	return nil
}

func (p *TxPublisher) convert(i int, topic string, m *message.Message) (Message, error) {
	id, err := uuid.Parse(m.UUID)
	if err != nil {
		return Message{}, invalidMessage(i, "EventID", fmt.Sprintf("message UUID %q is not a UUID; use watermill.NewUUID() or uuid.NewString()", m.UUID))
	}
	tenant := p.cfg.DefaultTenantID
	if s := m.Metadata.Get(schema.MetadataTenantID); s != "" {
		if tenant, err = uuid.Parse(s); err != nil {
			return Message{}, invalidMessage(i, "TenantID", fmt.Sprintf("metadata tenant_id %q is not a UUID", s))
		}
	}
	var headers map[string]string
	for k, v := range m.Metadata {
		if schema.ReservedMetadata(k) {
			continue
		}
		if headers == nil {
			headers = make(map[string]string, len(m.Metadata))
		}
		headers[k] = v
	}
	return Message{TenantID: tenant, Topic: topic, EventID: id, Payload: json.RawMessage(m.Payload), Headers: headers}, nil
}

// Close makes later Publish calls fail. It does not touch the transaction,
// which the caller commits or rolls back. Close is idempotent.
func (p *TxPublisher) Close() error {
	p.closed.Store(true)
	return nil
}

// Beginner begins transactions; *pgxpool.Pool and *pgx.Conn satisfy it.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// DBPublisherConfig configures a DBPublisher.
type DBPublisherConfig struct {
	// Table is the outbox table. Required.
	Table schema.Table
	// DefaultTenantID is used for messages without a tenant_id metadata
	// entry. Defaults to none: such messages are refused.
	DefaultTenantID uuid.UUID
	// EnqueuerConfig configures the Enqueuer the DBPublisher writes with:
	// topic validation (ValidateTopic), the payload limit, metrics. The
	// zero value is the defaults.
	EnqueuerConfig
}

// DBPublisher is a Watermill message.Publisher that enqueues each Publish
// call in a transaction of its own. Use it where there is no business write
// to join (tests, tools, events that stand alone); use TxPublisher or
// Enqueue to commit events with business rows.
type DBPublisher struct {
	db     Beginner
	tx     TxPublisherConfig
	closed atomic.Bool
}

var _ message.Publisher = (*DBPublisher)(nil)

// NewDBPublisher returns a publisher that opens a transaction on db per
// Publish call.
func NewDBPublisher(db Beginner, cfg DBPublisherConfig) (*DBPublisher, error) {
	if db == nil {
		return nil, errors.New("publisher: invalid config: nil db; pass a *pgxpool.Pool")
	}
	enq, err := NewEnqueuer(cfg.EnqueuerConfig)
	if err != nil {
		return nil, err
	}
	tx := TxPublisherConfig{Table: cfg.Table, DefaultTenantID: cfg.DefaultTenantID, Enqueuer: enq}
	if err := tx.setDefaults(); err != nil {
		return nil, err
	}
	return &DBPublisher{db: db, tx: tx}, nil
}

// Publish enqueues msgs in one transaction, committed before it returns.
func (p *DBPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.closed.Load() {
		return ErrPublisherClosed
	}
	ctx := context.Background()
	if len(msgs) > 0 && msgs[0].Context() != nil {
		ctx = msgs[0].Context()
	}
	return pgx.BeginFunc(ctx, p.db, func(tx pgx.Tx) error {
		return (&TxPublisher{tx: tx, cfg: p.tx}).Publish(topic, msgs...)
	})
}

// Close makes later Publish calls fail. It is idempotent.
func (p *DBPublisher) Close() error {
	p.closed.Store(true)
	return nil
}
