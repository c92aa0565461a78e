package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxkit/watermill-outbox/schema"
)

// The dead rows page groups the dead rows by a normalised cause, counted
// over every dead row in SQL, and lists them a page at a time.
//
// normalisedCause is the SQL expression of a row's cause: its last_error
// without the relay's own wrapping prefix ("publish event <uuid> to
// "<topic>": ", possibly repeated), with uuids and long hex strings masked
// as <id>, numbers (with their unit: 30s, 10.0.0.1:9092) as <n>, quoted
// values as "…" or '…', whitespace collapsed, cut at 300 characters.
// It costs some 20 µs a row (8 regular expressions), so the grouping query
// runs under causesTimeout.
const normalisedCause = `left(btrim(regexp_replace(
  regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(regexp_replace(
    regexp_replace(COALESCE(last_error, ''), '^(?:publish event [^ ]+ to (?:"(?:[^"\\]|\\.)*"|[^ :]+): )+', ''),
    '[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}', '<id>', 'g'),
    '"(?:[^"\\]|\\.)*"', '"…"', 'g'),
    '(?<![[:alnum:]])''[^'']*''', '''…''', 'g'),
    '\m0x[0-9a-fA-F]+\M', '<id>', 'g'),
    '\m[0-9a-fA-F]{16,}\M', '<id>', 'g'),
    '\m[0-9]+(?:[.:,][0-9]+)*[a-zA-Zµ]{0,3}\M', '<n>', 'g'),
  '\s{2,}|[\t\n\r]', ' ', 'g')), 300)`

// causeMasks are the masks normalisedCause puts in place of values.
var causeMasks = []string{"<id>", "<n>", `"…"`, `'…'`}

// causesTimeoutDefault bounds the time the grouping of the dead rows by
// cause may take.
const causesTimeoutDefault = 20 * time.Second

// maxCausesShown bounds the causes the dead rows page lists.
const maxCausesShown = 50

// deadPageSize is the number of dead rows one page lists.
const deadPageSize = 100

// deadQuery is the filter of the dead rows page.
type deadQuery struct {
	Topic, Error, Cause string
}

// where renders the conditions of q after the dead rows' own, appending
// its arguments to args.
func (q deadQuery) where(args []any) (string, []any) {
	conds := []string{"published_at IS NULL", "dead_at IS NOT NULL"}
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args)) + "::text"
	}
	if q.Topic != "" {
		conds = append(conds, "topic = "+arg(q.Topic))
	}
	if q.Error != "" {
		conds = append(conds, "strpos(lower(last_error), lower("+arg(q.Error)+")) > 0")
	}
	if q.Cause != "" {
		conds = append(conds, normalisedCause+" = "+arg(q.Cause))
	}
	return strings.Join(conds, " AND "), args
}

// cause is one group of dead rows: those whose last_error normalises
// alike.
type cause struct {
	Cause       string
	Count       int64
	First, Last time.Time
	// EventID, Topic and LastError are those of the group's latest row.
	EventID, Topic, LastError string
	// Fragment is the longest literal part of the cause, which the
	// replay link filters on (the replay takes "last error contains");
	// "" when there is none.
	Fragment string
}

// causes groups the dead rows matching q (the Cause of q aside) and returns
// the largest groups, the number of groups and of rows.
func (h *handler) causes(ctx context.Context, t schema.Table, q deadQuery) (list []cause, groups, rows int64, err error) {
	q.Cause = ""
	where, args := q.where(nil)
	args = append(args, maxCausesShown)
	tbl := t.Sanitize()
	sql := `WITH g AS (
  SELECT ` + normalisedCause + ` AS cause, count(*) AS n, min(dead_at) AS first, max(dead_at) AS last,
    (array_agg(event_id ORDER BY sequence DESC))[1] AS latest,
    count(*) OVER () AS groups, (sum(count(*)) OVER ())::bigint AS total
  FROM ` + tbl + `
  WHERE ` + where + `
  GROUP BY 1
  ORDER BY n DESC, cause
  LIMIT $` + strconv.Itoa(len(args)) + `::int
)
SELECT g.cause, g.n, g.first, g.last, g.groups, g.total, g.latest::text, o.topic, COALESCE(o.last_error, '')
FROM g JOIN ` + tbl + ` AS o ON o.event_id = g.latest
ORDER BY g.n DESC, g.cause`
	tx, err := h.pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, strconv.FormatInt(h.causesTimeout.Milliseconds(), 10)); err != nil {
		return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
	}
	res, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
	}
	defer res.Close()
	for res.Next() {
		var c cause
		if err := res.Scan(&c.Cause, &c.Count, &c.First, &c.Last, &groups, &rows, &c.EventID, &c.Topic, &c.LastError); err != nil {
			return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
		}
		if c.Cause == "" {
			c.Cause = "(no error recorded)"
		} else {
			c.Fragment = fragment(c.Cause, c.LastError)
		}
		list = append(list, c)
	}
	if err := res.Err(); err != nil {
		return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
	}
	return list, groups, rows, nil
}

// fragment returns the longest literal part of a normalised cause that the
// full error contains (ignoring case), cut to 200 bytes on a rune
// boundary: what a bulk replay of the cause filters on.
func fragment(normalised, full string) string {
	parts := []string{normalised}
	for _, m := range causeMasks {
		var next []string
		for _, p := range parts {
			next = append(next, strings.Split(p, m)...)
		}
		parts = next
	}
	best := ""
	lowFull := strings.ToLower(full)
	for _, p := range parts {
		p = strings.Trim(p, " ()[]{}:,;.=<>")
		p = strings.TrimSpace(truncate(p, 200))
		if len(p) > len(best) && strings.Contains(lowFull, strings.ToLower(p)) {
			best = p
		}
	}
	if len(best) < 3 {
		return ""
	}
	return best
}

// deadRow is one line of the dead rows list.
type deadRow struct {
	Sequence  int64
	EventID   string
	Topic     string
	Attempts  int32
	DeadAt    time.Time
	LastError string
}

// deadPage is one page of the dead rows matching a filter, in sequence
// order, and where it sits among them.
type deadPage struct {
	Rows []deadRow
	// Total counts every matching row; Before those before the page.
	Total, Before int64
	// Next and Prev are the keyset cursors of the next and previous
	// pages, 0 when there is none.
	Next, Prev int64
}

// deadRows reads the page after the sequence after (or, with before > 0,
// the page before the sequence before).
func (h *handler) deadRows(ctx context.Context, t schema.Table, q deadQuery, after, before int64) (deadPage, error) {
	var p deadPage
	where, args := q.where(nil)
	tbl := t.Sanitize()
	order := "ASC"
	switch {
	case before > 0:
		args = append(args, before)
		where += " AND sequence < $" + strconv.Itoa(len(args)) + "::bigint"
		order = "DESC"
	case after > 0:
		args = append(args, after)
		where += " AND sequence > $" + strconv.Itoa(len(args)) + "::bigint"
	}
	args = append(args, deadPageSize+1)
	res, err := h.pool.Query(ctx, `SELECT sequence, event_id::text, topic, attempts, dead_at, COALESCE(last_error, '')
FROM `+tbl+` WHERE `+where+` ORDER BY sequence `+order+` LIMIT $`+strconv.Itoa(len(args))+`::int`, args...)
	if err != nil {
		return p, fmt.Errorf("list the dead rows of %s: %w", t, err)
	}
	defer res.Close()
	for res.Next() {
		var r deadRow
		if err := res.Scan(&r.Sequence, &r.EventID, &r.Topic, &r.Attempts, &r.DeadAt, &r.LastError); err != nil {
			return p, fmt.Errorf("list the dead rows of %s: %w", t, err)
		}
		p.Rows = append(p.Rows, r)
	}
	if err := res.Err(); err != nil {
		return p, fmt.Errorf("list the dead rows of %s: %w", t, err)
	}
	more := len(p.Rows) > deadPageSize
	if more {
		p.Rows = p.Rows[:deadPageSize]
	}
	if before > 0 {
		for i, j := 0, len(p.Rows)-1; i < j; i, j = i+1, j-1 {
			p.Rows[i], p.Rows[j] = p.Rows[j], p.Rows[i]
		}
	}
	if len(p.Rows) > 0 {
		first, last := p.Rows[0].Sequence, p.Rows[len(p.Rows)-1].Sequence
		if before > 0 || more {
			p.Next = last
		}
		if after > 0 || (before > 0 && more) {
			p.Prev = first
		}
		cwhere, cargs := q.where(nil)
		cargs = append(cargs, first)
		if err := h.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE sequence < $`+strconv.Itoa(len(cargs))+`::bigint) FROM `+tbl+
			` WHERE `+cwhere, cargs...).Scan(&p.Total, &p.Before); err != nil {
			return p, fmt.Errorf("count the dead rows of %s: %w", t, err)
		}
	}
	return p, nil
}

// cursor reads a keyset cursor of the query, 0 when absent.
func cursor(v url.Values, name string) (int64, bool) {
	s := v.Get(name)
	if s == "" {
		return 0, true
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil && n >= 0
}

func (h *handler) dead(w http.ResponseWriter, r *http.Request) {
	t, ok := h.table(w, r)
	if !ok {
		return
	}
	v := r.URL.Query()
	q := deadQuery{Topic: v.Get("topic"), Error: v.Get("error"), Cause: v.Get("cause")}
	after, ok1 := cursor(v, "after")
	before, ok2 := cursor(v, "before")
	if !ok1 || !ok2 {
		h.fail(w, r, http.StatusBadRequest, "after and before must be sequences (whole numbers).", tablePath(t, "dead"), "the dead rows")
		return
	}
	list, groups, total, err := h.causes(r.Context(), t, q)
	var pgErr *pgconn.PgError
	tooMany := errors.As(err, &pgErr) && pgErr.Code == "57014" /* query_canceled: the statement_timeout */ && r.Context().Err() == nil
	if tooMany {
		err = nil
		h.logger.Info("Console gave up grouping the dead rows: too many for the time allowed", watermill.LogFields{"table": t.String(), "timeout": h.causesTimeout.String()})
	}
	var page deadPage
	if err == nil {
		page, err = h.deadRows(r.Context(), t, q, after, before)
	}
	if tooMany {
		total = page.Total
	}
	if err != nil {
		h.logger.Error("Console could not list dead rows", err, watermill.LogFields{"table": t.String()})
		h.fail(w, r, http.StatusInternalServerError, "Cannot list the dead rows (see the console's log).", "", "")
		return
	}
	h.render(w, r, "dead.html", "Dead rows of "+t.String(), struct {
		Table               string
		Total, Groups       int64
		Topic, Error, Cause string
		Causes              []cause
		Page                deadPage
		From, To            int64
		TooMany             string
	}{t.String(), total, groups, q.Topic, q.Error, q.Cause, list, page, page.Before + 1, page.Before + int64(len(page.Rows)), tooManyText(tooMany, h.causesTimeout)})
}

// tooManyText says why the causes are missing, "" when they are not.
func tooManyText(tooMany bool, d time.Duration) string {
	if !tooMany {
		return ""
	}
	return "too many dead rows to group by cause within " + d.String() + ": filter by topic or error text to see the causes; the rows are listed below"
}
