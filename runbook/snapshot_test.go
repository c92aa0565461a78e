package runbook_test

import (
	"context"
	"errors"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
)

// TestReplayDeadChangesExactlyThePreviewedRows: a bulk replay given the
// snapshot of its preview changes exactly the rows the preview counted: a row
// that goes dead after the preview with a later sequence is left alone, and
// when the previewed set itself changed (a row replayed meanwhile, an older
// row gone dead) it refuses and changes nothing.
func TestReplayDeadChangesExactlyThePreviewedRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "replay_snapshot_outbox")
	ids := enqueue(t, pool, tbl, tenantA, repeat(topicA, 7), nil)
	markDead(t, pool, tbl, "timeout", ids[1], ids[2], ids[3])
	f := runbook.DeadFilter{Topic: topicA}

	// A later row dies after the preview: not replayed.
	preview, err := runbook.New(pool, tbl).ReplayDead(ctx, f, true)
	if err != nil || preview.Rows != 3 || preview.Snapshot.Rows != 3 || preview.Snapshot.MaxSequence != sequenceOf(t, pool, tbl, ids[3]) || preview.Snapshot.Digest == "" {
		t.Fatalf("preview: %v %+v", err, preview)
	}
	markDead(t, pool, tbl, "timeout", ids[4])
	expect := preview.Snapshot
	f.Expect = &expect
	res, err := runbook.New(pool, tbl).ReplayDead(ctx, f, false)
	if err != nil || res.Rows != 3 {
		t.Fatalf("replay of the previewed rows: %v %+v", err, res)
	}
	for _, id := range ids[1:4] {
		assertReset(t, pool, tbl, id)
	}
	if s := state(t, pool, tbl, ids[4]); !s.Dead {
		t.Fatalf("a row dead after the preview was replayed: %+v", s)
	}

	// The previewed set changes: refused, nothing changed.
	markDead(t, pool, tbl, "timeout", ids[2], ids[5])
	for _, change := range []struct {
		name string
		do   func()
	}{
		{"a previewed row replayed meanwhile", func() {
			if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, ids[5], runbook.ReplayOptions{}); err != nil {
				t.Fatal(err)
			}
		}},
		{"an older row gone dead meanwhile", func() { markDead(t, pool, tbl, "timeout", ids[0]) }},
	} {
		f := runbook.DeadFilter{Topic: topicA}
		preview, err := runbook.New(pool, tbl).ReplayDead(ctx, f, true)
		if err != nil || preview.Rows == 0 {
			t.Fatalf("%s: preview %v %+v", change.name, err, preview)
		}
		change.do()
		all := append([]uuid.UUID{}, ids...)
		before := states(t, pool, tbl, all)
		expect := preview.Snapshot
		f.Expect = &expect
		res, err := runbook.New(pool, tbl).ReplayDead(ctx, f, false)
		if !errors.Is(err, runbook.ErrReplaySetChanged) || res.Rows != 0 {
			t.Fatalf("%s: %v %+v, want ErrReplaySetChanged", change.name, err, res)
		}
		assertUnchanged(t, change.name, before, states(t, pool, tbl, all))
	}
}
