package schema_test

import (
	"context"
	"testing"

	"github.com/outboxkit/watermill-outbox/schema"
)

// TestMigrateAddsDeadNoticesTable: Migrate creates <table>_dead_notices
// (migration 000015) with every table, DetectColumns reports it
// (Columns.DeadNotices, which the relays' claims read), its down migration
// drops it, and Migrate adds it again to a table made before it.
func TestMigrateAddsDeadNoticesTable(t *testing.T) {
	t.Parallel()
	migratedCompanion(t, "death notices", func(ctx context.Context, q schema.Querier, tbl schema.Table) (bool, error) {
		c, err := schema.DetectColumns(ctx, q, tbl)
		return c.DeadNotices, err
	}, schema.DeadNoticesDownSQL)
}
