package runbook_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// pausedRows returns the rows of the paused topics' table of tbl.
func pausedRows(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.PausedTopicsTable()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPauseResumeTopic: a dry run changes nothing; a pause is stored (the
// reason with secrets masked), listed, counted by Stats, marked by Topics,
// and notifies the table's channel; pausing again changes nothing; resume
// deletes it and notifies; resuming a topic not paused is ErrNotPaused.
func TestPauseResumeTopic(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "pause_outbox")
	enqueue(t, pool, tbl, tenantA, []string{"org.a.v1", "org.a.v1", "org.b.v1"}, nil)

	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `LISTEN `+pgx.Identifier{sqlq.NotifyChannel(tbl)}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	notified := func() bool {
		wctx, cancel := context.WithTimeout(ctx, 2e9)
		defer cancel()
		n, err := conn.Conn().WaitForNotification(wctx)
		return err == nil && n.Payload == sqlq.PausedTopicsNotifyPayload
	}

	dry, err := runbook.New(pool, tbl).PauseTopic(ctx, "org.a.v1", "why", true)
	if err != nil || !dry.DryRun || dry.Changed != 0 || !strings.Contains(dry.Statement.SQL, "INSERT INTO") {
		t.Fatalf("dry run: %+v, %v", dry, err)
	}
	if n := pausedRows(t, pool, tbl); n != 0 {
		t.Fatalf("a dry run paused %d topics", n)
	}
	res, err := runbook.New(pool, tbl).PauseTopic(ctx, "org.a.v1", "broker down, see postgres://ops:hunter2@db/x", false)
	if err != nil || res.Changed != 1 || res.PausedAt == nil {
		t.Fatalf("PauseTopic: %+v, %v", res, err)
	}
	if strings.Contains(res.Reason, "hunter2") {
		t.Fatalf("the reason kept a password: %q", res.Reason)
	}
	if !notified() {
		t.Fatal("PauseTopic sent no notification on the table's channel")
	}
	again, err := runbook.New(pool, tbl).PauseTopic(ctx, "org.a.v1", "other", false)
	if err != nil || again.Changed != 0 || !again.PausedAt.Equal(*res.PausedAt) || again.Reason != res.Reason {
		t.Fatalf("second pause: %+v, %v; want the first pause kept", again, err)
	}
	list, err := runbook.New(pool, tbl).PausedTopics(ctx)
	if err != nil || len(list) != 1 || list[0].Topic != "org.a.v1" || list[0].Reason != res.Reason {
		t.Fatalf("PausedTopics: %+v, %v", list, err)
	}
	st, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil || st.PausedTopics != 1 || st.Pending != 3 {
		t.Fatalf("Stats: %+v, %v", st, err)
	}
	topics, err := runbook.New(pool, tbl).Topics(ctx, 0)
	if err != nil || len(topics) != 2 {
		t.Fatalf("Topics: %+v, %v", topics, err)
	}
	for _, b := range topics {
		if b.Paused != (b.Topic == "org.a.v1") {
			t.Fatalf("Topics: %+v; only org.a.v1 is paused", topics)
		}
	}
	// A paused topic with nothing pending is listed too.
	if _, err := runbook.New(pool, tbl).PauseTopic(ctx, "org.c.v1", "", false); err != nil {
		t.Fatal(err)
	}
	topics, err = runbook.New(pool, tbl).Topics(ctx, 0)
	if err != nil || len(topics) != 3 || topics[2].Topic != "org.c.v1" || !topics[2].Paused || topics[2].Pending != 0 {
		t.Fatalf("Topics with org.c.v1 paused and empty: %+v, %v", topics, err)
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, "org.c.v1", false); err != nil {
		t.Fatal(err)
	}
	for _, what := range []string{"pause", "resume"} {
		if !notified() {
			t.Fatalf("no notification for the %s of org.c.v1", what)
		}
	}

	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, "org.a.v1", true); err != nil || pausedRows(t, pool, tbl) != 1 {
		t.Fatalf("dry run of resume: %v, paused %d", err, pausedRows(t, pool, tbl))
	}
	r, err := runbook.New(pool, tbl).ResumeTopic(ctx, "org.a.v1", false)
	if err != nil || r.Changed != 1 || pausedRows(t, pool, tbl) != 0 {
		t.Fatalf("ResumeTopic: %+v, %v", r, err)
	}
	if !notified() {
		t.Fatal("ResumeTopic sent no notification on the table's channel")
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, "org.a.v1", false); !errors.Is(err, runbook.ErrNotPaused) {
		t.Fatalf("resume of a topic not paused: %v, want ErrNotPaused", err)
	}
	if st, err := runbook.New(pool, tbl).Stats(ctx); err != nil || st.PausedTopics != 0 {
		t.Fatalf("Stats after resume: %+v, %v", st, err)
	}
}

// TestPauseTopicRefusals: bad input, an unknown table, a table without the
// paused topics' table and a WAL table are refused with a clear error, and
// nothing is changed.
func TestPauseTopicRefusals(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "refuse_outbox")
	for _, c := range []struct{ topic, reason, want string }{
		{"", "", "empty"},
		{"*", "", `"*" is not a topic`},
		{strings.Repeat("t", 128), "", "128 bytes"},
		{"a b", "", "spaces"},
		{"org.a.v1", strings.Repeat("r", 201), "201 bytes"},
		{"org.a.v1", "two\nlines", "one line"},
	} {
		_, err := runbook.New(pool, tbl).PauseTopic(ctx, c.topic, c.reason, false)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "nothing changed") {
			t.Errorf("PauseTopic(%.20q, %.20q): %v; want an error saying %q and nothing changed", c.topic, c.reason, err, c.want)
		}
	}
	if _, err := runbook.New(pool, tbl).ResumeTopic(ctx, "*", false); !errors.Is(err, runbook.ErrBadTopic) {
		t.Errorf("ResumeTopic(*): %v, want ErrBadTopic", err)
	}
	if n := pausedRows(t, pool, tbl); n != 0 {
		t.Fatalf("refused pauses wrote %d rows", n)
	}

	missing := schema.MustParseTable(tbl.Schema() + ".no_such_outbox")
	if _, err := runbook.New(pool, missing).PauseTopic(ctx, "org.a.v1", "", false); !errors.Is(err, schema.ErrTableNotFound) {
		t.Errorf("unknown table: %v, want ErrTableNotFound", err)
	}

	// A table made before migration 000007: relays see nothing paused,
	// listing works, a pause says which migration to run.
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000007", "down")); err != nil {
		t.Fatal(err)
	}
	if l, err := runbook.New(pool, tbl).PausedTopics(ctx); err != nil || len(l) != 0 {
		t.Fatalf("PausedTopics without the table: %v, %v", l, err)
	}
	if st, err := runbook.New(pool, tbl).Stats(ctx); err != nil || st.PausedTopics != 0 {
		t.Fatalf("Stats without the table: %+v, %v", st, err)
	}
	_, err := runbook.New(pool, tbl).PauseTopic(ctx, "org.a.v1", "", false)
	if !errors.Is(err, runbook.ErrNoPausedTopics) || !strings.Contains(err.Error(), "outbox migrate --table="+tbl.String()) {
		t.Fatalf("pause without the table: %v", err)
	}
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}

	// A table the WAL relay streams (a progress table and a publication).
	if _, err := pool.Exec(ctx, sqlq.WALCreateProgressTable(tbl)); err != nil {
		t.Fatal(err)
	}
	pub := "pause_test_" + tbl.Schema()
	if _, err := pool.Exec(ctx, sqlq.WALCreatePublication(pub, tbl)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP PUBLICATION IF EXISTS `+pgx.Identifier{pub}.Sanitize())
	})
	// walrelay.Setup records the mode so.
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeWAL, "test"); err != nil {
		t.Fatal(err)
	}
	if m, err := runbook.New(pool, tbl).Mode(ctx); err != nil || m != schema.ModeWAL {
		t.Fatalf("mode %q (%v), want wal", m, err)
	}
	_, err = runbook.New(pool, tbl).PauseTopic(ctx, "org.a.v1", "", false)
	if !errors.Is(err, runbook.ErrPauseWAL) || !strings.Contains(err.Error(), "retain WAL") || !strings.Contains(err.Error(), "Instead") {
		t.Fatalf("pause on a WAL table: %v, want ErrPauseWAL saying why and what to do instead", err)
	}
	if n := pausedRows(t, pool, tbl); n != 0 {
		t.Fatalf("a refused WAL pause wrote %d rows", n)
	}
}
