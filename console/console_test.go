package console_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

const (
	hostileError   = `<script>alert("e")</script> "><img src=x onerror=alert(1)>: boom`
	hostileTopic   = `org.<b>bold</b>.v1`
	hostilePayload = `{"x":"<script>alert(\"p\")</script>"}`
)

// deadRow enqueues one event and makes it dead with hostile strings in its
// last_error, topic and payload.
func deadRow(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) uuid.UUID {
	t.Helper()
	ctx := context.Background()
	id := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.thing.failed.v1", EventID: id,
			Payload: json.RawMessage(hostilePayload)})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', attempts = 3,
  last_error = $2, topic = $3 WHERE event_id = $1`, id, hostileError, hostileTopic); err != nil {
		t.Fatal(err)
	}
	return id
}

func server(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, token string) *httptest.Server {
	t.Helper()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: token})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

type resp struct {
	code int
	body string
	hdr  http.Header
}

func do(t *testing.T, method, u string, form url.Values, hdr map[string]string) resp {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return resp{res.StatusCode, string(b), res.Header}
}

func isDead(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) bool {
	t.Helper()
	var dead bool
	if err := pool.QueryRow(context.Background(), `SELECT dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	return dead
}

// TestPagesEscapeHostileStrings: the overview, the dead rows and the event
// render, with the security headers, and user data is inert.
func TestPagesEscapeHostileStrings(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	srv := server(t, pool, tbl, "")
	for _, path := range []string{"/", "/t/" + tbl.String() + "/dead", "/t/" + tbl.String() + "/event/" + id.String() + "?payload=1",
		"/t/" + tbl.String() + "/topics", "/t/" + tbl.String() + "/held", "/t/" + tbl.String() + "/replay?error=" + url.QueryEscape("<script>")} {
		r := do(t, "GET", srv.URL+path, nil, nil)
		if r.code != 200 {
			t.Fatalf("%s: %d %s", path, r.code, r.body)
		}
		if csp := r.hdr.Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self'") || !strings.Contains(csp, "default-src 'none'") {
			t.Errorf("%s: Content-Security-Policy %q", path, csp)
		}
		if r.hdr.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("%s: no nosniff", path)
		}
		for _, raw := range []string{"<script>alert", "<img src=x", "<b>bold</b>"} {
			if strings.Contains(r.body, raw) {
				t.Errorf("%s renders %q unescaped", path, raw)
			}
		}
		if strings.Contains(r.body, "postgres://") {
			t.Errorf("%s renders a DSN", path)
		}
	}
	dead := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/dead", nil, nil).body
	if !strings.Contains(dead, "&lt;script&gt;alert(&#34;e&#34;)&lt;/script&gt;") || !strings.Contains(dead, "1 dead row,") || !strings.Contains(dead, "1 cause.") {
		t.Errorf("dead page does not group the row under its escaped cause:\n%s", dead)
	}
	ev := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/"+id.String(), nil, nil).body
	if strings.Contains(ev, "alert(\\") || strings.Contains(ev, `id="payload"`) {
		t.Error("the payload is shown without being asked for")
	}
	if r := do(t, "GET", srv.URL+"/t/other.table/dead", nil, nil); r.code != 404 {
		t.Errorf("unknown table: %d", r.code)
	}
	if r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/not-a-uuid", nil, nil); r.code != 400 {
		t.Errorf("bad event id: %d", r.code)
	}
	var counts map[string]struct {
		Stats map[string]any `json:"stats"`
	}
	if err := json.Unmarshal([]byte(do(t, "GET", srv.URL+"/api/counts", nil, nil).body), &counts); err != nil || counts[tbl.String()].Stats["dead"] != float64(1) {
		t.Errorf("counts %v %v", counts, err)
	}
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// TestActionsNeedTokenCSRFAndSameOrigin: without a token the console is
// read-only; with one, a replay needs the token, the CSRF token and the same
// origin; every refusal changes nothing.
func TestActionsNeedTokenCSRFAndSameOrigin(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	replay := "/t/" + tbl.String() + "/event/" + id.String() + "/replay"

	ro := server(t, pool, tbl, "")
	if r := do(t, "POST", ro.URL+replay, url.Values{}, map[string]string{"Authorization": "Bearer x"}); r.code != 403 || !strings.Contains(r.body, "read-only") {
		t.Errorf("read-only console: %d %s", r.code, r.body)
	}

	const token = "s3cret-token-of-the-console"
	srv := server(t, pool, tbl, token)
	bearer := map[string]string{"Authorization": "Bearer " + token}
	session := login(t, srv.URL, token)
	page := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/event/"+id.String(), nil, session).body
	m := csrfField.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF field for the logged-in token holder:\n%s", page)
	}
	csrf := url.Values{"csrf": {m[1]}}
	withSession := func(k, v string) map[string]string { return map[string]string{"Cookie": session["Cookie"], k: v} }
	for name, c := range map[string]struct {
		form url.Values
		hdr  map[string]string
		want int
	}{
		"no token":            {csrf, nil, 401},
		"wrong token":         {csrf, map[string]string{"Authorization": "Bearer nope-nope-nope-nope"}, 401},
		"session, no CSRF":    {url.Values{}, session, 403},
		"session, wrong CSRF": {url.Values{"csrf": {"00"}}, session, 403},
		"cross origin":        {csrf, map[string]string{"Authorization": "Bearer " + token, "Origin": "http://evil.example"}, 403},
		"cross site":          {csrf, map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "cross-site"}, 403},
		"same site":           {csrf, map[string]string{"Authorization": "Bearer " + token, "Sec-Fetch-Site": "same-site"}, 403},
		"opaque origin":       {csrf, map[string]string{"Authorization": "Bearer " + token, "Origin": "null"}, 403},
		"session cross site":  {csrf, withSession("Sec-Fetch-Site", "cross-site"), 403},
	} {
		if r := do(t, "POST", srv.URL+replay, c.form, c.hdr); r.code != c.want {
			t.Errorf("%s: %d %s, want %d", name, r.code, r.body, c.want)
		}
		if !isDead(t, pool, tbl, id) {
			t.Fatalf("%s changed the row", name)
		}
	}
	for _, method := range []string{"GET", "PUT", "DELETE"} {
		if r := do(t, method, srv.URL+replay, nil, bearer); r.code != 405 {
			t.Errorf("%s on an action: %d", method, r.code)
		}
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("a refused request changed the row")
	}

	// Log in: wrong token refused; the right one sets an HttpOnly,
	// SameSite=Strict cookie that is not the token.
	if r := do(t, "POST", srv.URL+"/login", url.Values{"token": {"nope"}}, nil); r.code != 401 {
		t.Errorf("login with a wrong token: %d", r.code)
	}
	r := do(t, "POST", srv.URL+"/login", url.Values{"token": {token}, "back": {"/"}}, nil)
	cookie := r.hdr.Get("Set-Cookie")
	if r.code != 303 || !strings.Contains(cookie, "HttpOnly") || !strings.Contains(cookie, "SameSite=Strict") || strings.Contains(cookie, token) {
		t.Fatalf("login: %d cookie %q", r.code, cookie)
	}
	if r := do(t, "POST", srv.URL+replay, csrf, session); r.code != 303 {
		t.Fatalf("replay with the session and CSRF: %d %s", r.code, r.body)
	}
	if isDead(t, pool, tbl, id) {
		t.Fatal("the replay did not change the row")
	}
	if r := do(t, "POST", srv.URL+replay, nil, bearer); r.code != 409 || !strings.Contains(r.body, "not replayed") {
		t.Errorf("second replay of a pending row: %d %s", r.code, r.body)
	}
}
