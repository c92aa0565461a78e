//go:build fault

package fault

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/schema"
)

// waitDrained waits until every row of tbl is published and every event_id
// in it was received (recv, guarded by mu), or until deadline. It returns the
// event_ids of the table as last read.
func waitDrained(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tbl schema.Table, mu *sync.Mutex, recv map[string]int, deadline time.Time) []string {
	t.Helper()
	var rows []string
	for {
		var pending int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NULL`).Scan(&pending); err == nil && pending == 0 {
			r, err := pool.Query(ctx, `SELECT event_id::text FROM `+tbl.Sanitize())
			if err != nil {
				t.Fatal(err)
			}
			if rows, err = pgx.CollectRows(r, pgx.RowTo[string]); err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			missing := 0
			for _, id := range rows {
				if recv[id] == 0 {
					missing++
				}
			}
			mu.Unlock()
			if missing == 0 {
				return rows
			}
		}
		if time.Now().After(deadline) {
			return rows
		}
		time.Sleep(200 * time.Millisecond)
	}
}
