package main

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
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
