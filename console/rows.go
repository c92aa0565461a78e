package console

import (
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// rowsPageSize is the number of rows one page of a row list shows.
const rowsPageSize = 100

// rowStates are the lists the rows page offers, in its tab order.
var rowStates = []runbook.ListState{runbook.ListPending, runbook.ListRetrying, runbook.ListDead, runbook.ListDelivered, runbook.ListAll}

// timeLayouts are the forms a time of the search may take: RFC 3339, or a
// browser's datetime-local value and shorter, read as UTC.
var timeLayouts = []string{time.RFC3339, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02 15:04:05", "2006-01-02 15:04", "2006-01-02"}

// parseTime reads a time of the search; the zero time when s is empty.
func parseTime(s string) (time.Time, bool) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, true
	}
	for _, l := range timeLayouts {
		if t, err := time.ParseInLocation(l, s, time.UTC); err == nil {
			return t, true
		}
	}
	return time.Time{}, false
}

// rowsQuery is the filter of the rows page as the form gave it.
type rowsQuery struct {
	State                               runbook.ListState
	Topic, Event, Tenant, Key, From, To string
}

// values renders q as a query string (without the cursors).
func (q rowsQuery) values() url.Values {
	v := url.Values{"state": {string(q.State)}}
	for k, s := range map[string]string{"topic": q.Topic, "event": q.Event, "tenant": q.Tenant, "key": q.Key, "from": q.From, "to": q.To} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// rows lists the rows of a table in one state (pending, retrying, dead,
// delivered) or every state, a page at a time, with a search by topic,
// event id, tenant, ordering key and creation time range.
func (h *handler) rows(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	v := r.URL.Query()
	q := rowsQuery{State: runbook.ListState(v.Get("state")), Topic: strings.TrimSpace(v.Get("topic")), Event: strings.TrimSpace(v.Get("event")),
		Tenant: strings.TrimSpace(v.Get("tenant")), Key: v.Get("key"), From: strings.TrimSpace(v.Get("from")), To: strings.TrimSpace(v.Get("to"))}
	if q.State == "" {
		q.State = runbook.ListPending
	}
	back := tablePath(t, "rows")
	f := runbook.ListFilter{State: q.State, Topic: q.Topic, OrderingKey: q.Key, Limit: rowsPageSize}
	var problems []string
	if !q.State.Valid() {
		problems = append(problems, "state must be pending, retrying, dead, delivered or all")
	}
	if q.Event != "" {
		id, err := uuid.Parse(q.Event)
		if err != nil {
			problems = append(problems, "the event id must be a UUID")
		}
		f.EventID = id
	}
	if q.Tenant != "" {
		id, err := uuid.Parse(q.Tenant)
		if err != nil {
			problems = append(problems, "the tenant must be a UUID")
		}
		f.TenantID = id
	}
	var okFrom, okTo bool
	f.CreatedFrom, okFrom = parseTime(q.From)
	f.CreatedTo, okTo = parseTime(q.To)
	if !okFrom || !okTo {
		problems = append(problems, "times must look like 2026-01-31T14:05 (UTC) or 2026-01-31T14:05:00+01:00")
	} else if !f.CreatedFrom.IsZero() && !f.CreatedTo.IsZero() && !f.CreatedFrom.Before(f.CreatedTo) {
		problems = append(problems, "the time range must end after it starts")
	}
	after, ok1 := cursor(v, "after")
	before, ok2 := cursor(v, "before")
	if !ok1 || !ok2 || (after > 0 && before > 0) {
		problems = append(problems, "after and before must be sequences (whole numbers), at most one of them")
	}
	if len(problems) > 0 {
		h.fail(w, r, http.StatusBadRequest, "The search is not valid: "+strings.Join(problems, "; ")+".", back, "the rows")
		return
	}
	f.After, f.Before = after, before
	p, err := runbook.New(h.pool, t).ListRows(r.Context(), f)
	if err != nil {
		h.logger.Error("Console could not list rows", err, watermill.LogFields{"table": t.String(), "state": string(q.State)})
		h.fail(w, r, http.StatusInternalServerError, "Cannot list the rows (see the console's log).", "", "")
		return
	}
	mode, _ := runbook.New(h.pool, t).Mode(r.Context())
	type tab struct {
		State   runbook.ListState
		Current bool
		Query   string
	}
	var tabs []tab
	for _, s := range rowStates {
		tq := q
		tq.State = s
		tabs = append(tabs, tab{s, s == q.State, tq.values().Encode()})
	}
	h.render(w, r, "rows.html", stateTitle(q.State)+" of "+t.String(), struct {
		Table    string
		Q        rowsQuery
		Query    string
		Tabs     []tab
		Page     runbook.RowPage
		From, To int64
		Mode     schema.Mode
		Keyed    bool
	}{t.String(), q, q.values().Encode(), tabs, p, p.Before + 1, p.Before + int64(len(p.Rows)), mode, mode != schema.ModeDefault})
}

// stateTitle names a list.
func stateTitle(s runbook.ListState) string {
	switch s {
	case runbook.ListPending:
		return "Pending rows"
	case runbook.ListRetrying:
		return "Retrying rows"
	case runbook.ListDead:
		return "Dead rows"
	case runbook.ListDelivered:
		return "Delivered rows"
	}
	return "Rows"
}

// rowState says in a word or two where a row is.
func rowState(r runbook.Row) string {
	switch {
	case r.Skipped:
		return "skipped"
	case r.Delivered && r.PublishedAt == nil:
		return "delivered"
	case r.PublishedAt != nil:
		return "published"
	case r.DeadAt != nil:
		return "dead"
	case r.SkipRequested:
		return "skip requested"
	case r.Held:
		return "holds its key"
	case r.WaitingBehind != nil:
		return "waits behind a held key"
	case r.ReplayDue:
		return "replay due"
	case r.LockedAt != nil:
		return "leased"
	case r.LastError != nil:
		return "retrying"
	}
	return "pending"
}
