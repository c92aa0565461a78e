package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestConsoleRefusesOpenAddressWithoutToken: a console on a non-loopback
// address needs a token or --read-only.
func TestConsoleRefusesOpenAddressWithoutToken(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	r := rbRun(t, rbEnv("OUTBOX_CONSOLE_ADDR", "0.0.0.0:0", "OUTBOX_CONSOLE_TABLES", tbl.String()), "console")
	if r.code != 2 || !strings.Contains(r.stderr, "not a loopback address") || !strings.Contains(r.stderr, "--read-only") {
		t.Fatalf("exit %d, stderr %s", r.code, r.stderr)
	}
	r = rbRun(t, rbEnv("OUTBOX_CONSOLE_ADDR", "127.0.0.1:0"), "console")
	if r.code != 2 || !strings.Contains(r.stderr, "OUTBOX_CONSOLE_TABLES") {
		t.Fatalf("no tables: exit %d, stderr %s", r.code, r.stderr)
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestConsoleServes: `outbox console` serves the overview of its tables
// and stops on its context (SIGTERM in the binary).
func TestConsoleServes(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	env := rbEnv("OUTBOX_CONSOLE_ADDR", "127.0.0.1:0", "OUTBOX_RELAY_TABLES", tbl.String())
	ctx, cancel := context.WithCancel(context.Background())
	var stdout, stderr syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"console"}, func(k string) string { return env[k] }, &stdout, &stderr)
	}()
	addr := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)`)
	var m []string
	for deadline := time.Now().Add(2 * time.Minute); m == nil; m = addr.FindStringSubmatch(stdout.String()) {
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("no address printed; stderr %s", stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	res, err := http.Get("http://" + m[1] + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !strings.Contains(string(body), tbl.String()) || !strings.Contains(string(body), "read-only") {
		t.Fatalf("overview: %d %s", res.StatusCode, body)
	}
	chartsEvery10s(t, "http://"+m[1], nil, tbl.String())
	cancel()
	if code := <-done; code != 0 {
		t.Fatalf("exit %d, stderr %s", code, stderr.String())
	}
}

var consoleAddrLog = regexp.MustCompile(`msg="Serving the console"[^\n]* addr=(\S+)`)

// TestRelayDaemonServesConsole: with OUTBOX_CONSOLE_ADDR set, the relay
// daemon serves the console of its tables, with actions when
// OUTBOX_CONSOLE_TOKEN is set; on an open address without a token it
// refuses to start.
func TestRelayDaemonServesConsole(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox")
	env := relayEnv(testdb.URL(), tbl)
	env["OUTBOX_CONSOLE_ADDR"] = "0.0.0.0:0"
	r := rbRun(t, env, "relay")
	// The daemon takes no flags: its refusal names the variable, not
	// `--read-only`.
	if r.code != 2 || !strings.Contains(r.stderr, "not a loopback address") || !strings.Contains(r.stderr, "OUTBOX_CONSOLE_READ_ONLY=true") ||
		strings.Contains(r.stderr, "--read-only") {
		t.Fatalf("open address without a token: exit %d, stderr %s", r.code, r.stderr)
	}
	env["OUTBOX_CONSOLE_TOKEN"] = "short"
	if r := rbRun(t, env, "relay"); r.code != 2 || !strings.Contains(r.stderr, "OUTBOX_CONSOLE_TOKEN is 5 bytes") || strings.Contains(r.stderr, "short") {
		t.Fatalf("short token: exit %d, stderr %s", r.code, r.stderr)
	}
	env["OUTBOX_CONSOLE_ADDR"] = "127.0.0.1:0"
	env["OUTBOX_CONSOLE_TOKEN"] = "daemon-console-token"
	d := startDaemon(t, env)
	var m []string
	for deadline := time.Now().Add(2 * time.Minute); m == nil; m = consoleAddrLog.FindStringSubmatch(d.stderr.String()) {
		if time.Now().After(deadline) {
			t.Fatalf("no console address logged; stderr %s", d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	// With the token set, nothing but the console's health answers
	// without it.
	if code, body := get(t, "http://"+m[1]+"/", nil); code != 401 || strings.Contains(body, tbl.String()) || !strings.Contains(body, `name="token"`) {
		t.Fatalf("anonymous overview: %d %s", code, body)
	}
	if code, _ := get(t, "http://"+m[1]+"/healthz", nil); code != 200 {
		t.Fatalf("console health: %d", code)
	}
	if code, body := get(t, "http://"+m[1]+"/", map[string]string{"Authorization": "Bearer daemon-console-token"}); code != 200 || !strings.Contains(body, tbl.String()) {
		t.Fatalf("overview with the token: %d %s", code, body)
	}
	chartsEvery10s(t, "http://"+m[1], map[string]string{"Authorization": "Bearer daemon-console-token"}, tbl.String())
	// The Host is checked against OUTBOX_CONSOLE_ADDR.
	if code, _ := get(t, "http://"+m[1]+"/", map[string]string{"Authorization": "Bearer daemon-console-token", "Host": "rebound.example"}); code != 421 {
		t.Fatalf("foreign Host: %d", code)
	}
	if strings.Contains(d.stderr.String(), "daemon-console-token") {
		t.Fatal("the daemon logged the console token")
	}
}

// chartsEvery10s checks that the console at base samples the counts of
// table for its charts every 10 s over the last hour, the first at once.
func chartsEvery10s(t *testing.T, base string, hdr map[string]string, table string) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); ; {
		code, body := get(t, base+"/api/series", hdr)
		var s struct {
			IntervalSeconds float64                     `json:"interval_seconds"`
			WindowSeconds   float64                     `json:"window_seconds"`
			Tables          map[string][]map[string]any `json:"tables"`
		}
		if err := json.Unmarshal([]byte(body), &s); code != 200 || err != nil || s.IntervalSeconds != 10 || s.WindowSeconds != 3600 {
			t.Fatalf("/api/series: %d %v %s", code, err, body)
		}
		if len(s.Tables[table]) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("no sample of %s: %s", table, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// get fetches u with the headers hdr ("Host" sets the Host header).
func get(t *testing.T, u string, hdr map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest("GET", u, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(body)
}

// TestConsoleEnvironment: OUTBOX_CONSOLE_* become the console's settings;
// --read-only keeps a set token guarding the reads; short tokens, bad
// host names and trace URLs that are not http(s) with {trace_id} are
// refused with the fix.
func TestConsoleEnvironment(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "outbox")
	env := func(kv ...string) Env {
		m := map[string]string{"OUTBOX_CONSOLE_TABLES": tbl.String()}
		for i := 0; i+1 < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return Env{getenv: func(k string) string { return m[k] }}
	}
	const tok = "0123456789abcdef0123"
	c, err := loadConsoleConfig(env("OUTBOX_CONSOLE_ADDR", "0.0.0.0:8080", "OUTBOX_CONSOLE_TOKEN", tok, "OUTBOX_CONSOLE_PUBLIC_READ", "true",
		"OUTBOX_CONSOLE_ALLOWED_HOSTS", " console.example.com, ops.example.com ", "OUTBOX_CONSOLE_TRUST_PROXY", "1"), nil, true)
	if err != nil || c.token != tok || !c.publicRead || !c.trustProxy || len(c.allowedHosts) != 2 || c.allowedHosts[1] != "ops.example.com" {
		t.Fatalf("config %+v, %v", c, err)
	}
	c, err = loadConsoleConfig(env("OUTBOX_CONSOLE_ADDR", "0.0.0.0:8080", "OUTBOX_CONSOLE_TOKEN", tok, "OUTBOX_CONSOLE_READ_ONLY", "true"), nil, false)
	if err != nil || c.token != tok || !c.readOnly || c.mode() != "read-only, reads need the token" {
		t.Fatalf("read-only with a token: %+v, %v", c, err)
	}
	if c, err = loadConsoleConfig(env("OUTBOX_CONSOLE_ADDR", "10.0.0.1:8080", "OUTBOX_CONSOLE_READ_TOKEN", tok), nil, false); err != nil || c.readToken != tok {
		t.Fatalf("a read token on an open address: %+v, %v", c, err)
	}
	for name, e := range map[string]Env{
		"short token":                  env("OUTBOX_CONSOLE_TOKEN", "x"),
		"short read token":             env("OUTBOX_CONSOLE_READ_TOKEN", "abc"),
		"host with scheme":             env("OUTBOX_CONSOLE_ALLOWED_HOSTS", "https://console.example.com"),
		"bad bool":                     env("OUTBOX_CONSOLE_PUBLIC_READ", "yes please"),
		"trace URL without {trace_id}": env("OUTBOX_CONSOLE_TRACE_URL", "https://tempo.example.com/trace/"),
		"trace URL not http":           env("OUTBOX_CONSOLE_TRACE_URL", "javascript:alert(1)//{trace_id}"),
	} {
		if _, err := loadConsoleConfig(e, nil, true); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	if c, err = loadConsoleConfig(env("OUTBOX_CONSOLE_TRACE_URL", " https://tempo.example.com/trace/{trace_id} "), nil, true); err != nil ||
		c.traceURL != "https://tempo.example.com/trace/{trace_id}" {
		t.Fatalf("trace URL: %+v, %v", c, err)
	}
	if _, err = loadConsoleConfig(env("OUTBOX_CONSOLE_TRACE_URL", "ftp://tempo.example.com/{trace_id}"), nil, true); !errors.Is(err, errUsage) ||
		!strings.Contains(err.Error(), "OUTBOX_CONSOLE_TRACE_URL") || !strings.Contains(err.Error(), "http or https") {
		t.Errorf("an ftp trace URL: %v", err)
	}
	_, err = loadConsoleConfig(env("OUTBOX_CONSOLE_TOKEN", "x"), nil, true)
	if err == nil || !strings.Contains(err.Error(), "at least 16 bytes") || !strings.Contains(err.Error(), "openssl rand") {
		t.Errorf("short token: %v", err)
	}
	_, err = loadConsoleConfig(env("OUTBOX_CONSOLE_ADDR", "0.0.0.0:8080"), nil, true)
	if err == nil || !strings.Contains(err.Error(), "--read-only") {
		t.Errorf("console without a token on an open address: %v", err)
	}
}

// TestReadOnlyConsoleTakesBothTokens: `outbox console --read-only`
// (OUTBOX_CONSOLE_READ_ONLY) with OUTBOX_CONSOLE_TOKEN and
// OUTBOX_CONSOLE_READ_TOKEN lets the holder of either read and neither
// act (issue 56 item 8: the console token was refused).
func TestReadOnlyConsoleTakesBothTokens(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	const tok, readTok = "console-token-0123456789", "read-token-0123456789ab"
	env := Env{getenv: func(k string) string {
		return map[string]string{"OUTBOX_CONSOLE_ADDR": "127.0.0.1:0", "OUTBOX_CONSOLE_TABLES": tbl.String(), "OUTBOX_CONSOLE_TOKEN": tok,
			"OUTBOX_CONSOLE_READ_TOKEN": readTok, "OUTBOX_CONSOLE_READ_ONLY": "true"}[k]
	}}
	c, err := loadConsoleConfig(env, nil, true)
	if err != nil {
		t.Fatal(err)
	}
	var stdout syncBuffer
	srv, err := serveConsole(pool, c, watermill.NopLogger{}, &stdout)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Shutdown(context.Background()) })
	m := regexp.MustCompile(`on (http://\S+) \((.*)\)`).FindStringSubmatch(stdout.String())
	if m == nil {
		t.Fatalf("no address printed: %s", stdout.String())
	}
	if m[2] != "read-only, reads need OUTBOX_CONSOLE_READ_TOKEN or OUTBOX_CONSOLE_TOKEN" {
		t.Errorf("start-up line says %q", m[2])
	}
	for _, k := range []string{tok, readTok} {
		if code, body := get(t, m[1]+"/", map[string]string{"Authorization": "Bearer " + k}); code != 200 || !strings.Contains(body, tbl.String()) {
			t.Errorf("overview with the token %s...: %d", k[:5], code)
		}
	}
	if code, _ := get(t, m[1]+"/", nil); code != 401 {
		t.Errorf("anonymous overview: %d", code)
	}
}
