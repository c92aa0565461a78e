package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// lockedBuffer is a bytes.Buffer the daemon and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// daemon is `outbox relay` running in-process.
type daemon struct {
	stderr *lockedBuffer
	cancel context.CancelFunc
	exit   chan int
	addr   string // the health server's address
}

var healthAddrLog = regexp.MustCompile(`msg="Serving health probes"[^\n]* addr=(\S+)`)

// startDaemon runs `outbox relay` with env (plus a health server on a free
// port) until the test ends, and waits for the health server.
func startDaemon(t *testing.T, env map[string]string) *daemon {
	t.Helper()
	env["OUTBOX_HEALTH_ADDR"] = "127.0.0.1:0"
	ctx, cancel := context.WithCancel(context.Background())
	d := &daemon{stderr: &lockedBuffer{}, cancel: cancel, exit: make(chan int, 1)}
	go func() {
		d.exit <- run(ctx, []string{"relay"}, func(k string) string { return env[k] }, io.Discard, d.stderr)
	}()
	t.Cleanup(func() { d.stop(t) })
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if m := healthAddrLog.FindStringSubmatch(d.stderr.String()); m != nil {
			d.addr = m[1]
			return d
		}
		if time.Now().After(deadline) {
			t.Fatalf("no health server; stderr:\n%s", d.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// stop cancels the daemon and checks it exits 0; it is idempotent.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	if d.cancel == nil {
		return
	}
	d.cancel()
	d.cancel = nil
	select {
	case code := <-d.exit:
		if code != 0 {
			t.Errorf("daemon exit code %d; stderr:\n%s", code, d.stderr.String())
		}
	case <-time.After(2 * time.Minute):
		t.Errorf("daemon did not stop; stderr:\n%s", d.stderr.String())
	}
}

// get returns the status and body of GET path on the health server.
func (d *daemon) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := http.Get("http://" + d.addr + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// waitReady polls path until it answers code with a body satisfying ok.
func (d *daemon) wait(t *testing.T, path string, code int, ok func(string) bool) string {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		c, body := d.get(t, path)
		if c == code && ok(body) {
			return body
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET %s: %d %q, want %d; stderr:\n%s", path, c, body, code, d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func relayEnv(dbURL string, tbl schema.Table) map[string]string {
	return map[string]string{
		"OUTBOX_DATABASE_URL":        dbURL,
		"OUTBOX_RELAY_TABLES":        tbl.String(),
		"OUTBOX_BACKEND":             "amqp",
		"OUTBOX_AMQP_URL":            "amqp://guest:guest@127.0.0.1:5672/",
		"OUTBOX_RELAY_POLL_INTERVAL": "100ms",
		"OUTBOX_CLEANER_ENABLED":     "false",
	}
}

func oneLineBody(prefix string) func(string) bool {
	return func(body string) bool {
		return strings.HasPrefix(body, prefix) && strings.Count(body, "\n") == 1 && strings.HasSuffix(body, "\n")
	}
}

// TestHealthWhileStartUpWaitsForTheDatabase: with the database unreachable,
// /healthz answers 200 and /readyz 503 with the reason, for as long as
// start-up waits; a stop signal then ends the daemon cleanly.
func TestHealthWhileStartUpWaitsForTheDatabase(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	_ = ln.Close() // nothing listens there now
	d := startDaemon(t, relayEnv("postgres://relay:s3cret-pw@"+closed+"/test?sslmode=disable", schema.MustParseTable("public.org_outbox")))

	if code, body := d.get(t, livenessPath); code != http.StatusOK || body != "ok\n" {
		t.Fatalf("liveness %d %q", code, body)
	}
	body := d.wait(t, readinessPath, http.StatusServiceUnavailable, oneLineBody("starting: waiting for the database: "))
	if !strings.Contains(body, "connection refused") || strings.Contains(body, "s3cret-pw") {
		t.Fatalf("readiness body %q", body)
	}
	time.Sleep(300 * time.Millisecond) // still waiting, still not ready, still alive
	if code, _ := d.get(t, readinessPath); code != http.StatusServiceUnavailable {
		t.Fatalf("readiness %d while the database is unreachable", code)
	}
	if code, _ := d.get(t, livenessPath); code != http.StatusOK {
		t.Fatalf("liveness %d while start-up waits", code)
	}
	d.stop(t)
}

// tcpProxy forwards a local port to PostgreSQL; stop cuts every connection
// and refuses new ones, start listens again on the same port.
type tcpProxy struct {
	target string
	addr   string

	mu    sync.Mutex
	ln    net.Listener
	conns []net.Conn
	wg    sync.WaitGroup
}

func (p *tcpProxy) start(t *testing.T) {
	t.Helper()
	addr := p.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	p.mu.Lock()
	p.ln, p.addr = ln, ln.Addr().String()
	p.mu.Unlock()
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", p.target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			p.wg.Add(2)
			go func() { defer p.wg.Done(); _, _ = io.Copy(s, c); _ = s.Close() }()
			go func() { defer p.wg.Done(); _, _ = io.Copy(c, s); _ = c.Close() }()
		}
	}()
}

func (p *tcpProxy) stop() {
	p.mu.Lock()
	_ = p.ln.Close()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
	p.mu.Unlock()
	p.wg.Wait()
}

// TestHealthReadiness: a relay is ready as leader and another as standby;
// when the database stops answering one of them, its /readyz turns 503 with
// the reason (liveness stays 200), and it is ready again once the database
// is back.
func TestHealthReadiness(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	u, err := url.Parse(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	p := &tcpProxy{target: u.Host}
	p.start(t)
	defer p.stop()
	viaProxy := *u
	viaProxy.Host = p.addr

	a := startDaemon(t, relayEnv(viaProxy.String(), tbl))
	a.wait(t, readinessPath, http.StatusOK, oneLineBody("ready: "))
	b := startDaemon(t, relayEnv(testdb.URL(), tbl))
	// One leads the table, the other stands by; both are ready.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		ca, bodyA := a.get(t, readinessPath)
		cb, bodyB := b.get(t, readinessPath)
		leaderA := strings.Contains(bodyA, "leader of ["+tbl.String()+"]")
		leaderB := strings.Contains(bodyB, "leader of ["+tbl.String()+"]")
		if ca == http.StatusOK && cb == http.StatusOK && leaderA != leaderB &&
			strings.Contains(bodyA+bodyB, "standby for ["+tbl.String()+"]") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a: %d %q\nb: %d %q", ca, bodyA, cb, bodyB)
		}
		time.Sleep(50 * time.Millisecond)
	}

	p.stop() // a's database stops answering
	body := a.wait(t, readinessPath, http.StatusServiceUnavailable, oneLineBody("database does not answer: "))
	if code, _ := a.get(t, livenessPath); code != http.StatusOK {
		t.Fatalf("liveness %d while the database is away", code)
	}
	t.Logf("a while its database is away: %q", body)
	// b leads now.
	b.wait(t, readinessPath, http.StatusOK, func(s string) bool { return strings.Contains(s, "leader of ["+tbl.String()+"]") })

	p.start(t) // back on the same port
	a.wait(t, readinessPath, http.StatusOK, oneLineBody("ready: "))
	a.stop(t)
	b.stop(t)
}

// TestReadinessFollowsEveryTable: readiness waits for the router, names a
// table whose relay stopped while the others run, and reports the drain.
func TestReadinessFollowsEveryTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tables := []schema.Table{testdb.Table(t, "a_outbox"), testdb.Table(t, "b_outbox")}
	h := &health{relayEnabled: true, tables: len(tables)}
	h.setPool(pool)
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	gc := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
	defer gc.Close()
	var subs []*subscriber.Subscriber
	for _, tbl := range tables {
		s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: 100 * time.Millisecond}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		subs = append(subs, s)
		f, err := forwarder.New(s, gc, forwarder.Config{}, watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		h.addRelay(tbl, s, f.AddTo(r))
	}
	h.setRouter(r)
	ctx := context.Background()
	if ok, reason := h.ready(ctx); ok || reason != "starting: 2 of 2 table relays subscribed" {
		t.Fatalf("before the router runs: %v %q", ok, reason)
	}
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	waitReason := func(want func(bool, string) bool) string {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			ok, reason := h.ready(ctx)
			if want(ok, reason) {
				return reason
			}
			if time.Now().After(deadline) {
				t.Fatalf("readiness stuck at %v %q", ok, reason)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	want := fmt.Sprintf("ready: leader of [%s %s], standby for []", tables[0], tables[1])
	waitReason(func(ok bool, r string) bool { return ok && r == want })

	_ = subs[0].Close() // table a's relay stops; b's runs on
	waitReason(func(ok bool, r string) bool { return !ok && r == "relay of table "+tables[0].String()+" stopped" })

	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitReason(func(ok bool, r string) bool { return !ok && r == "stopping: the relay is draining" })
}
