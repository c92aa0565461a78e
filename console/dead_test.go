package console_test

import (
	"context"
	"fmt"
	"html"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

var (
	causeRow   = regexp.MustCompile(`(?s)<tr class="cause">\s*<td class="n" data-cause-count>(\d+)</td>\s*<td><code class="cause-text">([^<]*)</code>`)
	position   = regexp.MustCompile(`<p id="page-position">(\d+)–(\d+) of (\d+) rows?,`)
	linkOf     = func(id string) *regexp.Regexp { return regexp.MustCompile(`id="` + id + `" href="([^"]+)"`) }
	replayLink = regexp.MustCompile(`class="replay-cause" href="([^"]+)"`)
	rowsLink   = regexp.MustCompile(`class="cause-rows" href="([^"]+)"`)
)

// TestDeadGroupedByCause: the dead rows are grouped by their normalised
// cause over every dead row (not the first 1,000): the relay's "publish
// event <uuid> to <topic>:" prefix is left out, ids, numbers and quoted
// values are masked, so two kafka errors stay apart and 1,200 errors that
// differ only in a table name are one cause; the full error is on the page;
// a cause's replay link previews exactly its rows; the rows are paged with
// their total.
func TestDeadGroupedByCause(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	ctx := context.Background()
	insert := func(n int, lastError string) {
		t.Helper()
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, available_at, dead_at, last_error)
SELECT gen_random_uuid(), 'org.a.v1', '{}', gen_random_uuid(), 3, 'infinity', now(), format($2, gen_random_uuid(), i, i * 7)
FROM generate_series(1, $1) AS i`, n, lastError); err != nil {
			t.Fatal(err)
		}
	}
	insert(1200, `pq: relation "orders_%2$s" does not exist (SQLSTATE 42P01)`)
	insert(3, `publish event %s to "org.a.v1": kafka: Message was too large (%s bytes > 1048576)`)
	insert(2, `publish event %s to "org.a.v1": kafka: Request exceeded the user-specified time limit in the request after %3$sms`)
	insert(1, `publish event %s to "org.a.v1": publish event 11111111-2222-3333-4444-555555555555 to "org.b.v1": amqp: channel closed; id 0x%2$s, trace 4bf92f3577b34da6a3ce929d0e0e47%2$s`)
	srv := server(t, pool, tbl, "")
	base := srv.URL
	dead := base + "/t/" + tbl.String() + "/dead"

	page := do(t, "GET", dead, nil, nil)
	if page.code != 200 {
		t.Fatalf("dead page: %d %s", page.code, page.body)
	}
	var got []string
	for _, m := range causeRow.FindAllStringSubmatch(page.body, -1) {
		got = append(got, m[1]+" "+html.UnescapeString(m[2]))
	}
	want := []string{
		`1200 pq: relation "…" does not exist (SQLSTATE 42P01)`,
		`3 kafka: Message was too large (<n> bytes > <n>)`,
		`2 kafka: Request exceeded the user-specified time limit in the request after <n>`,
		`1 amqp: channel closed; id <id>, trace <id>`,
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("causes:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if !strings.Contains(page.body, "1206 dead rows") || !strings.Contains(page.body, "4 causes") {
		t.Errorf("the page does not count every dead row and cause:\n%s", page.body)
	}
	if !strings.Contains(html.UnescapeString(page.body), `kafka: Message was too large (`) || !regexp.MustCompile(`<pre class="full-error">publish event [0-9a-f-]{36} to &#34;org.a.v1&#34;: kafka: Message was too large \(\d+ bytes &gt; 1048576\)</pre>`).MatchString(page.body) {
		t.Errorf("the full error text is not on the page")
	}

	// The replay link of the "too large" cause previews its 3 rows.
	links := replayLink.FindAllStringSubmatch(page.body, -1)
	if len(links) != 4 {
		t.Fatalf("%d replay links, want 4", len(links))
	}
	preview := do(t, "GET", base+html.UnescapeString(links[1][1]), nil, nil)
	if !strings.Contains(preview.body, `<dd id="preview-rows">3</dd>`) {
		t.Errorf("the replay of the too-large cause (%s) does not preview 3 rows:\n%s", links[1][1], preview.body)
	}
	preview = do(t, "GET", base+html.UnescapeString(links[0][1]), nil, nil)
	if !strings.Contains(preview.body, `<dd id="preview-rows">1200</dd>`) {
		t.Errorf("the replay of the relation cause (%s) does not preview 1200 rows:\n%s", links[0][1], preview.body)
	}

	// A cause's rows.
	rl := rowsLink.FindAllStringSubmatch(page.body, -1)
	rows := do(t, "GET", base+html.UnescapeString(rl[2][1]), nil, nil)
	if m := position.FindStringSubmatch(rows.body); m == nil || m[3] != "2" || strings.Count(rows.body, `class="event-link"`) != 2 {
		t.Errorf("rows of the time-limit cause: %v\n%s", m, rows.body)
	}

	// Paging: 100 rows a page, 13 pages, the total on each.
	u := dead
	var pages, seen int
	for u != "" {
		r := do(t, "GET", u, nil, nil)
		m := position.FindStringSubmatch(r.body)
		if r.code != 200 || m == nil || m[3] != "1206" {
			t.Fatalf("page %d (%s): %d %v", pages, u, r.code, m)
		}
		if want := fmt.Sprint(seen + 1); m[1] != want {
			t.Fatalf("page %d starts at %s, want %s", pages, m[1], want)
		}
		n := strings.Count(r.body, `<tr><td class="n">`)
		seen += n
		pages++
		u = ""
		if next := linkOf("next-page").FindStringSubmatch(r.body); next != nil {
			u = base + html.UnescapeString(next[1])
		}
		if pages == 2 {
			prev := linkOf("prev-page").FindStringSubmatch(r.body)
			if prev == nil {
				t.Fatal("the second page has no previous link")
			}
			if m := position.FindStringSubmatch(do(t, "GET", base+html.UnescapeString(prev[1]), nil, nil).body); m == nil || m[1] != "1" || m[2] != "100" {
				t.Fatalf("previous of the second page: %v", m)
			}
		}
	}
	if pages != 13 || seen != 1206 {
		t.Fatalf("%d pages, %d rows; want 13 and 1206", pages, seen)
	}
	for _, bad := range []string{"?after=-1", "?before=x", "?cause=" + url.QueryEscape(uuid.NewString())} {
		if r := do(t, "GET", dead+bad, nil, nil); r.code >= 500 {
			t.Errorf("%s: %d", bad, r.code)
		}
	}
}

// TestDeadCausesTimeout: when grouping by cause takes longer than allowed,
// the page says so and still lists the rows, with their total; no error.
func TestDeadCausesTimeout(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, available_at, dead_at, last_error)
SELECT gen_random_uuid(), 'org.a.v1', '{}', gen_random_uuid(), 3, 'infinity', now(), 'publish event ' || gen_random_uuid() || ' to "org.a.v1": boom ' || i
FROM generate_series(1, 20000) AS i`); err != nil {
		t.Fatal(err)
	}
	logs := watermill.NewCaptureLogger()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	console.SetCausesTimeout(h, time.Millisecond)
	srv := httptest.NewServer(h)
	defer srv.Close()
	r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/dead", nil, nil)
	if m := position.FindStringSubmatch(r.body); r.code != 200 || !strings.Contains(r.body, `id="too-many"`) || m == nil || m[3] != "20000" {
		t.Fatalf("dead page past the timeout: %d %v\n%s", r.code, m, r.body)
	}
	if errs := logs.Captured()[watermill.ErrorLogLevel]; len(errs) > 0 {
		t.Errorf("logged errors: %v", errs)
	}
}

// TestReplayExactCause: the replay of a cause selects exactly the rows
// whose normalised cause is the group's, even when its text is part of
// another cause's ("broker down" in "broker down: retry later"): the
// preview counts the group's rows, the replay changes them and no other,
// and the job page reports the same count.
func TestReplayExactCause(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	short := deadWith(t, pool, tbl, "org.a.v1", `publish event 6f1c2b1e-0d3a-4b8e-9d6f-1a2b3c4d5e6f to "org.a.v1": broker down`, 2)
	long := deadWith(t, pool, tbl, "org.a.v1", `broker down: retry later`, 3)
	longer := deadWith(t, pool, tbl, "org.b.v1", `publish event 0a1b2c3d-0d3a-4b8e-9d6f-1a2b3c4d5e6f to "org.b.v1": Broker Down: retry after 30s`, 4)
	const token = "exact-cause-token-of-the-console"
	srv := server(t, pool, tbl, token)
	auth := login(t, srv.URL, token)
	name := tbl.String()

	page := do(t, "GET", srv.URL+"/t/"+name+"/dead", nil, auth)
	counts := map[string]string{}
	for _, m := range causeRow.FindAllStringSubmatch(page.body, -1) {
		counts[html.UnescapeString(m[2])] = m[1]
	}
	want := map[string]string{"broker down": "2", "broker down: retry later": "3", "Broker Down: retry after <n>": "4"}
	if fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Fatalf("causes %v, want %v", counts, want)
	}
	links := replayLink.FindAllStringSubmatch(page.body, -1)
	if len(links) != 3 {
		t.Fatalf("%d replay links, want 3", len(links))
	}
	// The links follow the causes' order: 4, 3, 2 rows.
	for i, c := range []struct {
		rows string
		ids  []uuid.UUID
	}{{"4", longer}, {"3", long}, {"2", short}} {
		link, err := url.Parse(html.UnescapeString(links[i][1]))
		if err != nil {
			t.Fatal(err)
		}
		form := previewForm(t, srv.URL, name, link.Query(), auth)
		if form.Get("rows") != c.rows || form.Get("cause") == "" {
			t.Fatalf("the preview of the cause %q counts %s rows (form %v), want %s", link.Query().Get("cause"), form.Get("rows"), form, c.rows)
		}
		before := deadCount(t, pool, tbl)
		r := do(t, "POST", srv.URL+"/t/"+name+"/replay", with(form, "confirm", c.rows), auth)
		if r.code != 303 {
			t.Fatalf("replay of %q: %d %s", form.Get("cause"), r.code, r.body)
		}
		job := do(t, "GET", srv.URL+r.hdr.Get("Location"), nil, auth)
		if !strings.Contains(job.body, "Replayed "+c.rows+" dead rows") {
			t.Fatalf("the job page of %q does not report %s rows:\n%s", form.Get("cause"), c.rows, job.body)
		}
		for _, id := range c.ids {
			if isDead(t, pool, tbl, id) {
				t.Errorf("row %s of the replayed cause %q is still dead", id, form.Get("cause"))
			}
		}
		if n := deadCount(t, pool, tbl); fmt.Sprint(before-n) != c.rows {
			t.Fatalf("the replay of %q changed %d dead rows, want %s", form.Get("cause"), before-n, c.rows)
		}
	}
}

// TestReplayCauseTimeout: a replay of a cause whose rows take longer than
// the grouping's bound to select answers 503 with what to do, and changes
// nothing; so does the list of the cause's rows.
func TestReplayCauseTimeout(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, attempts, available_at, dead_at, last_error)
SELECT gen_random_uuid(), 'org.a.v1', '{}', gen_random_uuid(), 3, 'infinity', now(), 'publish event ' || gen_random_uuid() || ' to "org.a.v1": boom ' || i
FROM generate_series(1, 20000) AS i`); err != nil {
		t.Fatal(err)
	}
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}})
	if err != nil {
		t.Fatal(err)
	}
	console.SetCausesTimeout(h, time.Millisecond)
	srv := httptest.NewServer(h)
	defer srv.Close()
	r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/replay?cause="+url.QueryEscape("boom <n>"), nil, nil)
	if r.code != 503 || !strings.Contains(r.body, "took longer than 1ms") || !strings.Contains(r.body, "Nothing changed") {
		t.Fatalf("preview past the bound: %d\n%s", r.code, r.body)
	}
	if n := deadCount(t, pool, tbl); n != 20000 {
		t.Fatalf("%d dead rows, want 20000", n)
	}
	// The list of the cause's rows is bounded the same way.
	r = do(t, "GET", srv.URL+"/t/"+tbl.String()+"/dead?cause="+url.QueryEscape("boom <n>"), nil, nil)
	if r.code != 503 || !strings.Contains(r.body, "took longer than 1ms") {
		t.Fatalf("the rows of a cause past the bound: %d\n%s", r.code, r.body)
	}
}
