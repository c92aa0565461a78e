package runbook_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	statemodel "github.com/outboxkit/watermill-outbox/internal/state"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// enqueueKeys commits one event per key (an empty key: unkeyed), in order,
// and returns their event_ids.
func enqueueKeys(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys ...string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	msgs := make([]publisher.Message, len(keys))
	ids := make([]uuid.UUID, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: tenantA, Topic: topicA, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	// A new Enqueuer each time: an Enqueuer caches a table's columns on
	// first use, and these tests add the ordering column in place.
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := enq.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return ids
}

// hold writes the hold of the key of event id at that event's row, as the
// ordered relay writes it; state is "retrying", "dead", "resolved" or
// "replay".
func hold(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID, state string) {
	t.Helper()
	exec(t, pool, tbl, `INSERT INTO `+tbl.HoldsTable()+` (ordering_key, partition, sequence, attempts, available_at, last_error, dead_at, resolved_at, replay)
SELECT ordering_key, ordering_partition, sequence,
  CASE $2 WHEN 'dead' THEN 25 WHEN 'retrying' THEN 2 ELSE 0 END,
  CASE $2 WHEN 'dead' THEN 'infinity'::timestamptz WHEN 'retrying' THEN now() + interval '1 minute' ELSE now() END,
  CASE $2 WHEN 'dead' THEN 'broker said no' WHEN 'retrying' THEN 'flaky' END,
  CASE $2 WHEN 'dead' THEN now() END, CASE $2 WHEN 'resolved' THEN now() END, $2 = 'replay'
FROM %s WHERE event_id = $1`, id, state)
}

// TestOrderedTableStateIsTrue drives an ordered table to a known mix (rows
// below the floors, a dead hold with a row waiting behind it, a retrying
// hold, a skip, a resolved hold above the floor, a replay, fresh rows, and
// unkeyed pending, dead and published rows) written as the ordered relay
// writes its floors and holds, and checks that Stats, Backlog, Dead, Topics,
// Event and the gauge statement all report exactly that mix.
func TestOrderedTableStateIsTrue(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "ord_outbox", schema.WithMode(schema.ModeOrdered))

	// Relayed before the floors: done x3; the dead key's first row is
	// acked, its second is dead, its third waits; the retrying key's first
	// retries, its second waits; a skipped row; a row replayed later.
	before := enqueueKeys(t, pool, tbl, "done", "done", "done", "dead", "dead", "dead", "retry", "retry", "skip", "replay")
	exec(t, pool, tbl, `UPDATE `+tbl.PartitionsTable()+` SET floor_sequence = (SELECT max(sequence) FROM %s)`)
	after := enqueueKeys(t, pool, tbl, "fresh", "fresh", "skip", "acked-above-floor", "", "", "")
	hold(t, pool, tbl, before[4], "dead")
	hold(t, pool, tbl, before[6], "retrying")
	hold(t, pool, tbl, before[8], "resolved")
	exec(t, pool, tbl, `UPDATE %s SET skipped_at = now() WHERE event_id = $1`, before[8])
	hold(t, pool, tbl, before[9], "replay")
	hold(t, pool, tbl, after[3], "resolved") // acked, the floor not written yet
	markDead(t, pool, tbl, "unkeyed boom", after[5])
	exec(t, pool, tbl, `UPDATE %s SET published_at = now() WHERE event_id = $1`, after[6])

	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// pending: dead key's waiting row, the retrying row and the row behind
	// it, the replay, 2 fresh, the skipped key's next row, 1 unkeyed.
	want := runbook.TableStats{Table: tbl.String(), Mode: schema.ModeOrdered, Pending: 8, Retrying: 1, Dead: 2, WaitingBehindHeldKeys: 2,
		HeldKeys: 3, DeadHeldKeys: 1, ReplaysDue: 1, PublishedLastHour: 1, PublishedLastMinute: 1}
	got := s
	got.OldestPendingCreatedAt, got.OldestPendingAgeSeconds = nil, 0
	if got != want {
		t.Fatalf("Stats:\n got %+v\nwant %+v", got, want)
	}
	if s.OldestPendingCreatedAt == nil || s.OldestPendingAgeSeconds > 60 {
		t.Fatalf("oldest pending: %v, %v s", s.OldestPendingCreatedAt, s.OldestPendingAgeSeconds)
	}

	backlog, err := runbook.New(pool, tbl).Backlog(ctx, runbook.BacklogOptions{})
	if err != nil {
		t.Fatal(err)
	}
	assertSet(t, "backlog", eventIDs(backlog), before[5], before[6], before[7], before[9], after[0], after[1], after[2], after[4])

	dead, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
	if err != nil {
		t.Fatal(err)
	}
	assertIDs(t, "dead", dead, before[4], after[5])
	if d := dead[0]; d.Attempts != 25 || d.LastError == nil || *d.LastError != "broker said no" || d.DeadAt == nil || !d.Held ||
		d.OrderingKey == nil || *d.OrderingKey != "dead" {
		t.Fatalf("dead held row: %+v", d)
	}
	if dead, err = runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{ErrorContains: "BROKER"}); err != nil || len(dead) != 1 {
		t.Fatalf("dead rows with 'broker': %d, %v", len(dead), err)
	}

	topics, err := runbook.New(pool, tbl).Topics(ctx, 0)
	if err != nil || len(topics) != 1 || topics[0].Pending != 8 || topics[0].Dead != 2 || topics[0].Retrying != 1 {
		t.Fatalf("topics: %+v, %v", topics, err)
	}

	type ev struct {
		delivered, skipped, held, dead, replay bool
		behind                                 bool
		attempts                               int
	}
	for i, c := range []struct {
		id   uuid.UUID
		want ev
	}{
		{before[0], ev{delivered: true}},
		{before[3], ev{delivered: true}},
		{before[4], ev{held: true, dead: true, attempts: 25}},
		{before[5], ev{behind: true}},
		{before[6], ev{held: true, attempts: 2}},
		{before[8], ev{skipped: true}},
		{before[9], ev{replay: true}},
		{after[0], ev{}},
		{after[3], ev{delivered: true}},
		{after[5], ev{dead: true, attempts: 25}}, // markDead sets attempts
		{after[6], ev{delivered: true}},
	} {
		r, err := runbook.New(pool, tbl).Event(ctx, c.id)
		if err != nil {
			t.Fatal(err)
		}
		g := ev{r.Delivered, r.Skipped, r.Held, r.DeadAt != nil, r.ReplayDue, r.WaitingBehind != nil, r.Attempts}
		if g != c.want {
			t.Errorf("event %d: %+v, want %+v (row %+v)", i, g, c.want, r)
		}
	}

	// The gauges' statement agrees with Stats.
	var pending, locked, deadN int64
	var oldest float64
	gq := sqlq.NewStateQueries(tbl, schema.ModeOrdered, schema.Columns{OrderingKey: true})
	if err := pool.QueryRow(ctx, gq.Gauges()).Scan(&pending, &locked, &deadN, &oldest); err != nil {
		t.Fatal(err)
	}
	if pending != s.Pending || deadN != s.Dead || locked != s.Locked {
		t.Fatalf("gauges: pending %d dead %d locked %d; stats %+v", pending, deadN, locked, s)
	}
	// What the relay's gauges compute today (sqlq.OrderedQueries.Stats),
	// for the record: it counts the acked row above the floor as pending.
	oq := sqlq.NewOrderedQueries(tbl, schema.Columns{OrderingKey: true})
	if err := pool.QueryRow(ctx, oq.Stats).Scan(&pending, &locked, &deadN, &oldest); err != nil {
		t.Fatal(err)
	}
	t.Logf("OrderedQueries.Stats (before the gauges read the state queries): pending %d, dead %d; state layer: pending %d, dead %d", pending, deadN, s.Pending, s.Dead)

	// The console shows the same: /api/counts is Stats, and the event page
	// of the dead held row shows the hold's attempts and error.
	cs := ConsoleCounts(t, pool, tbl)
	cs.OldestPendingCreatedAt, cs.OldestPendingAgeSeconds = nil, 0
	if cs != want {
		t.Errorf("console /api/counts:\n got %+v\nwant %+v", cs, want)
	}
	page := ConsoleEventPage(t, pool, tbl, before[4])
	for _, w := range []string{"broker said no", "25"} {
		if !strings.Contains(page, w) {
			t.Errorf("the console's page of the dead held row lacks %q", w)
		}
	}
}

// assertSet fails unless got holds exactly want, in any order.
func assertSet(t *testing.T, what string, got []uuid.UUID, want ...uuid.UUID) {
	t.Helper()
	m := map[uuid.UUID]int{}
	for _, id := range got {
		m[id]++
	}
	for _, id := range want {
		m[id]--
	}
	for id, n := range m {
		if n != 0 {
			t.Fatalf("%s: %d rows, want %d; %s off by %d", what, len(got), len(want), id, n)
		}
	}
}

// TestUpgradeDefaultTableToOrdered: a default-mode table with rows in every
// state (published, pending, retrying, dead) is migrated to ordered mode
// with schema.Migrate(..., WithMode(ModeOrdered)) (outbox migrate
// --ordered: it records the switch), gets keyed and unkeyed rows, and is
// relayed by an ordered relay: every row not yet delivered is delivered,
// nothing published before is delivered again, the dead row stays dead,
// and Stats is true before and after.
func TestUpgradeDefaultTableToOrdered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "up_outbox")

	old := enqueueKeys(t, pool, tbl, "", "", "", "", "")
	exec(t, pool, tbl, `UPDATE %s SET published_at = now() - interval '5 minutes' WHERE event_id = $1`, old[0])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 3, last_error = 'flaky', available_at = now() WHERE event_id = $1`, old[2])
	markDead(t, pool, tbl, "boom", old[3])
	s, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil || s.Mode != schema.ModeDefault || s.Pending != 3 || s.Retrying != 1 || s.Dead != 1 {
		t.Fatalf("before the upgrade: %+v, %v", s, err)
	}

	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatalf("upgrade to ordered mode: %v", err)
	}
	s, err = runbook.New(pool, tbl).Stats(ctx)
	if err != nil || s.Mode != schema.ModeOrdered || s.Pending != 3 || s.Retrying != 1 || s.Dead != 1 {
		t.Fatalf("after the upgrade, before relaying: %+v, %v", s, err)
	}
	fresh := enqueueKeys(t, pool, tbl, "k1", "k2", "k1", "", "k2", "k1")

	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		PollInterval: 100 * time.Millisecond, CloseTimeout: 2 * time.Second}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	msgs, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		got = map[string]int{}
	)
	go func() {
		for m := range msgs {
			mu.Lock()
			got[m.UUID]++
			mu.Unlock()
			m.Ack()
		}
	}()
	want := append([]uuid.UUID{old[1], old[2], old[4]}, fresh...)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err = runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		n := 0
		for _, id := range want {
			if got[id.String()] > 0 {
				n++
			}
		}
		mu.Unlock()
		if n == len(want) && s.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("not drained: %d of %d delivered, stats %+v", n, len(want), s)
		}
		time.Sleep(100 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	if got[old[0].String()] != 0 || got[old[3].String()] != 0 {
		t.Fatalf("the published row delivered %d times, the dead row %d times; want 0", got[old[0].String()], got[old[3].String()])
	}
	if s.Dead != 1 || s.Retrying != 0 || s.HeldKeys != 0 || s.PublishedLastHour != 5 {
		t.Fatalf("after relaying: %+v (want dead 1, published last hour 5: the old published row and 4 unkeyed acked)", s)
	}
	for _, id := range fresh {
		r, err := runbook.New(pool, tbl).Event(ctx, id)
		if err != nil || !r.Delivered {
			t.Fatalf("event %s after relaying: %+v, %v", id, r, err)
		}
	}
}

// TestUpgradeWhileDefaultRelayRuns: the upgrade path of a rolling deploy.
// A default-mode relay drains a table while it is migrated to ordered mode;
// an ordered relay refuses to start beside it (schema.ErrRelayModeMix);
// once the default relay stops, the ordered relay delivers every row the
// default relay had not, keyed rows of each key in order; nothing is lost
// and Stats reads 0 pending at the end.
func TestUpgradeWhileDefaultRelayRuns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "roll_outbox")
	cfg := subscriber.Config{Table: tbl, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		PollInterval: 100 * time.Millisecond, CloseTimeout: 2 * time.Second}
	var (
		mu  sync.Mutex
		got = map[string]int{}
		seq = map[string][]int64{} // key -> sequences in delivery order
	)
	consume := func(s *subscriber.Subscriber) {
		msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for m := range msgs {
				n, _ := strconv.ParseInt(m.Metadata.Get(schema.MetadataSequence), 10, 64)
				mu.Lock()
				got[m.UUID]++
				if k := m.Metadata.Get(schema.MetadataOrderingKey); k != "" {
					seq[k] = append(seq[k], n)
				}
				mu.Unlock()
				m.Ack()
			}
		}()
	}
	def, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	consume(def)
	before := enqueueKeys(t, pool, tbl, "", "", "", "")

	if err := schema.Migrate(ctx, pool, tbl, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatalf("upgrade while the default relay runs: %v", err)
	}
	keyed := enqueueKeys(t, pool, tbl, "a", "b", "a", "", "b", "a")
	ocfg := cfg
	ocfg.Ordered = true
	// The refusal reads the default relay's single-active lock: wait until
	// it holds it (its election may not have run yet on a loaded machine).
	for deadline := time.Now().Add(2 * time.Minute); !def.IsLeader(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the default relay was not elected within 2 minutes")
		}
	}
	if _, err := subscriber.New(context.Background(), pool, ocfg, watermill.NopLogger{}); !errors.Is(err, schema.ErrRelayModeMix) {
		t.Fatalf("ordered relay beside the default relay: %v, want ErrRelayModeMix", err)
	}
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}
	after := enqueueKeys(t, pool, tbl, "a", "c", "")
	ord, err := subscriber.New(context.Background(), pool, ocfg, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("ordered relay once the default relay stopped: %v", err)
	}
	t.Cleanup(func() { _ = ord.Close() })
	consume(ord)
	all := append(append(append([]uuid.UUID{}, before...), keyed...), after...)
	// A condition with a generous deadline: the verdict does not depend on
	// the machine's speed.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		missing := 0
		for _, id := range all {
			if got[id.String()] == 0 {
				missing++
			}
		}
		mu.Unlock()
		if missing == 0 && s.Pending == 0 && s.Dead == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events not delivered; stats %+v", missing, len(all), s)
		}
		time.Sleep(100 * time.Millisecond)
	}
	mu.Lock()
	defer mu.Unlock()
	for k, s := range seq {
		for i := 1; i < len(s); i++ {
			if s[i] < s[i-1] {
				t.Errorf("key %s delivered out of order: %v", k, s)
			}
		}
	}
}

// TestSkippedAtMigration: an ordered table of an earlier version records a
// skip as a last_error text and has no skipped_at. The runbook refuses to
// read it (a skipped row would read as delivered) and ordered relays
// refuse it, each naming migration 000012; schema.Migrate (what `outbox
// migrate --ordered` runs, and the shipped 000012) adds the column and
// marks skipped the rows the text recorded as skipped, and only those; the
// runbook then says skipped.
func TestSkippedAtMigration(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "old_outbox", schema.WithMode(schema.ModeOrdered))
	ids := enqueueKeys(t, pool, tbl, "s", "s", "f")
	exec(t, pool, tbl, `UPDATE `+tbl.PartitionsTable()+` SET floor_sequence = (SELECT max(sequence) FROM %s)`)
	hold(t, pool, tbl, ids[0], "resolved")
	exec(t, pool, tbl, `ALTER TABLE %s DROP COLUMN skipped_at`)
	exec(t, pool, tbl, `UPDATE %s SET last_error = 'skipped by an operator at 2026-01-01; was: boom' WHERE event_id = $1`, ids[0])
	exec(t, pool, tbl, `UPDATE %s SET last_error = 'boom' WHERE event_id = $1`, ids[2])

	if _, err := runbook.New(pool, tbl).Stats(ctx); !errors.Is(err, statemodel.ErrNotMigrated) || !strings.Contains(err.Error(), "000012") {
		t.Fatalf("runbook on a table without skipped_at: %v, want state.ErrNotMigrated naming 000012", err)
	}
	if s, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, Ordered: true}, watermill.NopLogger{}); !errors.Is(err, subscriber.ErrOrderedNotMigrated) ||
		!strings.Contains(err.Error(), "000012") {
		if err == nil {
			_ = s.Close()
		}
		t.Fatalf("an ordered relay on a table without skipped_at: %v, want subscriber.ErrOrderedNotMigrated naming 000012", err)
	}
	if err := schema.Migrate(ctx, pool, tbl, schema.WithMode(schema.ModeOrdered)); err != nil {
		t.Fatal(err)
	}
	if ready, _, err := sqlq.OrderedReady(ctx, pool, tbl); err != nil || !ready {
		t.Fatalf("after the migration: ready %t (%v), want ready", ready, err)
	}
	for i, want := range []bool{true, false, false} {
		var skipped bool
		if err := pool.QueryRow(ctx, `SELECT skipped_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[i]).Scan(&skipped); err != nil {
			t.Fatal(err)
		}
		if skipped != want {
			t.Errorf("row %d after the migration: skipped_at set %t, want %t", i, skipped, want)
		}
	}
	ev, err := runbook.New(pool, tbl).Event(ctx, ids[0])
	if err != nil {
		t.Fatal(err)
	}
	if !ev.Skipped || ev.Delivered {
		t.Errorf("the row skipped by an earlier version: skipped %t, delivered %t; want skipped", ev.Skipped, ev.Delivered)
	}
}
