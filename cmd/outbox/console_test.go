package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

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
	for deadline := time.Now().Add(10 * time.Second); m == nil; m = addr.FindStringSubmatch(stdout.String()) {
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
	if r.code != 2 || !strings.Contains(r.stderr, "not a loopback address") {
		t.Fatalf("open address without a token: exit %d, stderr %s", r.code, r.stderr)
	}
	env["OUTBOX_CONSOLE_ADDR"] = "127.0.0.1:0"
	env["OUTBOX_CONSOLE_TOKEN"] = "daemon-console-token"
	d := startDaemon(t, env)
	var m []string
	for deadline := time.Now().Add(10 * time.Second); m == nil; m = consoleAddrLog.FindStringSubmatch(d.stderr.String()) {
		if time.Now().After(deadline) {
			t.Fatalf("no console address logged; stderr %s", d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	res, err := http.Get("http://" + m[1] + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || !strings.Contains(string(body), tbl.String()) || !strings.Contains(string(body), `name="token"`) {
		t.Fatalf("overview: %d %s", res.StatusCode, body)
	}
	if strings.Contains(d.stderr.String(), "daemon-console-token") {
		t.Fatal("the daemon logged the console token")
	}
}
