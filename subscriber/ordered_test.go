package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// keyed is one event to enqueue with an ordering key.
type keyed struct {
	key   string
	event uuid.UUID
}

// enqueueKeyed commits one transaction with the events of keys, in order.
func enqueueKeyed(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys ...string) []keyed {
	t.Helper()
	ctx := context.Background()
	out := make([]keyed, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		out[i] = keyed{k, uuid.New()}
		msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: out[i].event,
			Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func orderedCfg(tbl schema.Table) subscriber.Config {
	return subscriber.Config{Table: tbl, Ordered: true, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		PollInterval: 100 * time.Millisecond, BatchSize: 50, CloseTimeout: 2 * time.Second,
		Backoff: func(int) time.Duration { return 20 * time.Millisecond }}
}

// recorder keeps, per key, the sequences in the order of their first
// delivery, and which events were acked.
type recorder struct {
	mu     sync.Mutex
	first  map[string][]int64
	seen   map[string]bool // event_id delivered at least once
	acked  map[string]bool
	dups   int
	change chan struct{}
	trace  map[string][]string // key -> deliveries, for failures
}

func newRecorder() *recorder {
	return &recorder{first: map[string][]int64{}, seen: map[string]bool{}, acked: map[string]bool{}, change: make(chan struct{}, 1),
		trace: map[string][]string{}}
}

func (r *recorder) deliver(msg *message.Message) {
	seq, _ := strconv.ParseInt(msg.Metadata.Get(schema.MetadataSequence), 10, 64)
	r.mu.Lock()
	defer r.mu.Unlock()
	k0 := msg.Metadata.Get(schema.MetadataOrderingKey)
	r.trace[k0] = append(r.trace[k0], fmt.Sprintf("%s:%d/a%s", msg.Metadata.Get("relay"), seq, msg.Metadata.Get(schema.MetadataAttempts)))
	if r.seen[msg.UUID] {
		r.dups++
		return
	}
	r.seen[msg.UUID] = true
	k := msg.Metadata.Get(schema.MetadataOrderingKey)
	r.first[k] = append(r.first[k], seq)
}

func (r *recorder) ack(msg *message.Message) {
	r.mu.Lock()
	r.acked[msg.UUID] = true
	r.mu.Unlock()
	select {
	case r.change <- struct{}{}:
	default:
	}
}

func (r *recorder) isAcked(id uuid.UUID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acked[id.String()]
}

// checkOrder fails for every key whose first deliveries are not in sequence
// order.
func (r *recorder) checkOrder(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, seqs := range r.first {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Errorf("key %s: first deliveries out of order: %v\n%v", k, seqs, r.trace[k])
				break
			}
		}
	}
}

// waitAcked waits until every event is acked, for within but at least 2
// minutes: the deadline only bounds how slow a loaded machine may be (the
// ordered tests' polls, leases and backoffs are a second or less, or, where
// a test tells a wake-up from a poll, 10 minutes).
func (r *recorder) waitAcked(t *testing.T, events []keyed, within time.Duration, onFail ...func()) {
	t.Helper()
	within = max(within, 2*time.Minute)
	deadline := time.After(within)
	for {
		missing := 0
		for _, e := range events {
			if !r.isAcked(e.event) {
				missing++
			}
		}
		if missing == 0 {
			return
		}
		select {
		case <-r.change:
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			for _, f := range onFail {
				f()
			}
			for _, e := range events {
				if !r.isAcked(e.event) {
					t.Logf("missing %s %s", e.key, e.event)
					break
				}
			}
			t.Fatalf("%d of %d events not acked within %s", missing, len(events), within)
		}
	}
}

// consume runs a handler over the messages of one subscription: handle
// returns false to nack.
func consume(t *testing.T, s *subscriber.Subscriber, rec *recorder, handle func(*message.Message) bool) {
	t.Helper()
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("%p", s)
	name = name[len(name)-4:]
	go func() {
		for msg := range ch {
			msg.Metadata.Set("relay", name)
			rec.deliver(msg)
			if handle != nil && !handle(msg) {
				msg.Nack()
				continue
			}
			rec.ack(msg)
			msg.Ack()
		}
	}()
}

func orderedSub(t *testing.T, pool *pgxpool.Pool, cfg subscriber.Config) *subscriber.Subscriber {
	t.Helper()
	var logger watermill.LoggerAdapter = watermill.NopLogger{}
	if os.Getenv("ORDERED_DEBUG") != "" {
		logger = watermill.NewStdLogger(false, false)
	}
	s, err := subscriber.New(context.Background(), pool, cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// TestOrderedPerKeyOrder runs producers and relays that come, go and die
// while handlers nack at random: every key's first deliveries are in
// sequence order and every event is acked.
func TestOrderedPerKeyOrder(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	rec := newRecorder()
	var nackMu sync.Mutex
	rng := rand.New(rand.NewPCG(1, 2))
	handle := func(*message.Message) bool {
		nackMu.Lock()
		defer nackMu.Unlock()
		return rng.IntN(100) >= 5
	}
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 1000

	var (
		prodWg sync.WaitGroup
		evMu   sync.Mutex
		events []keyed
	)
	for p := 0; p < 3; p++ {
		prodWg.Add(1)
		go func() {
			defer prodWg.Done()
			for i := 0; i < 40; i++ {
				keys := make([]string, 10)
				for j := range keys {
					keys[j] = "k" + strconv.Itoa((p*7+i*3+j)%20)
				}
				ev := enqueueKeyed(t, pool, tbl, keys...)
				evMu.Lock()
				events = append(events, ev...)
				evMu.Unlock()
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	// Relays: a, b from the start; a closes, c joins, b is killed, d joins.
	a := orderedSub(t, pool, cfg)
	consume(t, a, rec, handle)
	b := orderedSub(t, pool, cfg)
	consume(t, b, rec, handle)
	time.Sleep(300 * time.Millisecond)
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	c := orderedSub(t, pool, cfg)
	consume(t, c, rec, handle)
	time.Sleep(300 * time.Millisecond)
	subscriber.Abandon(b)
	_ = b.Close()
	d := orderedSub(t, pool, cfg)
	consume(t, d, rec, handle)
	prodWg.Wait()
	rec.waitAcked(t, events, 30*time.Second, func() { dumpOrdered(t, pool, tbl) })
	rec.checkOrder(t)
	t.Logf("%d events, %d duplicate deliveries", len(events), rec.dups)
}

// sameSlot returns a key other than k in k's partition.
func sameSlot(t *testing.T, pool *pgxpool.Pool, k string) string {
	t.Helper()
	var other string
	err := pool.QueryRow(context.Background(), `SELECT 'x' || g FROM generate_series(1, 10000) AS g
WHERE hashtext('x' || g) & 63 = hashtext($1) & 63 LIMIT 1`, k).Scan(&other)
	if err != nil {
		t.Fatal(err)
	}
	return other
}

func partitionFloor(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, key string) int64 {
	t.Helper()
	var f int64
	if err := pool.QueryRow(context.Background(), `SELECT floor_sequence FROM `+tbl.PartitionsTable()+` WHERE partition = hashtext($1) & 63`, key).Scan(&f); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestOrderedLateCommit: a transaction that enqueued a row of key K stays
// open while later rows of another key of the same partition commit and
// flow; the floor does not pass K's row, which is delivered once committed,
// before the row a second writer of K enqueued meanwhile.
func TestOrderedLateCommit(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	k := "late-key"
	other := sameSlot(t, pool, k)

	txA, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = txA.Rollback(ctx) }()
	evA := uuid.New()
	seqA, err := publisher.Enqueue(ctx, txA, tbl, publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: evA,
		Payload: json.RawMessage(`{}`), OrderingKey: k})
	if err != nil {
		t.Fatal(err)
	}
	// Writer B of the same key blocks on the key lock until A ends.
	bDone := make(chan []keyed, 1)
	go func() { bDone <- enqueueKeyed(t, pool, tbl, k) }()

	rec := newRecorder()
	s := orderedSub(t, pool, orderedCfg(tbl))
	consume(t, s, rec, nil)
	flowing := enqueueKeyed(t, pool, tbl, other, other, other)
	rec.waitAcked(t, flowing, 10*time.Second)
	time.Sleep(1500 * time.Millisecond) // several cycles and a floor persist
	if f := partitionFloor(t, pool, tbl, k); f >= seqA {
		t.Fatalf("floor %d passed the open transaction's row %d", f, seqA)
	}
	if rec.isAcked(evA) {
		t.Fatal("uncommitted row delivered")
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	evB := <-bDone
	rec.waitAcked(t, append(evB, keyed{k, evA}), 10*time.Second)
	rec.checkOrder(t)
	rec.mu.Lock()
	got := rec.first[k]
	rec.mu.Unlock()
	if len(got) != 2 || got[0] != seqA {
		t.Fatalf("key %s delivered %v, want A's row %d first, then B's", k, got, seqA)
	}
}

// TestOrderedUnrelatedLongTransaction: an open transaction that wrote to
// another table holds nothing back; the floor passes the new rows. The
// transaction stays open until the test ends, so a relay that waited on it
// would deliver nothing and hold the floor: the deadlines only bound a
// loaded machine's slowness.
func TestOrderedUnrelatedLongTransaction(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	other := tbl.Schema() + ".business"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+other+` (id int)`); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `INSERT INTO `+other+` VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	s := orderedSub(t, pool, orderedCfg(tbl))
	consume(t, s, rec, nil)
	start := time.Now()
	evs := enqueueKeyed(t, pool, tbl, "a", "b", "a", "c")
	rec.waitAcked(t, evs, 2*time.Minute)
	t.Logf("keys delivered in %s while an unrelated transaction was open", time.Since(start).Round(time.Millisecond))
	var last int64
	if err := pool.QueryRow(ctx, `SELECT max(sequence) FROM `+tbl.Sanitize()+` WHERE ordering_key = 'a'`).Scan(&last); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for partitionFloor(t, pool, tbl, "a") < last {
		if time.Now().After(deadline) {
			t.Fatalf("floor of key a's partition stays below %d while an unrelated transaction is open", last)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The unrelated transaction was open all along.
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("the unrelated transaction ended before the test did: %v", err)
	}
}

// TestOrderedBadInput refuses long keys, NUL and Ordered on a table without
// the column.
func TestOrderedBadInput(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	plain := testdb.Table(t, "plain")
	cases := map[string]struct {
		tbl  schema.Table
		key  string
		want string
	}{
		"long": {tbl, strings.Repeat("k", 257), "at most 256 bytes"},
		"nul":  {tbl, "a\x00b", "NUL"},
		"utf8": {tbl, "a\xffb", "UTF-8"},
		"none": {plain, "k", "no ordering_key column"},
	}
	for name, c := range cases {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, c.tbl, publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1",
				EventID: uuid.New(), Payload: json.RawMessage(`{}`), OrderingKey: c.key})
			return err
		})
		if !errors.Is(err, publisher.ErrInvalidMessage) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "OrderingKey") {
			t.Errorf("%s: error %v, want a validation error on OrderingKey mentioning %q", name, err, c.want)
		}
	}
	if _, err := publisher.Enqueue(ctx, nil, tbl, publisher.Message{}); err == nil {
		t.Error("nil tx accepted")
	}
	_, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: plain, Ordered: true}, nil)
	if err == nil || !strings.Contains(err.Error(), "outbox migrate --ordered --table="+plain.String()) || !strings.Contains(err.Error(), "ordering_key") {
		t.Fatalf("Ordered on a table without the column: %v", err)
	}
	s := orderedSub(t, pool, subscriber.Config{Table: tbl, Ordered: true})
	if _, err := s.Subscribe(ctx, "org.thing.changed.v1"); err == nil {
		t.Fatal("ordered Subscribe with one topic accepted")
	}
}

// TestOrderedHandover: a relay that closes hands its partitions over at
// once, one that is killed within LockTTL; a joining relay takes a share.
// "At once" is read from the table, not the clock: when Close returns, the
// closed relay holds no lease and has left the membership, so nothing
// keeps its partitions from the other relay. The killed relay's partitions
// pass after its heartbeat is LockTTL old, and LockTTL is 8 s so that a
// loaded machine's late ticks (6 s allowed) stay apart from a takeover that
// waits a second LockTTL.
func TestOrderedHandover(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	owners := func() map[string]int {
		rows, err := pool.Query(ctx, `SELECT COALESCE(owner, '') FROM `+tbl.PartitionsTable()+` WHERE lease_until > now()`)
		if err != nil {
			t.Fatal(err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]int{}
		for _, n := range names {
			out[n]++
		}
		return out
	}
	waitOwners := func(n int, within time.Duration) time.Duration {
		start := time.Now()
		for {
			o := owners()
			total := 0
			for _, c := range o {
				total += c
			}
			if len(o) == n && total == schema.OrderingPartitions {
				return time.Since(start)
			}
			if time.Since(start) > within {
				t.Fatalf("owners %v, want %d relays sharing %d partitions within %s", o, n, schema.OrderingPartitions, within)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.LockTTL = 8 * time.Second
	const lateTicks = 6 * time.Second // a loaded machine's
	a := orderedSub(t, pool, cfg)
	consume(t, a, rec, nil)
	waitOwners(1, 2*time.Minute)
	var aID string
	for id := range owners() {
		aID = id
	}
	b := orderedSub(t, pool, cfg)
	consume(t, b, rec, nil)
	waitOwners(2, 2*time.Minute)
	evs := enqueueKeyed(t, pool, tbl, "h1", "h2", "h3", "h4", "h1", "h2")
	rec.waitAcked(t, evs, 2*time.Minute)

	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	var leased, member int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+tbl.PartitionsTable()+` WHERE owner = $1 AND lease_until > now()),
  (SELECT count(*) FROM `+tbl.RelaysTable()+` WHERE relay_id = $1)`, aID).Scan(&leased, &member); err != nil {
		t.Fatal(err)
	}
	if leased != 0 || member != 0 {
		t.Fatalf("after Close the closed relay still leases %d partitions (member: %v): they pass only after LockTTL", leased, member == 1)
	}
	d := waitOwners(1, 2*time.Minute)
	t.Logf("closed relay's partitions taken over after %s", d)
	c := orderedSub(t, pool, cfg)
	consume(t, c, rec, nil)
	waitOwners(2, 2*time.Minute)
	subscriber.Abandon(b)
	_ = b.Close()
	d = waitOwners(1, 2*time.Minute)
	if d > cfg.LockTTL+lateTicks {
		t.Errorf("killed relay's partitions taken over after %s, want within LockTTL %s (plus %s of late ticks)", d, cfg.LockTTL, lateTicks)
	}
	evs = enqueueKeyed(t, pool, tbl, "h1", "h2", "h3", "h4", "h5")
	rec.waitAcked(t, evs, 2*time.Minute)
	rec.checkOrder(t)
	t.Logf("killed relay's partitions taken over after %s", d)
}

// TestOrderedDeadKeyReplayAndSkip: a dead row holds its key only; after a
// retry of its hold it goes first and the rest of its key follows; a
// skipped dead row lets its key continue after it.
func TestOrderedDeadKeyReplayAndSkip(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	oq := sqlq.NewOrderedQueries(tbl, schema.Columns{TraceContext: true, Headers: true, OrderingKey: true})
	bad := map[string]bool{}
	var badMu sync.Mutex
	handle := func(msg *message.Message) bool {
		badMu.Lock()
		defer badMu.Unlock()
		return !bad[msg.UUID]
	}
	held := enqueueKeyed(t, pool, tbl, "dead", "dead", "dead")
	skipped := enqueueKeyed(t, pool, tbl, "skip", "skip")
	badMu.Lock()
	bad[held[0].event.String()] = true
	bad[skipped[0].event.String()] = true
	badMu.Unlock()
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 2
	s := orderedSub(t, pool, cfg)
	consume(t, s, rec, handle)
	flow := enqueueKeyed(t, pool, tbl, "free", "free", "free")
	rec.waitAcked(t, flow, 10*time.Second)
	// Wait for both holds to be dead.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()+` WHERE dead_at IS NOT NULL`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 2 {
			break
		}
		if time.Now().After(deadline) {
			dumpOrdered(t, pool, tbl)
			t.Fatalf("%d dead holds, want 2", n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(300 * time.Millisecond)
	for _, e := range append(held[1:], skipped[1:]...) {
		if rec.isAcked(e.event) {
			t.Fatalf("a row behind a dead row of key %s was delivered", e.key)
		}
	}
	// Stats read the persisted floors: wait for them to pass the free key.
	var pending, leased, dead int64
	var oldest float64
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if err := pool.QueryRow(ctx, oq.Stats).Scan(&pending, &leased, &dead, &oldest); err != nil {
			t.Fatal(err)
		}
		if (pending == 3 && dead == 2) || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if pending != 3 || dead != 2 || oldest <= 0 {
		t.Errorf("stats pending=%d dead=%d oldest=%f, want 3 and 2 (rows behind the dead ones are pending)", pending, dead, oldest)
	}
	// Fix and retry the dead key; skip the other.
	badMu.Lock()
	bad = map[string]bool{skipped[0].event.String(): true}
	badMu.Unlock()
	seqOf := func(e keyed) int64 {
		var s int64
		if err := pool.QueryRow(ctx, `SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $1`, e.event).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	hk, err := runbook.New(pool, tbl).HeldKeys(ctx, 0)
	if err != nil || len(hk) != 2 || hk[0].DeadAt == nil || hk[1].DeadAt == nil {
		t.Fatalf("held keys %+v, %v; want the two dead keys", hk, err)
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, held[1].event, false); !errors.Is(err, runbook.ErrNotHeld) {
		t.Fatalf("skip of a row that holds nothing: %v", err)
	}
	rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, held[0].event, runbook.ReplayOptions{})
	if err != nil || rep.Changed != 1 || !rep.Dead || rep.Row.Sequence != seqOf(held[0]) {
		t.Fatalf("replay of the dead held row: %+v %v", rep, err)
	}
	sk, err := runbook.New(pool, tbl).SkipEvent(ctx, skipped[0].event, false)
	if err != nil || sk.Changed != 1 || sk.Key != "skip" {
		t.Fatalf("skip: %+v %v", sk, err)
	}
	rec.waitAcked(t, append(held, skipped[1:]...), 10*time.Second)
	rec.checkOrder(t)
	if rec.isAcked(skipped[0].event) {
		t.Fatal("the skipped row was delivered and acked")
	}
	// Resolved holds are tombstones until the written floor passes them;
	// floors are written once per tick, later on a loaded machine (make
	// test runs every package at once).
	var holds int
	for deadline := time.Now().Add(2 * time.Minute); ; {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()).Scan(&holds); err != nil {
			t.Fatal(err)
		}
		if holds == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if holds != 0 {
		dumpOrdered(t, pool, tbl)
		t.Fatalf("%d holds left after 2 minutes, want none", holds)
	}
}

func dumpOrdered(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) {
	t.Helper()
	for _, q := range []string{
		`SELECT partition, owner, lease_until > now(), floor_sequence FROM ` + tbl.PartitionsTable() + ` ORDER BY partition`,
		`SELECT ordering_key, partition, sequence, attempts, available_at, dead_at IS NOT NULL, skip_requested_at IS NOT NULL, replay, resolved_at FROM ` + tbl.HoldsTable(),
		`SELECT relay_id, heartbeat_at FROM ` + tbl.RelaysTable(),
	} {
		rows, err := pool.Query(context.Background(), q)
		if err != nil {
			t.Log(err)
			continue
		}
		for rows.Next() {
			v, _ := rows.Values()
			t.Log(v...)
		}
		rows.Close()
	}
}

// TestOrderedCleaner deletes the relayed keyed rows below the floors, never
// a held row or the rows behind it.
func TestOrderedCleaner(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	evs := enqueueKeyed(t, pool, tbl, "c1", "c1", "c2", "c2")
	var bad sync.Map
	bad.Store(evs[2].event.String(), true)
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.MaxAttempts = 1
	s := orderedSub(t, pool, cfg)
	consume(t, s, rec, func(m *message.Message) bool { _, b := bad.Load(m.UUID); return !b })
	rec.waitAcked(t, evs[:2], 5*time.Second)
	var last int64
	if err := pool.QueryRow(ctx, `SELECT max(sequence) FROM `+tbl.Sanitize()).Scan(&last); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Minute); partitionFloor(t, pool, tbl, "c1") < last || partitionFloor(t, pool, tbl, "c2") < last; {
		if time.Now().After(deadline) {
			t.Fatal("floors did not pass the rows")
		}
		time.Sleep(50 * time.Millisecond)
	}
	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Nanosecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	n, _, err := c.CleanOnce(ctx)
	if err != nil || n != 2 {
		t.Fatalf("cleaned %d, %v; want the 2 rows of c1", n, err)
	}
	var left []string
	rows, _ := pool.Query(ctx, `SELECT event_id::text FROM `+tbl.Sanitize()+` ORDER BY sequence`)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(left) != 2 || left[0] != evs[2].event.String() {
		t.Fatalf("left %v, %v; want c2's dead row and the row behind it", left, err)
	}
}

// TestOrderedHotKey relays a backlog of one key, larger than the window a
// relay reads ahead, in order.
func TestOrderedHotKey(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	var evs []keyed
	for i := 0; i < 5; i++ {
		keys := make([]string, 1000)
		for j := range keys {
			keys[j] = "hot"
		}
		evs = append(evs, enqueueKeyed(t, pool, tbl, keys...)...)
	}
	rec := newRecorder()
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 500
	s := orderedSub(t, pool, cfg)
	consume(t, s, rec, nil)
	rec.waitAcked(t, evs, 20*time.Second, func() { dumpOrdered(t, pool, tbl) })
	rec.checkOrder(t)
}
