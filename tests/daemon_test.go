package tests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// outboxBinary builds cmd/outbox once per test run.
func outboxBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "outbox-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "outbox")
		out, err := exec.Command("go", "build", "-o", binPath, "../cmd/outbox").CombinedOutput()
		if err != nil {
			buildErr = err
			t.Logf("%s", out)
		}
	})
	if buildErr != nil {
		t.Fatalf("build cmd/outbox: %v", buildErr)
	}
	return binPath
}

// syncBuffer is a bytes.Buffer safe for a child process and the test.
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

// TestDaemonRelaysAndDrainsOnSIGTERM starts `outbox relay` from the
// environment, checks that it relays to Kafka, then makes the broker slow
// (every produce answered 1.5s late), enqueues ten more events and sends
// SIGTERM while the broker holds a produce request of them: the daemon
// lets the messages in the forwarder's hands finish and acks them on their
// first attempt, gives back the leases of the rows it had claimed and not
// yet handed over (no attempt counted), leaves nothing leased and exits 0.
// A second daemon, the broker fast again, relays the rows given back: every
// event is on the broker exactly once.
func TestDaemonRelaysAndDrainsOnSIGTERM(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	cluster, err := kafkatest.Start(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	const topic = "org.organization.created.v1"
	want := enqueueTraced(t, pool, tbl, topic, 30)
	all := map[string]sent{}
	for id, s := range want {
		all[id] = s
	}
	env := append(os.Environ(),
		"OUTBOX_DATABASE_URL="+testdb.URL(),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_BACKEND=kafka",
		"OUTBOX_KAFKA_BROKERS="+strings.Join(cluster.Brokers(), ","),
		"OUTBOX_RELAY_POLL_INTERVAL=100ms",
		"OUTBOX_CLEANER_INTERVAL=1s",
		"PROMETHEUS_METRICS_ENABLED=true",
		"PROMETHEUS_METRICS_ADDR=127.0.0.1:0",
	)
	d := startDaemon(t, env)
	waitAllPublished(t, pool, tbl, len(want))

	sub, err := cluster.NewSubscriber("daemon-e2e", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	receiveAll(t, sub, topic, tbl, want, nil)

	// A slow broker, new events, and SIGTERM while the broker holds a
	// produce request of them (a message in the forwarder's hands: a
	// produce takes 1.5 s, so the wait sees it whatever the machine's
	// speed), every new row leased or published.
	slow := cluster.SlowProduce(1500 * time.Millisecond)
	more := enqueueTracedInOneTx(t, pool, tbl, topic, 10)
	for id, s := range more {
		all[id] = s
	}
	ctx := context.Background()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var leased, published int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE locked_at IS NOT NULL), count(*) FILTER (WHERE published_at IS NOT NULL) FROM `+tbl.Sanitize()).
			Scan(&leased, &published); err != nil {
			t.Fatal(err)
		}
		if leased > 0 && leased+published-30 == len(more) && slow.Held() > 0 {
			t.Logf("SIGTERM with %d of the %d new events leased, a produce request held by the broker", leased, len(more))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d new events leased, %d published, %d produce requests held by the broker; stderr:\n%s",
				leased, len(more), published-30, slow.Held(), d.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	var signalled time.Time // the database's clock, as published_at
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&signalled); err != nil {
		t.Fatal(err)
	}
	d.stop(t)
	// Each new row: published on its first attempt, or given back (leased,
	// not yet handed to the forwarder: no attempt counted); none leased;
	// the messages in flight at SIGTERM finished after it.
	var finished, before, givenBack int
	for id := range more {
		var (
			publishedAt *time.Time
			locked      bool
			attempts    int
			lastError   *string
		)
		if err := pool.QueryRow(ctx, `SELECT published_at, locked_at IS NOT NULL, attempts, last_error FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).
			Scan(&publishedAt, &locked, &attempts, &lastError); err != nil {
			t.Fatal(err)
		}
		switch {
		case locked || lastError != nil:
			t.Fatalf("event %s after SIGTERM: locked %v, last_error %v; want acked or given back\nstderr:\n%s", id, locked, lastError, d.stderr.String())
		case publishedAt != nil && attempts != 1:
			t.Fatalf("event %s after SIGTERM: published after %d attempts; want acked on its first\nstderr:\n%s", id, attempts, d.stderr.String())
		case publishedAt == nil && attempts != 0:
			t.Fatalf("event %s after SIGTERM: given back with %d attempts counted; want 0 (it was never handed over)\nstderr:\n%s", id, attempts, d.stderr.String())
		case publishedAt == nil:
			givenBack++
		case publishedAt.After(signalled):
			finished++
		default:
			before++
		}
	}
	t.Logf("after SIGTERM: %d events finished after it, %d published before it, %d given back", finished, before, givenBack)
	if finished == 0 {
		t.Fatalf("no event in flight at SIGTERM was finished after it (%d published before, %d given back)\nstderr:\n%s", before, givenBack, d.stderr.String())
	}
	if !strings.Contains(d.stdout.String(), "relaying 1 table(s) to kafka") || !strings.Contains(d.stdout.String(), "relay stopped") {
		t.Fatalf("daemon stdout:\n%s", d.stdout.String())
	}
	if givenBack > 0 {
		slow.Fast()
		d2 := startDaemon(t, env)
		waitAllPublished(t, pool, tbl, len(all))
		d2.stop(t)
	}
	// Every event on the broker exactly once, each with attempts = 1.
	again, err := cluster.NewSubscriber("daemon-e2e-after-sigterm", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	receiveAll(t, again, topic, tbl, all, nil)
}

// daemon is an `outbox relay` process started by a test.
type daemon struct {
	cmd            *exec.Cmd
	exited         chan error
	stdout, stderr *syncBuffer
}

// startDaemon starts `outbox relay` with env; it is killed when the test
// ends unless stop ended it.
func startDaemon(t *testing.T, env []string) *daemon {
	t.Helper()
	d := &daemon{cmd: exec.Command(outboxBinary(t), "relay"), exited: make(chan error, 1), stdout: &syncBuffer{}, stderr: &syncBuffer{}}
	d.cmd.Env = env
	d.cmd.Stdout, d.cmd.Stderr = d.stdout, d.stderr
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { d.exited <- d.cmd.Wait() }()
	t.Cleanup(func() {
		if d.cmd.ProcessState == nil {
			_ = d.cmd.Process.Kill()
			if err := <-d.exited; err != nil {
				t.Logf("daemon killed at the end of the test: %v", err)
			}
		}
	})
	return d
}

// stop sends SIGTERM once the daemon relays (before, its signal handler
// may not be installed yet) and waits for a clean exit.
func (d *daemon) stop(t *testing.T) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Minute); !strings.Contains(d.stdout.String(), "relaying 1 table(s)"); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("daemon not relaying within 2 minutes; stdout:\n%s\nstderr:\n%s", d.stdout.String(), d.stderr.String())
		}
	}
	signalled := time.Now()
	if err := d.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-d.exited:
		if err != nil {
			t.Fatalf("daemon exit: %v\nstderr:\n%s", err, d.stderr.String())
		}
	case <-time.After(2 * time.Minute):
		t.Fatalf("daemon did not exit within 2 minutes of SIGTERM; stderr:\n%s", d.stderr.String())
	}
	t.Logf("daemon exited %s after SIGTERM", time.Since(signalled).Round(time.Millisecond))
}

// TestDaemonRefusesBadEnvironment: a bad setting stops the daemon at start
// with the variable's name, exit code 2, and no secret echoed.
func TestDaemonRefusesBadEnvironment(t *testing.T) {
	t.Parallel()
	base := map[string]string{
		"OUTBOX_DATABASE_URL":  "postgres://relay:s3cret-pw@127.0.0.1:5432/test",
		"OUTBOX_RELAY_TABLES":  "public.org_outbox",
		"OUTBOX_BACKEND":       "kafka",
		"OUTBOX_KAFKA_BROKERS": "127.0.0.1:9092",
	}
	cases := []struct {
		set  map[string]string
		want string
	}{
		{map[string]string{"OUTBOX_RELAY_BATCH_SIZE": "lots"}, "OUTBOX_RELAY_BATCH_SIZE"},
		{map[string]string{"OUTBOX_RELAY_POLL_INTERVAL": "soon"}, "OUTBOX_RELAY_POLL_INTERVAL"},
		{map[string]string{"OUTBOX_RELAY_SINGLE_ACTIVE": "maybe"}, "OUTBOX_RELAY_SINGLE_ACTIVE"},
		{map[string]string{"OUTBOX_RELAY_ORDERED": "sometimes"}, "OUTBOX_RELAY_ORDERED"},
		{map[string]string{"OUTBOX_RELAY_LEADER_TIMEOUT": "2s"}, "OUTBOX_RELAY_LEADER_TIMEOUT=2s is below 3s"},
		{map[string]string{"OUTBOX_RELAY_LEADER_TIMEOUT": "soon"}, "OUTBOX_RELAY_LEADER_TIMEOUT"},
		{map[string]string{"OUTBOX_RELAY_TABLES": `public.org_outbox; DROP TABLE x`}, "OUTBOX_RELAY_TABLES"},
		{map[string]string{"OUTBOX_RELAY_TABLES": ""}, "OUTBOX_RELAY_TABLES is not set"},
		{map[string]string{"OUTBOX_BACKEND": "carrier-pigeon"}, "OUTBOX_BACKEND"},
		{map[string]string{"OUTBOX_KAFKA_BROKERS": ""}, "OUTBOX_KAFKA_BROKERS"},
		{map[string]string{"OUTBOX_DATABASE_URL": ""}, "OUTBOX_DATABASE_URL is not set"},
		{map[string]string{"OUTBOX_CLEANER_RETENTION": "-1h"}, "OUTBOX_CLEANER_RETENTION"},
		{map[string]string{"PROMETHEUS_METRICS_PATH": "metrics"}, "PROMETHEUS_METRICS_PATH"},
	}
	bin := outboxBinary(t)
	for _, c := range cases {
		env := os.Environ()
		for k, v := range base {
			if _, override := c.set[k]; !override {
				env = append(env, k+"="+v)
			}
		}
		for k, v := range c.set {
			env = append(env, k+"="+v)
		}
		cmd := exec.Command(bin, "relay")
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		var exitErr *exec.ExitError
		if err == nil || !errors.As(err, &exitErr) || exitErr.ExitCode() != 2 {
			t.Errorf("%v: exit %v, want code 2; output:\n%s", c.set, err, out)
			continue
		}
		if !strings.Contains(string(out), c.want) {
			t.Errorf("%v: output does not name %s:\n%s", c.set, c.want, out)
		}
		if strings.Contains(string(out), "s3cret-pw") {
			t.Errorf("%v: output leaks the database password:\n%s", c.set, out)
		}
	}
}

// TestDaemonExportsRelaySpansOverOTLP: with OTEL_EXPORTER_OTLP_ENDPOINT set,
// `outbox relay` exports one span per relayed message over OTLP/HTTP, in the
// trace of the row's traceparent and child of its span, to a collector
// stand-in served by the test.
func TestDaemonExportsRelaySpansOverOTLP(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	const topic = "org.organization.created.v1"
	want := enqueueTraced(t, pool, tbl, topic, 3)

	type export struct {
		path string
		req  *coltracepb.ExportTraceServiceRequest
	}
	exports := make(chan export, 100)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		req := &coltracepb.ExportTraceServiceRequest{}
		if err == nil {
			err = proto.Unmarshal(body, req)
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		exports <- export{r.URL.Path, req}
		w.Header().Set("Content-Type", "application/x-protobuf")
		b, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		_, _ = w.Write(b)
	}))
	defer collector.Close()

	var stdout, stderr syncBuffer
	cmd := exec.Command(outboxBinary(t), "relay")
	cmd.Env = append(os.Environ(),
		"OUTBOX_DATABASE_URL="+testdb.URL(),
		"OUTBOX_RELAY_TABLES="+tbl.String(),
		"OUTBOX_BACKEND=amqp", "OUTBOX_AMQP_URL=amqp://guest:guest@127.0.0.1:5672/",
		"OUTBOX_RELAY_POLL_INTERVAL=100ms",
		"OUTBOX_CLEANER_ENABLED=false",
		"OTEL_EXPORTER_OTLP_ENDPOINT="+collector.URL,
		"OTEL_BSP_SCHEDULE_DELAY=100",
		"OTEL_SERVICE_NAME=relay-under-test",
	)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()

	parents := map[string]string{} // event_id -> the row's traceparent
	for id, s := range want {
		parents[id] = s.parent
	}
	deadline := time.After(30 * time.Second)
	for len(parents) > 0 {
		select {
		case e := <-exports:
			if e.path != "/v1/traces" {
				t.Fatalf("export to %s, want /v1/traces", e.path)
			}
			for _, rs := range e.req.GetResourceSpans() {
				service := ""
				for _, kv := range rs.GetResource().GetAttributes() {
					if kv.GetKey() == "service.name" {
						service = kv.GetValue().GetStringValue()
					}
				}
				for _, ss := range rs.GetScopeSpans() {
					for _, sp := range ss.GetSpans() {
						id := ""
						for _, kv := range sp.GetAttributes() {
							if kv.GetKey() == "messaging.message.id" {
								id = kv.GetValue().GetStringValue()
							}
						}
						parent, ok := parents[id]
						if !ok {
							t.Fatalf("unexpected span %q (message id %q)", sp.GetName(), id)
						}
						got := fmt.Sprintf("00-%x-%x-01", sp.GetTraceId(), sp.GetParentSpanId())
						if got != parent || sp.GetName() != "publish "+topic || service != "relay-under-test" {
							t.Fatalf("span %q of service %q: trace/parent %s, want %s", sp.GetName(), service, got, parent)
						}
						delete(parents, id)
					}
				}
			}
		case <-deadline:
			t.Fatalf("%d relay spans not exported; stderr:\n%s", len(parents), stderr.String())
		}
	}
}
