package subscriber_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestOrderedReplayRacingCleanerStrandsNoKey: operators replay old keyed
// rows while a cleaner with a tiny retention deletes them; whichever wins
// each row, every key goes on: its next row is delivered.
func TestOrderedReplayRacingCleanerStrandsNoKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	o := orderedSub(t, pool, orderedCfg(tbl))
	rec := newRecorder()
	consume(t, o, rec, nil)
	cl, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Nanosecond, BatchSize: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const keys = 60
	names := make([]string, keys)
	for i := range names {
		names[i] = fmt.Sprintf("k%02d", i)
	}
	for round := range 3 {
		old := enqueueKeyed(t, pool, tbl, names...)
		rec.waitAcked(t, old, 60*time.Second)
		// Every row at or below its partition's written floor: replayable
		// and deletable.
		waitUntil(t, 60*time.Second, func() bool {
			var behind int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` AS o JOIN `+tbl.PartitionsTable()+` AS p
  ON p.partition = o.ordering_partition WHERE o.ordering_key IS NOT NULL AND o.sequence > p.floor_sequence`).Scan(&behind)
			return err == nil && behind == 0
		})
		var wg sync.WaitGroup
		wg.Add(2)
		go func() {
			defer wg.Done()
			for range 20 {
				if _, _, err := cl.CleanOnce(ctx); err != nil {
					t.Errorf("clean: %v", err)
					return
				}
			}
		}()
		go func() {
			defer wg.Done()
			for _, e := range old {
				// Refusals (the row is gone, or not cleaned up yet) are
				// fine; a stranded key is not.
				_, _ = runbook.New(pool, tbl).ReplayEvent(ctx, e.event, runbook.ReplayOptions{})
			}
		}()
		wg.Wait()
		next := enqueueKeyed(t, pool, tbl, names...)
		rec.waitAcked(t, next, 60*time.Second, func() {
			t.Logf("round %d: holds:\n%s", round, dumpHolds(t, tbl))
		})
	}
	rec.checkOrder(t)
}

func dumpHolds(t *testing.T, tbl schema.Table) string {
	t.Helper()
	rows, err := testdb.Pool(t).Query(context.Background(), `SELECT h.ordering_key, h.sequence, h.replay, h.resolved_at IS NOT NULL,
  EXISTS (SELECT 1 FROM `+tbl.Sanitize()+` AS o WHERE o.ordering_key = h.ordering_key AND o.sequence = h.sequence) FROM `+tbl.HoldsTable()+` AS h ORDER BY 1`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	out := ""
	for rows.Next() {
		var (
			k                   string
			seq                 int64
			replay, res, exists bool
		)
		if err := rows.Scan(&k, &seq, &replay, &res, &exists); err != nil {
			return err.Error()
		}
		out += fmt.Sprintf("  %s seq %d replay %v resolved %v row exists %v\n", k, seq, replay, res, exists)
	}
	return out
}
