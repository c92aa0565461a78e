package sqlq

import (
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Defaults of Adapter, shared with the subscriber.
const (
	MaxAttemptsDefault = 25
	LockTTLDefault     = 60 * time.Second
	BatchSizeDefault   = 100
)

// AllTopics as the topic of SelectQuery (and of subscriber.Subscribe) claims
// the rows of every topic.
const AllTopics = "*"

// Adapter is the configuration of the watermill-sql adapters, and renders
// their statements: package schema/sqlv3 (watermill-sql v3) and package
// schema/sqlv4 (watermill-sql v4) declare their adapters as Adapter's type
// and run the SQL of its Statement methods (InsertStatement, ClaimStatement,
// ScanClaimed, AckStatement, SchemaStatements), so both run the same SQL.
// Adapter itself implements no watermill-sql interface, so package schema
// does not depend on watermill-sql; convert it, as sqlv3.Adapter(a) or
// sqlv4.Adapter(a).
//
// InsertStatement writes one row per message: msg.UUID must be a UUID (it
// becomes event_id), metadata tenant_id is required, the payload must be
// JSON and the remaining metadata goes to the headers column when the table
// has one. ClaimStatement is the stock subscriber's lease claim;
// AckStatement marks the rows the same transaction claimed as published.
//
// The stock subscribers are weaker than package subscriber: they keep the
// claim transaction open while the handler runs, resend a nacked message
// in-process without backoff, last_error or dead state, and cannot extend a
// lease. Use them for interop; use package subscriber for the relay.
type Adapter struct {
	// schema.Table is the outbox table. Required.
	Table schema.Table
	// schema.Columns lists the table's optional columns (see DetectColumns).
	// Defaults to none.
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

// InsertStatement renders one multi-row INSERT of msgs, idempotent on
// event_id, with topic stored in the topic column. It is the insert of both
// watermill-sql adapters (packages schema/sqlv3 and schema/sqlv4), and it takes
// part in the wake-up handshake as publisher.Enqueue does: a sleeping relay
// is woken within milliseconds.
func (a Adapter) InsertStatement(topic string, msgs message.Messages) (Statement, error) {
	if a.Table.IsZero() {
		return Statement{}, errors.New("schema: invalid config: Adapter.Table is not set; set it to the outbox table")
	}
	if len(msgs) == 0 {
		return Statement{}, errors.New("schema: adapter: no messages to insert")
	}
	cols := []string{ColumnTenantID, ColumnTopic, ColumnPayload, ColumnEventID}
	if a.Columns.Headers {
		cols = append(cols, ColumnHeaders)
	}
	var (
		args   []any
		values strings.Builder
	)
	for i, msg := range msgs {
		row, err := a.insertArgs(topic, msg)
		if err != nil {
			return Statement{}, fmt.Errorf("schema: adapter: message #%d (uuid %q): %w", i, msg.UUID, err)
		}
		if i > 0 {
			values.WriteString(", ")
		}
		values.WriteString("(")
		for j := range row {
			if j > 0 {
				values.WriteString(", ")
			}
			values.WriteString("$" + itoa(len(args)+j+1) + insertCasts[j])
		}
		values.WriteString(")")
		args = append(args, row...)
	}
	// The insert takes part in the wake-up handshake as Enqueue does
	// (docs/ARCHITECTURE.md, "Wake-up"): it notifies only while a relay
	// sleeps on the idle lock, else holds the lock shared until it commits.
	args = append(args, NotifyChannel(a.Table))
	query := `WITH ins AS (INSERT INTO ` + a.Table.Sanitize() + ` (` + joinComma(cols) + `) VALUES ` + values.String() +
		` ON CONFLICT (` + ColumnEventID + `) DO NOTHING RETURNING 1)
SELECT pg_notify($` + itoa(len(args)) + `::text, '') WHERE EXISTS (SELECT 1 FROM ins) AND NOT pg_try_advisory_xact_lock_shared(` +
		strconv.FormatInt(IdleLockKey(a.Table), 10) + `)`
	return Statement{SQL: query, Args: args}, nil
}

var insertCasts = []string{"::uuid", "", "::jsonb", "::uuid", "::jsonb"}

func (a Adapter) insertArgs(topic string, msg *message.Message) ([]any, error) {
	id, err := uuid.Parse(msg.UUID)
	if err != nil || id == uuid.Nil {
		return nil, errors.New("UUID must be a non-nil UUID: it becomes the row's event_id (use watermill.NewUUID())")
	}
	tenant, err := uuid.Parse(msg.Metadata.Get(schema.MetadataTenantID))
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
			if !schema.ReservedMetadata(k) {
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

// ClaimStatement renders the lease claim of the adapters' SelectQuery: up to
// BatchSize due rows of topic (every topic when topic is AllTopics), leased
// for LockTTL. Rows it returns are read with ScanClaimed.
func (a Adapter) ClaimStatement(topic string) Statement {
	q := a.queries()
	args := []any{a.maxAttempts(), a.lockTTL().Seconds(), a.batchSize()}
	if topic == AllTopics {
		return Statement{SQL: q.AdapterClaimAll, Args: args}
	}
	return Statement{SQL: q.AdapterClaimTopic, Args: append(args, topic)}
}

// ScanClaimed reads one row returned by ClaimStatement: its sequence (the
// adapters' offset) and its message, with UUID = event_id and the outbox
// metadata (see ClaimedRow.Message).
func (a Adapter) ScanClaimed(row Scanner) (sequence int64, msg *message.Message, err error) {
	var r ClaimedRow
	scan := r.Scan
	if a.Columns.OrderingKey {
		scan = r.ScanKeyed // the claim returns ordering_key last
	}
	if err := scan(row, a.Columns); err != nil {
		return 0, nil, err
	}
	msg, err = r.Message(a.Table)
	if err != nil {
		return 0, nil, err
	}
	return r.Sequence, msg, nil
}

// AckStatement renders the adapters' ack: it marks published every row the
// current transaction claimed, up to sequence.
func (a Adapter) AckStatement(sequence int64) Statement {
	return Statement{SQL: a.queries().AckUpToInTx, Args: []any{sequence}}
}

// SchemaStatements renders the table's idempotent DDL, with the optional
// columns of schema.Columns, for the adapters' SchemaInitializingQueries.
func (a Adapter) SchemaStatements() []Statement {
	var out []Statement
	for _, s := range schema.UpStatements(a.Table, a.Columns) {
		out = append(out, Statement{SQL: s})
	}
	return out
}

// SubscribeIsolationLevel is the isolation level of the adapters'
// SubscribeIsolationLevel: READ COMMITTED, which SKIP LOCKED needs to let
// concurrent subscribers share a table.
func (a Adapter) SubscribeIsolationLevel() stdsql.IsolationLevel { return stdsql.LevelReadCommitted }
