package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// deadWith enqueues n events of topic and makes them dead with lastError.
func deadWith(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic, lastError string, n int) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ids := make([]uuid.UUID, n)
	msgs := make([]publisher.Message, n)
	for i := range ids {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: ids[i], Payload: json.RawMessage(`{}`)}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', attempts = 3, last_error = $2
WHERE event_id = ANY($1)`, ids, lastError); err != nil {
		t.Fatal(err)
	}
	return ids
}

func deadCount(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE dead_at IS NOT NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

var hidden = regexp.MustCompile(`name="(rows|max_sequence|digest|csrf|topic|error|cause)" value="([^"]*)"`)

// previewForm opens the preview of a bulk replay and returns its form.
func previewForm(t *testing.T, base, tbl string, query url.Values, hdr map[string]string) url.Values {
	t.Helper()
	r := do(t, "GET", base+"/t/"+tbl+"/replay?"+query.Encode(), nil, hdr)
	if r.code != 200 {
		t.Fatalf("preview: %d %s", r.code, r.body)
	}
	form := url.Values{}
	for _, m := range hidden.FindAllStringSubmatch(r.body, -1) {
		form.Set(m[1], html.UnescapeString(m[2]))
	}
	if form.Get("rows") == "" || (hdr["Cookie"] != "" && form.Get("csrf") == "") {
		t.Fatalf("preview without a replay form:\n%s", r.body)
	}
	return form
}

// TestBulkReplayPreviewConfirmProgress: the preview counts the rows; the
// replay needs that exact count typed, changes nothing when the rows
// changed since the preview, and then replays exactly them; its page
// follows their delivery.
func TestBulkReplayPreviewConfirmProgress(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	broker := deadWith(t, pool, tbl, "org.a.v1", "publish: broker down: connection refused", 3)
	other := deadWith(t, pool, tbl, "org.a.v1", "permanent: bad payload", 1)
	const token = "bulk-token-of-the-console"
	srv := server(t, pool, tbl, token)
	auth := login(t, srv.URL, token) // a session: its actions need its CSRF token
	name := tbl.String()

	form := previewForm(t, srv.URL, name, url.Values{"error": {"broker down"}}, auth)
	if form.Get("rows") != "3" || form.Get("error") != "broker down" {
		t.Fatalf("preview form %v, want 3 rows", form)
	}
	// A wrong count, no count, no CSRF: refused, nothing changed.
	for what, f := range map[string]url.Values{"wrong count": with(form, "confirm", "2"), "no count": form, "no CSRF": with(with(form, "confirm", "3"), "csrf", "")} {
		if r := do(t, "POST", srv.URL+"/t/"+name+"/replay", f, auth); r.code < 400 {
			t.Errorf("%s: %d %s", what, r.code, r.body)
		}
	}
	if n := deadCount(t, pool, tbl); n != 4 {
		t.Fatalf("refused replays changed rows: %d dead, want 4", n)
	}
	// One of the previewed rows was replayed by someone else since the
	// preview: the replay is refused as a whole.
	if _, err := runbook.New(pool, tbl).ReplayEvent(context.Background(), broker[1], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if r := do(t, "POST", srv.URL+"/t/"+name+"/replay", with(form, "confirm", "3"), auth); r.code != 409 || !strings.Contains(r.body, "preview again") {
		t.Fatalf("replay after the set changed: %d %s", r.code, r.body)
	}
	if n := deadCount(t, pool, tbl); n != 3 {
		t.Fatalf("a refused replay changed rows: %d dead, want 3", n)
	}
	// It dies again, and a new row matches: a new preview counts 4.
	if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', last_error = 'broker down'
WHERE event_id = $1`, broker[1]); err != nil {
		t.Fatal(err)
	}
	late := deadWith(t, pool, tbl, "org.a.v1", "publish: broker down again", 1)
	form = previewForm(t, srv.URL, name, url.Values{"error": {"broker down"}}, auth)
	r := do(t, "POST", srv.URL+"/t/"+name+"/replay", with(form, "confirm", "4"), auth)
	if r.code != 303 {
		t.Fatalf("confirmed replay: %d %s", r.code, r.body)
	}
	for _, id := range append(broker, late...) {
		if isDead(t, pool, tbl, id) {
			t.Fatalf("row %s not replayed", id)
		}
	}
	if !isDead(t, pool, tbl, other[0]) {
		t.Fatal("a row outside the filter was replayed")
	}
	job := r.hdr.Get("Location")
	page := do(t, "GET", srv.URL+job, nil, auth)
	if page.code != 200 || !strings.Contains(page.body, "Replayed 4 dead rows") {
		t.Fatalf("progress page: %d %s", page.code, page.body)
	}
	progress := func() runbook.Progress {
		var p runbook.Progress
		res := do(t, "GET", srv.URL+"/api/replay/"+job[strings.LastIndex(job, "/")+1:], nil, auth)
		if err := json.Unmarshal([]byte(res.body), &p); err != nil {
			t.Fatalf("progress %d %s: %v", res.code, res.body, err)
		}
		return p
	}
	if p := progress(); p != (runbook.Progress{Rows: 4, Pending: 4}) {
		t.Fatalf("progress before a relay: %+v", p)
	}
	// A relay delivers them: the progress shows it.
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ch, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			msg.Ack()
		}
	}()
	deadline := time.Now().Add(2 * time.Minute)
	for p := progress(); p.Published != 4; p = progress() {
		if time.Now().After(deadline) {
			t.Fatalf("progress after the relay ran: %+v", p)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The overview names the relay that holds the single-active lock.
	var counts map[string]struct {
		Leader *runbook.Session `json:"leader"`
	}
	if err := json.Unmarshal([]byte(do(t, "GET", srv.URL+"/api/counts", nil, auth).body), &counts); err != nil {
		t.Fatal(err)
	}
	var pid int32
	if err := pool.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted
  AND ((classid::bigint << 32) | objid::bigint) = $1`, sqlq.LockKey(tbl)).Scan(&pid); err != nil {
		t.Fatalf("the relay holds no single-active lock: %v", err)
	}
	if l := counts[name].Leader; l == nil || l.PID != pid {
		t.Fatalf("overview leader %+v, want pid %d", l, pid)
	}
	var state struct {
		Done    bool  `json:"done"`
		Pending int64 `json:"pending"`
	}
	if err := json.Unmarshal([]byte(do(t, "GET", srv.URL+"/api/replay/"+job[strings.LastIndex(job, "/")+1:], nil, auth).body), &state); err != nil || !state.Done || state.Pending != 0 {
		t.Errorf("a finished job: %+v (%v), want done", state, err)
	}
	if page := do(t, "GET", srv.URL+job, nil, auth); !regexp.MustCompile(`<p id="job-done" class="flash">Finished`).MatchString(page.body) {
		t.Errorf("the finished job's page does not say it is finished:\n%s", page.body)
	}
	// A job the console does not remember (a restart) is said so: a page
	// with the layout and a link back, and JSON that the script reads.
	if r := do(t, "GET", srv.URL+"/api/replay/0000", nil, auth); r.code != 404 || !strings.Contains(r.body, `"gone":true`) {
		t.Errorf("unknown job: %d %s", r.code, r.body)
	}
	if r := do(t, "GET", srv.URL+"/t/"+name+"/replay/0000", nil, auth); r.code != 404 || !strings.Contains(r.body, "no record of that bulk replay") ||
		!strings.Contains(r.body, `id="back" href="/t/`+name+`/dead"`) && !strings.Contains(r.body, `href="/t/`+name+`/dead" id="back"`) {
		t.Errorf("unknown job's page: %d %s", r.code, r.body)
	}
}

func with(v url.Values, k, val string) url.Values {
	out := url.Values{}
	for key, vs := range v {
		out[key] = append([]string(nil), vs...)
	}
	out.Set(k, val)
	return out
}

// TestHeldKeySkip: an ordered relay holds a key on a dead row; the held
// keys page lists it, a skip from the page lets the key go on, and the
// overview counts the held key and shows the active relay.
func TestHeldKeySkip(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	ids := make([]uuid.UUID, 2)
	msgs := make([]publisher.Message, 2)
	for i := range ids {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.held.v1", EventID: ids[i], Payload: json.RawMessage(`{}`), OrderingKey: "<b>k1</b>"}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, MaxAttempts: 1, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: 2 * time.Second}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := sub.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		acked = map[string]bool{}
	)
	go func() {
		for msg := range ch {
			if msg.UUID == ids[0].String() {
				msg.Nack()
				continue
			}
			mu.Lock()
			acked[msg.UUID] = true
			mu.Unlock()
			msg.Ack()
		}
	}()
	const token = "held-token-of-the-console"
	logs := watermill.NewCaptureLogger()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	auth := login(t, srv.URL, token) // a session: its actions need its CSRF token
	name := tbl.String()
	var page resp
	for deadline := time.Now().Add(2 * time.Minute); ; {
		page = do(t, "GET", srv.URL+"/t/"+name+"/held", nil, auth)
		if strings.Contains(page.body, `class="skip"`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the dead hold never showed with a skip button: %d\n%s", page.code, page.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(page.body, "&lt;b&gt;k1&lt;/b&gt;") || !strings.Contains(page.body, ids[0].String()) {
		t.Fatalf("held keys page does not show the key escaped and its row:\n%s", page.body)
	}
	// The rows pages read ordered mode's state: the held row is dead, the
	// key's next row pending, waiting behind it.
	if r := do(t, "GET", srv.URL+"/t/"+name+"/rows?state=dead", nil, auth); !strings.Contains(r.body, `<tr data-event="`+ids[0].String()+`">`) ||
		strings.Contains(r.body, ids[1].String()) {
		t.Errorf("ordered dead rows:\n%s", r.body)
	}
	if r := do(t, "GET", srv.URL+"/t/"+name+"/rows?state=pending", nil, auth); !strings.Contains(r.body, `<tr data-event="`+ids[1].String()+`">`) ||
		!strings.Contains(r.body, "waits behind a held key") {
		t.Errorf("ordered pending rows:\n%s", r.body)
	}
	var counts map[string]struct {
		Held    int `json:"held_keys"`
		Ordered int `json:"ordered_relays"`
	}
	if err := json.Unmarshal([]byte(do(t, "GET", srv.URL+"/api/counts", nil, auth).body), &counts); err != nil {
		t.Fatal(err)
	}
	if c := counts[name]; c.Held != 1 || c.Ordered != 1 {
		t.Fatalf("overview counts: %+v", c)
	}
	if r := do(t, "POST", srv.URL+"/t/"+name+"/event/"+ids[0].String()+"/skip", url.Values{}, auth); r.code != 403 {
		t.Fatalf("skip without CSRF: %d %s", r.code, r.body)
	}
	m := csrfField.FindStringSubmatch(page.body)
	// Before the skip: the key's second row waits behind the hold and holds
	// nothing itself. (Right after the skip the relay moves the hold onto
	// it while it delivers it, and a skip of it then is accepted.)
	if r := do(t, "POST", srv.URL+"/t/"+name+"/event/"+ids[1].String()+"/skip", url.Values{"csrf": {m[1]}}, auth); r.code != 409 {
		t.Errorf("skip of a row that holds nothing: %d %s", r.code, r.body)
	}
	if r := do(t, "POST", srv.URL+"/t/"+name+"/event/"+ids[0].String()+"/skip", url.Values{"csrf": {m[1]}}, auth); r.code != 303 {
		t.Fatalf("skip: %d %s", r.code, r.body)
	}
	for deadline := time.Now().Add(2 * time.Minute); ; {
		mu.Lock()
		ok := acked[ids[1].String()]
		mu.Unlock()
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the key's next row was not delivered after the skip")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Right after the ack the hold still names the delivered row until the
	// relay's next tick resolves it (seen once): wait for that tick.
	for deadline := time.Now().Add(2 * time.Minute); strings.Contains(do(t, "GET", srv.URL+"/t/"+name+"/held", nil, auth).body, ids[1].String()); {
		if time.Now().After(deadline) {
			t.Error("the delivered row still shows as held")
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The actions are logged: who, what, on which row; never the token.
	var skips, refused int
	for _, m := range logs.Captured()[watermill.InfoLogLevel] {
		if m.Fields["action"] == "skip" && m.Fields["who"] == "token holder" && m.Fields["table"] == name {
			switch {
			case m.Msg == "Console skip" && m.Fields["event_id"] == ids[0].String():
				skips++
			case m.Msg == "Console skip refused" && m.Fields["event_id"] == ids[1].String():
				refused++
			}
		}
		if strings.Contains(fmt.Sprint(m.Fields), token) {
			t.Errorf("the token is in a log line: %v", m)
		}
	}
	if skips != 1 || refused != 1 {
		t.Errorf("logged %d skips and %d refusals, want 1 and 1: %v", skips, refused, logs.Captured())
	}
}

// TestTopicsBacklog: the backlog page counts pending, retrying and dead
// rows per topic.
func TestTopicsBacklog(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	deadWith(t, pool, tbl, "org.dead.v1", "boom", 2)
	ids := deadWith(t, pool, tbl, "org.pending.v1", "", 3)
	if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET dead_at = NULL, available_at = now(), last_error = NULLIF(last_error, '') WHERE event_id = ANY($1)`, ids); err != nil {
		t.Fatal(err)
	}
	list, err := runbook.New(pool, tbl).Topics(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 2 || list[0].Topic != "org.pending.v1" || list[0].Pending != 3 || list[1].Dead != 2 || list[1].Pending != 0 {
		t.Fatalf("topics %+v", list)
	}
	srv := server(t, pool, tbl, "")
	body := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/topics", nil, nil).body
	if !strings.Contains(body, "org.pending.v1") || !strings.Contains(body, `href="/t/`+tbl.String()+`/dead?topic=org.dead.v1"`) {
		t.Fatalf("topics page:\n%s", body)
	}
}
