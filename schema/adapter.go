package schema

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
)

// Defaults of Adapter, shared with the subscriber (DESIGN §5).
const (
	MaxAttemptsDefault = 25
	LockTTLDefault     = 60 * time.Second
	BatchSizeDefault   = 100
)

// AllTopics as the topic of SelectQuery (and of subscriber.Subscribe) claims
// the rows of every topic.
const AllTopics = "*"

// Adapter lets watermill-sql v3's stock NewPublisher and NewSubscriber work on
// an outbox table. It implements both sql.SchemaAdapter and
// sql.OffsetsAdapter; pass the same value as both.
//
// InsertQuery writes one row per message: msg.UUID must be a UUID (it becomes
// event_id), metadata tenant_id is required, the payload must be JSON and
// the remaining metadata goes to the headers column when the table has one.
// SelectQuery is the lease claim of DESIGN §5; AckMessageQuery marks the rows
// the same transaction claimed as published.
//
// The stock subscriber is weaker than package subscriber: it keeps the claim
// transaction open while the handler runs, resends a nacked message
// in-process without backoff, last_error or dead state, and cannot extend a
// lease. Use it for interop; use package subscriber for the relay.
type Adapter struct {
	// Table is the outbox table. Required.
	Table Table
	// Columns lists the table's optional columns (see DetectColumns).
	// Defaults to none.
	Columns Columns
	// MaxAttempts excludes rows with this many attempts (dead). Defaults to 25.
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

func (a Adapter) queries() *Queries { return NewQueries(a.Table, a.Columns) }

func (a Adapter) maxAttempts() int {
	if a.MaxAttempts <= 0 {
		return MaxAttemptsDefault
	}
	return a.MaxAttempts
}

func (a Adapter) lockTTL() time.Duration {
	if a.LockTTL <= 0 {
		return LockTTLDefault
	}
	return a.LockTTL
}

func (a Adapter) batchSize() int {
	if a.BatchSize <= 0 {
		return BatchSizeDefault
	}
	return a.BatchSize
}

// InsertQuery implements sql.SchemaAdapter: one multi-row INSERT, idempotent
// on event_id. Topic is stored in the topic column.
func (a Adapter) InsertQuery(topic string, msgs message.Messages) (wsql.Query, error) {
	if a.Table.IsZero() {
		return wsql.Query{}, errors.New("outbox adapter: Table is not set")
	}
	if len(msgs) == 0 {
		return wsql.Query{}, errors.New("outbox adapter: no messages to insert")
	}
	cols := []string{ColumnTenantID, ColumnTopic, ColumnPayload, ColumnEventID}
	if a.Columns.Headers {
		cols = append(cols, ColumnHeaders)
	}
	var (
		args   []any
		values string
	)
	for i, msg := range msgs {
		row, err := a.insertArgs(topic, msg)
		if err != nil {
			return wsql.Query{}, fmt.Errorf("outbox adapter: message #%d (uuid %q): %w", i, msg.UUID, err)
		}
		if i > 0 {
			values += ", "
		}
		values += "("
		for j := range row {
			if j > 0 {
				values += ", "
			}
			values += "$" + itoa(len(args)+j+1) + insertCasts[j]
		}
		values += ")"
		args = append(args, row...)
	}
	query := `INSERT INTO ` + a.Table.Sanitize() + ` (` + joinComma(cols) + `) VALUES ` + values +
		` ON CONFLICT (` + ColumnEventID + `) DO NOTHING`
	return wsql.Query{Query: query, Args: args}, nil
}

var insertCasts = []string{"::uuid", "", "::jsonb", "::uuid", "::jsonb"}

func (a Adapter) insertArgs(topic string, msg *message.Message) ([]any, error) {
	id, err := uuid.Parse(msg.UUID)
	if err != nil || id == uuid.Nil {
		return nil, errors.New("UUID must be a non-nil UUID: it becomes the row's event_id (use watermill.NewUUID())")
	}
	tenant, err := uuid.Parse(msg.Metadata.Get(MetadataTenantID))
	if err != nil || tenant == uuid.Nil {
		return nil, errors.New("metadata tenant_id must be a non-nil UUID")
	}
	if topic == "" || topic == AllTopics {
		return nil, fmt.Errorf("topic %q cannot be stored; publish to a concrete topic", topic)
	}
	if len(msg.Payload) == 0 || !json.Valid(msg.Payload) {
		return nil, errors.New("payload must be valid JSON: the payload column is JSONB")
	}
	args := []any{tenant.String(), topic, string(msg.Payload), id.String()}
	if a.Columns.Headers {
		h := map[string]string{}
		for k, v := range msg.Metadata {
			if !ReservedMetadata(k) {
				h[k] = v
			}
		}
		b, err := json.Marshal(h)
		if err != nil {
			return nil, fmt.Errorf("encode metadata: %w", err)
		}
		args = append(args, string(b))
	}
	return args, nil
}

// SelectQuery implements sql.SchemaAdapter with the lease claim of DESIGN §5.
func (a Adapter) SelectQuery(topic string, _ string, _ wsql.OffsetsAdapter) wsql.Query {
	q := a.queries()
	args := []any{a.maxAttempts(), a.lockTTL().Seconds(), a.batchSize()}
	if topic == AllTopics {
		return wsql.Query{Query: q.ClaimAll, Args: args}
	}
	return wsql.Query{Query: q.ClaimTopic, Args: append(args, topic)}
}

// UnmarshalMessage implements sql.SchemaAdapter: the message has UUID =
// event_id and the metadata of DESIGN §4. Row.Offset is the sequence.
func (a Adapter) UnmarshalMessage(row wsql.Scanner) (wsql.Row, error) {
	var r ClaimedRow
	if err := r.Scan(row, a.Columns); err != nil {
		return wsql.Row{}, err
	}
	msg, err := r.Message(a.Table)
	if err != nil {
		return wsql.Row{}, err
	}
	return wsql.Row{
		Offset:  r.Sequence,
		UUID:    []byte(r.EventID),
		Payload: []byte(r.Payload),
		Msg:     msg,
	}, nil
}

// SchemaInitializingQueries implements sql.SchemaAdapter: the table's DDL,
// with the optional columns of Columns.
func (a Adapter) SchemaInitializingQueries(string) []wsql.Query {
	var qs []wsql.Query
	for _, s := range upStatements(a.Table, a.Columns) {
		qs = append(qs, wsql.Query{Query: s})
	}
	return qs
}

// SubscribeIsolationLevel implements sql.SchemaAdapter: READ COMMITTED, which
// SKIP LOCKED needs to let concurrent subscribers share a table.
func (a Adapter) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelReadCommitted }

// AckMessageQuery implements sql.OffsetsAdapter: it marks published every row
// the subscriber's transaction claimed up to row's sequence.
func (a Adapter) AckMessageQuery(_ string, row wsql.Row, _ string) wsql.Query {
	return wsql.Query{Query: a.queries().AckUpToInTx, Args: []any{row.Offset}}
}

// ConsumedMessageQuery implements sql.OffsetsAdapter; the claim already
// recorded the lease, so there is nothing to do.
func (a Adapter) ConsumedMessageQuery(string, wsql.Row, string, []byte) wsql.Query {
	return wsql.Query{}
}

// NextOffsetQuery implements sql.OffsetsAdapter; the outbox has no offsets
// table (rows carry their own state), so it is empty.
func (a Adapter) NextOffsetQuery(string, string) wsql.Query { return wsql.Query{} }

// BeforeSubscribingQueries implements sql.OffsetsAdapter; nothing is needed.
func (a Adapter) BeforeSubscribingQueries(string, string) []wsql.Query { return nil }
