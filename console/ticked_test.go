package console_test

import (
	"context"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

var pickBox = regexp.MustCompile(`<input type="checkbox" name="event" value="([0-9a-f-]{36})" class="pick"`)

// picks lists the event ids a page offers a tick box for.
func picks(body string) []string {
	var out []string
	for _, m := range pickBox.FindAllStringSubmatch(body, -1) {
		out = append(out, m[1])
	}
	return out
}

// TestReplayTickedRows: the dead rows page and the rows page offer a tick
// box on each row a replay accepts (none on a published or a pending row,
// none for the read-only token); replaying the ticked rows needs the CSRF
// token and the typed count of ticked rows (else 400, nothing changed),
// then replays each through runbook.Runbook.ReplayEvent and reports each outcome:
// a ticked row the runbook refuses (published) is reported refused (409)
// and left as it is. The report links back to the list it came from, only
// a path of the console.
func TestReplayTickedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	dead := deadWith(t, pool, tbl, "org.ticked.v1", "kafka: broker down", 3)
	published := deadWith(t, pool, tbl, "org.ticked.v1", "kafka: broker down", 1)[0]
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = NULL, last_error = NULL, available_at = now(), published_at = now() WHERE event_id = $1`, published); err != nil {
		t.Fatal(err)
	}
	pending := enqueue(t, ctx, tbl, publisherMessage("org.ticked.v1"))
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, ReadToken: readToken})
	name := tbl.String()
	session := login(t, srv.URL, adminToken)

	deadPage := do(t, "GET", srv.URL+"/t/"+name+"/dead", nil, session).body
	if got := sorted(picks(deadPage)); strings.Join(got, ",") != strings.Join(sorted(idStrings(dead)), ",") {
		t.Fatalf("the dead rows page ticks %v, want the dead rows %v", got, idStrings(dead))
	}
	rowsPage := do(t, "GET", srv.URL+"/t/"+name+"/rows?state=all", nil, session).body
	if got := sorted(picks(rowsPage)); strings.Join(got, ",") != strings.Join(sorted(idStrings(dead)), ",") || strings.Contains(rowsPage, `value="`+pending.String()+`" class="pick"`) {
		t.Fatalf("the rows page ticks %v, want only the dead rows %v", got, idStrings(dead))
	}
	reader := map[string]string{"Authorization": "Bearer " + readToken}
	if b := do(t, "GET", srv.URL+"/t/"+name+"/dead", nil, reader).body; len(picks(b)) != 0 || strings.Contains(b, `id="replay-ticked"`) {
		t.Fatal("the read-only token gets tick boxes")
	}
	csrf := csrfField.FindStringSubmatch(deadPage)[1]
	replayTicked := srv.URL + "/t/" + name + "/replay-ticked"
	form := url.Values{"csrf": {csrf}, "event": {dead[0].String(), dead[1].String()}, "back": {"/t/" + name + "/dead?topic=org.ticked.v1"}}
	for _, bad := range []string{"", "3", "two"} {
		form.Set("confirm", bad)
		r := do(t, "POST", replayTicked, form, session)
		if r.code != 400 || !strings.Contains(r.body, "Type the number of ticked rows (2)") ||
			!strings.Contains(r.body, `<a href="/t/`+name+`/dead?topic=org.ticked.v1" id="back">`) {
			t.Fatalf("replay of ticked rows confirmed with %q: %d\n%s", bad, r.code, r.body)
		}
	}
	form.Set("confirm", "2")
	if r := do(t, "POST", replayTicked, url.Values{"event": form["event"], "confirm": {"2"}}, session); r.code != 403 {
		t.Fatalf("replay of ticked rows without CSRF: %d", r.code)
	}
	if r := do(t, "POST", replayTicked, form, reader); r.code != 403 {
		t.Fatalf("replay of ticked rows with the read-only token: %d", r.code)
	}
	if deadCount(t, pool, tbl) != 3 {
		t.Fatal("a refused replay of ticked rows changed a row")
	}
	r := do(t, "POST", replayTicked, form, session)
	if r.code != 200 || !strings.Contains(r.body, "2 rows replayed") || strings.Contains(r.body, "refused") {
		t.Fatalf("replay of 2 ticked rows: %d\n%s", r.code, r.body)
	}
	if isDead(t, pool, tbl, dead[0]) || isDead(t, pool, tbl, dead[1]) || !isDead(t, pool, tbl, dead[2]) {
		t.Fatal("the ticked rows, and only they, should be pending again")
	}
	// A published row ticked (by a stale page, or a forged form) is refused
	// by the runbook and left as it is; the other is replayed.
	form = url.Values{"csrf": {csrf}, "event": {published.String(), dead[2].String()}, "confirm": {"2"}, "back": {"//evil.example/"}}
	r = do(t, "POST", replayTicked, form, session)
	if r.code != 409 || !strings.Contains(r.body, "1 row replayed, 1 refused") || !strings.Contains(r.body, `<a href="/" id="back">`) {
		t.Fatalf("replay of a published and a dead row: %d\n%s", r.code, r.body)
	}
	var stillPublished bool
	if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, published).Scan(&stillPublished); err != nil || !stillPublished {
		t.Fatalf("the refused published row changed (%v)", err)
	}
	if deadCount(t, pool, tbl) != 0 {
		t.Fatal("the dead row ticked with the published one was not replayed")
	}
}

// idStrings are the ids as text.
func idStrings(in []uuid.UUID) []string {
	out := make([]string, len(in))
	for i, id := range in {
		out[i] = id.String()
	}
	return out
}
