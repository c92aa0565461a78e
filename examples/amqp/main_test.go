package main

import (
	"bytes"
	"context"
	"os"
	"regexp"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
)

func TestMain(m *testing.M) {
	// Everything run opens (AMQP connections, routers, relay, pool), it
	// closes.
	goleak.VerifyTestMain(m)
}

// testDatabaseURL prefers TEST_DATABASE_URL (set by the Makefile), then
// OUTBOX_DATABASE_URL, then the local default. PostgreSQL and RabbitMQ that
// cannot be reached fail the test; it is never skipped.
func testDatabaseURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return plumbing.DatabaseURL()
}

const uuidRE = `[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`

var (
	enqueuedRE = regexp.MustCompile(`(?m)^enqueued (ex[0-9a-f]{8}\.(?:organization\.created|member\.invited)\.v1) tenant=(Acme|Globex) event_id=(` + uuidRE + `)$`)
	receivedRE = regexp.MustCompile(`(?m)^received (\S+) event_id=(` + uuidRE + `)\n  headers:\n((?:    \S+: .*\n)+)  payload: (.*)\n`)
	headerRE   = regexp.MustCompile(`(?m)^    (\S+): (.*)$`)
)

func TestAMQPExample(t *testing.T) {
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run (RabbitMQ at %s and PostgreSQL are required; `make up` starts them): %v\noutput so far:\n%s", redactURL(amqpURL()), err, buf.String())
	}
	out := buf.String()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nfull output:\n%s", append(args, out)...)
	}

	type sent struct{ topic, tenant string }
	want := map[string]sent{}
	for _, m := range enqueuedRE.FindAllStringSubmatch(out, -1) {
		want[m[3]] = sent{topic: m[1], tenant: m[2]}
	}
	if len(want) != 4 {
		fail("enqueued %d events, want 4", len(want))
	}
	tenantIDs := map[string]string{"Acme": "a0000000-0000-4000-8000-000000000001", "Globex": "b0000000-0000-4000-8000-000000000002"}
	// The consumer group reads a queue of its own per topic, never the
	// queue named after the topic, which on a shared broker may be another
	// application's.
	for _, s := range want {
		line := "consumer group header_printer reads " + s.topic + " from queue " + s.topic + "_header_printer\n"
		if !strings.Contains(out, line) {
			fail("missing %q: the consumer must read a queue named after its group", line)
		}
	}

	received := receivedRE.FindAllStringSubmatch(out, -1)
	if len(received) != 4 {
		fail("received %d events, want 4", len(received))
	}
	for _, m := range received {
		topic, id, payload := m[1], m[2], m[4]
		s, ok := want[id]
		if !ok {
			fail("received event %s, which was not enqueued (or twice)", id)
		}
		delete(want, id)
		if topic != s.topic {
			fail("event %s received on %s, enqueued on %s", id, topic, s.topic)
		}
		headers := map[string]string{}
		for _, h := range headerRE.FindAllStringSubmatch(m[3], -1) {
			headers[h[1]] = h[2]
		}
		for k, v := range map[string]string{
			"event_id": id, "tenant_id": tenantIDs[s.tenant], "topic": topic, "attempts": "1", "partition_key": id,
			"correlation_id": "signup-" + strings.ToLower(s.tenant),
		} {
			if headers[k] != v {
				fail("event %s: header %s = %q, want %q", id, k, headers[k], v)
			}
		}
		if !regexp.MustCompile(`^example_[0-9a-f]{12}\.org_outbox$`).MatchString(headers["table"]) || headers["sequence"] == "" {
			fail("event %s: table %q, sequence %q", id, headers["table"], headers["sequence"])
		}
		if !strings.HasPrefix(payload, "{") {
			fail("event %s: payload %q is not the business JSON", id, payload)
		}
	}
	if strings.Contains(out, "duplicate ignored") {
		fail("RabbitMQ redelivered an event in a clean run")
	}
	if !strings.HasSuffix(out, "received 4 events from RabbitMQ; all 4 outbox rows published\n") {
		fail("the output does not end with the summary line")
	}
}

// TestRunFailsWithoutRabbitMQ: an unreachable broker is a clear error, and
// run still cleans up (goleak checks the goroutines).
func TestRunFailsWithoutRabbitMQ(t *testing.T) {
	t.Setenv("OUTBOX_AMQP_URL", "amqp://guest:secret@127.0.0.1:1/")
	err := run(context.Background(), &bytes.Buffer{}, testDatabaseURL())
	if err == nil || !strings.Contains(err.Error(), "RabbitMQ at amqp://guest:xxxxx@127.0.0.1:1/ is unreachable") {
		t.Fatalf("run with no RabbitMQ: %v, want an error naming the redacted address", err)
	}
	if strings.Contains(err.Error(), "secret") {
		t.Errorf("the error leaks the password: %v", err)
	}
}
