package main

import (
	"bytes"
	"context"
	"encoding/json"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// The runbook tests' fixtures; names start with rb to stay clear of the
// package's other tests.

const (
	rbTopicA = "org.cli.alpha.v1"
	rbTopicB = "org.cli.beta.v1"
)

var rbTenant = uuid.MustParse("3f0c2a8e-9d4b-4c1a-8e7f-5a6b7c8d9e01")

type rbResult struct {
	code           int
	stdout, stderr string
}

// rbRun runs the outbox command line with env as the whole environment.
func rbRun(t *testing.T, env map[string]string, args ...string) rbResult {
	t.Helper()
	var stdout, stderr bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	code := run(ctx, args, func(k string) string { return env[k] }, &stdout, &stderr)
	return rbResult{code, stdout.String(), stderr.String()}
}

func rbEnv(extra ...string) map[string]string {
	env := map[string]string{"OUTBOX_DATABASE_URL": testdb.URL()}
	for i := 0; i+1 < len(extra); i += 2 {
		env[extra[i]] = extra[i+1]
	}
	return env
}

func (r rbResult) expect(t *testing.T, code int, stdout, stderr []string) {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit code %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, code, r.stdout, r.stderr)
	}
	for _, s := range stdout {
		if !strings.Contains(r.stdout, s) {
			t.Fatalf("stdout lacks %q:\n%s\nstderr:\n%s", s, r.stdout, r.stderr)
		}
	}
	for _, s := range stderr {
		if !strings.Contains(r.stderr, s) {
			t.Fatalf("stderr lacks %q:\n%s\nstdout:\n%s", s, r.stderr, r.stdout)
		}
	}
}

func rbEnqueue(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topics ...string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	msgs := make([]publisher.Message, len(topics))
	ids := make([]uuid.UUID, len(topics))
	for i, topic := range topics {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: rbTenant, Topic: topic, EventID: ids[i], Payload: json.RawMessage(`{"secret":"payload-must-not-print"}`)}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func rbExec(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), strings.ReplaceAll(sql, "%s", tbl.Sanitize()), args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func rbMarkDead(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, lastError string, ids ...uuid.UUID) {
	t.Helper()
	for _, id := range ids {
		rbExec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = $2, locked_at = NULL, dead_at = now(), available_at = 'infinity' WHERE event_id = $1`, id, lastError)
	}
}

// rbSnapshot returns every row's mutable state, keyed by event_id.
func rbSnapshot(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) map[uuid.UUID]string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT event_id::text, attempts::text || '|' || available_at::text || '|' ||
		COALESCE(locked_at::text, '-') || '|' || COALESCE(published_at::text, '-') || '|' || COALESCE(last_error, '-') FROM `+tbl.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[uuid.UUID]string{}
	for rows.Next() {
		var id, st string
		if err := rows.Scan(&id, &st); err != nil {
			t.Fatal(err)
		}
		out[uuid.MustParse(id)] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func rbAttempts(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) (attempts int, lastError *string) {
	t.Helper()
	err := pool.QueryRow(context.Background(), `SELECT attempts, last_error FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&attempts, &lastError)
	if err != nil {
		t.Fatal(err)
	}
	return attempts, lastError
}

func rbDecode[T any](t *testing.T, s string) T {
	t.Helper()
	var v T
	dec := json.NewDecoder(strings.NewReader(s))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("output is not the expected JSON: %v\n%s", err, s)
	}
	return v
}

func TestRunbookCommandsListed(t *testing.T) {
	t.Parallel()
	r := rbRun(t, nil, "help")
	r.expect(t, 0, []string{"backlog", "dead", "stats"}, nil)
}

func TestRunbookUsageErrors(t *testing.T) {
	t.Parallel()
	tbl := "public.some_outbox"
	cases := []struct {
		env  map[string]string
		args []string
		says string
	}{
		{rbEnv(), []string{"stats"}, "--table is required"},
		{rbEnv(), []string{"stats", "--table=Bad-Name"}, "--table"},
		{rbEnv(), []string{"backlog", "--table=" + tbl, "--limit=0"}, "--limit=0"},
		{rbEnv(), []string{"backlog", "--table=" + tbl, "extra"}, "unexpected argument"},
		{rbEnv(), []string{"backlog", "--table=" + tbl, "--no-such-flag"}, "no-such-flag"},
		{map[string]string{}, []string{"stats", "--table=" + tbl}, "OUTBOX_DATABASE_URL is not set"},
		{rbEnv(), []string{"stats", "--table=" + tbl, "--max-attempts=3"}, "max-attempts"},
		{rbEnv(), []string{"dead"}, "needs a subcommand"},
		{rbEnv(), []string{"dead", "purge"}, `unknown subcommand "purge"`},
		{rbEnv(), []string{"dead", "list", "--table=" + tbl, "--tenant=nope"}, "--tenant"},
		{rbEnv(), []string{"dead", "replay", "--table=" + tbl, "--confirm"}, "--topic=X"},
		{rbEnv(), []string{"dead", "replay", "--table=" + tbl, "--topic=a.b.c.v1", "--all"}, "exclude each other"},
		{rbEnv(), []string{"dead", "replay", "--table=" + tbl, "--event-id=" + uuid.NewString(), "--topic=a.b.c.v1"}, "drop --topic"},
		{rbEnv(), []string{"dead", "replay", "--table=" + tbl, "--event-id=42"}, "--event-id"},
		{rbEnv(), []string{"dead", "replay", "--table=" + tbl, "--all", "--limit=-1"}, "--limit=-1"},
	}
	for _, c := range cases {
		r := rbRun(t, c.env, c.args...)
		if r.code != 2 || !strings.Contains(r.stderr, c.says) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 saying %q", c.args, r.code, r.stderr, c.says)
		}
	}
	r := rbRun(t, rbEnv(), "stats", "--help")
	r.expect(t, 0, []string{"-table", "-json", "OUTBOX_DATABASE_URL"}, nil)
	r = rbRun(t, rbEnv(), "dead", "replay", "--help")
	r.expect(t, 0, []string{"-confirm", "-force", "-dry-run", "-event-id", "-all", "OUTBOX_ENVIRONMENT"}, nil)
}

func TestRunbookStatsCommand(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_stats_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA, rbTopicA, rbTopicB)
	rbMarkDead(t, pool, tbl, "boom", ids[0], ids[1])
	rbExec(t, pool, tbl, `UPDATE %s SET attempts = 1, locked_at = now() WHERE event_id = $1`, ids[2])
	rbExec(t, pool, tbl, `UPDATE %s SET published_at = now() WHERE event_id = $1`, ids[3])
	rbExec(t, pool, tbl, `UPDATE %s SET created_at = now() - interval '90 seconds' WHERE event_id = $1`, ids[4])

	r := rbRun(t, rbEnv(), "stats", "--table="+tbl.String())
	r.expect(t, 0, []string{"table                " + tbl.String(), "pending              2", "locked               1",
		"mode                 default", "dead                 2", "outbox dead list", "oldest pending age   1m30s", "published last hour  1"}, nil)

	r = rbRun(t, rbEnv(), "stats", "--table="+tbl.String(), "--json")
	r.expect(t, 0, nil, nil)
	s := rbDecode[runbook.TableStats](t, r.stdout)
	if s.Table != tbl.String() || s.Pending != 2 || s.Locked != 1 || s.Dead != 2 || s.PublishedLastHour != 1 ||
		s.OldestPendingAgeSeconds < 90 || s.OldestPendingAgeSeconds > 150 {
		t.Fatalf("stats JSON: %+v", s)
	}
	// Dead is dead_at: the relay's max attempts plays no part.
	r = rbRun(t, rbEnv("OUTBOX_RELAY_MAX_ATTEMPTS", "1"), "stats", "--table="+tbl.String(), "--json")
	if s := rbDecode[runbook.TableStats](t, r.stdout); s.Dead != 2 || s.Pending != 2 {
		t.Fatalf("stats with OUTBOX_RELAY_MAX_ATTEMPTS=1: %+v", s)
	}

	missing := tbl.Schema() + ".missing_outbox"
	r = rbRun(t, rbEnv(), "stats", "--table="+missing)
	r.expect(t, 1, nil, []string{"outbox table not found", "outbox migrate --table=" + missing})
	r = rbRun(t, rbEnv("OUTBOX_DATABASE_URL", "postgres://nobody:hunter2@127.0.0.1:1/none?connect_timeout=2"), "stats", "--table="+tbl.String())
	r.expect(t, 1, nil, []string{"connect to OUTBOX_DATABASE_URL"})
	if strings.Contains(r.stderr, "hunter2") {
		t.Fatalf("password printed: %s", r.stderr)
	}
}

type rbRowsJSON struct {
	Table     string        `json:"table"`
	Rows      []runbook.Row `json:"rows"`
	NextAfter int64         `json:"next_after"`
}

func rbIDs(rows []runbook.Row) []uuid.UUID {
	out := []uuid.UUID{}
	for _, r := range rows {
		out = append(out, r.EventID)
	}
	return out
}

func TestRunbookBacklogCommand(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_backlog_outbox")
	r := rbRun(t, rbEnv(), "backlog", "--table="+tbl.String())
	r.expect(t, 0, []string{"No pending rows in " + tbl.String()}, nil)

	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicB, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "boom", ids[0])
	rbExec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = E'HTTP 503\nfrom broker', available_at = now() - interval '1 hour' WHERE event_id = $1`, ids[3])

	r = rbRun(t, rbEnv(), "backlog", "--table="+tbl.String())
	r.expect(t, 0, []string{"SEQUENCE", "EVENT_ID", "LAST_ERROR", "HTTP 503 from broker", "3 pending rows of " + tbl.String()}, nil)
	if strings.Contains(r.stdout, ids[0].String()) || strings.Contains(r.stdout, "payload-must-not-print") {
		t.Fatalf("backlog shows a dead row or the payload:\n%s", r.stdout)
	}
	// Claim order: the retry due an hour ago first, then by sequence.
	p3, p1, p2 := strings.Index(r.stdout, ids[3].String()), strings.Index(r.stdout, ids[1].String()), strings.Index(r.stdout, ids[2].String())
	if p3 < 0 || p1 < 0 || p2 < 0 || p3 > p1 || p1 > p2 {
		t.Fatalf("rows not in claim order:\n%s", r.stdout)
	}

	r = rbRun(t, rbEnv(), "backlog", "--table="+tbl.String(), "--limit=2")
	r.expect(t, 0, []string{"More may exist: raise --limit"}, nil)

	r = rbRun(t, rbEnv(), "backlog", "--table="+tbl.String(), "--json", "--topic="+rbTopicA)
	r.expect(t, 0, nil, nil)
	out := rbDecode[rbRowsJSON](t, r.stdout)
	if got, want := rbIDs(out.Rows), []uuid.UUID{ids[3], ids[2]}; out.Table != tbl.String() || !reflect.DeepEqual(got, want) {
		t.Fatalf("backlog JSON: %+v, want rows %v", out, want)
	}
	if le := out.Rows[0].LastError; le == nil || *le != "HTTP 503\nfrom broker" || out.Rows[0].Attempts != 2 {
		t.Fatalf("backlog JSON row: %+v", out.Rows[0])
	}
}

func TestRunbookDeadListCommand(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_dead_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicB, rbTopicA, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "publish: Timeout after 30s", ids[0], ids[2])
	rbMarkDead(t, pool, tbl, "no route for topic", ids[1], ids[3])

	r := rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String())
	r.expect(t, 0, []string{ids[0].String(), ids[1].String(), ids[2].String(), ids[3].String(), "4 dead rows of " + tbl.String(),
		"publish: Timeout after 30s", "outbox dead replay --table=" + tbl.String() + " --event-id=<event_id> --confirm"}, nil)
	if strings.Contains(r.stdout, ids[4].String()) {
		t.Fatalf("a pending row is listed as dead:\n%s", r.stdout)
	}

	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--topic="+rbTopicA, "--error=timeout", "--json")
	r.expect(t, 0, nil, nil)
	out := rbDecode[rbRowsJSON](t, r.stdout)
	if got, want := rbIDs(out.Rows), []uuid.UUID{ids[0], ids[2]}; !reflect.DeepEqual(got, want) || out.NextAfter != 0 {
		t.Fatalf("dead list JSON: %+v, want %v", out, want)
	}

	// Paging: a full page says where the next one starts.
	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--limit=3", "--json")
	page := rbDecode[rbRowsJSON](t, r.stdout)
	if len(page.Rows) != 3 || page.NextAfter != page.Rows[2].Sequence {
		t.Fatalf("page 1: %+v", page)
	}
	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--limit=3", "--after="+strconv.FormatInt(page.NextAfter, 10))
	r.expect(t, 0, []string{ids[3].String(), "1 dead row of "}, nil)
	if strings.Contains(r.stdout, "Next page") {
		t.Fatalf("a partial page offers a next page:\n%s", r.stdout)
	}
	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--limit=3")
	r.expect(t, 0, []string{"Next page: add --after=" + strconv.FormatInt(page.NextAfter, 10)}, nil)

	r = rbRun(t, rbEnv(), "dead", "list", "--table="+tbl.String(), "--tenant="+uuid.NewString())
	r.expect(t, 0, []string{"No dead rows in " + tbl.String() + " match"}, nil)
}

func TestRunbookReplayOneCommand(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_replay_one_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA)
	dead, pending, failed := ids[0], ids[1], ids[2]
	rbMarkDead(t, pool, tbl, "HTTP 503", dead)
	rbExec(t, pool, tbl, `UPDATE %s SET attempts = 4, last_error = 'timeout', available_at = now() + interval '10 minutes' WHERE event_id = $1`, failed)
	before := rbSnapshot(t, pool, tbl)
	args := []string{"dead", "replay", "--table=" + tbl.String(), "--event-id=" + dead.String()}

	// Without --confirm: the preview, exit 2, nothing changed.
	r := rbRun(t, rbEnv("OUTBOX_ENVIRONMENT", "development"), args...)
	r.expect(t, 2, []string{"Replay one event of " + tbl.String(), dead.String(), "dead (25 attempts, dead since ", "HTTP 503",
		"Statement:", "UPDATE " + tbl.Sanitize() + " SET dead_at = NULL, skipped_at = NULL, attempts = 0", "-- $1 = '" + dead.String() + "'", "Rows it changes: 1"},
		[]string{"nothing changed", "add --confirm"})
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("the preview changed rows")
	}
	// --dry-run: the preview, exit 0, nothing changed.
	r = rbRun(t, rbEnv(), append(args, "--dry-run", "--json")...)
	r.expect(t, 0, nil, nil)
	rep := rbDecode[replayReport](t, r.stdout)
	if rep.Rows != 1 || rep.Changed != 0 || rep.Applied || !rep.DryRun || rep.EventID != dead.String() || rep.Row == nil || rep.Row.Attempts != 25 {
		t.Fatalf("dry run report: %+v", rep)
	}
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("the dry run changed rows")
	}
	// A row neither dead nor failed is refused, even with --confirm.
	r = rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--event-id="+pending.String(), "--confirm")
	r.expect(t, 1, nil, []string{"cannot replay event " + pending.String(), "neither dead nor failed", "nothing changed"})
	r = rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--event-id="+uuid.NewString(), "--confirm")
	r.expect(t, 1, nil, []string{"no row has this event_id"})
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("a refused replay changed rows")
	}

	// With --confirm the dead row is reset, and only it; no --force is needed for one event.
	r = rbRun(t, rbEnv(), append(args, "--confirm")...)
	r.expect(t, 0, []string{"Rows it changes: 1", "Replayed 1 row: event " + dead.String() + " of " + tbl.String()}, nil)
	if a, le := rbAttempts(t, pool, tbl, dead); a != 0 || le != nil {
		t.Fatalf("after replay: attempts %d, last_error %v", a, le)
	}
	after := rbSnapshot(t, pool, tbl)
	if after[pending] != before[pending] || after[failed] != before[failed] {
		t.Fatal("replaying one event changed other rows")
	}
	// A failed row still retrying can be replayed too; JSON reports it.
	r = rbRun(t, rbEnv(), "dead", "replay", "--table="+tbl.String(), "--event-id="+failed.String(), "--confirm", "--json")
	r.expect(t, 0, nil, nil)
	if rep := rbDecode[replayReport](t, r.stdout); !rep.Applied || rep.Changed != 1 || rep.Rows != 1 {
		t.Fatalf("replay report: %+v", rep)
	}
	if a, le := rbAttempts(t, pool, tbl, failed); a != 0 || le != nil {
		t.Fatalf("failed row after replay: attempts %d, last_error %v", a, le)
	}
	// Replayed rows are pending again: a second replay is refused.
	r = rbRun(t, rbEnv(), append(args, "--confirm")...)
	r.expect(t, 1, nil, []string{"neither dead nor failed"})
}

func TestRunbookReplayBulkCommand(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_replay_bulk_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA, rbTopicB, rbTopicA)
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[0], ids[1], ids[3])
	rbMarkDead(t, pool, tbl, "no route", ids[2])
	dev := rbEnv("OUTBOX_ENVIRONMENT", "development")
	args := []string{"dead", "replay", "--table=" + tbl.String(), "--topic=" + rbTopicA, "--error=TIMEOUT"}
	before := rbSnapshot(t, pool, tbl)

	// Preview without --confirm: the statement and the count, exit 2.
	r := rbRun(t, dev, args...)
	r.expect(t, 2, []string{"Replay dead rows of " + tbl.String(), `topic = "` + rbTopicA + `"`, `last_error contains "TIMEOUT"`,
		"WITH target AS", "FOR UPDATE", "UPDATE " + tbl.Sanitize(), "-- $2 = '" + rbTopicA + "'", "-- $3 = 'TIMEOUT'", "Rows it changes: 2"},
		[]string{"nothing changed", "add --confirm to replay 2 rows of " + tbl.String()})
	if strings.Contains(r.stderr, "--force") {
		t.Fatalf("a development database asked for --force: %s", r.stderr)
	}
	// The dry run's count is what the real run changes.
	r = rbRun(t, dev, append(args, "--dry-run", "--json")...)
	r.expect(t, 0, nil, nil)
	dry := rbDecode[replayReport](t, r.stdout)
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("preview or dry run changed rows")
	}
	r = rbRun(t, dev, append(args, "--confirm", "--json")...)
	r.expect(t, 0, nil, nil)
	real := rbDecode[replayReport](t, r.stdout)
	if dry.Rows != 2 || dry.Changed != 0 || dry.Applied || !real.Applied || real.Changed != dry.Rows || real.Rows != dry.Rows ||
		real.Statement != dry.Statement || !strings.Contains(real.Filter, "TIMEOUT") {
		t.Fatalf("dry run %+v, real run %+v", dry, real)
	}
	for _, id := range ids[:2] {
		if a, le := rbAttempts(t, pool, tbl, id); a != 0 || le != nil {
			t.Fatalf("%s after bulk replay: attempts %d, last_error %v", id, a, le)
		}
	}
	after := rbSnapshot(t, pool, tbl)
	for _, id := range ids[2:] {
		if after[id] != before[id] {
			t.Fatalf("row %s outside the filter changed: %s -> %s", id, before[id], after[id])
		}
	}

	// Nothing left to match: exit 0 without --confirm.
	r = rbRun(t, dev, args...)
	r.expect(t, 0, []string{"Rows it changes: 0", "Nothing to replay"}, nil)

	// --all with text output.
	r = rbRun(t, dev, "dead", "replay", "--table="+tbl.String(), "--all", "--confirm")
	r.expect(t, 0, []string{"every topic (--all)", "Rows it changes: 2", "Replayed 2 rows of " + tbl.String()}, nil)
	for _, id := range []uuid.UUID{ids[2], ids[3]} {
		if a, _ := rbAttempts(t, pool, tbl, id); a != 0 {
			t.Fatalf("%s not replayed by --all", id)
		}
	}
}

func TestRunbookBulkReplayRefusesNonDevelopment(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_replay_prod_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "boom", ids...)
	before := rbSnapshot(t, pool, tbl)
	args := []string{"dead", "replay", "--table=" + tbl.String(), "--topic=" + rbTopicA, "--confirm"}

	for _, env := range []map[string]string{rbEnv(), rbEnv("OUTBOX_ENVIRONMENT", "production"), rbEnv("OUTBOX_ENVIRONMENT", "dev")} {
		r := rbRun(t, env, args...)
		r.expect(t, 2, []string{"Rows it changes: 2"}, []string{"nothing changed", "not marked as development", "OUTBOX_ENVIRONMENT", "--force"})
		if strings.Contains(r.stderr, "add --confirm") {
			t.Fatalf("asks for --confirm although it was given: %s", r.stderr)
		}
		if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
			t.Fatalf("refused bulk replay (OUTBOX_ENVIRONMENT=%q) changed rows", env["OUTBOX_ENVIRONMENT"])
		}
	}
	// Without --confirm either, both are asked for.
	r := rbRun(t, rbEnv(), args[:len(args)-1]...)
	r.expect(t, 2, nil, []string{"add --confirm", "--force"})
	// --force without --confirm still changes nothing.
	r = rbRun(t, rbEnv(), append(args[:len(args)-1:len(args)-1], "--force")...)
	r.expect(t, 2, nil, []string{"add --confirm"})
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("bulk replay without --confirm changed rows")
	}
	// Forced and confirmed, it runs.
	r = rbRun(t, rbEnv(), append(args, "--force")...)
	r.expect(t, 0, []string{"Replayed 2 rows"}, nil)
	for _, id := range ids {
		if a, _ := rbAttempts(t, pool, tbl, id); a != 0 {
			t.Fatalf("%s not replayed with --force", id)
		}
	}
}

// TestRunbookReplayBulkExpect: `outbox dead replay --expect=...` replays the
// rows of an earlier preview only while they are still exactly those rows;
// once the set changed it refuses and changes nothing.
func TestRunbookReplayBulkExpect(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_replay_expect_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[1], ids[2])
	dev := rbEnv("OUTBOX_ENVIRONMENT", "development")
	args := []string{"dead", "replay", "--table=" + tbl.String(), "--topic=" + rbTopicA}

	r := rbRun(t, dev, append(args, "--dry-run", "--json")...)
	r.expect(t, 0, nil, nil)
	preview := rbDecode[replayReport](t, r.stdout)
	if preview.Rows != 2 || preview.Expect == "" {
		t.Fatalf("preview %+v", preview)
	}
	// An older row goes dead after the preview: the set changed, refused.
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[0])
	before := rbSnapshot(t, pool, tbl)
	r = rbRun(t, dev, append(args, "--confirm", "--expect="+preview.Expect)...)
	r.expect(t, 1, nil, []string{"changed since the preview", "nothing changed"})
	if !reflect.DeepEqual(before, rbSnapshot(t, pool, tbl)) {
		t.Fatal("a refused replay changed rows")
	}
	// A fresh preview's --expect replays exactly its rows.
	r = rbRun(t, dev, append(args, "--dry-run", "--json")...)
	preview = rbDecode[replayReport](t, r.stdout)
	r = rbRun(t, dev, append(args, "--confirm", "--expect="+preview.Expect)...)
	r.expect(t, 0, []string{"Replayed 3 rows of " + tbl.String() + ", exactly those previewed"}, nil)
	r = rbRun(t, dev, append(args, "--confirm", "--expect=nonsense")...)
	r.expect(t, 2, nil, []string{"--expect"})
}

// TestDryRunShowsArgumentsOnOneLine: a newline in a --error (or --topic)
// argument is shown escaped in the printed statement, never as a bare SQL
// line of its own (issue 46).
func TestDryRunShowsArgumentsOnOneLine(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_dry_run_newline_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA)
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[0])
	dev := rbEnv("OUTBOX_ENVIRONMENT", "development")
	r := rbRun(t, dev, "dead", "replay", "--table="+tbl.String(), "--topic="+rbTopicA, "--error=timeout\nDROP TABLE students; --\r\tx", "--dry-run")
	r.expect(t, 0, []string{`-- $3 = E'timeout\nDROP TABLE students; --\r\tx'`}, nil)
	for _, line := range strings.Split(r.stdout, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "DROP TABLE") {
			t.Fatalf("an argument's newline printed a bare SQL line:\n%s", r.stdout)
		}
	}
}

// TestRunbookReplayBulkExpectLeavesLaterDeaths: rows that die after the
// preview, past its last sequence, do not stop `outbox dead replay
// --expect=...`: it replays exactly the previewed rows and leaves the later
// deaths for the next replay (docs/OPERATIONS.md, "Act"; issue 56 item 7:
// the command compared --expect with a fresh preview that counted them, so
// while rows kept dying an expected replay never went through).
func TestRunbookReplayBulkExpectLeavesLaterDeaths(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_replay_expect_later_outbox")
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[0], ids[1])
	dev := rbEnv("OUTBOX_ENVIRONMENT", "development")
	args := []string{"dead", "replay", "--table=" + tbl.String(), "--topic=" + rbTopicA}

	r := rbRun(t, dev, append(args, "--dry-run", "--json")...)
	r.expect(t, 0, nil, nil)
	preview := rbDecode[replayReport](t, r.stdout)
	if preview.Rows != 2 || preview.Expect == "" {
		t.Fatalf("preview %+v", preview)
	}
	rbMarkDead(t, pool, tbl, "publish: timeout", ids[2]) // dies after the preview
	r = rbRun(t, dev, append(args, "--confirm", "--expect="+preview.Expect)...)
	r.expect(t, 0, []string{"Replayed 2 rows of " + tbl.String() + ", exactly those previewed"}, nil)
	for i, id := range ids {
		a, _ := rbAttempts(t, pool, tbl, id)
		if replayed := a == 0; replayed != (i < 2) {
			t.Errorf("row %d (attempts %d): replayed %t, want %t (the rows of the preview, not the one that died after it)", i, a, replayed, i < 2)
		}
	}
	// The later death is the next replay's.
	r = rbRun(t, dev, append(args, "--confirm")...)
	r.expect(t, 0, []string{"Replayed 1 row of " + tbl.String()}, nil)
}
