package console_test

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

const jobsToken = "jobs-token-of-the-console"

var jobsAuth = map[string]string{"Authorization": "Bearer " + jobsToken}

// startConsole serves a new console on tbl; stop closes it and its
// server (a console restart is a stop and a new startConsole).
func startConsole(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (srv *httptest.Server, stop func()) {
	t.Helper()
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: jobsToken})
	if err != nil {
		t.Fatal(err)
	}
	srv = httptest.NewServer(h)
	stopped := false
	stop = func() {
		if !stopped {
			stopped = true
			srv.Close()
			_ = h.Close()
		}
	}
	t.Cleanup(stop)
	return srv, stop
}

// bulkReplay previews and confirms a bulk replay of the dead rows whose
// error contains errText, and returns its job page's path.
func bulkReplay(t *testing.T, base string, tbl schema.Table, errText string) string {
	t.Helper()
	form := previewForm(t, base, tbl.String(), url.Values{"error": {errText}}, jobsAuth)
	r := do(t, "POST", base+"/t/"+tbl.String()+"/replay", with(form, "confirm", form.Get("rows")), jobsAuth)
	if r.code != 303 || !strings.Contains(r.hdr.Get("Location"), "/replay/") {
		t.Fatalf("bulk replay: %d %s %s", r.code, r.hdr.Get("Location"), r.body)
	}
	return r.hdr.Get("Location")
}

// jobProgress reads /api/replay of the job page path job.
func jobProgress(t *testing.T, base, job string) (int, struct {
	runbook.Progress
	Done bool `json:"done"`
}) {
	t.Helper()
	var p struct {
		runbook.Progress
		Done bool `json:"done"`
	}
	r := do(t, "GET", base+"/api/replay/"+job[strings.LastIndex(job, "/")+1:], nil, jobsAuth)
	if r.code == 200 {
		if err := json.Unmarshal([]byte(r.body), &p); err != nil {
			t.Fatalf("progress %s: %v", r.body, err)
		}
	}
	return r.code, p
}

// TestBulkReplayJobSurvivesRestart: a bulk replay started on one console
// is shown, with its progress counted from the outbox rows, by a console
// started afterwards on the same database.
func TestBulkReplayJobSurvivesRestart(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox")
	ids := deadWith(t, pool, tbl, "org.a.v1", "publish: broker down", 3)
	deadWith(t, pool, tbl, "org.a.v1", "permanent: bad payload", 1)

	a, stopA := startConsole(t, pool, tbl)
	job := bulkReplay(t, a.URL, tbl, "broker down")
	if code, p := jobProgress(t, a.URL, job); code != 200 || p.Progress != (runbook.Progress{Rows: 3, Pending: 3}) {
		t.Fatalf("progress on console A: %d %+v", code, p)
	}
	stopA()

	// The relay delivers two of the rows, and the third dies again.
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET published_at = now() WHERE event_id = ANY($1)`, ids[:2]); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity' WHERE event_id = $1`, ids[2]); err != nil {
		t.Fatal(err)
	}
	b, _ := startConsole(t, pool, tbl)
	page := do(t, "GET", b.URL+job, nil, jobsAuth)
	if page.code != 200 || !strings.Contains(page.body, "Replayed 3 dead rows") || !strings.Contains(page.body, "contained “broker down”") ||
		!strings.Contains(page.body, `id="job-kept"`) || !strings.Contains(page.body, "by the token holder from 127.0.0.1") {
		t.Fatalf("job page on console B: %d\n%s", page.code, page.body)
	}
	if !strings.Contains(page.body, `<p id="job-done" class="flash">Finished`) {
		t.Errorf("the finished job's page on console B does not say it is finished:\n%s", page.body)
	}
	code, p := jobProgress(t, b.URL, job)
	if code != 200 || p.Progress != (runbook.Progress{Rows: 3, Published: 2, Dead: 1}) || !p.Done {
		t.Fatalf("progress on console B: %d %+v, want 3 rows, 2 delivered, 1 dead, done", code, p)
	}
	// The job belongs to its table: under another table's path it is gone.
	other := testdb.Table(t, "other")
	c, err := console.New(pool, console.Config{Tables: []schema.Table{tbl, other}, Token: jobsToken})
	if err != nil {
		t.Fatal(err)
	}
	srvC := httptest.NewServer(c)
	defer srvC.Close()
	if r := do(t, "GET", srvC.URL+"/t/"+other.String()+job[strings.Index(job, "/replay/"):], nil, jobsAuth); r.code != 404 {
		t.Errorf("the job under another table: %d, want 404", r.code)
	}
	if code, p := jobProgress(t, srvC.URL, job); code != 200 || p.Rows != 3 {
		t.Errorf("progress on a console of two tables: %d %+v", code, p)
	}
}

// TestBulkReplayJobWithoutJobsTable: on a table made before migration
// 000008 the bulk replay still replays, and its page follows it from the
// console's memory, saying so and naming outbox migrate; a restarted
// console no longer knows it. After the migration the next job persists.
func TestBulkReplayJobWithoutJobsTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox")
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000008", "down")); err != nil {
		t.Fatal(err)
	}
	deadWith(t, pool, tbl, "org.a.v1", "publish: broker down", 2)
	a, stopA := startConsole(t, pool, tbl)
	job := bulkReplay(t, a.URL, tbl, "broker down")
	if deadCount(t, pool, tbl) != 0 {
		t.Fatal("the rows were not replayed")
	}
	page := do(t, "GET", a.URL+job, nil, jobsAuth)
	if page.code != 200 || !strings.Contains(page.body, `id="job-memory"`) || !strings.Contains(page.body, "_replay_jobs does not exist") ||
		!strings.Contains(page.body, "outbox migrate --table="+tbl.String()) {
		t.Fatalf("job page without the jobs table: %d\n%s", page.code, page.body)
	}
	if code, p := jobProgress(t, a.URL, job); code != 200 || p.Progress != (runbook.Progress{Rows: 2, Pending: 2}) {
		t.Fatalf("progress from memory: %d %+v", code, p)
	}
	stopA()
	b, _ := startConsole(t, pool, tbl)
	if r := do(t, "GET", b.URL+job, nil, jobsAuth); r.code != 404 || !strings.Contains(r.body, "before `outbox migrate`") {
		t.Fatalf("a memory-only job after a restart: %d %s", r.code, r.body)
	}
	if code, _ := jobProgress(t, b.URL, job); code != 404 {
		t.Fatalf("a memory-only job's progress after a restart: %d, want 404", code)
	}
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	deadWith(t, pool, tbl, "org.a.v1", "publish: broker down", 1)
	job = bulkReplay(t, b.URL, tbl, "broker down")
	if _, err := runbook.New(pool, tbl).GetReplayJob(ctx, job[strings.LastIndex(job, "/")+1:]); err != nil {
		t.Fatalf("a job after the migration is not recorded: %v", err)
	}
}

// TestBulkReplayJobsBounded: the console keeps the newest 50 jobs of a
// table; a new one deletes the oldest.
func TestBulkReplayJobsBounded(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox")
	const kept = 50 // the console's maxJobs
	var oldest string
	for i := range kept {
		j, err := runbook.New(pool, tbl).SaveReplayJob(ctx, runbook.ReplayJob{Topic: "org.old.v1"}, kept+10)
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			oldest = j.ID
		}
	}
	deadWith(t, pool, tbl, "org.a.v1", "publish: broker down", 1)
	srv, _ := startConsole(t, pool, tbl)
	if r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/replay/"+oldest, nil, jobsAuth); r.code != 200 {
		t.Fatalf("the oldest job before a new one: %d %s", r.code, r.body)
	}
	job := bulkReplay(t, srv.URL, tbl, "broker down")
	var n int
	if err := pool.QueryRow(ctx, sqlq.NewReplayJobsQueries(tbl).Count).Scan(&n); err != nil || n != kept {
		t.Fatalf("%d jobs kept (%v), want %d", n, err, kept)
	}
	if r := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/replay/"+oldest, nil, jobsAuth); r.code != 404 {
		t.Fatalf("the oldest job after a new one: %d, want 404", r.code)
	}
	if r := do(t, "GET", srv.URL+job, nil, jobsAuth); r.code != 200 {
		t.Fatalf("the new job: %d %s", r.code, r.body)
	}
}
