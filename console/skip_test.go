package console_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestSkipInDefaultMode (issue 57, item 4): the event page of a dead row
// of a default-mode table offers Skip; the skip sets it aside at once
// (skipped, not dead, not delivered), goes back to the event page, and is
// logged with who and the reason.
func TestSkipInDefaultMode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "skipcon_outbox")
	id := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.skip.v1", EventID: id, Payload: json.RawMessage(`{}`)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 3, last_error = 'poison', dead_at = now(), available_at = 'infinity' WHERE event_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	const token = "skip-token-of-the-console"
	logs := watermill.NewCaptureLogger()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token, Logger: logs})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	auth := login(t, srv.URL, token)
	event := srv.URL + "/t/" + tbl.String() + "/event/" + id.String()
	page := do(t, "GET", event, nil, auth)
	if !strings.Contains(page.body, `id="skip"`) {
		t.Fatalf("the dead row's page offers no Skip:\n%s", page.body)
	}
	m := csrfField.FindStringSubmatch(page.body)
	r := do(t, "POST", event+"/skip", url.Values{"csrf": {m[1]}, "reason": {"poison payload"}}, auth)
	if r.code != 303 || !strings.Contains(r.hdr.Get("Location"), "/event/"+id.String()+"?done=skipped") {
		t.Fatalf("skip: %d %v %s", r.code, r.hdr, r.body)
	}
	if row, err := runbook.New(pool, tbl).Event(ctx, id); err != nil || row.State() != runbook.RowSkipped {
		t.Fatalf("after the skip: %+v, %v; want skipped", row, err)
	}
	if page = do(t, "GET", event, nil, auth); strings.Contains(page.body, `id="skip"`) || !strings.Contains(page.body, `id="replay"`) {
		t.Errorf("the skipped row's page offers Skip, or no Replay:\n%s", page.body)
	}
	logged := false
	for _, l := range logs.Captured()[watermill.InfoLogLevel] {
		if l.Msg == "Console skip" && l.Fields["event_id"] == id.String() && l.Fields["who"] == "token holder" && l.Fields["reason"] == "poison payload" {
			logged = true
		}
	}
	if !logged {
		t.Errorf("the skip was not logged with who and the reason: %v", logs.Captured())
	}
}
