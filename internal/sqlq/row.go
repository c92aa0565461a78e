package sqlq

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/outboxkit/watermill-outbox/schema"
)

// ClaimedRow is one row returned by a claim statement.
type ClaimedRow struct {
	ID       string
	EventID  string
	TenantID string
	Topic    string
	// Payload is the JSON payload; Message hands it to the message as is
	// (not copied).
	Payload     []byte
	Sequence    int64
	Attempts    int32
	LockedAt    time.Time
	CreatedAt   time.Time
	TraceParent *string
	TraceState  *string
	Headers     *string
	// OrderingKey is the row's ordering key: every claim of a table with
	// the column fills it (ScanClaim, ScanKeyed), as do the keyed relays'
	// reads.
	OrderingKey *string
	// Parked is true for a row that the claim did not lease but parked dead
	// (its lease expired on the last allowed attempt); ScanClaim fills it.
	Parked bool
}

// Scanner is satisfied by pgx.Row, pgx.Rows and *sql.Rows.
type Scanner interface {
	Scan(dest ...any) error
}

// Scan reads, for a table with columns c, the columns a claim returns
// before ordering_key: a row of Queries.AdapterClaimAll or
// AdapterClaimTopic (Adapter.ClaimStatement) when the table has no
// ordering_key (with one, read it with ScanKeyed), or of WALQueries.Row.
func (r *ClaimedRow) Scan(s Scanner, c schema.Columns) error {
	if err := s.Scan(r.dest(c)...); err != nil {
		return fmt.Errorf("scan claimed outbox row: %w", err)
	}
	return nil
}

// ScanKeyed reads the columns Scan reads, then ordering_key (the WAL
// relay's reads of held and missed rows, and an adapter's claim of a table
// with ordering_key).
func (r *ClaimedRow) ScanKeyed(s Scanner, c schema.Columns) error {
	if err := s.Scan(append(r.dest(c), &r.OrderingKey)...); err != nil {
		return fmt.Errorf("scan outbox row: %w", err)
	}
	return nil
}

// dest are the destinations of the columns Scan reads.
func (r *ClaimedRow) dest(c schema.Columns) []any {
	dest := []any{&r.ID, &r.EventID, &r.TenantID, &r.Topic, &r.Payload, &r.Sequence, &r.Attempts, &r.LockedAt, &r.CreatedAt}
	if c.TraceContext {
		dest = append(dest, &r.TraceParent, &r.TraceState)
	}
	if c.Headers {
		dest = append(dest, &r.Headers)
	}
	return dest
}

// ScanClaim reads a row produced by Queries.ClaimAll, ClaimTopic,
// ClaimAllUnkeyed or ClaimTopicUnkeyed: the columns Scan reads (with
// ordering_key when c.OrderingKey), then Parked.
//
// extra receives the columns a caller appended after parked (the default
// relay's bounded claim appends the rows' available_at).
func (r *ClaimedRow) ScanClaim(s Scanner, c schema.Columns, extra ...any) error {
	var lockedAt *time.Time // NULL for a parked row
	dest := []any{&r.ID, &r.EventID, &r.TenantID, &r.Topic, &r.Payload, &r.Sequence, &r.Attempts, &lockedAt, &r.CreatedAt}
	dest = append(r.optionalDest(dest, c), &r.Parked)
	dest = append(dest, extra...)
	if err := s.Scan(dest...); err != nil {
		return fmt.Errorf("scan claimed outbox row: %w", err)
	}
	r.LockedAt = time.Time{}
	if lockedAt != nil {
		r.LockedAt = *lockedAt
	}
	return nil
}

// optionalDest appends to dest the destinations of the optional columns
// the claim returns after its nine fixed ones (claimExprs), in its order.
func (r *ClaimedRow) optionalDest(dest []any, c schema.Columns) []any {
	if c.TraceContext {
		dest = append(dest, &r.TraceParent, &r.TraceState)
	}
	if c.Headers {
		dest = append(dest, &r.Headers)
	}
	if c.OrderingKey {
		dest = append(dest, &r.OrderingKey)
	}
	return dest
}

// Message builds the Watermill message of the row: UUID = event_id, payload =
// the JSON payload, and metadata event_id, tenant_id, topic, sequence,
// attempts and table, plus traceparent, tracestate and the stored headers
// when present. Headers never override the outbox's own keys. It fails
// when the stored headers are not a JSON object of strings.
func (r *ClaimedRow) Message(t schema.Table) (*message.Message, error) {
	msg := message.NewMessage(r.EventID, r.Payload)
	if r.Headers != nil && *r.Headers != "" {
		var h map[string]string
		if err := json.Unmarshal([]byte(*r.Headers), &h); err != nil {
			return nil, fmt.Errorf("outbox row sequence %d: headers column is not a JSON object of strings: %w", r.Sequence, err)
		}
		for k, v := range h {
			if !schema.ReservedMetadata(k) {
				msg.Metadata[k] = v
			}
		}
	}
	r.setMetadata(msg, t)
	return msg, nil
}

// MessageWithoutHeaders is Message without the stored headers: the message
// of a row whose headers Message cannot read, for the router's dead-letter
// path only (package deadletter); it is never published.
func (r *ClaimedRow) MessageWithoutHeaders(t schema.Table) *message.Message {
	msg := message.NewMessage(r.EventID, r.Payload)
	r.setMetadata(msg, t)
	return msg
}

// setMetadata sets the outbox's own metadata keys of the row on msg.
func (r *ClaimedRow) setMetadata(msg *message.Message, t schema.Table) {
	msg.Metadata[schema.MetadataEventID] = r.EventID
	msg.Metadata[schema.MetadataTenantID] = r.TenantID
	msg.Metadata[schema.MetadataTopic] = r.Topic
	msg.Metadata[schema.MetadataSequence] = strconv.FormatInt(r.Sequence, 10)
	msg.Metadata[schema.MetadataAttempts] = strconv.FormatInt(int64(r.Attempts), 10)
	msg.Metadata[schema.MetadataTable] = t.String()
	if r.TraceParent != nil && *r.TraceParent != "" {
		msg.Metadata[schema.MetadataTraceParent] = *r.TraceParent
	}
	if r.OrderingKey != nil && *r.OrderingKey != "" {
		msg.Metadata[schema.MetadataOrderingKey] = *r.OrderingKey
	}
	if r.TraceState != nil && *r.TraceState != "" {
		msg.Metadata[schema.MetadataTraceState] = *r.TraceState
	}
}
