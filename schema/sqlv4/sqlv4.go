// Package sqlv4 lets watermill-sql v4's stock NewPublisher and NewSubscriber
// work on an outbox table, as package schema/sqlv3 does for watermill-sql v3.
//
// Adapter implements v4's SchemaAdapter and OffsetsAdapter implements its
// OffsetsAdapter (v4 declares SchemaInitializingQueries in both with
// different parameters, so one type cannot be both). Both are configured
// with the fields of schema.Adapter and render their statements with its
// Statement methods, so v3 and v4 run the same SQL:
//
//	a := sqlv4.Adapter{Table: table, Columns: cols}
//	pub, _ := sql.NewPublisher(sql.PgxBeginner{Conn: pool}, sql.PublisherConfig{SchemaAdapter: a}, logger)
//	sub, _ := sql.NewSubscriber(sql.PgxBeginner{Conn: pool}, sql.SubscriberConfig{
//		SchemaAdapter: a, OffsetsAdapter: sqlv4.OffsetsAdapter(a),
//	}, logger)
//
// The package lives apart from package schema so that only its users link
// watermill-sql v4. The limits of schema.Adapter apply: the stock subscriber
// keeps the claim transaction open while the handler runs, resends a nacked
// message in-process without backoff, last_error or dead state, and cannot
// extend a lease; use package subscriber for the relay.
package sqlv4

import (
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Adapter implements watermill-sql v4's SchemaAdapter on an outbox table. Its
// fields are those of schema.Adapter (Table is required; the others default
// as there). Convert it to OffsetsAdapter for the subscriber.
type Adapter schema.Adapter

// OffsetsAdapter implements watermill-sql v4's OffsetsAdapter on an outbox
// table: the ack marks published the rows the subscriber's transaction
// claimed. Its fields are those of schema.Adapter; use the same values as the
// Adapter (OffsetsAdapter(adapter)).
type OffsetsAdapter schema.Adapter

var (
	_ wsql.SchemaAdapter  = Adapter{}
	_ wsql.OffsetsAdapter = OffsetsAdapter{}
)

func query(s schema.Statement) wsql.Query { return wsql.Query{Query: s.SQL, Args: s.Args} }

// InsertQuery implements SchemaAdapter with schema.Adapter.InsertStatement:
// msg.UUID must be a UUID (it becomes event_id), metadata tenant_id is
// required and the payload must be JSON.
func (a Adapter) InsertQuery(params wsql.InsertQueryParams) (wsql.Query, error) {
	s, err := schema.Adapter(a).InsertStatement(params.Topic, params.Msgs)
	if err != nil {
		return wsql.Query{}, err
	}
	return query(s), nil
}

// SelectQuery implements SchemaAdapter with schema.Adapter.ClaimStatement.
func (a Adapter) SelectQuery(params wsql.SelectQueryParams) (wsql.Query, error) {
	return query(schema.Adapter(a).ClaimStatement(params.Topic)), nil
}

// UnmarshalMessage implements SchemaAdapter with schema.Adapter.ScanClaimed:
// the message has UUID = event_id and the outbox metadata; Row.Offset is the
// sequence.
func (a Adapter) UnmarshalMessage(params wsql.UnmarshalMessageParams) (wsql.Row, error) {
	seq, msg, err := schema.Adapter(a).ScanClaimed(params.Row)
	if err != nil {
		return wsql.Row{}, err
	}
	return wsql.Row{Offset: seq, UUID: []byte(msg.UUID), Payload: msg.Payload, Msg: msg}, nil
}

// SchemaInitializingQueries implements SchemaAdapter with
// schema.Adapter.SchemaStatements: the table's idempotent DDL.
func (a Adapter) SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams) ([]wsql.Query, error) {
	var qs []wsql.Query
	for _, s := range schema.Adapter(a).SchemaStatements() {
		qs = append(qs, query(s))
	}
	return qs, nil
}

// SubscribeIsolationLevel implements SchemaAdapter: READ COMMITTED, which
// SKIP LOCKED needs to let concurrent subscribers share a table.
func (a Adapter) SubscribeIsolationLevel() stdsql.IsolationLevel {
	return schema.Adapter(a).SubscribeIsolationLevel()
}

// AckMessageQuery implements OffsetsAdapter with schema.Adapter.AckStatement:
// the rows the transaction claimed, up to the last acked row, are published.
func (o OffsetsAdapter) AckMessageQuery(params wsql.AckMessageQueryParams) (wsql.Query, error) {
	return query(schema.Adapter(o).AckStatement(params.LastRow.Offset)), nil
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
