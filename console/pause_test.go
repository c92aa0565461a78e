package console_test

import (
	"context"
	"encoding/json"
	"net/url"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestPauseResumeFromTopicsPage: the topics page offers Pause to a
// logged-in operator, not to the read-only token; a pause needs the
// session's CSRF token and the admin token; once paused, the topics page
// shows it paused with its reason and a Resume button, and the overview a
// "paused: X" badge; a bad topic is refused with 400 and nothing changed;
// Resume clears it all.
func TestPauseResumeFromTopicsPage(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox")
	name := tbl.String()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{
			{TenantID: uuid.New(), Topic: "org.a.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)},
			{TenantID: uuid.New(), Topic: "org.b.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`)},
		})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	paused := func() []runbook.PausedTopic {
		t.Helper()
		l, err := runbook.New(pool, tbl).PausedTopics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, ReadToken: readToken})
	pausePath := srv.URL + "/t/" + name + "/topics/pause"
	resumePath := srv.URL + "/t/" + name + "/topics/resume"

	reader := login(t, srv.URL, readToken)
	page := do(t, "GET", srv.URL+"/t/"+name+"/topics", nil, reader).body
	if strings.Contains(page, `class="pause"`) || strings.Contains(page, `id="pause-any"`) {
		t.Fatalf("the read-only session is offered Pause:\n%s", page)
	}
	m := csrfField.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token on the reader's page:\n%s", page)
	}
	if r := do(t, "POST", pausePath, url.Values{"csrf": {m[1]}, "topic": {"org.a.v1"}}, reader); r.code != 403 {
		t.Fatalf("pause with the read-only session: %d %s", r.code, r.body)
	}

	admin := login(t, srv.URL, adminToken)
	page = do(t, "GET", srv.URL+"/t/"+name+"/topics", nil, admin).body
	if !strings.Contains(page, `class="pause"`) || !strings.Contains(page, `id="pause-any"`) {
		t.Fatalf("the topics page offers no Pause to the operator:\n%s", page)
	}
	m = csrfField.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token on the operator's page:\n%s", page)
	}
	csrf := m[1]
	if r := do(t, "POST", pausePath, url.Values{"topic": {"org.a.v1"}}, admin); r.code != 403 {
		t.Fatalf("pause without the CSRF token: %d %s", r.code, r.body)
	}
	if r := do(t, "POST", pausePath, url.Values{"csrf": {csrf}, "topic": {"*"}}, admin); r.code != 400 || !strings.Contains(r.body, "not a topic") {
		t.Fatalf("pause of *: %d %s", r.code, r.body)
	}
	if l := paused(); len(l) != 0 {
		t.Fatalf("refused pauses paused %+v", l)
	}

	r := do(t, "POST", pausePath, url.Values{"csrf": {csrf}, "topic": {"org.a.v1"}, "reason": {"billing consumer down"}}, admin)
	if r.code != 303 || !strings.HasSuffix(r.hdr.Get("Location"), "/topics?done=paused") {
		t.Fatalf("pause: %d %s %s", r.code, r.hdr.Get("Location"), r.body)
	}
	if l := paused(); len(l) != 1 || l[0].Topic != "org.a.v1" || l[0].Reason != "billing consumer down" {
		t.Fatalf("paused topics after the console's pause: %+v", l)
	}
	page = do(t, "GET", srv.URL+"/t/"+name+"/topics?done=paused", nil, admin).body
	for _, want := range []string{`id="flash"`, `id="paused-topics"`, `class="relaying paused" data-topic="org.a.v1"`, `class="resume"`, "billing consumer down"} {
		if !strings.Contains(page, want) {
			t.Fatalf("topics page while paused lacks %q:\n%s", want, page)
		}
	}
	if strings.Contains(page, `class="relaying paused" data-topic="org.b.v1"`) {
		t.Fatalf("org.b.v1 shown paused:\n%s", page)
	}
	over := do(t, "GET", srv.URL+"/", nil, reader).body
	if !strings.Contains(over, "paused: org.a.v1") {
		t.Fatalf("the overview shows no paused badge:\n%s", over)
	}

	if r := do(t, "POST", resumePath, url.Values{"csrf": {csrf}, "topic": {"org.a.v1"}}, admin); r.code != 303 {
		t.Fatalf("resume: %d %s", r.code, r.body)
	}
	if l := paused(); len(l) != 0 {
		t.Fatalf("still paused after the console's resume: %+v", l)
	}
	if r := do(t, "POST", resumePath, url.Values{"csrf": {csrf}, "topic": {"org.a.v1"}}, admin); r.code != 409 || !strings.Contains(r.body, "not paused") {
		t.Fatalf("second resume: %d %s", r.code, r.body)
	}
	if over := do(t, "GET", srv.URL+"/", nil, admin).body; strings.Contains(over, "paused: ") {
		t.Fatalf("the overview still shows a paused badge:\n%s", over)
	}
}
