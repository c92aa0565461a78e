package console_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// login posts the token to /login and returns the session cookie as a
// header.
func login(t *testing.T, base, token string) map[string]string {
	t.Helper()
	r := do(t, "POST", base+"/login", url.Values{"token": {token}, "back": {"/"}}, nil)
	if r.code != 303 {
		t.Fatalf("login: %d %s", r.code, r.body)
	}
	return map[string]string{"Cookie": strings.SplitN(r.hdr.Get("Set-Cookie"), ";", 2)[0]}
}

func newConsole(t *testing.T, cfg console.Config) http.Handler {
	t.Helper()
	h, err := console.New(testdb.Pool(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func serve(t *testing.T, cfg console.Config) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(newConsole(t, cfg))
	t.Cleanup(srv.Close)
	return srv
}

const (
	adminToken = "admin-token-0123456789abcdef"
	readToken  = "read-token-0123456789abcdef"
)

// TestReadsNeedToken: with a token set, nothing but /healthz (and the
// login form's static files) answers without it; the read-only token reads
// but cannot act; PublicRead opens the reads, not the actions.
func TestReadsNeedToken(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	name := tbl.String()
	reads := []string{"/", "/t/" + name + "/dead", "/t/" + name + "/event/" + id.String() + "?payload=1", "/t/" + name + "/event/" + id.String(),
		"/t/" + name + "/topics", "/t/" + name + "/held", "/t/" + name + "/replay", "/t/" + name + "/replay/0000", "/api/counts", "/api/series", "/api/replay/0000",
		"/t/unknown.table/dead"}
	replay := "/t/" + name + "/event/" + id.String() + "/replay"

	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, ReadToken: readToken})
	for _, p := range reads {
		r := do(t, "GET", srv.URL+p, nil, nil)
		if r.code != 401 || strings.Contains(r.body, id.String()) || strings.Contains(r.body, "alert") || strings.Contains(r.body, name) {
			t.Errorf("anonymous GET %s: %d, want 401 and nothing of the table:\n%s", p, r.code, r.body)
		}
	}
	if r := do(t, "GET", srv.URL+"/", nil, nil); !strings.Contains(r.body, `id="login"`) {
		t.Errorf("the anonymous page offers no login form:\n%s", r.body)
	}
	for _, p := range []string{"/healthz", "/static/console.css", "/static/console.js"} {
		if r := do(t, "GET", srv.URL+p, nil, nil); r.code != 200 {
			t.Errorf("anonymous GET %s: %d", p, r.code)
		}
	}
	reader := map[string]string{"Authorization": "Bearer " + readToken}
	readerSession := login(t, srv.URL, readToken)
	for _, hdr := range []map[string]string{reader, readerSession, {"Authorization": "Bearer " + adminToken}} {
		if r := do(t, "GET", srv.URL+"/t/"+name+"/event/"+id.String()+"?payload=1", nil, hdr); r.code != 200 || !strings.Contains(r.body, `id="payload"`) {
			t.Errorf("event with %v: %d", hdr, r.code)
		}
		if r := do(t, "GET", srv.URL+"/api/counts", nil, hdr); r.code != 200 {
			t.Errorf("counts with %v: %d", hdr, r.code)
		}
	}
	page := do(t, "GET", srv.URL+"/t/"+name+"/event/"+id.String(), nil, readerSession).body
	if strings.Contains(page, `id="replay"`) || !strings.Contains(page, "read-only token") {
		t.Errorf("the reader's event page offers a replay or does not say read-only:\n%s", page)
	}
	m := csrfField.FindStringSubmatch(page)
	if m == nil {
		t.Fatalf("no CSRF token (logout form) for the reader's session:\n%s", page)
	}
	if r := do(t, "POST", srv.URL+replay, nil, reader); r.code != 403 {
		t.Errorf("replay with the read-only bearer token: %d %s", r.code, r.body)
	}
	if r := do(t, "POST", srv.URL+replay, url.Values{"csrf": {m[1]}}, readerSession); r.code != 403 {
		t.Errorf("replay with the read-only session: %d %s", r.code, r.body)
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("the read-only token replayed the row")
	}

	pub := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, PublicRead: true})
	for _, p := range reads[:7] {
		if r := do(t, "GET", pub.URL+p, nil, nil); r.code != 200 {
			t.Errorf("PublicRead, anonymous GET %s: %d", p, r.code)
		}
	}
	if r := do(t, "POST", pub.URL+replay, url.Values{}, nil); r.code != 401 {
		t.Errorf("PublicRead, anonymous replay: %d", r.code)
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("an anonymous replay changed the row")
	}
}

// TestTokenMinimumLength: short tokens and conflicting settings are refused
// by New with an error that says what to do.
func TestTokenMinimumLength(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	tables := []schema.Table{tbl}
	for name, c := range map[string]struct {
		cfg  console.Config
		want []string
	}{
		"one-character token": {console.Config{Tables: tables, Token: "x"}, []string{"Token", "OUTBOX_CONSOLE_TOKEN", "at least 16 bytes", "openssl rand"}},
		"15-byte token":       {console.Config{Tables: tables, Token: strings.Repeat("a", 15)}, []string{"15 bytes"}},
		"short read token":    {console.Config{Tables: tables, Token: adminToken, ReadToken: "short"}, []string{"ReadToken", "OUTBOX_CONSOLE_READ_TOKEN"}},
		"same tokens":         {console.Config{Tables: tables, Token: adminToken, ReadToken: adminToken}, []string{"own value"}},
		"public and reader":   {console.Config{Tables: tables, Token: adminToken, ReadToken: readToken, PublicRead: true}, []string{"conflict"}},
	} {
		_, err := console.New(testdb.Pool(t), c.cfg)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: error %q does not say %q", name, err, w)
			}
		}
	}
	if _, err := console.New(testdb.Pool(t), console.Config{Tables: tables, Token: strings.Repeat("a", 16)}); err != nil {
		t.Errorf("a 16-byte token: %v", err)
	}
}

// TestHostHeaderChecked: a Host that names neither the configured address
// nor an allowed host gets 421 (DNS rebinding), on reads too; /healthz
// answers whatever the Host.
func TestHostHeaderChecked(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	tables := []schema.Table{tbl}
	for _, c := range []struct {
		addr    string
		allowed []string
		host    string
		want    int
	}{
		{"127.0.0.1:8080", nil, "127.0.0.1:8080", 200},
		{"127.0.0.1:8080", nil, "localhost:8080", 200},
		{"127.0.0.1:8080", nil, "LOCALHOST", 200},
		{"127.0.0.1:8080", nil, "[::1]:8080", 200},
		{"127.0.0.1:8080", nil, "evil.example:8080", 421},
		{"127.0.0.1:8080", nil, "evil.example", 421},
		{"127.0.0.1:8080", nil, "127.0.0.1.evil.example", 421},
		{"127.0.0.1:8080", nil, "", 421},
		{"localhost:8080", nil, "127.0.0.1:8080", 200},
		{"127.0.0.1:8080", []string{"console.example.com"}, "console.example.com:443", 200},
		{"127.0.0.1:8080", []string{"console.example.com"}, "console.example.com.", 200},
		{"127.0.0.1:8080", []string{"console.example.com"}, "other.example.com", 421},
		{"0.0.0.0:8080", nil, "10.1.2.3:8080", 200},
		{":8080", nil, "localhost:8080", 200},
		{"0.0.0.0:8080", nil, "evil.example:8080", 421},
		{"10.0.0.5:8080", nil, "10.0.0.5:8080", 200},
		{"10.0.0.5:8080", nil, "localhost:8080", 421},
		{"10.0.0.5:8080", nil, "10.0.0.6:8080", 421},
		{"console.internal:8080", nil, "console.internal:8080", 200},
	} {
		h := newConsole(t, console.Config{Tables: tables, Addr: c.addr, AllowedHosts: c.allowed})
		req := httptest.NewRequest("GET", "/", nil)
		req.Host = c.host
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != c.want {
			t.Errorf("Addr %s, allowed %v, Host %q: %d, want %d", c.addr, c.allowed, c.host, rec.Code, c.want)
		}
		if c.want == 421 && strings.Contains(rec.Body.String(), tbl.String()) {
			t.Errorf("Host %q: the refusal shows the table", c.host)
		}
		req = httptest.NewRequest("GET", "/healthz", nil)
		req.Host = c.host
		rec = httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != 200 {
			t.Errorf("healthz, Host %q: %d", c.host, rec.Code)
		}
	}
}

var cookieValue = regexp.MustCompile(`^outbox_console=([^;]*)`)

// TestSessionsPerLogin: every login gets its own random session with its
// own CSRF token, which no other session accepts; POST /logout ends it; a
// session expires after SessionTTL.
func TestSessionsPerLogin(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, SessionTTL: 2 * time.Second})
	event := srv.URL + "/t/" + tbl.String() + "/event/" + id.String()

	a, b := login(t, srv.URL, adminToken), login(t, srv.URL, adminToken)
	if a["Cookie"] == b["Cookie"] || len(cookieValue.FindStringSubmatch(a["Cookie"])[1]) < 32 {
		t.Fatalf("two logins, sessions %q and %q: want distinct random ids", a["Cookie"], b["Cookie"])
	}
	r := do(t, "POST", srv.URL+"/login", url.Values{"token": {adminToken}}, nil)
	if c := r.hdr.Get("Set-Cookie"); !strings.Contains(c, "Max-Age=2") {
		t.Errorf("the session cookie does not expire with the session: %q", c)
	}
	csrfOf := func(s map[string]string) string {
		m := csrfField.FindStringSubmatch(do(t, "GET", event, nil, s).body)
		if m == nil {
			t.Fatal("no CSRF token on the event page")
		}
		return m[1]
	}
	ca, cb := csrfOf(a), csrfOf(b)
	if ca == cb {
		t.Fatal("two sessions share a CSRF token")
	}
	if r := do(t, "POST", event+"/replay", url.Values{"csrf": {ca}}, b); r.code != 403 {
		t.Fatalf("session B with session A's CSRF token: %d %s", r.code, r.body)
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("a foreign CSRF token replayed the row")
	}
	// Logout needs the session's CSRF token, then ends the session.
	if r := do(t, "POST", srv.URL+"/logout", url.Values{"csrf": {cb}}, a); r.code != 403 {
		t.Errorf("logout with another session's CSRF token: %d", r.code)
	}
	r = do(t, "POST", srv.URL+"/logout", url.Values{"csrf": {ca}}, a)
	if r.code != 303 || !strings.Contains(r.hdr.Get("Set-Cookie"), "Max-Age=0") {
		t.Fatalf("logout: %d %q", r.code, r.hdr.Get("Set-Cookie"))
	}
	if r := do(t, "GET", event, nil, a); r.code != 401 {
		t.Errorf("GET after logout: %d", r.code)
	}
	if r := do(t, "POST", event+"/replay", url.Values{"csrf": {ca}}, a); r.code != 401 {
		t.Errorf("replay after logout: %d", r.code)
	}
	if r := do(t, "GET", event, nil, b); r.code != 200 {
		t.Errorf("the other session was logged out too: %d", r.code)
	}
	// Expiry.
	time.Sleep(2100 * time.Millisecond)
	if r := do(t, "GET", event, nil, b); r.code != 401 {
		t.Errorf("GET after the session expired: %d", r.code)
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("the row changed")
	}
}

// TestFailedLoginsSlowedDown: after a few wrong tokens an address waits,
// longer each time, even with the right token and for the bearer header;
// another address is not affected; the wait ends.
func TestFailedLoginsSlowedDown(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, TrustProxy: true})
	from := func(ip string, extra ...string) map[string]string {
		h := map[string]string{"X-Forwarded-For": "198.51.100.1, " + ip}
		for i := 0; i+1 < len(extra); i += 2 {
			h[extra[i]] = extra[i+1]
		}
		return h
	}
	var refused, limited int
	for range 50 {
		switch r := do(t, "POST", srv.URL+"/login", url.Values{"token": {"wrong-token-0123456789"}}, from("203.0.113.7")); r.code {
		case 401:
			refused++
		case 429:
			limited++
			if r.hdr.Get("Retry-After") == "" {
				t.Fatal("429 without Retry-After")
			}
		default:
			t.Fatalf("wrong login: %d", r.code)
		}
	}
	if refused != 4 || limited != 46 {
		t.Fatalf("50 wrong logins: %d checked, %d slowed down; want 4 and 46", refused, limited)
	}
	if r := do(t, "POST", srv.URL+"/login", url.Values{"token": {adminToken}}, from("203.0.113.7")); r.code != 429 {
		t.Errorf("the right token during the wait: %d", r.code)
	}
	if r := do(t, "GET", srv.URL+"/", nil, from("203.0.113.7", "Authorization", "Bearer "+adminToken)); r.code != 429 {
		t.Errorf("the bearer token during the wait: %d", r.code)
	}
	if r := do(t, "POST", srv.URL+"/login", url.Values{"token": {adminToken}}, from("203.0.113.8")); r.code != 303 {
		t.Errorf("another address: %d", r.code)
	}
	// Wrong bearer tokens count too.
	for range 5 {
		do(t, "GET", srv.URL+"/", nil, from("203.0.113.9", "Authorization", "Bearer wrong-token-0123456789"))
	}
	if r := do(t, "GET", srv.URL+"/", nil, from("203.0.113.9", "Authorization", "Bearer "+adminToken)); r.code != 429 {
		t.Errorf("after wrong bearer tokens: %d", r.code)
	}
	// The first wait is a second.
	time.Sleep(1100 * time.Millisecond)
	if r := do(t, "POST", srv.URL+"/login", url.Values{"token": {adminToken}}, from("203.0.113.9")); r.code != 303 {
		t.Errorf("after the wait: %d", r.code)
	}
}

// TestSecureCookie: the session cookie is Secure over TLS and behind a
// trusted proxy that says https, not otherwise.
func TestSecureCookie(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	tables := []schema.Table{tbl}
	cookie := func(base string, client *http.Client, hdr map[string]string) string {
		req, err := http.NewRequest("POST", base+"/login", strings.NewReader(url.Values{"token": {adminToken}}.Encode()))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		res, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if res.StatusCode != 303 {
			t.Fatalf("login: %d", res.StatusCode)
		}
		return res.Header.Get("Set-Cookie")
	}
	noFollow := func(c *http.Client) *http.Client {
		c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
		return c
	}
	plain := serve(t, console.Config{Tables: tables, Token: adminToken})
	if c := cookie(plain.URL, noFollow(&http.Client{}), map[string]string{"X-Forwarded-Proto": "https"}); strings.Contains(c, "Secure") {
		t.Errorf("plain HTTP, untrusted X-Forwarded-Proto: %q", c)
	}
	proxied := serve(t, console.Config{Tables: tables, Token: adminToken, TrustProxy: true})
	if c := cookie(proxied.URL, noFollow(&http.Client{}), map[string]string{"X-Forwarded-Proto": "https"}); !strings.Contains(c, "Secure") {
		t.Errorf("trusted proxy with https: %q", c)
	}
	if c := cookie(proxied.URL, noFollow(&http.Client{}), map[string]string{"X-Forwarded-Proto": "http"}); strings.Contains(c, "Secure") {
		t.Errorf("trusted proxy with http: %q", c)
	}
	tlsSrv := httptest.NewTLSServer(newConsole(t, console.Config{Tables: tables, Token: adminToken}))
	defer tlsSrv.Close()
	if c := cookie(tlsSrv.URL, noFollow(tlsSrv.Client()), nil); !strings.Contains(c, "Secure") {
		t.Errorf("TLS: %q", c)
	}
}

// TestNoServerErrorFromInput: hostile query strings and forms get 400 (or
// their page), never 500, with or without a token, and log no error; a
// cause whose head is cut inside a UTF-8 character links to a page that
// answers.
func TestNoServerErrorFromInput(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	deadWith(t, pool, tbl, "org.utf8.v1", strings.Repeat("a", 79)+"é and then some more text: détail", 2)
	name := tbl.String()
	for _, token := range []string{"", adminToken} {
		logs := watermill.NewCaptureLogger()
		srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: token, Logger: logs})
		auth := map[string]string{}
		if token != "" {
			auth["Authorization"] = "bearer " + token
		}
		for _, p := range []string{"/t/" + name + "/dead", "/t/" + name + "/replay", "/t/" + name + "/event/" + id.String(), "/", "/t/" + name + "/held"} {
			for _, q := range []string{"error=%00", "error=%FF", "topic=%C3", "error=%zz", "done=%00", "done=%FF", "payload=%FF", "error=a%00b&topic=x", "%FF=1", "error=" + strings.Repeat("%C3%A9", 5000)} {
				for _, hdr := range []map[string]string{nil, auth} {
					r := do(t, "GET", srv.URL+p+"?"+q, nil, hdr)
					if r.code >= 500 {
						t.Errorf("GET %s?%s: %d %s", p, q, r.code, r.body)
					}
				}
			}
		}
		for _, f := range []url.Values{{"token": {"\xff"}}, {"token": {"a\x00b"}}, {"back": {"\xff"}, "token": {"x"}}} {
			if r := do(t, "POST", srv.URL+"/login", f, nil); r.code >= 500 {
				t.Errorf("login %v: %d", f, r.code)
			}
		}
		if r := do(t, "POST", srv.URL+"/t/"+name+"/replay", url.Values{"error": {"\x00"}, "topic": {"\xff"}}, auth); r.code >= 500 {
			t.Errorf("bulk replay with NUL: %d", r.code)
		}
		// Every link of the dead page answers.
		page := do(t, "GET", srv.URL+"/t/"+name+"/dead", nil, auth)
		if page.code != 200 {
			t.Fatalf("dead page: %d", page.code)
		}
		links := regexp.MustCompile(`href="(/t/[^"]+)"`).FindAllStringSubmatch(page.body, -1)
		if len(links) < 3 {
			t.Fatalf("dead page with %d links:\n%s", len(links), page.body)
		}
		for _, m := range links {
			u := strings.ReplaceAll(m[1], "&amp;", "&")
			if r := do(t, "GET", srv.URL+u, nil, auth); r.code != 200 {
				t.Errorf("link %s: %d %s", u, r.code, r.body)
			}
		}
		if errs := logs.Captured()[watermill.ErrorLogLevel]; len(errs) > 0 {
			t.Errorf("hostile input logged errors: %v", errs)
		}
	}
}

// TestDoneShowsOnlyKnownMessages: ?done= takes a message code; other text
// is never put on the page.
func TestDoneShowsOnlyKnownMessages(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	srv := server(t, pool, tbl, "")
	event := srv.URL + "/t/" + tbl.String() + "/event/" + id.String()
	for _, p := range []string{event, srv.URL + "/t/" + tbl.String() + "/held"} {
		r := do(t, "GET", p+"?done="+url.QueryEscape("your account is locked, call +1 555 0100"), nil, nil)
		if r.code != 200 || strings.Contains(r.body, "555 0100") || strings.Contains(r.body, `id="flash"`) {
			t.Errorf("%s shows an arbitrary ?done=: %d\n%s", p, r.code, r.body)
		}
	}
	if r := do(t, "GET", event+"?done=replayed", nil, nil); !strings.Contains(r.body, `id="flash"`) || !strings.Contains(r.body, "replayed") {
		t.Errorf("the replayed message is missing:\n%s", r.body)
	}
}

// TestLoginRedirectOnlyLocal: the login's back= is followed only when it is
// a path of this console; anything that a browser could read as another
// host goes to /.
func TestLoginRedirectOnlyLocal(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken})
	for back, want := range map[string]string{
		"/t/x/dead?topic=a":        "/t/x/dead?topic=a",
		"/t/../t/x/dead":           "/t/x/dead",
		"":                         "/",
		"//evil.example/":          "/",
		"/\\evil.example/":         "/",
		"\\\\evil.example":         "/",
		"/\t/evil.example/":        "/",
		"/\n/evil.example/":        "/",
		"/\r/evil.example":         "/",
		"/%09/evil.example":        "/%09/evil.example",
		"https://evil.example/":    "/",
		"javascript:alert(1)":      "/",
		"evil.example":             "/",
		"/./\\evil.example":        "/",
		"/ /evil.example":          "/%20/evil.example",
		"/..//evil.example":        "/evil.example",
		"/.//evil.example":         "/evil.example",
		"\u00a0//evil.example":     "/",
		"/\u2028/evil.example":     "/",
		"https:/evil.example":      "/",
		"/t/x/dead#frag":           "/t/x/dead",
		"/t/x?next=//evil.example": "/t/x?next=//evil.example",
	} {
		r := do(t, "POST", srv.URL+"/login", url.Values{"token": {adminToken}, "back": {back}}, nil)
		if r.code >= 500 {
			t.Errorf("back=%q: %d", back, r.code)
			continue
		}
		if loc := r.hdr.Get("Location"); r.code != 303 || loc != want {
			t.Errorf("back=%q: %d Location %q, want %q", back, r.code, loc, want)
		}
	}
}

// TestBearerCaseInsensitiveWithoutCSRF: the scheme is case-insensitive, and
// a request with the bearer token needs no CSRF token.
func TestBearerCaseInsensitiveWithoutCSRF(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken})
	for _, scheme := range []string{"bearer", "BEARER", "Bearer", "bEaReR"} {
		id := deadRow(t, pool, tbl)
		hdr := map[string]string{"Authorization": scheme + " " + adminToken}
		if r := do(t, "GET", srv.URL+"/api/counts", nil, hdr); r.code != 200 {
			t.Errorf("%s: counts %d", scheme, r.code)
		}
		if r := do(t, "POST", srv.URL+"/t/"+tbl.String()+"/event/"+id.String()+"/replay", nil, hdr); r.code != 303 {
			t.Errorf("%s: replay without CSRF %d %s", scheme, r.code, r.body)
		}
		if isDead(t, pool, tbl, id) {
			t.Errorf("%s: the row was not replayed", scheme)
		}
	}
	if r := do(t, "GET", srv.URL+"/api/counts", nil, map[string]string{"Authorization": "Basic " + adminToken}); r.code != 401 {
		t.Errorf("another scheme: %d", r.code)
	}
}

// TestReadOnlyTakesBothTokens: a console with ReadOnly, the console token
// and a read token lets the holder of either read (bearer or session) and
// neither act (issue 56 item 8: `outbox console --read-only` with both
// tokens refused the console token).
func TestReadOnlyTakesBothTokens(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	id := deadRow(t, pool, tbl)
	name := tbl.String()
	replay := "/t/" + name + "/event/" + id.String() + "/replay"
	srv := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: adminToken, ReadToken: readToken, ReadOnly: true})
	if r := do(t, "GET", srv.URL+"/", nil, nil); r.code != 401 {
		t.Errorf("anonymous read of a read-only console with tokens: %d", r.code)
	}
	for _, tok := range []string{adminToken, readToken} {
		bearer := map[string]string{"Authorization": "Bearer " + tok}
		sess := login(t, srv.URL, tok)
		for _, hdr := range []map[string]string{bearer, sess} {
			if r := do(t, "GET", srv.URL+"/t/"+name+"/event/"+id.String(), nil, hdr); r.code != 200 || strings.Contains(r.body, `id="replay"`) {
				t.Errorf("read with %v: %d (or a replay button offered)", hdr, r.code)
			}
		}
		if r := do(t, "POST", srv.URL+replay, nil, bearer); r.code != 403 {
			t.Errorf("replay with the bearer token %s of a read-only console: %d %s", tok[:5], r.code, r.body)
		}
	}
	if !isDead(t, pool, tbl, id) {
		t.Fatal("a read-only console replayed the row")
	}
}
