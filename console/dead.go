package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// The dead rows page groups the dead rows by a normalised cause
// (sqlq.CauseOf their last_error), counted over every dead row in SQL,
// and lists them a page at a time. Both read the table through the
// runbook's state reader (runbook.Runbook.DeadCausesOf, runbook.Runbook.ListRows with the
// dead state), so that they show the rows runbook.Runbook.Dead, `outbox dead list`
// and the counts show, in every mode: in an ordered table the keyed rows
// a dead hold holds too. The replay of a cause selects its rows by the
// same expression (runbook.DeadFilter.Cause), so its preview counts and
// replays exactly the group's rows. The expression costs some 20 µs a
// row, so both run under causesTimeout.

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

// cause is one group of dead rows: those whose last_error normalises
// alike.
type cause struct {
	Cause       string
	Count       int64
	First, Last time.Time
	// EventID, Topic and LastError are those of the group's latest row.
	EventID, Topic, LastError string
	// Key is the normalised cause the dead page and the replay filter
	// on; "" for the rows without an error, which have none.
	Key string
}

// causes groups the dead rows matching q (the Cause of q aside) and returns
// the largest groups, the number of groups and of rows.
func (h *handler) causes(ctx context.Context, t schema.Table, q deadQuery) (list []cause, groups, rows int64, err error) {
	var res runbook.DeadCauses
	err = h.bounded(ctx, func(db runbook.DB) error {
		var err error
		res, err = runbook.New(db, t).DeadCausesOf(ctx, runbook.DeadFilter{Topic: q.Topic, ErrorContains: q.Error}, maxCausesShown)
		return err
	})
	if err != nil {
		return nil, 0, 0, fmt.Errorf("group the dead rows of %s: %w", t, err)
	}
	for _, g := range res.Causes {
		c := cause{Cause: g.Cause, Key: g.Cause, Count: g.Rows, First: g.FirstDeadAt, Last: g.LastDeadAt,
			EventID: g.LatestEventID.String(), Topic: g.LatestTopic, LastError: g.LatestError}
		if c.Cause == "" {
			c.Cause = "(no error recorded)"
		}
		list = append(list, c)
	}
	return list, res.Groups, res.Rows, nil
}

// bounded runs read in a read-only transaction under causesTimeout.
func (h *handler) bounded(ctx context.Context, read func(db runbook.DB) error) error {
	return pgx.BeginTxFunc(ctx, h.pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, strconv.FormatInt(h.causesTimeout.Milliseconds(), 10)); err != nil {
			return fmt.Errorf("bound the statement time: %w", err)
		}
		return read(tx)
	})
}

// errCauseTimeout: selecting the rows of one cause took longer than the
// console allows.
var errCauseTimeout = errors.New("selecting the rows of this cause took too long")

// causeTimeoutText says what to do when errCauseTimeout stopped a preview
// or a replay.
func causeTimeoutText(d time.Duration) string {
	return "Selecting the dead rows of this cause took longer than " + d.String() +
		": too many dead rows to read the cause of each. Nothing changed. Filter by topic or by error text first (the dead rows page), or replay with the CLI (outbox dead replay --topic=X --error=TEXT)."
}

// isTimeout reports whether err is PostgreSQL's statement_timeout (not the
// request's end).
func isTimeout(ctx context.Context, err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "57014" /* query_canceled */ && ctx.Err() == nil
}

// replayDead is runbook.Runbook.ReplayDead (a preview with dryRun) for the bulk
// replay pages. A filter on a cause computes the cause of every dead row
// the other conditions keep, as the grouping does, so it runs under the
// same bound (causesTimeout, in one transaction) and a timeout returns
// errCauseTimeout, having changed nothing.
func (h *handler) replayDead(ctx context.Context, t schema.Table, f runbook.DeadFilter, dryRun bool) (runbook.BulkReplay, error) {
	if f.Cause == "" {
		return runbook.New(h.pool, t).ReplayDead(ctx, f, dryRun)
	}
	var res runbook.BulkReplay
	err := pgx.BeginFunc(ctx, h.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('statement_timeout', $1, true)`, strconv.FormatInt(h.causesTimeout.Milliseconds(), 10)); err != nil {
			return fmt.Errorf("bound the replay of a cause of %s: %w", t, err)
		}
		var err error
		res, err = runbook.New(tx, t).ReplayDead(ctx, f, dryRun)
		return err
	})
	if isTimeout(ctx, err) {
		return runbook.BulkReplay{}, fmt.Errorf("replay dead rows of %s: %w", t, errCauseTimeout)
	}
	return res, err
}

// deadRow is one line of the dead rows list.
type deadRow struct {
	Sequence  int64
	EventID   string
	Topic     string
	Attempts  int
	DeadAt    *time.Time
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
// the page before the sequence before). A filter on a cause computes the
// cause of every dead row the other conditions keep, so it runs under
// causesTimeout, as the grouping does.
func (h *handler) deadRows(ctx context.Context, t schema.Table, q deadQuery, after, before int64) (deadPage, error) {
	if q.Cause == "" {
		return deadRowsOf(ctx, h.pool, t, q, after, before)
	}
	var p deadPage
	err := h.bounded(ctx, func(db runbook.DB) error {
		var err error
		p, err = deadRowsOf(ctx, db, t, q, after, before)
		return err
	})
	if isTimeout(ctx, err) {
		return p, fmt.Errorf("list the dead rows of %s: %w", t, errCauseTimeout)
	}
	return p, err
}

// deadRowsOf is deadRows on db: runbook.Runbook.ListRows of the dead rows.
func deadRowsOf(ctx context.Context, db runbook.DB, t schema.Table, q deadQuery, after, before int64) (deadPage, error) {
	rp, err := runbook.New(db, t).ListRows(ctx, runbook.ListFilter{State: runbook.ListDead, Topic: q.Topic, ErrorContains: q.Error, Cause: q.Cause,
		After: after, Before: before, Limit: deadPageSize})
	if err != nil {
		return deadPage{}, fmt.Errorf("list the dead rows of %s: %w", t, err)
	}
	p := deadPage{Total: rp.Total, Before: rp.Before, Next: rp.Next, Prev: rp.Prev}
	for _, r := range rp.Rows {
		d := deadRow{Sequence: r.Sequence, EventID: r.EventID.String(), Topic: r.Topic, Attempts: r.Attempts, DeadAt: r.DeadAt}
		if r.LastError != nil {
			d.LastError = *r.LastError
		}
		p.Rows = append(p.Rows, d)
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
	tooMany := isTimeout(r.Context(), err)
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
	if errors.Is(err, errCauseTimeout) {
		h.fail(w, r, http.StatusServiceUnavailable, "Listing the dead rows of this cause took longer than "+h.causesTimeout.String()+
			": too many dead rows to read the cause of each. Filter by topic or by error text instead.", tablePath(t, "dead"), "the dead rows")
		return
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
