package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The tests of this file reproduce the defects an adversarial review of
// ordered mode found (issue 20, items 1-7); each failed on the design with
// one global cut and holds that could disagree with the floor.

// consumeAsync handles each message of one subscription in its own
// goroutine, so that a slow handler of one key does not hold the others
// back (ordered mode has one message in flight per key). handle returns
// true to ack.
func consumeAsync(t *testing.T, s *subscriber.Subscriber, rec *recorder, handle func(*message.Message) bool) {
	t.Helper()
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("%p", s)
	name = name[len(name)-4:]
	go func() {
		for msg := range ch {
			go func(msg *message.Message) {
				msg.Metadata.Set("relay", name)
				rec.deliver(msg)
				if handle != nil && !handle(msg) {
					msg.Nack()
					return
				}
				rec.ack(msg)
				msg.Ack()
			}(msg)
		}
	}()
}

// otherSlots returns n keys, each in its own partition, none in k's.
func otherSlots(t *testing.T, pool *pgxpool.Pool, k string, n int) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT DISTINCT ON (hashtext('o' || g) & 63) 'o' || g
FROM generate_series(1, 10000) AS g WHERE hashtext('o' || g) & 63 <> hashtext($1) & 63
ORDER BY hashtext('o' || g) & 63, g LIMIT $2`, k, n)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if len(out) != n {
		t.Fatalf("found %d keys in other partitions, want %d", len(out), n)
	}
	return out
}

// tableScans is how many scans (sequential and index) of table t the
// statistics collector has counted.
func tableScans(t *testing.T, pool *pgxpool.Pool, tbl string) int64 {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	var n int64
	if _, err := conn.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `SELECT COALESCE(seq_scan, 0) + COALESCE(idx_scan, 0) FROM pg_stat_user_tables
WHERE relid = $1::regclass`, tbl).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// scanRate measures the scans per second of the tables over d (the
// statistics are flushed by each backend at most once a second, so d
// should be several seconds).
func scanRate(t *testing.T, pool *pgxpool.Pool, d time.Duration, tables ...string) float64 {
	t.Helper()
	count := func() int64 {
		var n int64
		for _, tb := range tables {
			n += tableScans(t, pool, tb)
		}
		return n
	}
	time.Sleep(1500 * time.Millisecond) // let earlier statistics reach the collector
	start := count()
	time.Sleep(d)
	return float64(count()-start) / d.Seconds()
}

func holdCount(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, where string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.HoldsTable()+` WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOrderedOpenWriterStallsOnlyItsKey (item 1): a transaction that
// enqueued a keyed row stays open; 60 rows of other keys, in other
// partitions and in its own, all flow with BatchSize 5, and the waiting
// relay does not spin.
func TestOrderedOpenWriterStallsOnlyItsKey(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	k := "open-key"
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	openEv := uuid.New()
	if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: openEv,
		Payload: json.RawMessage(`{}`), OrderingKey: k}); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 5
	cfg.PollInterval = 10 * time.Minute // a delivery within the 2-minute waits is not the poll's
	var stmts atomic.Int64
	relayPool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = statementCounter{&stmts} })
	s := orderedSub(t, relayPool, cfg)
	consume(t, s, rec, nil)
	keys := append(otherSlots(t, pool, k, 2), sameSlot(t, pool, k))
	var evs []keyed
	for i := 0; i < 20; i++ {
		evs = append(evs, enqueueKeyed(t, pool, tbl, keys...)...)
	}
	rec.waitAcked(t, evs, 2*time.Minute)
	rec.checkOrder(t)
	// Waiting for the open writer, the relay does not spin: it polls the
	// cut (no table read) every few milliseconds at most. Statements are
	// counted on the relay's own pool (table scans show up in the
	// statistics only seconds later).
	before := stmts.Load()
	time.Sleep(3 * time.Second)
	rate := float64(stmts.Load()-before) / 3
	t.Logf("%.1f statements/s from the relay while a writer stays open", rate)
	if rate > 150 {
		t.Fatalf("%.1f statements/s while waiting for an open writer: the relay spins", rate)
	}
	if rec.isAcked(openEv) {
		t.Fatal("uncommitted row delivered")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, []keyed{{k, openEv}}, 2*time.Minute)
}

// TestOrderedResolvedHoldBelowFloor (item 2): key K is nacked once then
// acked while a lower row of another key of its partition is still in
// flight; the partition keeps flowing and its floor reaches the end once
// the slow row is acked.
func TestOrderedResolvedHoldBelowFloor(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	slowKey := "slow"
	k := sameSlot(t, pool, slowKey)
	slow := enqueueKeyed(t, pool, tbl, slowKey)
	failOnce := enqueueKeyed(t, pool, tbl, k)
	var nacked atomic.Bool
	release := make(chan struct{})
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 2
	s := orderedSub(t, pool, cfg)
	consumeAsync(t, s, rec, func(msg *message.Message) bool {
		switch msg.UUID {
		case slow[0].event.String():
			<-release
		case failOnce[0].event.String():
			return !nacked.CompareAndSwap(false, true)
		}
		return true
	})
	rec.waitAcked(t, failOnce, 2*time.Minute)
	var later []keyed
	for i := 0; i < 12; i++ {
		later = append(later, enqueueKeyed(t, pool, tbl, k)...)
	}
	rec.waitAcked(t, later, 2*time.Minute)
	close(release)
	rec.waitAcked(t, slow, 2*time.Minute)
	rec.checkOrder(t)
	var last int64
	if err := pool.QueryRow(context.Background(), `SELECT max(sequence) FROM `+tbl.Sanitize()).Scan(&last); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "floor reaches the last row", 2*time.Minute, func() bool { return partitionFloor(t, pool, tbl, k) >= last })
	waitFor(t, "no hold left", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "true") == 0 })
}

// TestOrderedSkipSurvivesHandover (item 3): a row skipped while an earlier
// row of its partition is in flight is not delivered again by the next
// owner, and its key is not held again.
func TestOrderedSkipSurvivesHandover(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	slowKey := "slow"
	k := sameSlot(t, pool, slowKey)
	slow := enqueueKeyed(t, pool, tbl, slowKey)
	bad := enqueueKeyed(t, pool, tbl, k)
	recA := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 1
	cfg.CloseTimeout = 100 * time.Millisecond
	a := orderedSub(t, pool, cfg)
	block := make(chan struct{})
	defer close(block)
	consumeAsync(t, a, recA, func(msg *message.Message) bool {
		if msg.UUID == slow[0].event.String() {
			<-block // never acked by a
			return false
		}
		return msg.UUID != bad[0].event.String()
	})
	waitFor(t, "dead hold", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "dead_at IS NOT NULL") == 1 })
	sk, err := runbook.New(pool, tbl).SkipEvent(ctx, bad[0].event, false)
	if err != nil || sk.Changed != 1 {
		t.Fatalf("skip: %+v %v", sk, err)
	}
	waitFor(t, "skip applied", 2*time.Minute, func() bool {
		return holdCount(t, pool, tbl, "skip_requested_at IS NOT NULL OR dead_at IS NOT NULL") == 0
	})
	after := enqueueKeyed(t, pool, tbl, k)
	recA.waitAcked(t, after, 2*time.Minute)
	if f := partitionFloor(t, pool, tbl, k); f >= slowSeq(t, pool, tbl, slow[0]) {
		t.Fatalf("floor %d passed the row in flight", f)
	}
	subscriber.Abandon(a)
	_ = a.Close()

	recB := newRecorder()
	b := orderedSub(t, pool, cfg)
	consumeAsync(t, b, recB, nil)
	more := enqueueKeyed(t, pool, tbl, k)
	recB.waitAcked(t, append(slow, more...), 2*time.Minute)
	recB.mu.Lock()
	again := recB.seen[bad[0].event.String()]
	recB.mu.Unlock()
	if again {
		t.Fatal("the skipped row was delivered again after the handover")
	}
	if n := holdCount(t, pool, tbl, "resolved_at IS NULL"); n != 0 {
		dumpOrdered(t, pool, tbl)
		t.Fatalf("%d active holds after the handover, want none", n)
	}
}

func slowSeq(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, e keyed) int64 {
	t.Helper()
	var s int64
	if err := pool.QueryRow(context.Background(), `SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $1`, e.event).Scan(&s); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestOrderedSkipDuringRetryInFlight (item 4): a skip of a retrying row
// whose retry is in flight is honoured when that retry fails: the row is
// not tried again and its key moves on.
func TestOrderedSkipDuringRetryInFlight(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	evs := enqueueKeyed(t, pool, tbl, "r", "r")
	var attempts atomic.Int32
	inSecond := make(chan struct{})
	proceed := make(chan struct{})
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 10
	s := orderedSub(t, pool, cfg)
	consumeAsync(t, s, rec, func(msg *message.Message) bool {
		if msg.UUID != evs[0].event.String() {
			return true
		}
		if attempts.Add(1) == 2 {
			close(inSecond)
			<-proceed
		}
		return false
	})
	select {
	case <-inSecond:
	case <-time.After(2 * time.Minute):
		t.Fatal("no retry")
	}
	sk, err := runbook.New(pool, tbl).SkipEvent(ctx, evs[0].event, false)
	if err != nil || sk.Changed != 1 {
		t.Fatalf("skip while the retry is in flight: %+v %v", sk, err)
	}
	close(proceed) // the retry fails
	rec.waitAcked(t, evs[1:], 2*time.Minute)
	time.Sleep(300 * time.Millisecond)
	if n := attempts.Load(); n != 2 {
		t.Fatalf("the skipped row was tried %d times, want 2 (no retry after the skip)", n)
	}
	waitFor(t, "no active hold", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "resolved_at IS NULL") == 0 })
}

// TestOrderedNackAfterHandover (item 5): the old owner acked K's first row
// and holds K at its second when it dies, with the partition's floor below
// both (a row of another key is in flight). The next owner does not
// deliver the acked row before the held one, delivers the held row again
// (retrying it while it nacks) and then the rest of K, in order.
func TestOrderedNackAfterHandover(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	slowKey := "slow"
	k := sameSlot(t, pool, slowKey)
	slow := enqueueKeyed(t, pool, tbl, slowKey)
	kEvs := enqueueKeyed(t, pool, tbl, k, k, k)
	recA := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.CloseTimeout = 100 * time.Millisecond
	cfg.Backoff = func(int) time.Duration { return 200 * time.Millisecond }
	a := orderedSub(t, pool, cfg)
	block := make(chan struct{})
	defer close(block)
	consumeAsync(t, a, recA, func(msg *message.Message) bool {
		switch msg.UUID {
		case slow[0].event.String():
			<-block
			return false
		case kEvs[1].event.String():
			return false
		}
		return true
	})
	recA.waitAcked(t, kEvs[:1], 2*time.Minute)
	waitFor(t, "hold at K's second row", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "attempts >= 1") == 1 })
	subscriber.Abandon(a)
	_ = a.Close()

	recB := newRecorder()
	var nacks atomic.Int32
	b := orderedSub(t, pool, cfg)
	consumeAsync(t, b, recB, func(msg *message.Message) bool {
		if msg.UUID == kEvs[1].event.String() && nacks.Add(1) <= 2 {
			return false
		}
		return true
	})
	recB.waitAcked(t, append(slow, kEvs[1:]...), 2*time.Minute)
	recB.checkOrder(t)
	recB.mu.Lock()
	trace := recB.trace[k]
	recB.mu.Unlock()
	if n := nacks.Load(); n < 3 {
		t.Fatalf("held row delivered %d times by the next owner, want 3 (two nacks, then ack): %v", n, trace)
	}
	// K's rows after the takeover: the held row (three times) then the third.
	want := []string{"a2", "a3", "a4"}
	if len(trace) < 4 {
		t.Fatalf("key %s deliveries %v", k, trace)
	}
	for i, w := range want {
		if got := trace[i]; len(got) < len(w) || got[len(got)-len(w):] != w {
			t.Fatalf("key %s deliveries %v, want the held row's attempts %v first", k, trace, want)
		}
	}
	var last int64
	if err := pool.QueryRow(context.Background(), `SELECT max(sequence) FROM `+tbl.Sanitize()).Scan(&last); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "floor reaches the last row", 2*time.Minute, func() bool { return partitionFloor(t, pool, tbl, k) >= last })
}

// TestOrderedReplayKeyedRow (item 6): a replay of a keyed row that was
// skipped, or acked, delivers it once more; a replay of a row above its
// partition's floor is refused with a clear error.
func TestOrderedReplayKeyedRow(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	evs := enqueueKeyed(t, pool, tbl, "p", "p", "q")
	var failing sync.Map
	failing.Store(evs[0].event.String(), true)
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 1
	s := orderedSub(t, pool, cfg)
	var deliveries sync.Map // event -> count
	consumeAsync(t, s, rec, func(msg *message.Message) bool {
		v, _ := deliveries.LoadOrStore(msg.UUID, new(atomic.Int32))
		v.(*atomic.Int32).Add(1)
		_, bad := failing.Load(msg.UUID)
		return !bad
	})
	rec.waitAcked(t, evs[2:], 2*time.Minute)
	waitFor(t, "dead hold", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "dead_at IS NOT NULL") == 1 })
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, evs[0].event, false); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, evs[1:2], 2*time.Minute)
	failing.Delete(evs[0].event.String())
	count := func(e keyed) int32 {
		v, ok := deliveries.Load(e.event.String())
		if !ok {
			return 0
		}
		return v.(*atomic.Int32).Load()
	}
	// The skipped row's tombstone goes once the floor passes it; until
	// then the replay is refused with a reason.
	var rep runbook.EventReplay
	waitFor(t, "replay of the skipped row accepted", 2*time.Minute, func() bool {
		var err error
		rep, err = runbook.New(pool, tbl).ReplayEvent(ctx, evs[0].event, runbook.ReplayOptions{})
		return err == nil
	})
	if rep.Changed != 1 {
		t.Fatalf("replay of the skipped row: %+v", rep)
	}
	waitFor(t, "skipped row delivered after its replay", 2*time.Minute, func() bool { return rec.isAcked(evs[0].event) })
	before := count(evs[2])
	rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, evs[2].event, runbook.ReplayOptions{})
	if err != nil || rep.Changed != 1 {
		t.Fatalf("replay of an acked keyed row: %+v %v", rep, err)
	}
	waitFor(t, "acked row delivered once more", 2*time.Minute, func() bool { return count(evs[2]) == before+1 })
	waitFor(t, "no hold left", 2*time.Minute, func() bool { return holdCount(t, pool, tbl, "true") == 0 })

	// A row above the floor (its transaction still open elsewhere keeps the
	// floor below it) is refused: it has not been relayed yet.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: uuid.New(),
		Payload: json.RawMessage(`{}`), OrderingKey: "p"}); err != nil {
		t.Fatal(err)
	}
	later := enqueueKeyed(t, pool, tbl, "q")
	_, err = runbook.New(pool, tbl).ReplayEvent(ctx, later[0].event, runbook.ReplayOptions{})
	if err == nil {
		// It may have been relayed already if the floor passed it: q is
		// another key, and only p waits for the open writer.
		waitFor(t, "replayed row delivered", 2*time.Minute, func() bool { return count(later[0]) >= 1 })
		return
	}
	if !errors.Is(err, runbook.ErrNotRelayedYet) {
		t.Fatalf("replay of a row not relayed yet: %v, want ErrNotRelayedYet", err)
	}
}

// TestOrderedIdleFleet (item 7): two idle ordered relays (own pools, as two
// processes) with PollInterval 10 m cost the database at most 20 table
// scans a second together, and each is woken within moments of a commit,
// not at its poll: a delivery within the 2-minute wait is not the poll's,
// however slow the machine.
func TestOrderedIdleFleet(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	cfg := orderedCfg(tbl)
	cfg.PollInterval = 10 * time.Minute
	rec := newRecorder()
	for i := 0; i < 2; i++ {
		p := testdb.NewPool(t, nil)
		consume(t, orderedSub(t, p, cfg), rec, nil)
	}
	waitFor(t, "two relays share the partitions", 2*time.Minute, func() bool {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(DISTINCT owner) FROM `+tbl.PartitionsTable()+` WHERE lease_until > now()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 2
	})
	// Wait for the partitions to settle (a taken-over partition's holds are
	// read once).
	prev, stable := "", 0
	waitFor(t, "stable partition owners", 2*time.Minute, func() bool {
		var owners string
		if err := pool.QueryRow(context.Background(), `SELECT string_agg(partition || ':' || COALESCE(owner, ''), ',' ORDER BY partition) FROM `+tbl.PartitionsTable()).Scan(&owners); err != nil {
			t.Fatal(err)
		}
		if owners == prev {
			stable++
		} else {
			prev, stable = owners, 0
		}
		return stable >= 50 // 1 s unchanged
	})
	rate := scanRate(t, pool, 5*time.Second, tbl.String(), tbl.HoldsTable())
	t.Logf("two idle ordered relays: %.1f scans/s of the outbox and holds tables", rate)
	if rate > 20 {
		t.Errorf("two idle ordered relays scan %.1f times a second, want at most 20", rate)
	}
	keys := otherSlots(t, pool, "none", 16)
	start := time.Now()
	evs := enqueueKeyed(t, pool, tbl, keys...)
	rec.waitAcked(t, evs, 2*time.Minute, func() {
		t.Errorf("the idle relays were not woken by the commit (PollInterval %s)", cfg.PollInterval)
	})
	t.Logf("idle relays delivered 16 keys (both relays' partitions) %s after their commit (PollInterval %s)", time.Since(start).Round(time.Millisecond), cfg.PollInterval)
}

// TestOrderedNeedsHoldStates: a table migrated by an earlier version
// (holds without the one holds table's columns, without the hold states,
// partitions without the term) is refused with the migration to run, and
// migration 000011 brings a holds table with live holds to the shape both
// keyed modes share: each hold keeps its state, read from the generated
// state column.
func TestOrderedNeedsHoldStates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeOrdered, "test"); err != nil {
		t.Fatal(err) // as the older version's relays left it
	}
	rows := enqueueKeyed(t, pool, tbl, "dead", "dead", "retry", "skip", "replay", "done")
	// Live holds, as an ordered relay of an older version leaves them.
	for _, h := range []struct {
		key, set string
	}{
		{"dead", `dead_at = now(), available_at = 'infinity', attempts = 3, last_error = 'poison'`},
		{"retry", `available_at = now() + interval '1 hour', attempts = 1, last_error = 'transient'`},
		{"skip", `dead_at = now(), available_at = 'infinity', skip_requested_at = now()`},
		{"replay", `replay = true`},
		{"done", `resolved_at = now()`},
	} {
		if _, err := pool.Exec(ctx, `INSERT INTO `+tbl.HoldsTable()+` (ordering_key, partition, sequence)
  SELECT ordering_key, ordering_partition, min(sequence) FROM `+tbl.Sanitize()+` WHERE ordering_key = $1 GROUP BY 1, 2`, h.key); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `UPDATE `+tbl.HoldsTable()+` SET `+h.set+` WHERE ordering_key = $1`, h.key); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000011", "down")); err != nil {
		t.Fatal(err)
	}
	_, err := subscriber.New(ctx, pool, orderedCfg(tbl), nil)
	if !errors.Is(err, subscriber.ErrOrderedNotMigrated) || !strings.Contains(err.Error(), "000011") ||
		!strings.Contains(err.Error(), "outbox migrate --ordered") {
		t.Fatalf("ordered relay on a holds table without the one holds table's columns: %v", err)
	}
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000011", "up")); err != nil {
		t.Fatal(err)
	}
	list, err := runbook.New(pool, tbl).ListHolds(ctx, runbook.HoldsFilter{Resolved: true})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]runbook.HoldState{}
	for _, h := range list {
		got[h.Key] = h.State
	}
	want := map[string]runbook.HoldState{"dead": runbook.HoldDead, "retry": runbook.HoldRetrying, "skip": runbook.HoldSkipRequested,
		"replay": runbook.HoldReplay, "done": runbook.HoldResolved}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("holds after migration 000011: %v, want %v", got, want)
	}
	// The relay of this version starts on it, delivers the free key and
	// applies the requested skip; the dead key stays held.
	s, err := subscriber.New(ctx, pool, orderedCfg(tbl), nil)
	if err != nil {
		t.Fatalf("after migration 000011: %v", err)
	}
	rec := newRecorder()
	consume(t, s, rec, nil)
	rec.waitAcked(t, []keyed{rows[4]}, 2*time.Minute, func() { t.Error("the replayed row was not delivered") })
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(50 * time.Millisecond) {
		open := map[string]runbook.HoldState{}
		list, err := runbook.New(pool, tbl).ListHolds(ctx, runbook.HoldsFilter{})
		if err != nil {
			t.Fatal(err)
		}
		for _, h := range list {
			open[h.Key] = h.State
		}
		if fmt.Sprint(open) == fmt.Sprint(map[string]runbook.HoldState{"dead": runbook.HoldDead, "retry": runbook.HoldRetrying}) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("open holds with the relay running: %v, want the dead and the retrying key's only (the skip applied, the replay delivered)", open)
		}
	}
	if _ = s.Close(); rec.isAcked(rows[1].event) || rec.isAcked(rows[3].event) || rec.isAcked(rows[5].event) {
		t.Errorf("delivered: the row behind the dead hold %v, the skipped row %v, the resolved hold's row %v; want none", rec.isAcked(rows[1].event),
			rec.isAcked(rows[3].event), rec.isAcked(rows[5].event))
	}

	// The hold states of migration 000005 likewise (their down migration
	// drops the state column that depends on them).
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000005", "down")); err != nil {
		t.Fatal(err)
	}
	_, err = subscriber.New(ctx, pool, orderedCfg(tbl), nil)
	if !errors.Is(err, subscriber.ErrOrderedNotMigrated) || !strings.Contains(err.Error(), "000005") {
		t.Fatalf("ordered relay on holds without the hold states: %v", err)
	}
	for _, step := range []string{"000005", "000011"} {
		if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, step, "up")); err != nil {
			t.Fatal(err)
		}
	}
	if s, err = subscriber.New(ctx, pool, orderedCfg(tbl), nil); err != nil {
		t.Fatalf("after the migrations: %v", err)
	}
	_ = s.Close()
	// The partitions' term (migration 000006) likewise.
	if _, err := pool.Exec(ctx, testdb.MigrationSQL(t, tbl, "000006", "down")); err != nil {
		t.Fatal(err)
	}
	_, err = subscriber.New(ctx, pool, orderedCfg(tbl), nil)
	if !errors.Is(err, subscriber.ErrOrderedNotMigrated) || !strings.Contains(err.Error(), "000006") {
		t.Fatalf("ordered relay on partitions without the term: %v", err)
	}
	// What the error says to run (schema.Migrate, as `outbox migrate
	// --ordered` does) adds it.
	if err := schema.Migrate(ctx, pool, tbl, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatal(err)
	}
	if s, err = subscriber.New(ctx, pool, orderedCfg(tbl), nil); err != nil {
		t.Fatalf("after schema.Migrate: %v", err)
	}
	_ = s.Close()
}

// statementCounter counts the statements sent on a pool, batched or not.
type statementCounter struct{ n *atomic.Int64 }

func (c statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.n.Add(1)
	return ctx
}

func (c statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c statementCounter) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return ctx
}

func (c statementCounter) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {
	c.n.Add(1)
}

func (c statementCounter) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}
