package console_test

import (
	"context"
	"encoding/json"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

var (
	rowsPosition = regexp.MustCompile(`<p id="page-position">(\d+)–(\d+) of (\d+) rows?\.</p>`)
	rowEvents    = regexp.MustCompile(`<tr data-event="([^"]+)">`)
	pageLink     = func(id string) *regexp.Regexp { return regexp.MustCompile(`id="` + id + `" href="([^"]+)"`) }
)

// TestRowsListsAndSearch: the rows page lists the pending, retrying, dead
// and delivered rows of a table with their totals, a page of 100 at a time
// (next and previous keep their place), and finds rows by event id,
// tenant, ordering key, topic and creation time range; a malformed search
// is a 400 page with a link back, never a 500.
func TestRowsListsAndSearch(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	tenant := uuid.New()
	msgs := make([]publisher.Message, 215)
	ids := make([]uuid.UUID, len(msgs))
	for i := range msgs {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.rows.v1", EventID: ids[i], Payload: json.RawMessage(`{}`)}
	}
	msgs[7].TenantID, msgs[8].TenantID = tenant, tenant
	msgs[9].OrderingKey = "customer-9"
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	// 0-4 published, 5-6 retrying, 7 dead, the rest pending; row 10
	// created an hour ago.
	exec(`UPDATE `+tbl.Sanitize()+` SET published_at = now() WHERE event_id = ANY($1)`, ids[0:5])
	exec(`UPDATE `+tbl.Sanitize()+` SET attempts = 1, last_error = 'timeout', available_at = now() + interval '1 minute' WHERE event_id = ANY($1)`, ids[5:7])
	exec(`UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', attempts = 3, last_error = 'boom' WHERE event_id = $1`, ids[7])
	exec(`UPDATE `+tbl.Sanitize()+` SET created_at = now() - interval '1 hour' WHERE event_id = $1`, ids[10])

	srv := server(t, pool, tbl, "")
	base := srv.URL + "/t/" + tbl.String() + "/rows"
	list := func(query string) (total int, events []string) {
		t.Helper()
		r := do(t, "GET", base+"?"+query, nil, nil)
		if r.code != 200 {
			t.Fatalf("rows?%s: %d %s", query, r.code, r.body)
		}
		if m := rowsPosition.FindStringSubmatch(r.body); m != nil {
			total, _ = strconv.Atoi(m[3])
		}
		for _, m := range rowEvents.FindAllStringSubmatch(r.body, -1) {
			events = append(events, m[1])
		}
		return total, events
	}
	for state, want := range map[string]int{"pending": 209, "retrying": 2, "dead": 1, "delivered": 5, "all": 215} {
		if total, _ := list("state=" + state); total != want {
			t.Errorf("%s: total %d, want %d", state, total, want)
		}
	}
	if _, ev := list("state=retrying"); len(ev) != 2 || ev[0] != ids[5].String() || ev[1] != ids[6].String() {
		t.Errorf("retrying rows %v, want rows 5 and 6", ev)
	}
	if _, ev := list("state=delivered"); len(ev) != 5 || ev[0] != ids[4].String() {
		t.Errorf("delivered rows %v, want newest (row 4) first", ev)
	}

	// Paging the 209 pending rows (the retrying ones are pending too): 100,
	// 100, 9, and back.
	r := do(t, "GET", base+"?state=pending", nil, nil)
	seen := map[string]bool{}
	for page := 1; ; page++ {
		m := rowsPosition.FindStringSubmatch(r.body)
		if m == nil {
			t.Fatalf("page %d without a position:\n%s", page, r.body)
		}
		for _, e := range rowEvents.FindAllStringSubmatch(r.body, -1) {
			if seen[e[1]] {
				t.Fatalf("row %s listed twice", e[1])
			}
			seen[e[1]] = true
		}
		next := pageLink("next-page").FindStringSubmatch(r.body)
		if next == nil {
			if page != 3 || m[1] != "201" || m[2] != "209" {
				t.Fatalf("last page %d at %s–%s", page, m[1], m[2])
			}
			prev := pageLink("prev-page").FindStringSubmatch(r.body)
			if prev == nil {
				t.Fatal("the last page has no previous link")
			}
			back := do(t, "GET", srv.URL+strings.ReplaceAll(prev[1], "&amp;", "&"), nil, nil)
			if m := rowsPosition.FindStringSubmatch(back.body); m == nil || m[1] != "101" || m[2] != "200" {
				t.Fatalf("previous page of the last: %v", m)
			}
			break
		}
		r = do(t, "GET", srv.URL+strings.ReplaceAll(next[1], "&amp;", "&"), nil, nil)
	}
	if len(seen) != 209 {
		t.Fatalf("paging saw %d pending rows, want 209", len(seen))
	}

	// Search.
	if total, ev := list("state=all&event=" + ids[7].String()); total != 1 || len(ev) != 1 || ev[0] != ids[7].String() {
		t.Errorf("search by event id: %d %v", total, ev)
	}
	if total, _ := list("state=all&tenant=" + tenant.String()); total != 2 {
		t.Errorf("search by tenant: %d, want 2", total)
	}
	if total, ev := list("state=pending&tenant=" + tenant.String()); total != 1 || ev[0] != ids[8].String() {
		t.Errorf("pending rows of the tenant: %d %v, want row 8", total, ev)
	}
	if total, ev := list("state=all&key=customer-9"); total != 1 || ev[0] != ids[9].String() {
		t.Errorf("search by ordering key: %d %v", total, ev)
	}
	from := url.QueryEscape(time.Now().Add(-2 * time.Hour).UTC().Format(time.RFC3339))
	to := url.QueryEscape(time.Now().Add(-30 * time.Minute).UTC().Format("2006-01-02T15:04"))
	if total, ev := list("state=all&from=" + from + "&to=" + to); total != 1 || ev[0] != ids[10].String() {
		t.Errorf("search by time range: %d %v, want row 10", total, ev)
	}
	if total, _ := list("state=all&topic=org.other.v1"); total != 0 {
		t.Errorf("search by another topic: %d", total)
	}
	for _, q := range []string{"state=bogus", "event=nope", "tenant=1", "from=yesterday", "after=-1", "after=1&before=9",
		"from=2026-01-02&to=2026-01-01", "after=99999999999999999999"} {
		r := do(t, "GET", base+"?"+q, nil, nil)
		if r.code != 400 || !strings.Contains(r.body, `id="back"`) || !strings.Contains(r.body, `<main`) {
			t.Errorf("rows?%s: %d, want a 400 page with a link back:\n%s", q, r.code, r.body)
		}
	}
}

// TestEventPageTimesAndReplayButton: the token holder sees a Replay button
// on a failed row and none on a published one; a time says how long ago,
// with the exact time (UTC, to the second) in its title.
func TestEventPageTimesAndReplayButton(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	dead := deadRow(t, pool, tbl)
	published := deadRow(t, pool, tbl)
	if _, err := pool.Exec(context.Background(), `UPDATE `+tbl.Sanitize()+` SET dead_at = NULL, published_at = now() - interval '3 minutes' WHERE event_id = $1`, published); err != nil {
		t.Fatal(err)
	}
	const token = "event-page-token-0123456789"
	srv := server(t, pool, tbl, token)
	auth := map[string]string{"Authorization": "Bearer " + token}
	r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/"+published.String(), nil, auth)
	if r.code != 200 || strings.Contains(r.body, `id="replay"`) || !strings.Contains(r.body, `id="no-replay"`) {
		t.Errorf("published event page: %d\n%s", r.code, r.body)
	}
	if !regexp.MustCompile(`<dd id="published"><time datetime="\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ" title="\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC" data-rel>3m( [12]s)? ago</time></dd>`).MatchString(r.body) {
		t.Errorf("published time not in the console's format:\n%s", r.body)
	}
	if r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/"+dead.String(), nil, auth); !strings.Contains(r.body, `id="replay"`) {
		t.Errorf("dead event page without a Replay button:\n%s", r.body)
	}
}
