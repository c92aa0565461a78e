package cleaner_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestCleanerDeletesSkippedRowsByDeliveredRetention: a row an operator
// skipped (runbook.SkipEvent: every row of a default table, an unkeyed row
// of an ordered table) is done, so the cleaner deletes it by Retention
// after skipped_at, like a delivered row, and never by DeadRetention, even
// when its dead_at is set (the state reader reads it skipped, not dead).
// docs/OPERATIONS.md, "The row's states".
func TestCleanerDeletesSkippedRowsByDeliveredRetention(t *testing.T) {
	t.Parallel()
	for _, m := range []schema.Mode{schema.ModeDefault, schema.ModeOrdered} {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testdb.Pool(t)
			tbl := testdb.Table(t, "skip_outbox", schema.WithMode(m))
			rb := runbook.New(pool, tbl)
			// Each row dies as a relay's last attempt leaves it; then the
			// skipped ones are skipped by the runbook, and each row's times
			// are set back as named.
			rows := []struct {
				name string
				skip bool
				set  string // applied after the skip
				// Whether the row is still there after the dead
				// retention pass, then after the retention pass.
				afterDead, afterRetention bool
			}{
				{"skipped long ago", true, `skipped_at = now() - interval '200 hours'`, true, false},
				{"skipped lately", true, `skipped_at = now() - interval '1 hour'`, true, true},
				// Its dead_at set too (no relay writes both): skipped wins.
				{"skipped long ago, dead_at set", true, `skipped_at = now() - interval '200 hours', dead_at = now() - interval '200 hours'`, true, false},
				{"dead long ago", false, `dead_at = now() - interval '200 hours'`, false, false},
			}
			ids := make([]uuid.UUID, len(rows))
			msgs := make([]publisher.Message, len(rows))
			for i := range rows {
				ids[i] = uuid.New()
				msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.skip.v1", EventID: ids[i], Payload: json.RawMessage(`{}`)}
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = 25, last_error = 'no', available_at = 'infinity',
  created_at = now() - interval '300 hours', dead_at = now() - interval '250 hours'`); err != nil {
				t.Fatal(err)
			}
			for i, r := range rows {
				if r.skip {
					if res, err := rb.SkipEvent(ctx, ids[i], false); err != nil || !res.Applied {
						t.Fatalf("skip %q: %+v, %v", r.name, res, err)
					}
				}
				if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET `+r.set+` WHERE event_id = $1`, ids[i]); err != nil {
					t.Fatal(err)
				}
			}
			st, err := rb.Stats(ctx)
			if err != nil || st.Dead != 1 || st.Pending != 0 {
				t.Fatalf("stats before cleaning: %+v, %v; want 1 dead row (the skipped rows are done)", st, err)
			}
			check := func(pass string, deleted, want int64, kept func(i int) bool) {
				t.Helper()
				for i, r := range rows {
					var n int
					if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[i]).Scan(&n); err != nil {
						t.Fatal(err)
					}
					if (n == 1) != kept(i) {
						t.Errorf("after the %s pass the row %q is in the table: %t, want %t", pass, r.name, n == 1, kept(i))
					}
				}
				if deleted != want {
					t.Errorf("the %s pass counted %d rows deleted, want %d", pass, deleted, want)
				}
			}
			// The dead retention deletes the dead row, never a skipped one.
			c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: 1000 * time.Hour, DeadRetention: time.Nanosecond}, nil)
			if err != nil {
				t.Fatal(err)
			}
			pub, dead, err := c.CleanOnce(ctx)
			if err != nil {
				t.Fatal(err)
			}
			check("dead retention", dead, 1, func(i int) bool { return rows[i].afterDead })
			if pub != 0 {
				t.Errorf("the dead retention pass deleted %d done rows, want 0", pub)
			}
			// The retention of delivered rows deletes the rows skipped
			// longer ago than it, counted with the published ones.
			c, err = cleaner.New(pool, cleaner.Config{Table: tbl, Retention: 168 * time.Hour}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if pub, dead, err = c.CleanOnce(ctx); err != nil {
				t.Fatal(err)
			}
			check("retention", pub, 2, func(i int) bool { return rows[i].afterRetention })
			if dead != 0 {
				t.Errorf("the retention pass deleted %d dead rows, want 0", dead)
			}
		})
	}
}
