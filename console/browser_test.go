package console_test

import (
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/chromedp/chromedp"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// chromiumPath is Debian's Chromium, which `make up` installs.
const chromiumPath = "/usr/bin/chromium"

// TestBrowserReplayDeadRow drives the console in a real headless Chromium as
// an operator would: the overview, the dead rows, one of them, log in with
// the token, replay it; a running relay delivers it and the overview shows
// no dead row; a row that dies then appears on the open page without a
// reload. UPDATE_SCREENSHOT=1 writes docs/console.png.
func TestBrowserReplayDeadRow(t *testing.T) {
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Fatalf("%s is missing: the browser test needs Debian's Chromium (`make up` installs it: apt-get install chromium): %v", chromiumPath, err)
	}
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)

	// The relay: delivered events are recorded.
	sub, err := subscriber.New(pool, subscriber.Config{Table: tbl, PollInterval: 200 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	sctx, scancel := context.WithCancel(context.Background())
	defer scancel()
	ch, err := sub.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu        sync.Mutex
		delivered = map[string]bool{}
		relayDone = make(chan struct{})
	)
	go func() {
		defer close(relayDone)
		for msg := range ch {
			mu.Lock()
			delivered[msg.UUID] = true
			mu.Unlock()
			msg.Ack()
		}
	}()

	const token = "browser-test-token"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromiumPath),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("user-data-dir", t.TempDir()),
		chromedp.Flag("window-size", "1200,800"),
	)
	actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()
	ctx, cancel := context.WithTimeout(bctx, 30*time.Second)
	defer cancel()

	if err := chromedp.Do(ctx,
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(`#overview`),
	); err != nil {
		t.Fatalf("browser, overview: %v", err)
	}
	deadBefore, err := chromedp.Run(ctx, chromedp.Text(`td[data-count="dead"]`))
	if err != nil {
		t.Fatalf("browser, dead count: %v", err)
	}
	for i, step := range []chromedp.Action[chromedp.Void]{
		chromedp.Click(`a.dead-link`),
		chromedp.WaitVisible(`a.event-link`),
		chromedp.Click(`a.event-link`),
		chromedp.WaitVisible(`#event`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#replay`),
		chromedp.Click(`#replay`),
		chromedp.WaitVisible(`#flash`),
	} {
		sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
		err := chromedp.Do(sctx, step)
		scancel()
		if err != nil {
			loc, _ := chromedp.Run(ctx, chromedp.Location())
			html, _ := chromedp.Run(ctx, chromedp.InnerHTML(`body`))
			t.Fatalf("browser, step %d of the replay (at %s): %v\n%s", i, loc, err, html)
		}
	}
	flash, err := chromedp.Run(ctx, chromedp.Text(`#flash`))
	if err != nil {
		t.Fatalf("browser, flash: %v", err)
	}
	if strings.TrimSpace(deadBefore) != "1" || !strings.Contains(flash, "replayed") {
		t.Fatalf("dead count before %q, flash %q", deadBefore, flash)
	}
	waitDelivered := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		ok := delivered[id.String()]
		mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(waitDelivered) {
			t.Fatal("the replayed event was not delivered by the relay")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The overview's live counts (no reload) reach no dead row.
	if err := chromedp.Do(ctx,
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(`#overview`),
	); err != nil {
		t.Fatalf("browser, overview after the replay: %v", err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('td[data-count="dead"]').textContent.trim() === "0"`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		t.Fatalf("browser: the overview's dead count did not reach 0: %v", err)
	}
	deadAfter, err := chromedp.Run(ctx, chromedp.Text(`td[data-count="dead"]`))
	if err != nil {
		t.Fatal(err)
	}
	// Live: a row that dies now shows up on the open page without a reload.
	scancel()
	<-relayDone
	deadRow(t, pool, tbl)
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('td[data-count="dead"]').textContent.trim() === "1"`,
		chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		t.Fatalf("browser: the open overview did not show the new dead row without a reload: %v", err)
	}
	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(deadAfter) != "0" || len(shot) == 0 {
		t.Fatalf("dead count after %q, screenshot %d bytes", deadAfter, len(shot))
	}
	if os.Getenv("UPDATE_SCREENSHOT") == "1" {
		if err := os.WriteFile(filepath.Join("..", "docs", "console.png"), shot, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
