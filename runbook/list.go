package runbook

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ListFilter selects the rows of ListRows. A zero field does not filter,
// but State is required.
type ListFilter struct {
	// State is the rows' state in the table's relay mode: pending,
	// retrying, dead, delivered (newest first) or all (a search).
	State schema.ListState
	// Topic keeps the rows of one topic.
	Topic string
	// EventID keeps the row of one event.
	EventID uuid.UUID
	// TenantID keeps the rows of one tenant.
	TenantID uuid.UUID
	// OrderingKey keeps the rows of one ordering key.
	OrderingKey string
	// CreatedFrom and CreatedTo keep the rows created at or after
	// CreatedFrom and before CreatedTo.
	CreatedFrom, CreatedTo time.Time
	// After is the cursor of the next page: the last Sequence of a page
	// (RowPage.Next). Before is the cursor of the previous page: the first
	// Sequence of a page (RowPage.Prev). At most one of them.
	After, Before int64
	// Limit bounds the rows of a page. Defaults to DefaultLimit.
	Limit int
}

// RowPage is one page of ListRows and where it sits in the list.
type RowPage struct {
	// Rows are the page's rows in the list's order: ascending sequence,
	// or descending for the delivered rows.
	Rows []Row `json:"rows"`
	// Total counts every matching row; Before those that come before the
	// page. Both are 0 when the page is empty.
	Total  int64 `json:"total"`
	Before int64 `json:"before"`
	// Next and Prev are the cursors of the next and previous pages (After
	// and Before of ListFilter), 0 when there is none.
	Next int64 `json:"next,omitempty"`
	Prev int64 `json:"prev,omitempty"`
}

// ListRows lists a page of the rows of t in state f.State matching f, in
// the table's relay mode (schema.StateQueries): what is pending, retrying,
// dead or delivered, or every row matching a search. The total and the
// position count every matching row.
func ListRows(ctx context.Context, db DB, t schema.Table, f ListFilter) (RowPage, error) {
	if err := checkTable(t); err != nil {
		return RowPage{}, err
	}
	limit, err := checkLimit(f.Limit)
	if err != nil {
		return RowPage{}, err
	}
	switch {
	case !f.State.Valid():
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: unknown state %q; use pending, retrying, dead, delivered or all", t, f.State)
	case f.After < 0 || f.Before < 0:
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: a negative cursor; pass the Sequence of a listed row", t)
	case f.After > 0 && f.Before > 0:
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: both After and Before are set; keep one", t)
	case !f.CreatedFrom.IsZero() && !f.CreatedTo.IsZero() && !f.CreatedFrom.Before(f.CreatedTo):
		return RowPage{}, fmt.Errorf("runbook: list rows of %s: the time range ends (%s) before it starts (%s)", t,
			f.CreatedTo.UTC().Format(time.RFC3339), f.CreatedFrom.UTC().Format(time.RFC3339))
	}
	sq, err := stateOf(ctx, db, t)
	if err != nil {
		return RowPage{}, err
	}
	sf := schema.RowListFilter{State: f.State, Topic: f.Topic, OrderingKey: f.OrderingKey, CreatedFrom: f.CreatedFrom, CreatedTo: f.CreatedTo}
	if f.EventID != uuid.Nil {
		sf.EventID = f.EventID.String()
	}
	if f.TenantID != uuid.Nil {
		sf.TenantID = f.TenantID.String()
	}
	rows, err := queryStateRows(ctx, db, t, "list rows of", sq.ListRows(sf, f.After, f.Before, limit+1))
	if err != nil {
		return RowPage{}, err
	}
	p := RowPage{Rows: rows}
	more := len(p.Rows) > limit
	if more {
		p.Rows = p.Rows[:limit]
	}
	if f.Before > 0 {
		slices.Reverse(p.Rows)
	}
	if len(p.Rows) == 0 {
		return p, nil
	}
	first, last := p.Rows[0].Sequence, p.Rows[len(p.Rows)-1].Sequence
	if f.Before > 0 || more {
		p.Next = last
	}
	if f.After > 0 || (f.Before > 0 && more) {
		p.Prev = first
	}
	st := sq.CountRows(sf, first)
	if err := db.QueryRow(ctx, st.SQL, st.Args...).Scan(&p.Total, &p.Before); err != nil {
		return RowPage{}, dbError(t, "count the rows of", err)
	}
	return p, nil
}
