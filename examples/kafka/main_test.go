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
	// Everything run opens (Kafka cluster, clients, routers, pool), it closes.
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

const uuidRE = `[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}`

var (
	enqueuedRE    = regexp.MustCompile(`(?m)^enqueued org\.member\.invited\.v1 tenant=(Acme|Globex) event_id=(` + uuidRE + `) sequence=\d+$`)
	consumedRE    = regexp.MustCompile(`(?m)^consumed event_id=(` + uuidRE + `) tenant=(Acme|Globex) partition=(\d+) key=(` + uuidRE + `): (\w+) now pays for \d seat\(s\)$`)
	redeliveredRE = regexp.MustCompile(`(?m)^redelivering event_id=(` + uuidRE + `) \(`)
	duplicateRE   = regexp.MustCompile(`(?m)^duplicate ignored event_id=(` + uuidRE + `)$`)
)

func TestKafkaExample(t *testing.T) {
	// The test uses the in-process cluster; unset the variable so that a
	// developer's environment cannot point it at a real one.
	t.Setenv("OUTBOX_KAFKA_BROKERS", "")
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run: %v\noutput so far:\n%s", err, buf.String())
	}
	out := buf.String()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nfull output:\n%s", append(args, out)...)
	}
	if !strings.HasPrefix(out, "kafka: in-process cluster") {
		fail("the output does not say which Kafka it uses")
	}

	tenantOf := map[string]string{} // event_id -> tenant name
	for _, m := range enqueuedRE.FindAllStringSubmatch(out, -1) {
		tenantOf[m[2]] = m[1]
	}
	if len(tenantOf) != 5 {
		fail("enqueued %d distinct events, want 5", len(tenantOf))
	}

	consumed := consumedRE.FindAllStringSubmatch(out, -1)
	if len(consumed) != 5 {
		fail("consumed %d events, want 5", len(consumed))
	}
	keyOf := map[string]string{"Acme": "a0000000-0000-4000-8000-000000000001", "Globex": "b0000000-0000-4000-8000-000000000002"}
	partitionOf := map[string]string{}
	seen := map[string]bool{}
	for _, m := range consumed {
		id, tenant, partition, key := m[1], m[2], m[3], m[4]
		if seen[id] {
			fail("event %s consumed twice", id)
		}
		seen[id] = true
		if tenantOf[id] != tenant {
			fail("event %s consumed for tenant %s, enqueued for %q", id, tenant, tenantOf[id])
		}
		if key != keyOf[tenant] {
			fail("event %s has record key %s, want the tenant_id %s", id, key, keyOf[tenant])
		}
		if p, ok := partitionOf[tenant]; ok && p != partition {
			fail("tenant %s's events landed on partitions %s and %s; the tenant key must keep them on one", tenant, p, partition)
		}
		partitionOf[tenant] = partition
	}

	redelivered := redeliveredRE.FindStringSubmatch(out)
	duplicate := duplicateRE.FindAllStringSubmatch(out, -1)
	if redelivered == nil || len(duplicate) != 1 || duplicate[0][1] != redelivered[1] || !seen[redelivered[1]] {
		fail("want one consumed event redelivered and ignored as a duplicate")
	}
	if !strings.Contains(out, "\nseats: Acme=3 Globex=2 (5 invitations, 6 deliveries)\n") {
		fail("seat counts are wrong: the duplicate must not bill a seat")
	}
	if !strings.HasSuffix(out, "\nall 5 outbox rows published\n") {
		fail("the output does not end with the published summary")
	}
}
