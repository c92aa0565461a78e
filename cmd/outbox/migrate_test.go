package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// A typo in the schema name must not create a schema: outbox migrate
// refuses it, --print shows CREATE SCHEMA only with --create-schema, and
// --create-schema creates it.
func TestMigrateRefusesMissingSchema(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	sch := testdb.Schema(t) + "_typo"
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+sch+` CASCADE`) })
	tbl := sch + ".org_outbox"

	r := rbRun(t, rbEnv(), "migrate", "--table="+tbl)
	r.expect(t, 1, nil, []string{`schema does not exist: "` + sch + `"`, "--create-schema"})
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, sch).Scan(&n); err != nil || n != 0 {
		t.Fatalf("refused migrate left schema count %d (%v)", n, err)
	}

	r = rbRun(t, rbEnv(), "migrate", "--print", "--table="+tbl)
	r.expect(t, 0, []string{"CREATE TABLE IF NOT EXISTS"}, nil)
	if strings.Contains(r.stdout, "CREATE SCHEMA") {
		t.Fatalf("--print without --create-schema shows CREATE SCHEMA:\n%s", r.stdout)
	}
	r = rbRun(t, rbEnv(), "migrate", "--print", "--create-schema", "--table="+tbl)
	r.expect(t, 0, []string{`CREATE SCHEMA IF NOT EXISTS "` + sch + `"`}, nil)

	r = rbRun(t, rbEnv(), "migrate", "--create-schema", "--table="+tbl)
	r.expect(t, 0, []string{"migrated " + tbl}, nil)
	r = rbRun(t, rbEnv(), "migrate", "--table="+tbl) // now it exists: idempotent, no flag needed
	r.expect(t, 0, []string{"migrated " + tbl}, nil)
}

// `outbox migrate --print` output, fed to the database as psql would run
// it, drops nothing: without --down it is the idempotent up migration only;
// with --down the down migration is there, every line commented out.
func TestMigratePrintDropsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Schema(t) + ".org_outbox"
	r := rbRun(t, rbEnv(), "migrate", "--ordered", "--table="+tbl)
	r.expect(t, 0, []string{"migrated " + tbl}, nil)
	if _, err := pool.Exec(ctx, `INSERT INTO `+tbl+` (tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), 'org.a.v1', '{}', gen_random_uuid() FROM generate_series(1, 5)`); err != nil {
		t.Fatal(err)
	}
	names := []string{tbl, tbl + "_partitions", tbl + "_relays", tbl + "_holds"}
	for _, args := range [][]string{
		{"--print"},
		{"--print", "--down"},
		{"--print", "--ordered", "--down"},
		{"--print", "--trace", "--headers", "--ordered", "--down"},
		{"--print", "--create-schema", "--down"},
		{"--print", "--wal", "--ordered", "--down"},
	} {
		r := rbRun(t, rbEnv(), append([]string{"migrate", "--table=" + tbl}, args...)...)
		r.expect(t, 0, []string{"CREATE TABLE IF NOT EXISTS"}, nil)
		down := strings.Contains(strings.Join(args, " "), "--down")
		if got := strings.Contains(r.stdout, "DROP TABLE"); got != down {
			t.Fatalf("%v: output shows DROP TABLE = %v, want %v:\n%s", args, got, down, r.stdout)
		}
		for _, line := range strings.Split(r.stdout, "\n") {
			if strings.Contains(strings.ToUpper(line), "DROP ") && !strings.HasPrefix(line, "-- ") {
				t.Fatalf("%v: live destructive line %q", args, line)
			}
		}
		// As psql runs a script: the simple protocol, statements one after
		// another.
		if _, err := pool.Exec(ctx, r.stdout); err != nil {
			t.Fatalf("%v: run the printed SQL: %v\n%s", args, err, r.stdout)
		}
		for _, n := range names {
			var ok bool
			if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, n).Scan(&ok); err != nil || !ok {
				t.Fatalf("%v: after running the printed SQL, %s exists = %v (%v)", args, n, ok, err)
			}
		}
		var rows int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl).Scan(&rows); err != nil || rows != 5 {
			t.Fatalf("%v: after running the printed SQL, %d rows (%v), want 5", args, rows, err)
		}
	}
	r = rbRun(t, rbEnv(), "migrate", "--down", "--table="+tbl)
	r.expect(t, 2, nil, []string{"--down only prints"})
}

// `outbox migrate --ordered` and OUTBOX_RELAY_ORDERED=true on an existing
// default-mode table add ordered mode (never a silent success); a table
// above 10,000 rows (orderedRewriteMaxRows) is refused with the SQL to run unless
// --rewrite is given.
func TestMigrateOrderedOnExistingTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	sch := testdb.Schema(t)
	check := func(tbl string, want bool) {
		t.Helper()
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2 AND column_name = 'ordering_key')
  AND to_regclass($3) IS NOT NULL`, sch, strings.TrimPrefix(tbl, sch+"."), tbl+"_holds").Scan(&ok); err != nil || ok != want {
			t.Fatalf("%s: ordered mode in place = %v (%v), want %v", tbl, ok, err, want)
		}
	}
	for i, env := range []map[string]string{rbEnv(), rbEnv("OUTBOX_RELAY_ORDERED", "true")} {
		tbl := sch + ".org_outbox" + string(rune('a'+i))
		rbRun(t, rbEnv(), "migrate", "--table="+tbl).expect(t, 0, []string{"migrated " + tbl}, nil)
		check(tbl, false)
		args := []string{"migrate", "--table=" + tbl}
		if i == 0 {
			args = append(args, "--ordered")
		}
		rbRun(t, env, args...).expect(t, 0, []string{"migrated " + tbl + " (ordered mode", "_holds"}, nil)
		check(tbl, true)
	}

	big := sch + ".big_outbox"
	rbRun(t, rbEnv(), "migrate", "--table="+big).expect(t, 0, []string{"migrated " + big}, nil)
	if _, err := pool.Exec(ctx, `INSERT INTO `+big+` (tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), 'a.b.c.v1', '{}', gen_random_uuid() FROM generate_series(1, 10001)`); err != nil {
		t.Fatal(err)
	}
	rbRun(t, rbEnv(), "migrate", "--ordered", "--table="+big).expect(t, 1, nil, []string{"rewrites the table", "--rewrite", "ADD COLUMN IF NOT EXISTS ordering_key"})
	check(big, false)
	rbRun(t, rbEnv(), "migrate", "--ordered", "--rewrite", "--table="+big).expect(t, 0, []string{"migrated " + big + " (ordered mode"}, nil)
	check(big, true)
}

// TestMigrateWALOnExistingTable (issue 33): `outbox migrate --wal` on an
// existing default-mode table with rows adds what the WAL relay needs (its
// progress and holds tables, the publication and the slot) without
// touching the rows, and a second run changes nothing; `outbox stats` then
// reads the table as a WAL table.
func TestMigrateWALOnExistingTable(t *testing.T) {
	t.Parallel()
	cluster := pgtest.Start(t, pgtest.Options{Settings: map[string]string{"wal_level": "logical", "max_replication_slots": "4", "max_wal_senders": "4"}})
	url := cluster.URL("", "")
	env := map[string]string{"OUTBOX_DATABASE_URL": url}
	tbl := "public.wal_up_outbox"
	rbRun(t, env, "migrate", "--table="+tbl).expect(t, 0, []string{"migrated " + tbl}, nil)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, `INSERT INTO `+tbl+` (tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), 'a.b.c.v1', '{}', gen_random_uuid() FROM generate_series(1, 50)`); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		rbRun(t, env, "migrate", "--wal", "--table="+tbl).expect(t, 0, []string{tbl}, nil)
	}
	var rows, slots, pubs int
	var progress, holds bool
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+tbl+`), (SELECT count(*) FROM pg_replication_slots), (SELECT count(*) FROM pg_publication_rel WHERE prrelid = $1::regclass),
  to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`, tbl, schema.MustParseTable(tbl).WALProgressTable(), schema.MustParseTable(tbl).HoldsTable()).Scan(&rows, &slots, &pubs, &progress, &holds); err != nil {
		t.Fatal(err)
	}
	if rows != 50 || slots != 1 || pubs != 1 || !progress || !holds {
		t.Fatalf("after migrate --wal twice: rows %d, slots %d, publications %d, progress table %v, holds table %v; want 50, 1, 1, true, true",
			rows, slots, pubs, progress, holds)
	}
	rbRun(t, env, "stats", "--json", "--table="+tbl).expect(t, 0, []string{`"mode": "wal"`}, nil)
}

// TestMigrateModeEveryPair: `outbox migrate --mode=` switches a table
// between every pair of modes, both ways, with one command each
// (docs/ORDERING.md, "Switching modes"), printing what it switched and
// recording the new mode; with a key held (an open hold) it refuses,
// naming the holds, and the mode stays.
func TestMigrateModeEveryPair(t *testing.T) {
	t.Parallel()
	cluster := pgtest.Start(t, pgtest.Options{Settings: map[string]string{"wal_level": "logical", "max_replication_slots": "4", "max_wal_senders": "4"}})
	env := map[string]string{"OUTBOX_DATABASE_URL": cluster.URL("", "")}
	tbl := "public.pairs_outbox"
	rbRun(t, env, "migrate", "--table="+tbl).expect(t, 0, []string{"migrated " + tbl}, nil)
	from := "default"
	// default->ordered->wal->default->wal->ordered->default: the six pairs.
	for _, to := range []string{"ordered", "wal", "default", "wal", "ordered", "default"} {
		rbRun(t, env, "migrate", "--mode="+to, "--table="+tbl).expect(t, 0, []string{"switched " + tbl + " from " + from + " to " + to + " mode"}, nil)
		rbRun(t, env, "stats", "--json", "--table="+tbl).expect(t, 0, []string{`"mode": "` + to + `"`}, nil)
		from = to
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, cluster.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	// A key the WAL relay holds (a dead row's open hold).
	rbRun(t, env, "migrate", "--mode=wal", "--table="+tbl).expect(t, 0, []string{"switched " + tbl + " from default to wal mode"}, nil)
	if _, err := pool.Exec(ctx, `INSERT INTO `+schema.MustParseTable(tbl).HoldsTable()+` (ordering_key, partition, sequence, attempts, dead_at, mode)
VALUES ('k', 0, 1, 3, now(), 'wal')`); err != nil {
		t.Fatal(err)
	}
	rbRun(t, env, "migrate", "--mode=ordered", "--table="+tbl).expect(t, 1, nil, []string{"key(s) held", "outbox keys held"})
	rbRun(t, env, "stats", "--json", "--table="+tbl).expect(t, 0, []string{`"mode": "wal"`}, nil)
}
