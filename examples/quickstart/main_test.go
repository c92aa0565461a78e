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

func TestQuickstart(t *testing.T) {
	var buf bytes.Buffer
	if err := run(context.Background(), &buf, testDatabaseURL()); err != nil {
		t.Fatalf("run: %v\noutput so far:\n%s", err, buf.String())
	}
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	want := []string{
		`^enqueued org\.organization\.created\.v1 event_id=(` + uuidRE + `) sequence=(\d+) \(committed with organization "Acme"\)$`,
		`^rolled back \(plan limit reached\): event_id=(` + uuidRE + `) outbox rows=0, organization rows=0$`,
		`^consumed org\.organization\.created\.v1 event_id=(` + uuidRE + `) attempts=1: onboarding tasks created for "Acme"$`,
		`^outbox row published: true$`,
		`^duplicate ignored event_id=(` + uuidRE + `)$`,
		`^onboarding tasks for "Acme": 2 \(two deliveries, one effect\)$`,
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), buf.String())
	}
	got := make([][]string, len(want))
	for i, pattern := range want {
		got[i] = regexp.MustCompile(pattern).FindStringSubmatch(lines[i])
		if got[i] == nil {
			t.Fatalf("line %d = %q, want it to match %s\nfull output:\n%s", i+1, lines[i], pattern, buf.String())
		}
	}
	committed, rolledBack, consumed, duplicate := got[0][1], got[1][1], got[2][1], got[4][1]
	if consumed != committed || duplicate != committed {
		t.Errorf("consumed %s and ignored the duplicate %s, want both to be the committed event %s", consumed, duplicate, committed)
	}
	if rolledBack == committed {
		t.Errorf("the rolled-back event has the committed event's id %s", committed)
	}
}

// TestRunFailsWithoutDatabase: an unreachable database is a clear error, not
// a hang.
func TestRunFailsWithoutDatabase(t *testing.T) {
	err := run(context.Background(), &bytes.Buffer{}, "postgres://postgres@127.0.0.1:1/test?sslmode=disable&connect_timeout=2")
	if err == nil || !strings.Contains(err.Error(), "PostgreSQL at 127.0.0.1:1 is unreachable") {
		t.Fatalf("run with no database: %v, want an error naming the address", err)
	}
}
