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
	// Everything run opens (Kafka cluster, clients, relay, pool), it closes.
	goleak.VerifyTestMain(m,
		// Sarama's metrics library starts one process-wide meter ticker on
		// first use and never stops it; it is not a per-client goroutine.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// testDatabaseURL prefers TEST_DATABASE_URL (set by the Makefile), then
// OUTBOX_DATABASE_URL, then the local default. A database that cannot be
// reached fails the test; it is never skipped.
func testDatabaseURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return plumbing.DatabaseURL()
}

// block is one printed Kafka record.
type block struct {
	topic, key, keyNote, eventID, tenantID, tenantName, payload string
	headers                                                     map[string]string
}

var (
	blockRE  = regexp.MustCompile(`(?m)^event (\d) of 5\n  topic:     (\S+)\n  key:       (\S+) \(([^)]*)\)\n  partition: \d+\n  event_id:  (\S+)\n  tenant_id: (\S+) \((\w*)\)\n  headers:\n((?:    \S+: .*\n)+)  payload:   (.*)\n`)
	headerRE = regexp.MustCompile(`(?m)^    (\S+): (.*)$`)
	tableRE  = regexp.MustCompile(`(?m)^enqueued 5 events for 2 tenants into (example_[0-9a-f]{12}\.org_outbox)$`)
)

func TestDemo(t *testing.T) {
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run: %v\noutput so far:\n%s", err, buf.String())
	}
	out := buf.String()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nfull output:\n%s", append(args, out)...)
	}
	m := tableRE.FindStringSubmatch(out)
	if m == nil {
		fail("no line saying where the events were enqueued")
	}
	table := m[1]
	if !strings.Contains(out, "\nrelayed to Kafka at 127.0.0.1:") {
		fail("no line saying the events were relayed")
	}
	if !strings.HasSuffix(out, "forwarded 5 events from "+table+" to Kafka; all rows published\n") {
		fail("the output does not end with the summary line")
	}

	var blocks []block
	for _, s := range blockRE.FindAllStringSubmatch(out, -1) {
		b := block{topic: s[2], key: s[3], keyNote: s[4], eventID: s[5], tenantID: s[6], tenantName: s[7], payload: s[9], headers: map[string]string{}}
		for _, h := range headerRE.FindAllStringSubmatch(s[8], -1) {
			b.headers[h[1]] = h[2]
		}
		blocks = append(blocks, b)
	}
	if len(blocks) != 5 {
		fail("got %d event blocks, want 5", len(blocks))
	}
	perTopic := map[string]int{}
	perTenant := map[string]int{}
	seen := map[string]bool{}
	for i, b := range blocks {
		if seen[b.eventID] {
			fail("event %s printed twice", b.eventID)
		}
		seen[b.eventID] = true
		if b.key != b.eventID || b.keyNote != "the event_id, the default partition key" {
			fail("event %d: key %q (%s), want the event_id %s", i+1, b.key, b.keyNote, b.eventID)
		}
		want := map[string]string{
			"event_id": b.eventID, "tenant_id": b.tenantID, "topic": b.topic, "table": table,
			"attempts": "1", "partition_key": b.eventID, "sequence": string(rune('1' + i)),
			"correlation_id": "signup-" + strings.ToLower(b.tenantName),
		}
		for k, v := range want {
			if b.headers[k] != v {
				fail("event %d: header %s = %q, want %q", i+1, k, b.headers[k], v)
			}
		}
		if len(b.headers) != len(want) {
			fail("event %d: headers %v, want exactly %v", i+1, b.headers, want)
		}
		if !strings.HasPrefix(b.payload, "{") {
			fail("event %d: payload %q is not the business JSON", i+1, b.payload)
		}
		perTopic[b.topic]++
		perTenant[b.tenantName]++
	}
	if perTopic["org.organization.created.v1"] != 2 || perTopic["org.member.invited.v1"] != 3 {
		fail("events per topic %v, want 2 organization.created and 3 member.invited", perTopic)
	}
	if perTenant["Acme"] != 3 || perTenant["Globex"] != 2 {
		fail("events per tenant %v, want Acme 3 and Globex 2", perTenant)
	}
	if !strings.Contains(out, `"email": "alice@acme.example"`) {
		fail("the payload of alice's invitation is missing")
	}
}
