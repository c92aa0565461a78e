package sqlq

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/outboxkit/watermill-outbox/schema"
)

// LeaseRequest asks an enqueue (package publisher, EnqueueBatch) to write
// its rows leased to the writer's process, for the hot path (package
// subscriber, HotPath): with Queries.EnqueueBatchLeased, each row written
// has attempts 1 and locked_at set, as a claim would lease it, so no relay
// claims it while the lease lasts and after it a claim does (a crash
// between the commit and the delivery is redelivered like any crash). Rows
// holds the rows written, as a claim reads them.
type LeaseRequest struct {
	Rows []ClaimedRow
}

type leaseKey struct{}

// WithLease returns ctx carrying r: an enqueue given it writes leased rows
// and appends them to r.Rows.
func WithLease(ctx context.Context, r *LeaseRequest) context.Context {
	return context.WithValue(ctx, leaseKey{}, r)
}

// LeaseOf returns the LeaseRequest ctx carries, or nil.
func LeaseOf(ctx context.Context) *LeaseRequest {
	r, _ := ctx.Value(leaseKey{}).(*LeaseRequest)
	return r
}

// Decode appends to r.Rows the rows of the fourth column of
// EnqueueBatchLeased: a JSON array of the claim's columns per row.
func (r *LeaseRequest) Decode(b []byte, c schema.Columns) error {
	var rows [][]json.RawMessage
	if err := json.Unmarshal(b, &rows); err != nil {
		return fmt.Errorf("decode the leased rows: %w", err)
	}
	for _, cols := range rows {
		var row ClaimedRow
		var payload string
		var lockedAt, createdAt string
		dest := row.optionalDest([]any{&row.ID, &row.EventID, &row.TenantID, &row.Topic, &payload, &row.Sequence, &row.Attempts, &lockedAt, &createdAt}, c)
		if len(cols) != len(dest) {
			return fmt.Errorf("decode the leased rows: %d columns, want %d", len(cols), len(dest))
		}
		for i, d := range dest {
			if err := json.Unmarshal(cols[i], d); err != nil {
				return fmt.Errorf("decode the leased rows: column %d: %w", i+1, err)
			}
		}
		var err error
		if row.LockedAt, err = parseJSONTime(lockedAt); err != nil {
			return err
		}
		if row.CreatedAt, err = parseJSONTime(createdAt); err != nil {
			return err
		}
		row.Payload = []byte(payload)
		r.Rows = append(r.Rows, row)
	}
	return nil
}

// parseJSONTime parses a timestamptz as json_build_array writes it
// (ISO 8601 with microseconds and the offset).
func parseJSONTime(s string) (time.Time, error) {
	t, err := time.Parse("2006-01-02T15:04:05.999999Z07:00", s)
	if err != nil {
		return time.Time{}, fmt.Errorf("decode the leased rows: timestamp %q: %w", s, err)
	}
	return t, nil
}
