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
	// Everything run opens (router, relay, in-process pub/sub, pool), it
	// closes.
	goleak.VerifyTestMain(m)
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
	handlersRE = regexp.MustCompile(`(?m)^router handlers: outbox_forwarder_(example_[0-9a-f]{12}\.org_outbox), search_indexer$`)
	enqueuedRE = regexp.MustCompile(`(?m)^enqueued org\.organization\.created\.v1 event_id=(` + uuidRE + `) \(organization "(\w+)"`)
	indexedRE  = regexp.MustCompile(`(?m)^indexed organization "(\w+)" event_id=(` + uuidRE + `) correlation_id=create-(\w+)$`)
	rejectedRE = regexp.MustCompile(`(?m)^rejected event_id=(` + uuidRE + `): invalid UUID length: 10$`)
	deadRE     = regexp.MustCompile(`(?m)^dead event_id=(` + uuidRE + `) attempts=1 last_error=(.*)$`)
)

func TestExistingRouter(t *testing.T) {
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run: %v\noutput so far:\n%s", err, buf.String())
	}
	out := buf.String()
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf(format+"\nfull output:\n%s", append(args, out)...)
	}

	h := handlersRE.FindStringSubmatch(out)
	if h == nil {
		fail("the router does not list the relay's handler next to the existing one")
	}
	table := h[1]

	idOf := map[string]string{} // organization -> event_id
	for _, m := range enqueuedRE.FindAllStringSubmatch(out, -1) {
		idOf[m[2]] = m[1]
	}
	if len(idOf) != 4 {
		fail("enqueued %d events, want 4", len(idOf))
	}
	indexed := indexedRE.FindAllStringSubmatch(out, -1)
	if len(indexed) != 3 {
		fail("indexed %d organizations, want 3", len(indexed))
	}
	for _, m := range indexed {
		name, id, corr := m[1], m[2], m[3]
		if idOf[name] != id {
			fail("organization %s indexed from event %s, enqueued as %s", name, id, idOf[name])
		}
		// The correlation_id metadata went through the headers column.
		if corr != strings.ToLower(name) {
			fail("organization %s carried correlation_id create-%s", name, corr)
		}
	}

	// The poison event: rejected once as permanent and dead at once, with
	// the consumer's error as last_error. That error only reaches the row
	// through CaptureError, which here is router-wide: the relay's handler
	// has no middleware of its own, and still records it.
	rejected := rejectedRE.FindAllStringSubmatch(out, -1)
	dead := deadRE.FindAllStringSubmatch(out, -1)
	if len(rejected) != 1 || len(dead) != 1 || rejected[0][1] != idOf["Broken"] || dead[0][1] != idOf["Broken"] {
		fail("want the Broken organization's event rejected once and dead")
	}
	if !strings.Contains(dead[0][2], "permanent: decode organization event: invalid UUID length: 10") {
		fail("last_error %q does not carry the consumer's error", dead[0][2])
	}
	if !strings.Contains(out, "\nrelayed through the existing router: 3 rows published, 3 organizations indexed, 1 dead\n") {
		fail("no summary line, or wrong counts")
	}

	labels := `table="` + table + `",topic="org.organization.created.v1"`
	for _, line := range []string{
		`metric outbox_enqueue_total{` + labels + `} 4`,
		`metric outbox_dispatch_total{result="success",` + labels + `} 3`,
		`metric outbox_dispatch_total{result="failure",` + labels + `} 1`,
		`metric outbox_dead_total{` + labels + `} 1`,
		// Watermill's router metrics measure both handlers.
		`metric handler_execution_time_seconds_count{handler_name="outbox_forwarder_` + table + `",success="true"} 3`,
		`metric handler_execution_time_seconds_count{handler_name="outbox_forwarder_` + table + `",success="false"} 1`,
		`metric handler_execution_time_seconds_count{handler_name="search_indexer",success="true"} 3`,
		`metric handler_execution_time_seconds_count{handler_name="search_indexer",success="false"} 1`,
	} {
		if !strings.Contains(out, "\n"+line+"\n") {
			fail("missing metric line %s", line)
		}
	}
}
