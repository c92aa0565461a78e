package schema_test

import (
	"context"
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateAddsReplayJobsTable: Migrate creates the replay jobs' table
// with a new table and adds it to a table made before it (migration
// 000008); DownSQL drops it; its insert keeps the newest jobs only.
func TestMigrateAddsReplayJobsTable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := migratedCompanion(t, "replay jobs", sqlq.ReplayJobsExist, schema.ReplayJobsDownSQL)
	q := sqlq.NewReplayJobsQueries(tbl)
	const keep = 3
	for i, id := range []string{"a1", "a2", "a3", "a4", "a5"} {
		var at any
		if err := pool.QueryRow(ctx, q.Insert, id, "org.a.v1", "", "", int64(i), []string{}, "", "", keep).Scan(&at); err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, q.Count).Scan(&n); err != nil || n != keep {
		t.Fatalf("%d jobs kept (%v), want %d", n, err, keep)
	}
	var kept []string
	if err := pool.QueryRow(ctx, `SELECT array_agg(id ORDER BY id)::text[] FROM `+tbl.ReplayJobsTable()).Scan(&kept); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(kept, ","); got != "a3,a4,a5" {
		t.Fatalf("kept jobs %s, want the newest a3,a4,a5", got)
	}
	if _, err := pool.Exec(ctx, q.Insert, "a6", strings.Repeat("x", schema.ReplayJobTextMaxBytes+1), "", "", 0, []string{}, "", "", keep); err == nil {
		t.Fatal("the table accepted a topic over ReplayJobTextMaxBytes")
	}
	if _, err := pool.Exec(ctx, schema.DownSQL(tbl)); err != nil {
		t.Fatal(err)
	}
	if ok, err := sqlq.ReplayJobsExist(ctx, pool, tbl); err != nil || ok {
		t.Fatalf("after DownSQL the replay jobs table exists %v (%v)", ok, err)
	}
}
