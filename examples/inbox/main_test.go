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
	// Everything run opens, it closes: no goroutine may outlive it.
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

func TestInbox(t *testing.T) {
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run: %v\noutput so far:\n%s", err, buf.String())
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	want := []string{
		`^enqueued shop\.order\.placed\.v1 event_id=(` + uuidRE + `)$`,
		`^handled event_id=(` + uuidRE + `): invoice for order ` + uuidRE + `, billing\.invoice\.created\.v1 enqueued in the same transaction$`,
		`^delivered event_id=(` + uuidRE + `) twice more: handler runs=1, invoices=1, next events=1, inbox records=1$`,
		`^rejected event_id=(` + uuidRE + `) \(amount -5\): nacked; its invoices=0, next events=0, inbox records=0$`,
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	ids := make([]string, len(want))
	for i, pattern := range want {
		m := regexp.MustCompile(pattern).FindStringSubmatch(lines[i])
		if m == nil {
			t.Fatalf("line %d = %q, want it to match %s\nfull output:\n%s", i+1, lines[i], pattern, buf.String())
		}
		ids[i] = m[1]
	}
	if ids[1] != ids[0] || ids[2] != ids[0] {
		t.Errorf("handled %s and redelivered %s, want both to be the enqueued event %s", ids[1], ids[2], ids[0])
	}
	if ids[3] == ids[0] {
		t.Errorf("the rejected event has the accepted event's id %s", ids[0])
	}
}
