// Package sqlv3 lets watermill-sql v3's stock NewPublisher and NewSubscriber
// work on an outbox table (package schema/sqlv4 does the same for
// watermill-sql v4).
//
// Adapter implements both v3's SchemaAdapter and its OffsetsAdapter; pass the
// same value as both. It is configured with a table and its columns, and
// renders the same statements as package schema/sqlv4, so v3 and v4 run the
// same SQL:
//
//	a := sqlv3.Adapter{Table: table, Columns: cols}
//	pub, _ := sql.NewPublisher(db, sql.PublisherConfig{SchemaAdapter: a}, logger)
//	sub, _ := sql.NewSubscriber(db, sql.SubscriberConfig{SchemaAdapter: a, OffsetsAdapter: a}, logger)
//
// A sqlv4.Adapter converts: sqlv3.Adapter(a).
//
// The package lives apart from package schema so that only its users link
// watermill-sql v3 (and, through its module, pgx v4, the MySQL driver and
// appengine in go.sum).
//
// InsertQuery writes one row per message: msg.UUID must be a UUID (it becomes
// event_id), metadata tenant_id is required, the payload must be JSON and
// the remaining metadata goes to the headers column when the table has one.
// SelectQuery is the subscriber's lease claim; AckMessageQuery marks the rows
// the same transaction claimed as published.
//
// The stock subscriber is weaker than package subscriber: it keeps the claim
// transaction open while the handler runs, resends a nacked message
// in-process without backoff, last_error or dead state, and cannot extend a
// lease. Use it for interop; use package subscriber for the relay.
package sqlv3

import (
	stdsql "database/sql"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Adapter implements watermill-sql v3's SchemaAdapter and OffsetsAdapter on
// an outbox table.
type Adapter struct {
	// Table is the outbox table. Required.
	Table schema.Table
	// Columns lists the table's optional columns (schema.DetectColumns reads
	// them). Defaults to none.
	Columns schema.Columns
	// MaxAttempts is the last allowed attempt: a row whose lease expires on
	// it is parked dead by the claim instead of being claimed again. Dead
	// rows (dead_at set) are never claimed, whatever MaxAttempts says.
	// Defaults to 25.
	MaxAttempts int
	// LockTTL is after how long a lease is considered abandoned. Defaults to 60s.
	LockTTL time.Duration
	// BatchSize is the claim's LIMIT. Defaults to 100.
	BatchSize int
}

var (
	_ wsql.SchemaAdapter  = Adapter{}
	_ wsql.OffsetsAdapter = Adapter{}
)

func query(s sqlq.Statement) wsql.Query { return wsql.Query{Query: s.SQL, Args: s.Args} }

// InsertQuery implements SchemaAdapter with the shared InsertStatement:
// msg.UUID must be a UUID (it becomes event_id), metadata tenant_id is
// required and the payload must be JSON.
func (a Adapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	s, err := sqlq.Adapter(a).InsertStatement(topic, msgs)
	if err != nil {
		return wsql.Query{}, err
	}
	return query(s), nil
}

// SelectQuery implements SchemaAdapter with the shared ClaimStatement.
func (a Adapter) SelectQuery(topic string, _ string, _ wsql.OffsetsAdapter) wsql.Query {
	return query(sqlq.Adapter(a).ClaimStatement(topic))
}

// UnmarshalMessage implements SchemaAdapter with the shared ScanClaimed:
// the message has UUID = event_id and the outbox metadata; Row.Offset is the
// sequence.
func (a Adapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	seq, msg, err := sqlq.Adapter(a).ScanClaimed(row)
	if err != nil {
		return wsql.Row{}, err
	}
	return wsql.Row{Offset: seq, UUID: []byte(msg.UUID), Payload: msg.Payload, Msg: msg}, nil
}

// SchemaInitializingQueries implements SchemaAdapter with
// the shared SchemaStatements: the table's idempotent DDL.
func (a Adapter) SchemaInitializingQueries(string) []wsql.Query {
	var qs []wsql.Query
	for _, s := range sqlq.Adapter(a).SchemaStatements() {
		qs = append(qs, query(s))
	}
	return qs
}

// SubscribeIsolationLevel implements SchemaAdapter: READ COMMITTED, which
// SKIP LOCKED needs to let concurrent subscribers share a table.
func (a Adapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return sqlq.Adapter(a).SubscribeIsolationLevel()
}

// AckMessageQuery implements OffsetsAdapter with the shared AckStatement:
// the rows the transaction claimed, up to row, are published.
func (a Adapter) AckMessageQuery(_ string, row wsql.Row, _ string) wsql.Query {
	return query(sqlq.Adapter(a).AckStatement(row.Offset))
}

// ConsumedMessageQuery implements OffsetsAdapter; the claim already recorded
// the lease, so there is nothing to do.
func (a Adapter) ConsumedMessageQuery(string, wsql.Row, string, []byte) wsql.Query {
	return wsql.Query{}
}

// NextOffsetQuery implements OffsetsAdapter; the outbox has no offsets table
// (rows carry their own state), so it is empty.
func (a Adapter) NextOffsetQuery(string, string) wsql.Query { return wsql.Query{} }

// BeforeSubscribingQueries implements OffsetsAdapter; nothing is needed.
func (a Adapter) BeforeSubscribingQueries(string, string) []wsql.Query { return nil }
