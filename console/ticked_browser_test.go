package console_test

import (
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestBrowserReplayTicked: on the dead rows page an operator ticks every
// row shown (the page counts them and stops refreshing), types the count
// and presses Enter, which submits nothing (the form's default button is
// disabled, so Enter never fires a row's button); the "Replay the ticked
// rows" button replays them, the report says so for each row, and its link
// goes back to the filtered list.
func TestBrowserReplayTicked(t *testing.T) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	deadWith(t, pool, tbl, "org.ticked.v1", "kafka: broker down", 3)
	const token = "ticked-browser-token-0123"
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: token})
	ctx := browser(t)
	list := srv.URL + "/t/" + tbl.String() + "/dead?topic=org.ticked.v1"
	steps(t, ctx, "tick every dead row",
		chromedp.Navigate(list),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#select-all-dead`),
		chromedp.Click(`#select-all-dead`),
		chromedp.WaitVisible(`#ticked`),
	)
	if n, _ := chromedp.Run(ctx, chromedp.Text(`#ticked`)); !strings.Contains(n, "3 ticked") {
		t.Fatalf("ticking every row shows %q", n)
	}
	steps(t, ctx, "Enter in the count", chromedp.SendKeys(`#ticked-confirm`, "3"+kb.Enter), chromedp.Sleep(time.Second))
	if loc, _ := chromedp.Run(ctx, chromedp.Location()); loc != list || deadCount(t, pool, tbl) != 3 {
		t.Fatalf("Enter in the count submitted something: at %s, %d dead rows", loc, deadCount(t, pool, tbl))
	}
	steps(t, ctx, "replay the ticked rows",
		chromedp.Click(`#replay-ticked`),
		chromedp.WaitVisible(`#ticked-summary`),
	)
	summary, _ := chromedp.Run(ctx, chromedp.Text(`#ticked-summary`))
	outcomes, _ := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll("#ticked-results td.outcome:not(.refused)").length`))
	if !strings.Contains(summary, "3 rows replayed") || outcomes != 3 || deadCount(t, pool, tbl) != 0 {
		t.Fatalf("the report says %q with %d rows replayed; %d rows still dead", summary, outcomes, deadCount(t, pool, tbl))
	}
	// A report is a POST's answer: it does not refresh (that would act again).
	if still, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`!document.querySelector("main[data-refresh]") && !document.getElementById("refresh-toggle")`)); err != nil || !still {
		t.Errorf("the report refreshes (%v)", err)
	}
	screenshot(t, ctx, "ticked")
	steps(t, ctx, "back to the list", chromedp.Click(`#back`), chromedp.WaitVisible(`#no-dead`))
	if loc, _ := chromedp.Run(ctx, chromedp.Location()); loc != list {
		t.Fatalf("the report's link went to %s, want %s", loc, list)
	}
}
