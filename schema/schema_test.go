package schema_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

func TestParseTable(t *testing.T) {
	t.Parallel()
	good := map[string]string{
		"org_outbox":        "public.org_outbox",
		"public.org_outbox": "public.org_outbox",
		"_x.a1":             "_x.a1",
	}
	for in, qualified := range good {
		tbl, err := schema.ParseTable(in)
		if err != nil {
			t.Errorf("ParseTable(%q): %v", in, err)
			continue
		}
		if tbl.String() != in || tbl.Qualified() != qualified {
			t.Errorf("ParseTable(%q) = %q / %q", in, tbl.String(), tbl.Qualified())
		}
	}
	bad := map[string]string{
		"":                             "empty",
		".org_outbox":                  "empty",
		"public.":                      "empty",
		"a.b.c":                        "3 dot-separated parts",
		`org"; DROP TABLE x; --`:       "not allowed",
		"org outbox":                   "not allowed",
		"Org_Outbox":                   "not allowed",
		"org_outbox;":                  "not allowed",
		`"org_outbox"`:                 "not allowed",
		"1org":                         "not allowed",
		"org-outbox":                   "not allowed",
		"é_outbox":                     "not allowed",
		strings.Repeat("a", 64) + ".t": "at most 63",
		strings.Repeat("a", 43):        "index and constraint names",
	}
	for in, want := range bad {
		_, err := schema.ParseTable(in)
		if err == nil {
			t.Errorf("ParseTable(%q) accepted a bad name", in)
			continue
		}
		if !errors.Is(err, schema.ErrInvalidTable) || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseTable(%q) error %q, want ErrInvalidTable mentioning %q", in, err, want)
		}
	}
}

func TestTableKeysAgreeForQualifiedAndUnqualified(t *testing.T) {
	t.Parallel()
	a, b := schema.MustParseTable("org_outbox"), schema.MustParseTable("public.org_outbox")
	if sqlq.LockKey(a) != sqlq.LockKey(b) || sqlq.NotifyChannel(a) != sqlq.NotifyChannel(b) {
		t.Fatalf("keys differ: %d/%d %q/%q", sqlq.LockKey(a), sqlq.LockKey(b), sqlq.NotifyChannel(a), sqlq.NotifyChannel(b))
	}
	if a.Sanitize() != `"org_outbox"` || b.Sanitize() != `"public"."org_outbox"` {
		t.Fatalf("Sanitize: %s %s", a.Sanitize(), b.Sanitize())
	}
	long := schema.MustParseTable(strings.Repeat("s", 63) + "." + strings.Repeat("t", 42))
	if ch := sqlq.NotifyChannel(long); len(ch) > schema.MaxIdentifierBytes {
		t.Fatalf("channel %q is %d bytes", ch, len(ch))
	}
}

// TestShippedMigrations checks that the migration files shipped for
// public.app_outbox are exactly what the code generates. Regenerate them with
// UPDATE_MIGRATIONS=1 go test ./schema -run TestShippedMigrations.
func TestShippedMigrations(t *testing.T) {
	t.Parallel()
	files := schema.MigrationFiles(schema.MustParseTable("public.app_outbox"))
	if os.Getenv("UPDATE_MIGRATIONS") == "1" {
		for path, body := range files {
			if err := os.WriteFile(filepath.FromSlash(path), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for path, want := range files {
		got, err := schema.Migrations.ReadFile(path)
		if err != nil {
			t.Errorf("shipped migration %s missing: %v", path, err)
			continue
		}
		if string(got) != want {
			t.Errorf("shipped migration %s is stale; regenerate with UPDATE_MIGRATIONS=1", path)
		}
	}
}

func TestShippedMigrationsApplyAndRevert(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	sch := testdb.Schema(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SET search_path TO `+sch); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = conn.Exec(ctx, `RESET search_path`) }()
	for _, f := range []string{
		"migrations/000001_create_app_outbox.up.sql",
		"migrations/000002_add_app_outbox_optional_columns.up.sql",
		"migrations/000007_add_app_outbox_paused_topics.up.sql",
		"migrations/000007_add_app_outbox_paused_topics.down.sql",
		"migrations/000007_add_app_outbox_paused_topics.up.sql",
		"migrations/000008_add_app_outbox_replay_jobs.up.sql",
		"migrations/000008_add_app_outbox_replay_jobs.down.sql",
		"migrations/000008_add_app_outbox_replay_jobs.up.sql",
		"migrations/000009_set_app_outbox_available_at_default.up.sql",
		"migrations/000009_set_app_outbox_available_at_default.down.sql",
		"migrations/000009_set_app_outbox_available_at_default.up.sql",
		"migrations/000003_add_app_outbox_ordering.up.sql",
		"migrations/000012_add_app_outbox_skipped_at.up.sql",
		"migrations/000012_add_app_outbox_skipped_at.down.sql",
		"migrations/000012_add_app_outbox_skipped_at.up.sql",
		"migrations/000011_add_app_outbox_one_holds_table.up.sql", // a no-op after 000003 of this version
		"migrations/000011_add_app_outbox_one_holds_table.down.sql",
		"migrations/000011_add_app_outbox_one_holds_table.up.sql",
		"migrations/000005_add_app_outbox_hold_states.up.sql", // a no-op after 000003 of this version
		"migrations/000005_add_app_outbox_hold_states.down.sql",
		"migrations/000005_add_app_outbox_hold_states.up.sql",
		"migrations/000011_add_app_outbox_one_holds_table.up.sql",
		"migrations/000004_add_app_outbox_dead_at.up.sql", // a no-op after 000001 of this version
		"migrations/000004_add_app_outbox_dead_at.down.sql",
		"migrations/000004_add_app_outbox_dead_at.up.sql",
		"migrations/000005_add_app_outbox_hold_states.down.sql",
		"migrations/000012_add_app_outbox_skipped_at.down.sql",
		"migrations/000003_add_app_outbox_ordering.down.sql",
		"migrations/000002_add_app_outbox_optional_columns.down.sql",
		"migrations/000007_add_app_outbox_paused_topics.down.sql",
		"migrations/000008_add_app_outbox_replay_jobs.down.sql",
		"migrations/000015_add_app_outbox_dead_notices.up.sql",
		"migrations/000015_add_app_outbox_dead_notices.down.sql",
		"migrations/000015_add_app_outbox_dead_notices.up.sql",
		"migrations/000015_add_app_outbox_dead_notices.down.sql",
		"migrations/000001_create_app_outbox.down.sql",
	} {
		body, err := schema.Migrations.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// The files name public.app_outbox; run them against the test schema.
		sql := strings.ReplaceAll(string(body), `"public".`, "")
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
		if strings.HasSuffix(f, "000004_add_app_outbox_dead_at.down.sql") {
			if err := schema.CheckDeadAt(ctx, conn, schema.MustParseTable(sch+".app_outbox")); !errors.Is(err, schema.ErrNoDeadAt) {
				t.Fatalf("after %s: %v, want ErrNoDeadAt", f, err)
			}
		}
		if strings.HasSuffix(f, "000004_add_app_outbox_dead_at.up.sql") {
			if err := schema.CheckDeadAt(ctx, conn, schema.MustParseTable(sch+".app_outbox")); err != nil {
				t.Fatalf("after %s: %v", f, err)
			}
		}
		if strings.Contains(f, "000005_") || strings.Contains(f, "000003_") {
			// Ordered mode needs the companion tables with the hold states.
			ok, err := sqlq.OrderedTablesExist(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if want := strings.HasSuffix(f, ".up.sql"); err != nil || ok != want {
				t.Fatalf("after %s: ordered tables ready %v (%v), want %v", f, ok, err, want)
			}
		}
		if strings.Contains(f, "000011_") || strings.Contains(f, "000012_") {
			// Ordered relays of this version need the one holds table.
			ready, _, err := sqlq.OrderedReady(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if want := strings.HasSuffix(f, ".up.sql"); err != nil || ready != want {
				t.Fatalf("after %s: ready for ordered relays %v (%v), want %v", f, ready, err, want)
			}
		}
		if strings.Contains(f, "000007_") || strings.Contains(f, "000001_") {
			// The paused topics' table: made by 000007 only (000001 is kept as shipped).
			ok, err := sqlq.PausedTopicsExist(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if want := strings.HasSuffix(f, "000007_add_app_outbox_paused_topics.up.sql"); err != nil || ok != want {
				t.Fatalf("after %s: paused topics table %v (%v), want %v", f, ok, err, want)
			}
		}
		if strings.Contains(f, "000015_") {
			// The death notices' table: made by 000015, dropped by its down.
			c, err := schema.DetectColumns(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if want := strings.HasSuffix(f, ".up.sql"); err != nil || c.DeadNotices != want {
				t.Fatalf("after %s: death notices table %v (%v), want %v", f, c.DeadNotices, err, want)
			}
		}
		if strings.Contains(f, "000008_") || strings.Contains(f, "000001_") {
			// The replay jobs' table: made by 000008 only (000001 is kept as shipped).
			ok, err := sqlq.ReplayJobsExist(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if want := strings.HasSuffix(f, "000008_add_app_outbox_replay_jobs.up.sql"); err != nil || ok != want {
				t.Fatalf("after %s: replay jobs table %v (%v), want %v", f, ok, err, want)
			}
		}
		if strings.Contains(f, "000009_") || strings.HasSuffix(f, "000001_create_app_outbox.up.sql") {
			// 000001 is kept as shipped (now()); 000009 sets the bounded
			// claim's default and its down migration puts now() back.
			def, err := schema.AvailableAtDefaultOf(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			want := "now()"
			if strings.HasSuffix(f, "000009_set_app_outbox_available_at_default.up.sql") {
				want = schema.AvailableAtDefault
			}
			if err != nil || def != want {
				t.Fatalf("after %s: available_at defaults to %q (%v), want %q", f, def, err, want)
			}
		}
		if strings.HasSuffix(f, "000002_add_app_outbox_optional_columns.up.sql") {
			cols, err := schema.DetectColumns(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
			if err != nil || !cols.TraceContext || !cols.Headers {
				t.Fatalf("after %s: columns %+v, err %v", f, cols, err)
			}
		}
	}
	_, err = schema.DetectColumns(ctx, conn, schema.MustParseTable(sch+".app_outbox"))
	if !errors.Is(err, schema.ErrTableNotFound) {
		t.Fatalf("after down migrations: %v, want ErrTableNotFound", err)
	}
}

func TestMigrateIdempotentConcurrentAndOptionalColumns(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := schema.MustParseTable(testdb.Schema(t) + ".org_outbox")

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- schema.Migrate(ctx, pool, tbl)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	cols, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	if cols != (schema.Columns{SkippedAt: true, DeadNotices: true}) { // skipped_at (000013) and the death notices (000015) are in every table
		t.Fatalf("plain Migrate created optional columns: %+v", cols)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithTraceColumns()); err != nil {
		t.Fatal(err)
	}
	if cols, _ = schema.DetectColumns(ctx, pool, tbl); !cols.TraceContext || cols.Headers {
		t.Fatalf("after WithTraceColumns: %+v", cols)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithHeadersColumn()); err != nil {
		t.Fatal(err)
	}
	if cols, _ = schema.DetectColumns(ctx, pool, tbl); !cols.TraceContext || !cols.Headers {
		t.Fatalf("after WithHeadersColumn: %+v", cols)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = $1 AND tablename = 'org_outbox'`, tbl.Schema()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 5 { // pkey, event_id key, three indexes
		t.Fatalf("indexes: %d, want 5", n)
	}
	if def, err := schema.AvailableAtDefaultOf(ctx, pool, tbl); err != nil || def != schema.AvailableAtDefault {
		t.Fatalf("Migrate: available_at defaults to %q (%v), want %q", def, err, schema.AvailableAtDefault)
	}
}

// TestMigrateSetsAvailableAtDefaultOfAnOldTable: a table made by an older
// version (available_at DEFAULT now(), the transaction's start) gets the
// default the bounded claim needs from Migrate; the statement is not run
// again once the default is right (Migrate runs only what is missing).
func TestMigrateSetsAvailableAtDefaultOfAnOldTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := schema.MustParseTable(testdb.Schema(t) + ".old_outbox")
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ALTER TABLE `+tbl.Sanitize()+` ALTER COLUMN available_at SET DEFAULT now()`); err != nil {
		t.Fatal(err)
	}
	if def, err := schema.AvailableAtDefaultOf(ctx, pool, tbl); err != nil || def != "now()" {
		t.Fatalf("old table: %q (%v)", def, err)
	}
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	if def, err := schema.AvailableAtDefaultOf(ctx, pool, tbl); err != nil || def != schema.AvailableAtDefault {
		t.Fatalf("after Migrate: available_at defaults to %q (%v), want %q", def, err, schema.AvailableAtDefault)
	}
	// Right already: Migrate must not take the table's ACCESS EXCLUSIVE
	// lock, so it completes while another transaction reads the table.
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback(ctx) }()
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM `+tbl.Sanitize()); err != nil {
		t.Fatal(err)
	}
	mctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := schema.Migrate(mctx, pool, tbl); err != nil {
		t.Fatalf("Migrate of an up-to-date table while the table is read: %v", err)
	}
}

func TestMigrateRefusesMissingSchemaUnlessAskedAndRejectsZeroTable(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	sch := testdb.Schema(t) + "_new"
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+sch+` CASCADE`) })
	tbl := schema.MustParseTable(sch + ".x_outbox")
	schemaExists := func() bool {
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, sch).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	for name, migrate := range map[string]func(...schema.MigrateOption) error{
		"outbox": func(o ...schema.MigrateOption) error { return schema.Migrate(ctx, pool, tbl, o...) },
		"inbox":  func(o ...schema.MigrateOption) error { return schema.MigrateInbox(ctx, pool, tbl, o...) },
	} {
		err := migrate()
		if !errors.Is(err, schema.ErrSchemaNotFound) {
			t.Fatalf("%s: Migrate into a missing schema: %v, want ErrSchemaNotFound", name, err)
		}
		for _, want := range []string{`"` + sch + `"`, "schema.WithCreateSchema()", "--create-schema"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: error %q does not mention %s", name, err, want)
			}
		}
		if schemaExists() {
			t.Fatalf("%s: the refused Migrate created the schema", name)
		}
	}
	if !strings.Contains(schema.UpSQL(tbl, schema.WithCreateSchema()), `CREATE SCHEMA IF NOT EXISTS "`+sch+`"`) ||
		strings.Contains(schema.UpSQL(tbl), "CREATE SCHEMA") {
		t.Fatal("UpSQL must print CREATE SCHEMA exactly when WithCreateSchema is given")
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithCreateSchema()); err != nil {
		t.Fatal(err)
	}
	if !schemaExists() {
		t.Fatal("Migrate with WithCreateSchema did not create the schema")
	}
	if err := schema.Migrate(ctx, pool, schema.Table{}); err == nil {
		t.Fatal("Migrate accepted a zero Table")
	}
}
