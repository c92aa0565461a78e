package console_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// deadEach makes n dead rows of topic, the i-th with the last error
// errorOf(i, its event id), and returns their event ids and errors.
func deadEach(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic string, n int, errorOf func(i int, id uuid.UUID) string) map[uuid.UUID]string {
	t.Helper()
	out := map[uuid.UUID]string{}
	for i, id := range deadWith(t, pool, tbl, topic, "", n) {
		msg := errorOf(i, id)
		if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET last_error = $2 WHERE event_id = $1`, id, msg); err != nil {
			t.Fatal(err)
		}
		out[id] = msg
	}
	return out
}

// poll waits until the script is true on the open page.
func poll(t *testing.T, ctx context.Context, what, script string, timeout time.Duration) {
	t.Helper()
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](script, chromedp.WithPollingTimeout(timeout))); err != nil {
		loc, _ := chromedp.Run(ctx, chromedp.Location())
		html, _ := chromedp.Run(ctx, chromedp.InnerHTML(`body`))
		t.Fatalf("browser, %s (at %s): %v\n%s", what, loc, err, html)
	}
}

// causeLine is one line of the dead rows page's table of causes.
type causeLine struct {
	Count string `json:"count"`
	Cause string `json:"cause"`
}

const readCauses = `Array.from(document.querySelectorAll("#causes tr.cause")).map(function (tr) {
  return {count: tr.querySelector("[data-cause-count]").textContent.trim(), cause: tr.querySelector("code.cause-text").textContent.trim()};
})`

// TestBrowserIncidentWalk walks an incident in headless Chromium as an
// operator would (issue 35's proof): a burst of dead rows of three causes,
// with numbers, ids and quoted values differing from row to row and the
// relay's own "publish event <id> to ...:" prefix on some; the dead rows
// page lists them as three causes of 5, 4 and 3 rows; one row of a cause
// opened shows its last error in full; the cause's replay is previewed
// with its count, confirmed by typing it, and followed until the page says
// it finished, a running relay delivering exactly that cause's rows, after
// which the page stops polling, and which a restarted console still shows;
// the overview, /api/counts and the dead rows page then count 3 dead rows
// fewer.
func TestBrowserIncidentWalk(t *testing.T) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	name := tbl.String()
	tooLarge := deadEach(t, pool, tbl, "org.orders.v1", 5, func(i int, id uuid.UUID) string {
		msg := fmt.Sprintf("kafka: Message was too large (%d bytes)", 1048577+i*4099)
		if i%2 == 1 { // the relay's own prefix on some: the cause is the same
			msg = fmt.Sprintf("publish event %s to %q: %s", id, "orders", msg)
		}
		return msg
	})
	timeLimit := deadEach(t, pool, tbl, "org.orders.v1", 4, func(i int, _ uuid.UUID) string {
		return fmt.Sprintf("kafka: Request exceeded the time limit (%d ms)", 30000+i*1500)
	})
	noExchange := deadEach(t, pool, tbl, "org.orders.v1", 3, func(i int, id uuid.UUID) string {
		return fmt.Sprintf("publish event %s to %q: amqp: NOT_FOUND - no exchange 'orders.dead-letter.x%d' in vhost 'shop-production-eu-west-%d', channel %d closed by the server",
			id, "orders", i+1, i+1, 7+i)
	})
	if n := deadCount(t, pool, tbl); n != 12 {
		t.Fatalf("%d dead rows made, want 12", n)
	}

	const token = "incident-walk-browser-token"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	sw := &swappable{h: h}
	srv := httptest.NewServer(sw)
	defer srv.Close()
	ctx := browser(t)

	// The overview after the login: 12 dead rows.
	steps(t, ctx, "the login",
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#overview`),
	)
	poll(t, ctx, "the overview's dead count before the replay is 12",
		`document.querySelector('td[data-count="dead"]').textContent.trim() === "12"`, pollTimeout)

	// The dead rows page: three causes, of 5, 4 and 3 rows.
	steps(t, ctx, "the dead rows",
		chromedp.Click(`a.dead-link`),
		chromedp.WaitVisible(`#causes`),
	)
	causes, err := chromedp.Run(ctx, chromedp.Evaluate[[]causeLine](readCauses))
	if err != nil {
		t.Fatal(err)
	}
	want := []causeLine{
		{"5", "kafka: Message was too large (<n> bytes)"},
		{"4", "kafka: Request exceeded the time limit (<n> ms)"},
		{"3", "amqp: NOT_FOUND - no exchange '…' in vhost '…', channel <n> closed by the server"},
	}
	if fmt.Sprint(causes) != fmt.Sprint(want) {
		t.Fatalf("the dead rows page lists the causes\n%v\nwant\n%v", causes, want)
	}
	total, err := chromedp.Run(ctx, chromedp.Text(`#dead-total`))
	if err != nil || !strings.HasPrefix(total, "12 dead rows, 3 causes.") {
		t.Fatalf("the dead rows page's total says %q (%v)", total, err)
	}

	// One row of the third cause, opened: its last error in full, the
	// relay's prefix and the values the cause masks included.
	const third = `#causes tr.cause:nth-child(3) `
	steps(t, ctx, "the rows of a cause",
		chromedp.Click(third+`a.cause-rows`),
		chromedp.WaitVisible(`#rows-heading code`),
		chromedp.WaitVisible(`#dead-rows a.event-link`),
	)
	listed, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(document.querySelectorAll("#dead-rows a.event-link")).map(function (a) { return a.textContent.trim(); })`))
	if err != nil {
		t.Fatal(err)
	}
	if len(listed) != 3 {
		t.Fatalf("the rows of the cause list %v, want the 3 rows of %v", listed, noExchange)
	}
	for _, id := range listed {
		if _, ok := noExchange[uuid.MustParse(id)]; !ok {
			t.Fatalf("the rows of the cause list %s, not one of its rows %v", id, noExchange)
		}
	}
	opened := uuid.MustParse(listed[0])
	cell, err := chromedp.Run(ctx, chromedp.Text(`#dead-rows tbody tr:first-child td.error-cell`))
	if err != nil {
		t.Fatal(err)
	}
	full := noExchange[opened]
	if len(full) <= 160 || strings.TrimSpace(cell) == full {
		t.Fatalf("the list should cut the %d-byte error: it shows %q", len(full), cell)
	}
	steps(t, ctx, "a row of the cause",
		chromedp.Click(`#dead-rows tbody tr:first-child a.event-link`),
		chromedp.WaitVisible(`#event`),
		chromedp.WaitVisible(`#last-error`),
	)
	shown, err := chromedp.Run(ctx, chromedp.Text(`#last-error`))
	if err != nil || shown != full {
		t.Fatalf("the event page of %s shows the last error\n%q (%v)\nwant\n%q", opened, shown, err, full)
	}

	// Back to every cause; the third's replay: the preview counts its 3
	// rows, the count typed confirms it.
	steps(t, ctx, "the replay preview",
		chromedp.Navigate(srv.URL+"/t/"+name+"/dead"),
		chromedp.WaitVisible(`#causes`),
	)
	if causes, err := chromedp.Run(ctx, chromedp.Evaluate[[]causeLine](readCauses)); err != nil || fmt.Sprint(causes) != fmt.Sprint(want) {
		t.Fatalf("the dead rows page lists the causes %v (%v), want %v", causes, err, want)
	}
	steps(t, ctx, "the replay preview",
		chromedp.Click(third+`a.replay-cause`),
		chromedp.WaitVisible(`#confirm`),
	)
	preview, err := chromedp.Run(ctx, chromedp.Text(`#preview`))
	if err != nil || !strings.Contains(preview, "amqp: NOT_FOUND - no exchange") {
		t.Fatalf("the preview says %q (%v)", preview, err)
	}
	if rows, err := chromedp.Run(ctx, chromedp.Text(`#preview-rows`)); err != nil || strings.TrimSpace(rows) != "3" {
		t.Fatalf("the preview counts %q (%v), want 3", rows, err)
	}
	steps(t, ctx, "the confirmation",
		chromedp.SendKeys(`#confirm`, "3"),
		chromedp.Click(`#confirm-replay`),
		chromedp.WaitVisible(`#progress`),
		chromedp.WaitVisible(`#job-following`),
	)

	// A relay delivers them; the page follows until it says it finished.
	delivered, stopRelay := relay(t, pool, tbl)
	defer stopRelay()
	poll(t, ctx, "the progress page reaches 3 delivered and says it finished",
		`document.querySelector('[data-progress="published"]').textContent.trim() === "3" && !document.getElementById("job-done").hidden && document.getElementById("job-following").hidden`,
		pollTimeout)
	doneText, err := chromedp.Run(ctx, chromedp.Text(`#job-done`))
	if err != nil || !strings.Contains(doneText, "3 delivered") || !strings.Contains(doneText, "0 dead again") {
		t.Fatalf("the finished line says %q (%v)", doneText, err)
	}
	calls, maxAtOnce := sw.progressCalls()
	time.Sleep(2500 * time.Millisecond) // more than two of the page's 1 s polls
	if later, _ := sw.progressCalls(); calls < 1 || maxAtOnce != 1 || later != calls {
		t.Fatalf("progress calls: %d, at most %d at once, %d after the replay finished; want 1 at once and none after", calls, maxAtOnce, later)
	}
	for id := range noExchange {
		if !delivered(id.String()) {
			t.Fatalf("row %s of the replayed cause was not delivered", id)
		}
	}
	for _, other := range []map[uuid.UUID]string{tooLarge, timeLimit} {
		for id := range other {
			if delivered(id.String()) {
				t.Fatalf("row %s of another cause was delivered", id)
			}
		}
	}

	// The console restarts (a new console on the same database): the job's
	// page, reloaded after a new login, still shows the finished replay.
	jobURL, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	h2, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	sw.set(h2)
	steps(t, ctx, "the job page after a restart",
		chromedp.Navigate(jobURL),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#job-done`),
	)
	if doneText, err := chromedp.Run(ctx, chromedp.Text(`#job-done`)); err != nil || !strings.Contains(doneText, "3 delivered") {
		t.Fatalf("after a restart the job page's finished line says %q (%v)", doneText, err)
	}

	// The counts settle: 3 dead rows fewer on the overview, in /api/counts
	// and on the dead rows page, which lists the two other causes.
	steps(t, ctx, "the overview after the replay",
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(`#overview`),
	)
	poll(t, ctx, "the overview's dead count after the replay is 9",
		`document.querySelector('td[data-count="dead"]').textContent.trim() === "9"`, pollTimeout)
	apiDead, err := chromedp.Run(ctx, chromedp.Evaluate[float64](
		`fetch("/api/counts", {credentials: "same-origin"}).then(function (r) { return r.json(); }).then(function (c) { return c[`+fmt.Sprintf("%q", name)+`].stats.dead; })`,
		chromedp.EvalAwaitPromise))
	if err != nil || apiDead != 9 {
		t.Fatalf("/api/counts says %v dead rows (%v), want 9", apiDead, err)
	}
	steps(t, ctx, "the dead rows after the replay",
		chromedp.Click(`a.dead-link`),
		chromedp.WaitVisible(`#causes`),
	)
	causes, err = chromedp.Run(ctx, chromedp.Evaluate[[]causeLine](readCauses))
	if err != nil || fmt.Sprint(causes) != fmt.Sprint(want[:2]) {
		t.Fatalf("after the replay the dead rows page lists the causes %v (%v), want %v", causes, err, want[:2])
	}
	if n := deadCount(t, pool, tbl); n != 9 {
		t.Fatalf("%d dead rows in the table after the replay, want 9", n)
	}
}
