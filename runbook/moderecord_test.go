package runbook_test

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// forgetMode deletes the mode recorded for tbl: a table migrated before
// the mode was recorded.
func forgetMode(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) {
	t.Helper()
	exec(t, pool, tbl, `DELETE FROM `+pgx.Identifier{tbl.Schema(), tbl.Name() + "_mode"}.Sanitize())
}

// relayOf starts a relay of tbl (ordered or not) whose handler nacks the
// events fail names and acks the others, with its gauges in m refreshed
// every 100 ms, and stops it when the test ends; stop stops it earlier.
func relayOf(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, ordered bool, m *metrics.Metrics, fail map[uuid.UUID]bool) (stop func()) {
	t.Helper()
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: ordered, MaxAttempts: 1, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: 2 * time.Second,
		Metrics: m, StatsInterval: 100 * time.Millisecond}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		cancel()
		_ = sub.Close()
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for msg := range ch {
			if fail[uuid.MustParse(msg.UUID)] {
				msg.Nack()
				continue
			}
			msg.Ack()
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			<-done
			_ = sub.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// eventually fails the test unless ok holds within 20 s.
func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); !ok(); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 20 s", what)
		}
	}
}

// TestDefaultRelayOnAllColumnsTableReadsDefault: a table created with
// every column (README step 1; earlier versions also created ordered mode's
// companion tables with it) reads as a default-mode table: Migrate records
// the mode of a table it creates, and a table without a record (migrated by
// an earlier version, where the mode was inferred as ordered) is recorded
// as default by the default relay that starts on it. The runbook, the console and
// the relay's gauges then read it in the default mode.
func TestDefaultRelayOnAllColumnsTableReadsDefault(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "all_outbox", schema.WithAllColumns())
	if m, err := runbook.New(pool, tbl).Mode(ctx); err != nil || m != schema.ModeDefault {
		t.Fatalf("a new table with every column: mode %q (%v), want default", m, err)
	}

	// A table of an earlier version: ordered mode's companion tables (its
	// Migrate with every column created them), no record; the mode is
	// inferred from the companion tables, as before.
	if _, err := pool.Exec(ctx, schema.OrderedUpgradeSQL(tbl)); err != nil {
		t.Fatal(err)
	}
	forgetMode(t, pool, tbl)
	if m, err := runbook.New(pool, tbl).Mode(ctx); err != nil || m != schema.ModeOrdered {
		t.Fatalf("without a record: mode %q (%v), want the inferred ordered", m, err)
	}
	enqueue(t, pool, tbl, tenantA, []string{topicA}, func(tx pgx.Tx, ids []uuid.UUID) error {
		_, err := tx.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = now(), available_at = 'infinity', attempts = 1, last_error = 'boom' WHERE event_id = $1`, ids[0])
		return err
	})
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	relayOf(t, pool, tbl, false, m, nil)
	delivered := enqueue(t, pool, tbl, tenantA, []string{topicA, topicA}, nil)
	eventually(t, "the default relay delivers", func() bool {
		for _, id := range delivered {
			if r, err := runbook.New(pool, tbl).Event(ctx, id); err != nil || r.PublishedAt == nil {
				return false
			}
		}
		return true
	})

	if m, err := runbook.New(pool, tbl).Mode(ctx); err != nil || m != schema.ModeDefault {
		t.Fatalf("relayed by a default relay: mode %q (%v), want default", m, err)
	}
	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil || s.Mode != schema.ModeDefault || !s.DeliveryTimesKnown || s.Dead != 1 || s.Pending != 0 || s.HeldKeys != 0 {
		t.Fatalf("stats: %+v, %v", s, err)
	}
	if c := ConsoleCounts(t, pool, tbl); c.Mode != schema.ModeDefault || c.Dead != 1 {
		t.Fatalf("console /api/counts: %+v, want mode default with 1 dead", c)
	}
	if page := consoleBody(t, pool, tbl, "/t/"+tbl.String()+"/relays"); !strings.Contains(page, `<strong id="mode">default</strong>`) {
		t.Errorf("the console's relays page does not say mode default")
	}
	label := tbl.Qualified()
	eventually(t, "the gauges", func() bool {
		return testutil.ToFloat64(m.Dead.WithLabelValues(label)) == 1 && testutil.ToFloat64(m.Pending.WithLabelValues(label)) == 0
	})
}

// consoleBody is the body of one authenticated GET of a console over tbl.
func consoleBody(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, path string) string {
	t.Helper()
	b, err := io.ReadAll(consoleGet(t, pool, tbl, path).Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestOrderedKeyedDeadRowOnEveryReader: an ordered relay leaves one keyed
// row dead (its key's hold is dead; the row's own dead_at stays NULL); the
// runbook's Dead and DeadCausesOf, the console's dead rows page and the
// relay's gauges all show it.
func TestOrderedKeyedDeadRowOnEveryReader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "ord_outbox", schema.WithMode(schema.ModeOrdered))
	ids := enqueueKeys(t, pool, tbl, "k", "k", "other")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	relayOf(t, pool, tbl, true, m, map[uuid.UUID]bool{ids[0]: true})
	eventually(t, "the keyed row is dead", func() bool {
		rows, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
		return err == nil && len(rows) == 1 && rows[0].EventID == ids[0] && rows[0].Held
	})
	if r, err := runbook.New(pool, tbl).Event(ctx, ids[0]); err != nil || r.DeadAt == nil {
		t.Fatalf("event: %+v, %v", r, err)
	}
	causes, err := runbook.New(pool, tbl).DeadCausesOf(ctx, runbook.DeadFilter{}, 0)
	if err != nil || causes.Rows != 1 || causes.Groups != 1 || len(causes.Causes) != 1 || causes.Causes[0].LatestEventID != ids[0] {
		t.Fatalf("causes: %+v, %v", causes, err)
	}
	page := consoleBody(t, pool, tbl, "/t/"+tbl.String()+"/dead")
	if strings.Contains(page, `id="no-dead"`) || !strings.Contains(page, ids[0].String()) || !strings.Contains(page, `<td class="n" data-cause-count>1</td>`) {
		t.Fatalf("the console's dead rows page does not show the keyed dead row %s:\n%s", ids[0], page)
	}
	rows := consoleBody(t, pool, tbl, "/t/"+tbl.String()+"/rows?state=dead")
	if !strings.Contains(rows, ids[0].String()) {
		t.Errorf("the console's rows page of the dead state does not show %s", ids[0])
	}
	label := tbl.Qualified()
	eventually(t, "the gauges count the keyed dead row", func() bool {
		return testutil.ToFloat64(m.Dead.WithLabelValues(label)) == 1
	})
}

// TestBulkReplayPassesTheSingleReplayRule: in an ordered table, a bulk
// replay (by filter, with and without a preview's snapshot) replays what
// ReplayEvent replays, as it replays it, and leaves alone what ReplayEvent
// refuses: a keyed row that died before the switch and is above its
// partition's floor (not recorded as done), and a dead hold whose skip is
// requested. Before, the bulk replay reset every row with dead_at set
// (reviving the first, and making a keyed row below its floor "done"
// without delivering it) and missed the keyed rows held by a dead hold.
func TestBulkReplayPassesTheSingleReplayRule(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bulk_outbox", schema.WithMode(schema.ModeOrdered))
	below := enqueueKeys(t, pool, tbl, "legacy-below", "held", "skip")
	exec(t, pool, tbl, `UPDATE `+tbl.PartitionsTable()+` SET floor_sequence = (SELECT max(sequence) FROM %s)`)
	above := enqueueKeys(t, pool, tbl, "legacy-above", "")
	legacyBelow, held, skip, legacyAbove, unkeyed := below[0], below[1], below[2], above[0], above[1]
	// Died in default mode before the switch: dead_at on the row.
	markDead(t, pool, tbl, "died before the switch", legacyBelow, legacyAbove, unkeyed)
	hold(t, pool, tbl, held, "dead")
	hold(t, pool, tbl, skip, "dead")
	exec(t, pool, tbl, `UPDATE `+tbl.HoldsTable()+` SET skip_requested_at = now() WHERE ordering_key = 'skip'`)

	refusedAlone := map[uuid.UUID]error{}
	for _, id := range []uuid.UUID{legacyBelow, held, skip, legacyAbove, unkeyed} {
		_, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{DryRun: true})
		refusedAlone[id] = err
	}
	if !errors.Is(refusedAlone[legacyAbove], runbook.ErrNotRelayedYet) || !errors.Is(refusedAlone[skip], runbook.ErrHoldRefused) ||
		refusedAlone[legacyBelow] != nil || refusedAlone[held] != nil || refusedAlone[unkeyed] != nil {
		t.Fatalf("single replays (dry run): %v", refusedAlone)
	}

	f := runbook.DeadFilter{Topic: topicA}
	p, err := runbook.New(pool, tbl).ReplayDead(ctx, f, true)
	if err != nil {
		t.Fatal(err)
	}
	if p.Rows != 3 || p.LeftAlone != 2 || p.Snapshot.MaxSequence != seqOf(t, pool, tbl, unkeyed) {
		t.Fatalf("preview: %d rows, %d left alone, snapshot %+v; want the 3 rows a single replay accepts, 2 left alone", p.Rows, p.LeftAlone, p.Snapshot)
	}
	before := states(t, pool, tbl, []uuid.UUID{legacyAbove})
	f.Expect = &p.Snapshot
	res, err := runbook.New(pool, tbl).ReplayDead(ctx, f, false)
	if err != nil || res.Rows != 3 || res.LeftAlone != 2 {
		t.Fatalf("replay of the preview: %+v, %v", res, err)
	}
	assertSet(t, "replayed", res.EventIDs, legacyBelow, held, unkeyed)
	assertUnchanged(t, "the keyed row above its floor", before, states(t, pool, tbl, []uuid.UUID{legacyAbove}))
	if st, ok, err := runbook.New(pool, tbl).HoldOfEvent(ctx, skip); err != nil || !ok || st != runbook.HoldSkipRequested {
		t.Fatalf("the hold whose skip is requested: %v %v %v", st, ok, err)
	}
	if st, ok, err := runbook.New(pool, tbl).HoldOfEvent(ctx, held); err != nil || !ok || st != runbook.HoldRetrying {
		t.Fatalf("the dead hold after the bulk replay: %v %v %v, want retrying (due now)", st, ok, err)
	}
	if st, ok, err := runbook.New(pool, tbl).HoldOfEvent(ctx, legacyBelow); err != nil || !ok || st != runbook.HoldReplay {
		t.Fatalf("the keyed row below its floor after the bulk replay: %v %v %v, want a replay hold", st, ok, err)
	}
	if r, err := runbook.New(pool, tbl).Event(ctx, unkeyed); err != nil || r.DeadAt != nil || r.Attempts != 0 {
		t.Fatalf("the unkeyed row after the bulk replay: %+v, %v", r, err)
	}
	// A second bulk replay finds nothing the rule accepts, and still
	// leaves the two refused rows alone.
	again, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{AllTopics: true}, false)
	if err != nil || again.Rows != 0 || again.LeftAlone != 2 {
		t.Fatalf("second bulk replay: %+v, %v", again, err)
	}
	assertUnchanged(t, "the keyed row above its floor", before, states(t, pool, tbl, []uuid.UUID{legacyAbove}))
}

// seqOf is the sequence of event id.
func seqOf(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestModeSwitchIsExplicit: Migrate with WithMode records a table's mode
// (outbox migrate --ordered, --mode=default) and refuses to switch it
// while relays of the recorded mode are subscribed, changing nothing; a
// relay records its own mode when it starts.
func TestModeSwitchIsExplicit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "switch_outbox")
	mode := func() schema.Mode {
		t.Helper()
		m, err := runbook.New(pool, tbl).Mode(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	stop := relayOf(t, pool, tbl, false, nil, nil)
	err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeOrdered))
	if !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("switch to ordered while a default relay runs: %v, want ErrRelayModeMix", err)
	}
	if cols, err := schema.DetectColumns(ctx, pool, tbl); err != nil || cols.OrderingKey || mode() != schema.ModeDefault {
		t.Fatalf("a refused switch changed the table: %+v, %v, mode %s", cols, err, mode())
	}
	stop()
	// The default relay's session may end on the server a moment after
	// Close returned.
	eventually(t, "the switch to ordered", func() bool {
		err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeOrdered))
		if err != nil && !errors.Is(err, schema.ErrRelayModeMix) {
			t.Fatal(err)
		}
		return err == nil
	})
	if m := mode(); m != schema.ModeOrdered {
		t.Fatalf("after the switch: mode %s, want ordered", m)
	}
	stop = relayOf(t, pool, tbl, true, nil, nil)
	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeDefault)); !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("switch back while an ordered relay runs: %v, want ErrRelayModeMix", err)
	}
	if m := mode(); m != schema.ModeOrdered {
		t.Fatalf("after a refused switch back: mode %s", m)
	}
	// A plain Migrate (every process may run it at start) leaves the
	// record alone.
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil || mode() != schema.ModeOrdered {
		t.Fatalf("plain migrate: %v, mode %s", err, mode())
	}
	stop()
	eventually(t, "the switch back to default", func() bool {
		err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeDefault))
		if err != nil && !errors.Is(err, schema.ErrRelayModeMix) {
			t.Fatal(err)
		}
		return err == nil
	})
	if m := mode(); m != schema.ModeDefault {
		t.Fatalf("after the switch back: mode %s, want default", m)
	}
	// A relay records its own mode when it starts.
	relayOf(t, pool, tbl, true, nil, nil)
	if m := mode(); m != schema.ModeOrdered {
		t.Fatalf("after an ordered relay started: mode %s, want ordered", m)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeWAL)); err == nil {
		t.Fatal("Migrate recorded the WAL mode, which walrelay.Setup records")
	}
}
