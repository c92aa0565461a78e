package runbook_test

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestReplayJobs: a recorded replay job reads back whole (its event ids
// included), only the newest keep jobs are kept, an over-long text is
// shortened on a rune boundary, and a table without the replay jobs'
// table is refused with runbook.ErrNoReplayJobs.
func TestReplayJobs(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox")
	ids := []uuid.UUID{uuid.New(), uuid.New()}
	saved, err := runbook.New(pool, tbl).SaveReplayJob(ctx, runbook.ReplayJob{Topic: "org.a.v1", ErrorContains: "broker down", Cause: "publish: broker down",
		Rows: 2, EventIDs: ids, RequestedBy: "token holder", Remote: "192.0.2.7"}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(saved.ID) != 16 || saved.CreatedAt.IsZero() {
		t.Fatalf("saved job %+v: want a 16-hex id and a time", saved)
	}
	got, err := runbook.New(pool, tbl).GetReplayJob(ctx, saved.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !got.CreatedAt.Equal(saved.CreatedAt) {
		t.Fatalf("created_at %v, saved %v", got.CreatedAt, saved.CreatedAt)
	}
	got.CreatedAt = saved.CreatedAt
	if !reflect.DeepEqual(got, saved) {
		t.Fatalf("read back %+v, saved %+v", got, saved)
	}
	// Two more jobs with keep 2: the first is deleted.
	long := strings.Repeat("é", schema.ReplayJobTextMaxBytes) // 2 bytes a rune
	second, err := runbook.New(pool, tbl).SaveReplayJob(ctx, runbook.ReplayJob{ErrorContains: long}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(second.ErrorContains); n != schema.ReplayJobTextMaxBytes || !strings.HasPrefix(long, second.ErrorContains) {
		t.Fatalf("an over-long text kept %d bytes, want %d whole runes", n, schema.ReplayJobTextMaxBytes)
	}
	if _, err := runbook.New(pool, tbl).SaveReplayJob(ctx, runbook.ReplayJob{Topic: "org.b.v1"}, 2); err != nil {
		t.Fatal(err)
	}
	if _, err := runbook.New(pool, tbl).GetReplayJob(ctx, saved.ID); !errors.Is(err, runbook.ErrNoReplayJob) {
		t.Fatalf("the oldest job beyond keep: %v, want ErrNoReplayJob", err)
	}
	if _, err := runbook.New(pool, tbl).GetReplayJob(ctx, second.ID); err != nil {
		t.Fatalf("a kept job: %v", err)
	}
	// A table made before migration 000008.
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000008", "down")); err != nil {
		t.Fatal(err)
	}
	if _, err := runbook.New(pool, tbl).SaveReplayJob(ctx, runbook.ReplayJob{}, 0); !errors.Is(err, runbook.ErrNoReplayJobs) || !strings.Contains(err.Error(), "outbox migrate") {
		t.Fatalf("save without the table: %v, want runbook.ErrNoReplayJobs naming outbox migrate", err)
	}
	if _, err := runbook.New(pool, tbl).GetReplayJob(ctx, second.ID); !errors.Is(err, runbook.ErrNoReplayJobs) {
		t.Fatalf("read without the table: %v, want runbook.ErrNoReplayJobs", err)
	}
}
