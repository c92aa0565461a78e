package runbook_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

const (
	topicA = "org.runbook.alpha.v1"
	topicB = "org.runbook.beta.v1"
)

func assertIDs(t *testing.T, what string, rows []runbook.Row, want ...uuid.UUID) {
	t.Helper()
	got := eventIDs(rows)
	if len(want) == 0 {
		want = []uuid.UUID{}
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("%s: got event_ids %v, want %v", what, got, want)
	}
}

func TestBacklog(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "backlog_outbox")
	ids := enqueue(t, pool, tbl, tenantA, []string{topicA, topicA, topicB, topicA, topicA, topicB}, nil)
	exec(t, pool, tbl, `UPDATE %s SET published_at = now() WHERE event_id = $1`, ids[1])
	markDead(t, pool, tbl, "boom", ids[2])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = 'connection refused', available_at = now() + interval '1 minute' WHERE event_id = $1`, ids[3])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 1, locked_at = now(), available_at = now() - interval '1 hour' WHERE event_id = $1`, ids[4])

	rows, err := runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Claim order: available_at, then sequence; published and dead rows are not pending.
	assertIDs(t, "backlog", rows, ids[4], ids[0], ids[5], ids[3])
	byID := map[uuid.UUID]runbook.Row{}
	for _, r := range rows {
		byID[r.EventID] = r
		if r.TenantID != tenantA || r.PublishedAt != nil || r.CreatedAt.IsZero() {
			t.Errorf("row %+v", r)
		}
	}
	if r := byID[ids[4]]; r.LockedAt == nil || r.Attempts != 1 || r.Topic != topicA {
		t.Errorf("leased row: %+v", r)
	}
	if r := byID[ids[3]]; r.LastError == nil || *r.LastError != "connection refused" || r.Attempts != 2 || r.LockedAt != nil {
		t.Errorf("retrying row: %+v", r)
	}
	if byID[ids[0]].Sequence >= byID[ids[5]].Sequence || byID[ids[5]].Topic != topicB {
		t.Errorf("sequences or topics wrong: %+v %+v", byID[ids[0]], byID[ids[5]])
	}

	rows, err = runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{Limit: 2})
	if err != nil {
		t.Fatal(err)
	}
	assertIDs(t, "backlog limit 2", rows, ids[4], ids[0])

	rows, err = runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{Topic: topicB})
	if err != nil {
		t.Fatal(err)
	}
	assertIDs(t, "backlog of topic B", rows, ids[5])

	if _, err := runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{Limit: -1}); err == nil || !strings.Contains(err.Error(), "negative") {
		t.Errorf("negative limit: %v", err)
	}
	if _, err := runbook.New(pool, schema.Table{}).Backlog(ctx, runbook.BacklogOptions{}); err == nil || !strings.Contains(err.Error(), "schema.ParseTable") {
		t.Errorf("zero table: %v", err)
	}
	missing := schema.MustParseTable(tbl.Schema() + ".missing_outbox")
	if _, err := runbook.New(pool, missing).Backlog(ctx, runbook.BacklogOptions{}); !errors.Is(err, schema.ErrTableNotFound) || !strings.Contains(err.Error(), "outbox migrate") {
		t.Errorf("missing table: %v", err)
	}
}

func TestDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "dead_outbox")
	a := enqueue(t, pool, tbl, tenantA, []string{topicA, topicA, topicB, topicA, topicA}, nil)
	b := enqueue(t, pool, tbl, tenantB, []string{topicA, topicB}, nil)
	markDead(t, pool, tbl, "HTTP 503 Service Unavailable", a[0])
	markDead(t, pool, tbl, "publish: timeout after 30s", a[1])
	markDead(t, pool, tbl, "permanent: no route for topic", a[2])
	markDead(t, pool, tbl, "Timeout waiting for broker", b[0])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, published_at = now() WHERE event_id = $1`, a[3])  // published, not dead
	exec(t, pool, tbl, `UPDATE %s SET attempts = 3, last_error = 'timeout' WHERE event_id = $1`, a[4]) // failed, not dead

	list := func(f runbook.DeadFilter) []runbook.Row {
		t.Helper()
		rows, err := runbook.New(pool, tbl).Dead(ctx, f)
		if err != nil {
			t.Fatalf("Dead(%+v): %v", f, err)
		}
		return rows
	}
	rows := list(runbook.DeadFilter{})
	assertIDs(t, "every dead row", rows, a[0], a[1], a[2], b[0])
	for i := 1; i < len(rows); i++ {
		if rows[i].Sequence <= rows[i-1].Sequence {
			t.Fatalf("not in sequence order: %+v", rows)
		}
	}
	if r := rows[2]; r.Attempts != 25 || r.LastError == nil || *r.LastError != "permanent: no route for topic" || r.Topic != topicB || r.TenantID != tenantA {
		t.Errorf("dead row: %+v", r)
	}
	assertIDs(t, "topic A", list(runbook.DeadFilter{Topic: topicA}), a[0], a[1], b[0])
	assertIDs(t, "tenant B", list(runbook.DeadFilter{TenantID: tenantB}), b[0])
	assertIDs(t, "error contains TIMEOUT", list(runbook.DeadFilter{ErrorContains: "TIMEOUT"}), a[1], b[0])
	assertIDs(t, "topic A, tenant A, 503", list(runbook.DeadFilter{Topic: topicA, TenantID: tenantA, ErrorContains: "503"}), a[0])

	page := list(runbook.DeadFilter{Limit: 2})
	assertIDs(t, "page 1", page, a[0], a[1])
	page = list(runbook.DeadFilter{Limit: 2, AfterSequence: page[1].Sequence})
	assertIDs(t, "page 2", page, a[2], b[0])
	assertIDs(t, "page 3", list(runbook.DeadFilter{Limit: 2, AfterSequence: page[1].Sequence}))

	for _, bad := range []runbook.DeadFilter{{Limit: -1}, {AfterSequence: -1}} {
		if _, err := runbook.New(pool, tbl).Dead(ctx, bad); err == nil || !strings.Contains(err.Error(), "negative") {
			t.Errorf("Dead(%+v): %v", bad, err)
		}
	}
}

func TestStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "stats_outbox")

	empty, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := (runbook.TableStats{Table: tbl.String(), Mode: schema.ModeDefault, DeliveryTimesKnown: true}); empty != want {
		t.Fatalf("empty table: %+v, want %+v", empty, want)
	}

	ids := enqueue(t, pool, tbl, tenantA, repeat(topicA, 7), nil)
	exec(t, pool, tbl, `UPDATE %s SET created_at = now() - interval '1 hour' WHERE event_id = $1`, ids[0])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = 'boom', available_at = now() + interval '1 minute' WHERE event_id = $1`, ids[1])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 1, locked_at = now() WHERE event_id = $1`, ids[2])
	markDead(t, pool, tbl, "dead", ids[3], ids[4])
	exec(t, pool, tbl, `UPDATE %s SET created_at = now() - interval '2 days' WHERE event_id = $1`, ids[3])
	exec(t, pool, tbl, `UPDATE %s SET published_at = now() WHERE event_id = $1`, ids[5])
	exec(t, pool, tbl, `UPDATE %s SET published_at = now() - interval '2 hours' WHERE event_id = $1`, ids[6])

	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if s.Pending != 3 || s.Retrying != 1 || s.Locked != 1 || s.Dead != 2 || s.PublishedLastHour != 1 {
		t.Fatalf("stats: %+v", s)
	}
	if s.OldestPendingAgeSeconds < 3600 || s.OldestPendingAgeSeconds > 3660 || s.OldestPendingCreatedAt == nil ||
		math.Abs(time.Since(*s.OldestPendingCreatedAt).Hours()-1) > 0.05 {
		t.Fatalf("oldest pending: %v s, created %v", s.OldestPendingAgeSeconds, s.OldestPendingCreatedAt)
	}
	if d := s.OldestPendingAge(); d < time.Hour || d > time.Hour+time.Minute {
		t.Fatalf("OldestPendingAge = %s", d)
	}

	// Many attempts without dead_at is still pending.
	exec(t, pool, tbl, `UPDATE %s SET attempts = 40 WHERE event_id = $1`, ids[1])
	if s, err = runbook.New(pool, tbl).Stats(ctx); err != nil || s.Pending != 3 || s.Dead != 2 {
		t.Fatalf("stats after 40 attempts: %+v, %v", s, err)
	}
}

// TestLegacyTableWithoutDeadAt: on a table created before dead_at, the
// runbook says what to run instead of a bare SQL error.
func TestLegacyTableWithoutDeadAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "legacy_runbook_outbox")
	if _, err := pool.Exec(ctx, `ALTER TABLE `+tbl.Sanitize()+` DROP COLUMN dead_at`); err != nil {
		t.Fatal(err)
	}
	_, err := runbook.New(pool, tbl).Stats(ctx)
	if !errors.Is(err, schema.ErrNoDeadAt) || !strings.Contains(err.Error(), "outbox migrate --table="+tbl.String()) {
		t.Fatalf("stats of a legacy table: %v", err)
	}
}

// untouchedDB is a DB that no call may reach.
type untouchedDB struct{ t *testing.T }

func (d untouchedDB) Query(context.Context, string, ...any) (pgx.Rows, error) {
	d.t.Fatal("Query reached the database")
	return nil, nil
}

func (d untouchedDB) QueryRow(context.Context, string, ...any) pgx.Row {
	d.t.Fatal("QueryRow reached the database")
	return nil
}

func (d untouchedDB) Exec(context.Context, string, ...any) (pgconn.CommandTag, error) {
	d.t.Fatal("Exec reached the database")
	return pgconn.CommandTag{}, nil
}

// TestRunbookChecks: every method of a runbook without a database handle
// (a nil *Runbook, a nil DB, a nil *pgxpool.Pool) or without a table says
// so, without touching a database; New checks nothing, and Table returns
// the table given.
func TestRunbookChecks(t *testing.T) {
	t.Parallel()
	tbl := schema.MustParseTable("public.org_outbox")
	if got := runbook.New(nil, tbl).Table(); got != tbl {
		t.Errorf("Table() = %v, want %v", got, tbl)
	}
	if got := (*runbook.Runbook)(nil).Table(); !got.IsZero() {
		t.Errorf("Table() of a nil runbook = %v", got)
	}
	cases := []struct {
		name string
		rb   *runbook.Runbook
		want string
	}{
		{"nil runbook", nil, "no database handle"},
		{"nil DB", runbook.New(nil, tbl), "no database handle"},
		{"nil pool", runbook.New((*pgxpool.Pool)(nil), tbl), "no database handle"},
		{"zero table", runbook.New(untouchedDB{t}, schema.Table{}), "schema.ParseTable"},
	}
	rt := reflect.TypeOf((*runbook.Runbook)(nil))
	ctx := reflect.ValueOf(context.Background())
	for _, c := range cases {
		for i := range rt.NumMethod() {
			m := rt.Method(i)
			if m.Name == "Table" {
				continue
			}
			args := []reflect.Value{reflect.ValueOf(c.rb), ctx}
			for j := 2; j < m.Type.NumIn(); j++ {
				args = append(args, reflect.Zero(m.Type.In(j)))
			}
			out := m.Func.Call(args)
			err, _ := out[len(out)-1].Interface().(error)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s: %s: %v, want an error saying %q", c.name, m.Name, err, c.want)
			}
		}
	}
}
