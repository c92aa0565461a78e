package schema_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateAddsTheRelaysLockTTL: a new table's mode table has
// lock_ttl_ms, where sqlq.RecordLockTTL writes a relay's LockTTL (rounded
// up to the millisecond) and RecordedMode reads it; a mode table without
// it (before migration 000014) reads as recording none and records
// nothing, until Migrate adds it; the shipped 000014 adds and drops it.
func TestMigrateAddsTheRelaysLockTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "lockttl_outbox")
	modeTable := tbl.Sanitize()[:len(tbl.Sanitize())-1] + `_mode"`
	read := func(what string) time.Duration {
		t.Helper()
		rec, ok, err := schema.RecordedMode(ctx, pool, tbl)
		if err != nil || !ok || rec.Mode != schema.ModeDefault {
			t.Fatalf("%s: record %+v (recorded %v, %v)", what, rec, ok, err)
		}
		return rec.LockTTL
	}
	record := func(what string, ttl time.Duration, want bool) {
		t.Helper()
		if ok, err := sqlq.RecordLockTTL(ctx, pool, tbl, ttl); err != nil || ok != want {
			t.Fatalf("%s: recorded %v (%v), want %v", what, ok, err, want)
		}
	}
	if got := read("new table"); got != 0 {
		t.Fatalf("new table: LockTTL %s recorded, want none", got)
	}
	record("new table", 1500*time.Microsecond, true)
	if got := read("recorded"); got != 2*time.Millisecond {
		t.Fatalf("recorded 1.5ms, read %s, want it rounded up to 2ms", got)
	}
	if _, err := sqlq.RecordLockTTL(ctx, pool, tbl, 0); err == nil {
		t.Fatal("RecordLockTTL accepted 0")
	}

	// A mode table made before migration 000014.
	if _, err := pool.Exec(ctx, `ALTER TABLE `+modeTable+` DROP COLUMN lock_ttl_ms`); err != nil {
		t.Fatal(err)
	}
	if got := read("without the column"); got != 0 {
		t.Fatalf("without the column: LockTTL %s, want none", got)
	}
	record("without the column", time.Minute, false)
	if err := schema.Migrate(ctx, pool, tbl); err != nil {
		t.Fatal(err)
	}
	record("after Migrate", 5*time.Minute, true)
	if got := read("after Migrate"); got != 5*time.Minute {
		t.Fatalf("after Migrate: LockTTL %s, want 5m", got)
	}

	// The shipped 000014, against the table public.app_outbox names.
	files := schema.MigrationFiles(tbl)
	for _, step := range []struct {
		file   string
		column bool
	}{
		{"down", false}, {"down", false}, {"up", true}, {"up", true},
	} {
		sql := files["migrations/000014_add_"+tbl.Name()+"_mode_lock_ttl."+step.file+".sql"]
		if !strings.Contains(sql, "lock_ttl_ms") {
			t.Fatalf("no migration 000014 %s: %q", step.file, sql)
		}
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("000014 %s: %v", step.file, err)
		}
		var has bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'lock_ttl_ms' AND NOT attisdropped)`,
			modeTable).Scan(&has); err != nil || has != step.column {
			t.Fatalf("after 000014 %s: column %v (%v), want %v", step.file, has, err, step.column)
		}
	}
	// 000010 as shipped creates the mode table without the column.
	if strings.Contains(files["migrations/000010_add_"+tbl.Name()+"_mode.up.sql"], "lock_ttl_ms") {
		t.Fatal("migration 000010 changed: it has lock_ttl_ms")
	}
}
