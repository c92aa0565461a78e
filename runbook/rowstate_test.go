package runbook_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TestRowRulesTableInDocs: docs/OPERATIONS.md carries the row rules table
// exactly as the code renders it.
func TestRowRulesTableInDocs(t *testing.T) {
	t.Parallel()
	doccheck.ExpectIn(t, "OPERATIONS.md", doccheck.Doc(t, "..", "OPERATIONS.md"), doccheck.Normalize(runbook.RowRulesTable()))
}

// rowStateTable makes a table of mode m for the row-state edges: a
// default-mode table (Migrate gives it skipped_at, migration 000013), or
// an ordered table, whose unkeyed rows record their state in their
// columns as a default table's do.
func rowStateTable(t *testing.T, pool *pgxpool.Pool, m schema.Mode) schema.Table {
	t.Helper()
	if m == schema.ModeOrdered {
		return testdb.Table(t, "rse_outbox", schema.WithMode(schema.ModeOrdered))
	}
	return testdb.Table(t, "rse_outbox")
}

// TestRowStateEdges drives one row along each edge of the row-state
// machine (docs/OPERATIONS.md, "The row's states") through the runbook,
// in the default mode and in ordered mode (its unkeyed rows; its keyed
// rows' edges go through their holds: TestHoldLifecycleOrdered,
// TestSkipOfReplayedSkippedRowStaysSkippedOrdered,
// TestSkipOfFailedReplayOfDefaultDeadRowOrdered): each accepted edge ends
// in the state the machine says, each refused one changes nothing and
// says why; then a relay of the mode delivers the pending rows and never a
// skipped one.
func TestRowStateEdges(t *testing.T) {
	t.Parallel()
	for _, m := range []schema.Mode{schema.ModeDefault, schema.ModeOrdered} {
		t.Run(string(m), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			pool := testdb.Pool(t)
			tbl := rowStateTable(t, pool, m)
			rb := runbook.New(pool, tbl)
			skip := func(id uuid.UUID) error { _, err := rb.SkipEvent(ctx, id, false); return err }
			replay := func(id uuid.UUID) error { _, err := rb.ReplayEvent(ctx, id, runbook.ReplayOptions{}); return err }
			set := func(sql string) func(uuid.UUID) {
				return func(id uuid.UUID) { exec(t, pool, tbl, `UPDATE %s SET `+sql+` WHERE event_id = $1`, id) }
			}
			dead := func(id uuid.UUID) { markDead(t, pool, tbl, "broker said no", id) }
			retrying := set(`attempts = 1, last_error = 'flaky', available_at = now() + interval '1 hour'`)
			inFlight := set(`attempts = 2, last_error = 'flaky', locked_at = now()`)
			delivered := set(`published_at = now()`)
			skipped := func(id uuid.UUID) {
				dead(id)
				if err := skip(id); err != nil {
					t.Fatal(err)
				}
			}
			edges := []struct {
				name   string
				from   func(uuid.UUID)
				from0  runbook.RowState
				ops    []func(uuid.UUID) error
				want   runbook.RowState
				refuse error // the last op's refusal, nil when accepted
			}{
				{"skip dead", dead, runbook.RowDead, []func(uuid.UUID) error{skip}, runbook.RowSkipped, nil},
				{"skip retrying", retrying, runbook.RowRetrying, []func(uuid.UUID) error{skip}, runbook.RowSkipped, nil},
				{"skip pending", nil, runbook.RowPending, []func(uuid.UUID) error{skip}, runbook.RowSkipped, nil},
				{"skip in flight", inFlight, runbook.RowInFlight, []func(uuid.UUID) error{skip}, runbook.RowInFlight, runbook.ErrLocked},
				{"skip delivered", delivered, runbook.RowDelivered, []func(uuid.UUID) error{skip}, runbook.RowDelivered, runbook.ErrAlreadyPublished},
				{"skip skipped", skipped, runbook.RowSkipped, []func(uuid.UUID) error{skip}, runbook.RowSkipped, runbook.ErrAlreadySkipped},
				{"replay dead", dead, runbook.RowDead, []func(uuid.UUID) error{replay}, runbook.RowPending, nil},
				{"replay retrying", retrying, runbook.RowRetrying, []func(uuid.UUID) error{replay}, runbook.RowPending, nil},
				{"replay skipped", skipped, runbook.RowSkipped, []func(uuid.UUID) error{replay}, runbook.RowPending, nil},
				{"replay skipped, skip again", skipped, runbook.RowSkipped, []func(uuid.UUID) error{replay, skip}, runbook.RowSkipped, nil},
				{"replay pending", nil, runbook.RowPending, []func(uuid.UUID) error{replay}, runbook.RowPending, runbook.ErrNotFailed},
				{"replay in flight", inFlight, runbook.RowInFlight, []func(uuid.UUID) error{replay}, runbook.RowInFlight, runbook.ErrLocked},
				{"replay delivered", delivered, runbook.RowDelivered, []func(uuid.UUID) error{replay}, runbook.RowDelivered, runbook.ErrAlreadyPublished},
			}
			var pending, never []uuid.UUID
			for _, e := range edges {
				id := enqueue(t, pool, tbl, tenantA, []string{topicA}, nil)[0]
				if e.from != nil {
					e.from(id)
				}
				if got := eventState(t, pool, tbl, id).State(); got != e.from0 {
					t.Fatalf("%s: the row reads %s before, want %s", e.name, got, e.from0)
				}
				before := state(t, pool, tbl, id)
				var err error
				for _, op := range e.ops {
					if err = op(id); err != nil {
						break
					}
				}
				switch {
				case e.refuse == nil && err != nil:
					t.Errorf("%s: %v", e.name, err)
				case e.refuse != nil && !errors.Is(err, e.refuse):
					t.Errorf("%s: %v, want a refusal matching %v", e.name, err, e.refuse)
				case e.refuse != nil:
					if !strings.Contains(err.Error(), "nothing changed") {
						t.Errorf("%s: the refusal does not say nothing changed: %v", e.name, err)
					}
					assertUnchanged(t, e.name, []rowState{before}, []rowState{state(t, pool, tbl, id)})
				}
				if got := eventState(t, pool, tbl, id).State(); got != e.want {
					t.Errorf("%s: the row reads %s after, want %s", e.name, got, e.want)
				}
				switch e.want {
				case runbook.RowPending:
					pending = append(pending, id)
				case runbook.RowSkipped:
					never = append(never, id)
				}
			}
			exec(t, pool, tbl, `UPDATE %s SET locked_at = NULL WHERE locked_at IS NOT NULL`)
			c, _ := startRelay(t, pool, tbl, m == schema.ModeOrdered, func(uuid.UUID) bool { return false })
			waitUntil(t, 15*time.Second, "the pending rows delivered", func() bool {
				for _, id := range pending {
					if c.count(c.acked, id) == 0 {
						return false
					}
				}
				return true
			})
			for _, id := range never {
				if n := c.count(c.delivers, id); n != 0 {
					t.Errorf("skipped row %s delivered %d times", id, n)
				}
				if got := eventState(t, pool, tbl, id).State(); got != runbook.RowSkipped {
					t.Errorf("skipped row %s reads %s after the relay ran", id, got)
				}
			}
			st, err := rb.Stats(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if st.Dead != 0 {
				t.Errorf("stats count %d dead rows, want 0 (skipped rows are not dead): %+v", st.Dead, st)
			}
		})
	}
}

// TestSkipNeedsSkippedAt: a default-mode table without skipped_at (made by
// an earlier version) refuses a skip, naming the migration; nothing
// changes.
func TestSkipNeedsSkippedAt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "rsn_outbox")
	exec(t, pool, tbl, `ALTER TABLE %s DROP COLUMN IF EXISTS skipped_at`)
	id := enqueue(t, pool, tbl, tenantA, []string{topicA}, nil)[0]
	markDead(t, pool, tbl, "broker said no", id)
	before := state(t, pool, tbl, id)
	_, err := runbook.New(pool, tbl).SkipEvent(ctx, id, false)
	if !errors.Is(err, runbook.ErrNoSkippedAt) || !strings.Contains(err.Error(), "outbox migrate --table=") || !strings.Contains(err.Error(), "000013") {
		t.Fatalf("skip on a table without skipped_at: %v", err)
	}
	assertUnchanged(t, "the refused skip", []rowState{before}, []rowState{state(t, pool, tbl, id)})
}
