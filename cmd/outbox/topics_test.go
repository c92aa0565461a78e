package main

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
)

// TestTopicsPauseResume: `outbox topics pause` pauses a topic (a dry run
// changes nothing, a second pause says it was paused already), `outbox
// topics` shows it PAUSED with its reason and `outbox stats` counts it;
// `outbox topics resume` resumes it; bad input exits 2 and a resume of a
// topic not paused exits 1, with nothing changed.
func TestTopicsPauseResume(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "cli_pause_outbox")
	rbEnqueue(t, pool, tbl, "org.a.v1", "org.a.v1", "org.b.v1")
	table := "--table=" + tbl.String()
	paused := func() []runbook.PausedTopic {
		t.Helper()
		l, err := runbook.New(pool, tbl).PausedTopics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	rbRun(t, rbEnv(), "topics", "pause", table, "--topic=org.a.v1", "--dry-run").expect(t, 0, []string{"Dry run", "nothing changed", "INSERT INTO"}, nil)
	if l := paused(); len(l) != 0 {
		t.Fatalf("a dry run paused %+v", l)
	}
	rbRun(t, rbEnv(), "topics", "pause", table, "--topic=org.a.v1", "--reason=consumer broken").
		expect(t, 0, []string{`Paused topic "org.a.v1"`, "outbox topics resume --table=" + tbl.String() + " --topic=org.a.v1"}, nil)
	rbRun(t, rbEnv(), "topics", "pause", table, "--topic=org.a.v1").expect(t, 0, []string{"paused already"}, nil)
	if l := paused(); len(l) != 1 || l[0].Topic != "org.a.v1" || l[0].Reason != "consumer broken" {
		t.Fatalf("paused topics: %+v", l)
	}

	r := rbRun(t, rbEnv(), "topics", table)
	r.expect(t, 0, []string{"PAUSED", "REASON", "consumer broken", "1 topic(s) paused"}, nil)
	for _, line := range strings.Split(r.stdout, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || (f[0] != "org.a.v1" && f[0] != "org.b.v1") {
			continue
		}
		if got := strings.Contains(line, "PAUSED since"); got != (f[0] == "org.a.v1") {
			t.Fatalf("topics list: line %q; only org.a.v1 is paused:\n%s", line, r.stdout)
		}
	}
	list := rbDecode[[]runbook.TopicBacklog](t, rbRun(t, rbEnv(), "topics", "list", table, "--json").stdout)
	if len(list) != 2 {
		t.Fatalf("topics --json: %+v", list)
	}
	rbRun(t, rbEnv(), "stats", table).expect(t, 0, []string{"paused topics", "outbox topics --table=" + tbl.String()}, nil)

	rbRun(t, rbEnv(), "topics", "pause", table, "--topic=*").expect(t, 2, nil, []string{`"*" is not a topic`, "nothing changed"})
	rbRun(t, rbEnv(), "topics", "pause", table).expect(t, 2, nil, []string{"--topic is required"})
	rbRun(t, rbEnv(), "topics", "pause", "--table=no such", "--topic=x").expect(t, 2, nil, []string{"--table"})
	rbRun(t, rbEnv(), "topics", "pause", "--table="+tbl.Schema()+".missing_outbox", "--topic=org.a.v1").expect(t, 1, nil, []string{"outbox table not found"})
	rbRun(t, rbEnv(), "topics", "frobnicate", table).expect(t, 2, nil, []string{"unknown subcommand"})

	rbRun(t, rbEnv(), "topics", "resume", table, "--topic=org.a.v1").expect(t, 0, []string{`Resumed topic "org.a.v1"`}, nil)
	if l := paused(); len(l) != 0 {
		t.Fatalf("still paused after resume: %+v", l)
	}
	rbRun(t, rbEnv(), "topics", "resume", table, "--topic=org.a.v1").expect(t, 1, nil, []string{"not paused", "nothing changed"})
	if r := rbRun(t, rbEnv(), "topics", table); strings.Contains(r.stdout, "PAUSED since") {
		t.Fatalf("topics list after resume:\n%s", r.stdout)
	}
}

// TestMigratePrintHasPausedTopics: `outbox migrate --print` creates the
// paused topics' table, and --down drops it (commented out).
func TestMigratePrintHasPausedTopics(t *testing.T) {
	t.Parallel()
	r := rbRun(t, map[string]string{}, "migrate", "--print", "--down", "--table=public.org_outbox")
	r.expect(t, 0, []string{`CREATE TABLE IF NOT EXISTS "public"."org_outbox_paused_topics"`, `-- DROP TABLE IF EXISTS "public"."org_outbox_paused_topics"`}, nil)
}
