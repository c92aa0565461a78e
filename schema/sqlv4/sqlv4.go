// Package sqlv4 lets watermill-sql v4's stock NewPublisher and NewSubscriber
// work on an outbox table, as package schema/sqlv3 does for watermill-sql v3.
//
// Adapter implements v4's SchemaAdapter and OffsetsAdapter implements its
// OffsetsAdapter (v4 declares SchemaInitializingQueries in both with
// different parameters, so one type cannot be both). Both are configured
// with a table and its columns and render the same statements as package
// schema/sqlv3, so v3 and v4 run the same SQL:
//
//	a := sqlv4.Adapter{Table: table, Columns: cols}
//	pub, _ := sql.NewPublisher(sql.PgxBeginner{Conn: pool}, sql.PublisherConfig{SchemaAdapter: a}, logger)
//	sub, _ := sql.NewSubscriber(sql.PgxBeginner{Conn: pool}, sql.SubscriberConfig{
//		SchemaAdapter: a, OffsetsAdapter: sqlv4.OffsetsAdapter(a),
//	}, logger)
//
// The package lives apart from package schema so that only its users link
// watermill-sql v4. The stock subscriber
// keeps the claim transaction open while the handler runs, resends a nacked
// message in-process without backoff, last_error or dead state, and cannot
// extend a lease; use package subscriber for the relay.
package sqlv4

import (
	stdsql "database/sql"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Adapter implements watermill-sql v4's SchemaAdapter on an outbox table.
// Convert it to OffsetsAdapter for the subscriber.
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

// OffsetsAdapter implements watermill-sql v4's OffsetsAdapter on an outbox
// table: the ack marks published the rows the subscriber's transaction
// claimed. Its fields are those of Adapter; use the same values
// (OffsetsAdapter(adapter)).
type OffsetsAdapter Adapter

var (
	_ wsql.SchemaAdapter  = Adapter{}
	_ wsql.OffsetsAdapter = OffsetsAdapter{}
)

func query(s sqlq.Statement) wsql.Query { return wsql.Query{Query: s.SQL, Args: s.Args} }

// InsertQuery implements SchemaAdapter with the shared InsertStatement:
// msg.UUID must be a UUID (it becomes event_id), metadata tenant_id is
// required and the payload must be JSON.
func (a Adapter) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	s, err := sqlq.Adapter(a).InsertStatement(params.Topic, params.Msgs)
	if err != nil {
		return wsql.Query{}, err
	}
	return query(s), nil
}

// SelectQuery implements SchemaAdapter with the shared ClaimStatement.
func (a Adapter) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	return query(sqlq.Adapter(a).ClaimStatement(params.Topic)), nil
}

// UnmarshalMessage implements SchemaAdapter with the shared ScanClaimed:
// the message has UUID = event_id and the outbox metadata; Row.Offset is the
// sequence.
func (a Adapter) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	seq, msg, err := sqlq.Adapter(a).ScanClaimed(params.Row)
	if err != nil {
		return wsql.Row{}, err
	}
	return wsql.Row{Offset: seq, UUID: []byte(msg.UUID), Payload: msg.Payload, Msg: msg}, nil
}

// SchemaInitializingQueries implements SchemaAdapter with
// the shared SchemaStatements: the table's idempotent DDL.
func (a Adapter) SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	var qs []wsql.Query
	for _, s := range sqlq.Adapter(a).SchemaStatements() {
		qs = append(qs, query(s))
	}
	return qs, nil
}

// SubscribeIsolationLevel implements SchemaAdapter: READ COMMITTED, which
// SKIP LOCKED needs to let concurrent subscribers share a table.
func (a Adapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return sqlq.Adapter(a).SubscribeIsolationLevel()
}

// AckMessageQuery implements OffsetsAdapter with the shared AckStatement:
// the rows the transaction claimed, up to the last acked row, are published.
func (o OffsetsAdapter) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	return query(sqlq.Adapter(o).AckStatement(params.LastRow.Offset)), nil
}

// ConsumedMessageQuery implements OffsetsAdapter; the claim already recorded
// the lease, so there is nothing to do.
func (o OffsetsAdapter) ConsumedMessageQuery(wsql.ConsumedMessageQueryParams) (wsql.Query, error) {
	return wsql.Query{}, nil
}

// NextOffsetQuery implements OffsetsAdapter; the outbox has no offsets table
// (rows carry their own state), so it is empty.
func (o OffsetsAdapter) NextOffsetQuery(wsql.NextOffsetQueryParams) (wsql.Query, error) {
	return wsql.Query{}, nil
}

// SchemaInitializingQueries implements OffsetsAdapter; there is no offsets
// table to create.
func (o OffsetsAdapter) SchemaInitializingQueries(wsql.OffsetsSchemaInitializingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}

// BeforeSubscribingQueries implements OffsetsAdapter; nothing is needed.
func (o OffsetsAdapter) BeforeSubscribingQueries(wsql.BeforeSubscribingQueriesParams) ([]wsql.Query, error) {
	return nil, nil
}
