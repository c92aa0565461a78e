package console_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestDeadPageShowsKeyedDeadRows: an ordered relay leaves one keyed row
// dead (its key's hold is dead, the row's own dead_at stays NULL): the
// dead rows page lists it under its cause, as `outbox dead list` does;
// the bulk replay of its cause previews it and replays it as a replay of
// the row alone does: the hold is retried. (The runbook's
// TestBulkReplayPassesTheSingleReplayRule checks the rows a bulk replay
// leaves alone.)
func TestDeadPageShowsKeyedDeadRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	first, _, _ := heldKeys(t, pool, tbl, "k-1")
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		rows, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
		if err == nil && len(rows) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the keyed rows never went dead: %v, %v", rows, err)
		}
	}
	const token = "modes-token-of-the-console"
	srv := server(t, pool, tbl, token)
	auth := login(t, srv.URL, token)
	name := tbl.String()

	page := do(t, "GET", srv.URL+"/t/"+name+"/dead", nil, auth)
	if page.code != 200 || strings.Contains(page.body, `id="no-dead"`) || !strings.Contains(page.body, first[0].String()) ||
		!strings.Contains(page.body, `<td class="n" data-cause-count>1</td>`) {
		t.Fatalf("the dead rows page does not list the keyed dead row %s under its cause:\n%s", first[0], page.body)
	}
	causes, err := runbook.New(pool, tbl).DeadCausesOf(ctx, runbook.DeadFilter{}, 0)
	if err != nil || len(causes.Causes) != 1 {
		t.Fatalf("causes: %+v, %v", causes, err)
	}
	cause := causes.Causes[0].Cause
	rows := do(t, "GET", srv.URL+"/t/"+name+"/dead?"+url.Values{"cause": {cause}}.Encode(), nil, auth)
	if !strings.Contains(rows.body, first[0].String()) || !strings.Contains(rows.body, "1–1 of 1 row,") {
		t.Fatalf("the rows of the cause %q:\n%s", cause, rows.body)
	}

	preview := do(t, "GET", srv.URL+"/t/"+name+"/replay?"+url.Values{"cause": {cause}}.Encode(), nil, auth)
	if !strings.Contains(preview.body, `<dd id="preview-rows">1</dd>`) || strings.Contains(preview.body, `preview-left-alone`) {
		t.Fatalf("the preview of the cause's replay does not count the held row:\n%s", preview.body)
	}
	deadAt := func() *time.Time {
		t.Helper()
		var at *time.Time
		if err := pool.QueryRow(ctx, `SELECT dead_at FROM `+tbl.HoldsTable()+` WHERE ordering_key = 'k-1'`).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}
	before := deadAt()
	form := previewForm(t, srv.URL, name, url.Values{"cause": {cause}}, auth)
	form.Set("confirm", form.Get("rows"))
	if r := do(t, "POST", srv.URL+"/t/"+name+"/replay", form, auth); r.code != 303 {
		t.Fatalf("bulk replay: %d\n%s", r.code, r.body)
	}
	// The replayed hold was retried: no longer dead, or dead again later
	// (the relay fails the row again).
	if after := deadAt(); before == nil || (after != nil && !after.After(*before)) {
		t.Fatalf("the held row's hold was not retried: dead at %v, then %v", before, after)
	}
}
