package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// chromiumPath is Debian's Chromium, which `make up` installs.
const chromiumPath = "/usr/bin/chromium"

// The browser tests wait on conditions, never on how fast the machine is:
// these bounds are generous, so that only a page that never gets there
// fails, also on a loaded 2-core machine running other suites beside them.
const (
	browserTimeout = 5 * time.Minute // one test's browser, from start to end
	stepTimeout    = time.Minute     // one browser action (navigate, wait, click)
	pollTimeout    = time.Minute     // a condition on the page or in the table
)

// browser starts a headless Chromium for one test; the context ends it.
func browser(t *testing.T) context.Context {
	t.Helper()
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Fatalf("%s is missing: the browser test needs Debian's Chromium (`make up` installs it: apt-get install chromium): %v", chromiumPath, err)
	}
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
		chromedp.Flag("window-size", "1366,900"),
	)
	actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
	bctx, bcancel := chromedp.NewContext(actx)
	ctx, cancel := context.WithTimeout(bctx, browserTimeout)
	t.Cleanup(func() {
		cancel()
		bcancel()
		acancel()
	})
	// The first action starts the browser and ties it to its context:
	// run it on ctx, not on a step's shorter one.
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("start Chromium: %v", err)
	}
	return ctx
}

// steps runs browser actions one by one; a failure reports the page.
func steps(t *testing.T, ctx context.Context, what string, actions ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	for i, step := range actions {
		sctx, scancel := context.WithTimeout(ctx, stepTimeout)
		err := chromedp.Do(sctx, step)
		scancel()
		if err != nil {
			loc, _ := chromedp.Run(ctx, chromedp.Location())
			html, _ := chromedp.Run(ctx, chromedp.InnerHTML(`body`))
			t.Fatalf("browser, step %d of %s (at %s): %v\n%s", i, what, loc, err, html)
		}
	}
}

// relay runs a default-mode relay that acks everything and records what
// it delivered.
func relay(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (delivered func(string) bool, stop func()) {
	t.Helper()
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 200 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu   sync.Mutex
		seen = map[string]bool{}
		done = make(chan struct{})
	)
	go func() {
		defer close(done)
		for msg := range ch {
			mu.Lock()
			seen[msg.UUID] = true
			mu.Unlock()
			msg.Ack()
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			scancel()
			<-done
			_ = sub.Close()
		})
	}
	t.Cleanup(stop)
	return func(id string) bool {
		mu.Lock()
		defer mu.Unlock()
		return seen[id]
	}, stop
}

// TestBrowserReplayDeadRow drives the console in a real headless Chromium as
// an operator would: the overview, the dead rows, one of them, log in with
// the token, replay it; a running relay delivers it and the overview shows
// no dead row; a row that dies then appears on the open page without a
// reload. UPDATE_SCREENSHOT=1 writes docs/console.png.
func TestBrowserReplayDeadRow(t *testing.T) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)

	delivered, stopRelay := relay(t, pool, tbl)

	const token = "browser-test-token"
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	ctx := browser(t)

	// With a token, the console shows nothing but its login form.
	steps(t, ctx, "the login",
		chromedp.Navigate(srv.URL+"/"),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#overview`),
	)
	deadBefore, err := chromedp.Run(ctx, chromedp.Text(`td[data-count="dead"]`))
	if err != nil {
		t.Fatalf("browser, dead count: %v", err)
	}
	steps(t, ctx, "the replay",
		chromedp.Click(`a.dead-link`),
		chromedp.WaitVisible(`a.event-link`),
		chromedp.Click(`a.event-link`),
		chromedp.WaitVisible(`#event`),
		chromedp.WaitVisible(`#replay`),
		chromedp.Click(`#replay`),
		chromedp.WaitVisible(`#flash`),
	)
	flash, err := chromedp.Run(ctx, chromedp.Text(`#flash`))
	if err != nil {
		t.Fatalf("browser, flash: %v", err)
	}
	if strings.TrimSpace(deadBefore) != "1" || !strings.Contains(flash, "replayed") {
		t.Fatalf("dead count before %q, flash %q", deadBefore, flash)
	}
	waitDelivered := time.Now().Add(pollTimeout)
	for !delivered(id.String()) {
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
		chromedp.WithPollingTimeout(pollTimeout))); err != nil {
		t.Fatalf("browser: the overview's dead count did not reach 0: %v", err)
	}
	deadAfter, err := chromedp.Run(ctx, chromedp.Text(`td[data-count="dead"]`))
	if err != nil {
		t.Fatal(err)
	}
	// Live: a row that dies now shows up on the open page without a reload.
	stopRelay()
	deadRow(t, pool, tbl)
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('td[data-count="dead"]').textContent.trim() === "1"`,
		chromedp.WithPollingTimeout(pollTimeout))); err != nil {
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

// swappable serves the console it holds, so that a test can replace it
// (a restart), and watches the progress calls of the bulk replay page:
// each is held for slow, and the most at once is recorded.
type swappable struct {
	mu       sync.Mutex
	h        http.Handler
	slow     time.Duration
	inFlight int
	maxIn    int
	calls    int
}

func (s *swappable) set(h http.Handler) {
	s.mu.Lock()
	s.h = h
	s.mu.Unlock()
}

// waitIdle waits until no progress call is under way, and then as long
// again as one takes, for a call the browser sent just before to arrive.
func (s *swappable) waitIdle(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(pollTimeout); ; time.Sleep(20 * time.Millisecond) {
		s.mu.Lock()
		n := s.inFlight
		s.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a progress call still under way after %s", pollTimeout)
		}
	}
	time.Sleep(s.slow + 100*time.Millisecond)
	s.mu.Lock()
	n := s.inFlight
	s.mu.Unlock()
	if n != 0 {
		s.waitIdle(t)
	}
}

func (s *swappable) progressCalls() (calls, maxAtOnce int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.calls, s.maxIn
}

func (s *swappable) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	h := s.h
	progress := strings.HasPrefix(r.URL.Path, "/api/replay/")
	if progress {
		s.calls++
		s.inFlight++
		s.maxIn = max(s.maxIn, s.inFlight)
	}
	s.mu.Unlock()
	if progress {
		time.Sleep(s.slow)
		defer func() {
			s.mu.Lock()
			s.inFlight--
			s.mu.Unlock()
		}()
	}
	h.ServeHTTP(w, r)
}

// TestBrowserBulkReplay: from the dead rows grouped by cause, an operator
// previews the replay of one cause, types the count, confirms, and watches
// the progress page count the rows a running relay delivers, without a
// reload. Each progress call answers in 1.5 s, longer than the page's
// 1 s pace: the calls never overlap, the header's pause toggle holds them,
// and they stop when the replay is done, which the page says. Then the
// console restarts: the reloaded page needs a new login (sessions are kept
// in memory), and then shows the finished replay again, read from the
// table's <table>_replay_jobs, without polling.
func TestBrowserBulkReplay(t *testing.T) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	ids := deadWith(t, pool, tbl, "org.bulk.v1", "publish: broker down", 3)
	deadWith(t, pool, tbl, "org.bulk.v1", "permanent: bad payload", 1)
	const token = "bulk-browser-token"
	newConsole := func() http.Handler {
		h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	sw := &swappable{h: newConsole(), slow: 1500 * time.Millisecond}
	srv := httptest.NewServer(sw)
	defer srv.Close()
	ctx := browser(t)
	steps(t, ctx, "the bulk replay",
		chromedp.Navigate(srv.URL+"/t/"+tbl.String()+"/dead"),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`.badge.ok`),
		chromedp.WaitVisible(`a.replay-cause`),
		chromedp.Click(`a.replay-cause`),
		chromedp.WaitVisible(`#confirm`),
	)
	rows, err := chromedp.Run(ctx, chromedp.Text(`#preview-rows`))
	if err != nil || strings.TrimSpace(rows) != "3" {
		t.Fatalf("preview counts %q (%v), want 3", rows, err)
	}
	steps(t, ctx, "the confirmation",
		chromedp.SendKeys(`#confirm`, "3"),
		chromedp.Click(`#confirm-replay`),
		chromedp.WaitVisible(`#progress`),
		chromedp.WaitVisible(`#job-following`),
	)
	jobURL, err := chromedp.Run(ctx, chromedp.Location())
	if err != nil {
		t.Fatal(err)
	}
	// Nothing is delivered before a relay runs: the page keeps following.
	time.Sleep(2 * time.Second)
	if pending, err := chromedp.Run(ctx, chromedp.Text(`[data-progress="pending"]`)); err != nil || strings.TrimSpace(pending) != "3" {
		t.Fatalf("pending before the relay runs: %q (%v), want 3", pending, err)
	}
	// The header's toggle holds the following too: paused, no progress
	// call goes out.
	steps(t, ctx, "pause the following", chromedp.WaitVisible(`#refresh-toggle`), chromedp.Click(`#refresh-toggle`))
	sw.waitIdle(t) // a call under way when paused ends
	pausedCalls, _ := sw.progressCalls()
	time.Sleep(2500 * time.Millisecond)
	if later, _ := sw.progressCalls(); later != pausedCalls {
		t.Fatalf("the paused progress page kept calling: %d calls, then %d", pausedCalls, later)
	}
	steps(t, ctx, "resume the following", chromedp.Click(`#refresh-toggle`))
	delivered, _ := relay(t, pool, tbl)
	if _, err := chromedp.Run(ctx, chromedp.Poll[bool](`document.querySelector('[data-progress="published"]').textContent.trim() === "3" && !document.getElementById("job-done").hidden`,
		chromedp.WithPollingTimeout(pollTimeout))); err != nil {
		html, _ := chromedp.Run(ctx, chromedp.InnerHTML(`body`))
		t.Fatalf("browser: the progress page did not reach 3 delivered and say it is finished: %v\n%s", err, html)
	}
	for _, id := range ids {
		if !delivered(id.String()) {
			t.Fatalf("row %s was not delivered", id)
		}
	}
	if deadCount(t, pool, tbl) != 1 {
		t.Fatal("the row of the other cause was replayed too")
	}
	doneText, err := chromedp.Run(ctx, chromedp.Text(`#job-done`))
	if err != nil || !strings.Contains(doneText, "3 delivered") || !strings.Contains(doneText, "0 dead again") {
		t.Fatalf("the finished line says %q (%v)", doneText, err)
	}
	calls, maxAtOnce := sw.progressCalls()
	time.Sleep(3 * time.Second)
	callsLater, _ := sw.progressCalls()
	if maxAtOnce != 1 || callsLater != calls || calls < 1 {
		t.Fatalf("progress calls: %d, at most %d at once, %d after the replay was done; want 1 at once and none after", calls, maxAtOnce, callsLater)
	}
	screenshot(t, ctx, "job")

	// A restart: sessions are gone, the job is not. Reloaded, the page
	// needs a login; after it, it shows the finished replay, and does not
	// poll.
	sw.set(newConsole())
	steps(t, ctx, "the replay after a restart",
		chromedp.Navigate(jobURL),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#progress`),
		chromedp.WaitVisible(`#job-done`),
		chromedp.WaitVisible(`#job-kept`),
	)
	if loc, err := chromedp.Run(ctx, chromedp.Location()); err != nil || loc != jobURL {
		t.Fatalf("after the login the browser is at %q (%v), want the job page %s", loc, err, jobURL)
	}
	doneText, err = chromedp.Run(ctx, chromedp.Text(`#job-done`))
	if err != nil || !strings.Contains(doneText, "3 delivered") || !strings.Contains(doneText, "0 dead again") {
		t.Fatalf("after a restart the finished line says %q (%v)", doneText, err)
	}
	calls, _ = sw.progressCalls()
	time.Sleep(2500 * time.Millisecond)
	if later, _ := sw.progressCalls(); later != calls {
		t.Fatalf("the finished job's page polled after a restart: %d calls, then %d", calls, later)
	}
}

// TestBrowserReplayJobForgotten: a progress page left open while the
// console restarts stops following and says why.
func TestBrowserReplayJobForgotten(t *testing.T) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	deadWith(t, pool, tbl, "org.bulk.v1", "publish: broker down", 2)
	const token = "bulk-browser-token"
	newConsole := func() http.Handler {
		h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		return h
	}
	sw := &swappable{h: newConsole()}
	srv := httptest.NewServer(sw)
	defer srv.Close()
	ctx := browser(t)
	steps(t, ctx, "the bulk replay",
		chromedp.Navigate(srv.URL+"/t/"+tbl.String()+"/replay?topic=org.bulk.v1"),
		chromedp.WaitVisible(`#need-login`),
		chromedp.SendKeys(`input[name="token"]`, token),
		chromedp.Click(`#login`),
		chromedp.WaitVisible(`#confirm`),
		chromedp.SendKeys(`#confirm`, "2"),
		chromedp.Click(`#confirm-replay`),
		chromedp.WaitVisible(`#job-following`),
	)
	sw.set(newConsole()) // no relay runs: the job is still pending
	steps(t, ctx, "the restart", chromedp.WaitVisible(`#job-logged-out`))
	calls, _ := sw.progressCalls()
	time.Sleep(2500 * time.Millisecond)
	if later, _ := sw.progressCalls(); later != calls {
		t.Fatalf("the page kept polling after the console forgot its session: %d calls, then %d", calls, later)
	}
}

// screenshot writes the page, at the browser's 1366x900 window, to
// docs/console-<name>.png when UPDATE_SCREENSHOT=1.
func screenshot(t *testing.T, ctx context.Context, name string) {
	t.Helper()
	if os.Getenv("UPDATE_SCREENSHOT") != "1" {
		return
	}
	shot, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		t.Fatalf("screenshot %s: %v", name, err)
	}
	if err := os.WriteFile(filepath.Join("..", "docs", "console-"+name+".png"), shot, 0o644); err != nil {
		t.Fatal(err)
	}
}
