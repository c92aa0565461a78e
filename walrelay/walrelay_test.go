package walrelay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// cluster starts a private PostgreSQL with wal_level = logical and
// returns a pool on it and an outbox table (with every optional column)
// set up for the WAL relay.
// clusterSlots bounds the private clusters running at once: each test
// starts its own, and `make test` runs this package beside the others on a
// 2-core machine.
var clusterSlots = make(chan struct{}, 3)

func cluster(t *testing.T) (*pgxpool.Pool, schema.Table) {
	t.Helper()
	pool, tbl, _ := clusterPG(t)
	return pool, tbl
}

// clusterPG is cluster with the private server itself, for tests that
// restart it.
func clusterPG(t *testing.T) (*pgxpool.Pool, schema.Table, *pgtest.Cluster) {
	t.Helper()
	return clusterWith(t, nil)
}

// clusterWith is clusterPG with more server settings.
func clusterWith(t *testing.T, extra map[string]string) (*pgxpool.Pool, schema.Table, *pgtest.Cluster) {
	t.Helper()
	return startCluster(t, extra, true)
}

// startCluster is clusterWith; without setup, the table is migrated but
// walrelay.Setup is left to the test.
func startCluster(t *testing.T, extra map[string]string, setup bool) (*pgxpool.Pool, schema.Table, *pgtest.Cluster) {
	t.Helper()
	clusterSlots <- struct{}{}
	t.Cleanup(func() { <-clusterSlots })
	settings := map[string]string{
		"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "10", "wal_sender_timeout": "10s",
		// Commits are durable, as on a user's server: the tests that crash
		// the server (Cluster.Crash) must not lose a committed row or hold.
		"synchronous_commit": "on",
	}
	for k, v := range extra {
		settings[k] = v
	}
	pg := pgtest.Start(t, pgtest.Options{Settings: settings})
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tbl := schema.MustParseTable("public.wal_outbox")
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	if setup {
		if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
			t.Fatal(err)
		}
	}
	return pool, tbl, pg
}

func relay(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, mutate func(*walrelay.Config)) *walrelay.Subscriber {
	t.Helper()
	return relayLogged(t, pool, tbl, mutate, watermill.NopLogger{})
}

func relayLogged(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, mutate func(*walrelay.Config), logger watermill.LoggerAdapter) *walrelay.Subscriber {
	t.Helper()
	cfg := walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: 2 * time.Second, Backoff: func(int) time.Duration { return 20 * time.Millisecond }}
	if mutate != nil {
		mutate(&cfg)
	}
	s, err := walrelay.New(context.Background(), pool, cfg, logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// recorder keeps every delivery per key, in order.
type recorder struct {
	mu     sync.Mutex
	byKey  map[string][]int64 // key -> sequences in delivery order
	acked  map[string]int     // event_id -> acks
	change chan struct{}
}

func newRecorder() *recorder {
	return &recorder{byKey: map[string][]int64{}, acked: map[string]int{}, change: make(chan struct{}, 1)}
}

// consume acks what handle accepts (nil handle: everything), one goroutine
// per message so that keys run concurrently.
func (r *recorder) consume(t *testing.T, s message.Subscriber, handle func(*message.Message) error) {
	t.Helper()
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			go func(msg *message.Message) {
				if handle != nil {
					if err := handle(msg); err != nil {
						subscriber.RecordError(msg, err)
						msg.Nack()
						return
					}
				}
				seq, _ := strconv.ParseInt(msg.Metadata.Get(schema.MetadataSequence), 10, 64)
				key := msg.Metadata.Get(schema.MetadataOrderingKey)
				r.mu.Lock()
				r.byKey[key] = append(r.byKey[key], seq)
				r.acked[msg.UUID]++
				r.mu.Unlock()
				msg.Ack()
				select {
				case r.change <- struct{}{}:
				default:
				}
			}(msg)
		}
	}()
}

// liveness is the least any condition wait of these tests allows: a
// deadline only bounds how slow a loaded machine may be, never tells a
// fast path from a slow one (the tests that do set their timers apart,
// with gaps of many seconds).
const liveness = 2 * time.Minute

// waitAcked waits until every event of ids was acked, for within but at
// least liveness.
func (r *recorder) waitAcked(t *testing.T, ids []uuid.UUID, within time.Duration) {
	t.Helper()
	within = max(within, liveness)
	deadline := time.Now().Add(within)
	for {
		r.mu.Lock()
		missing := 0
		for _, id := range ids {
			if r.acked[id.String()] == 0 {
				missing++
			}
		}
		r.mu.Unlock()
		if missing == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events not acked within %s", missing, len(ids), within)
		}
		select {
		case <-r.change:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (r *recorder) has(id uuid.UUID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acked[id.String()] > 0
}

// enqueue writes one transaction of keyed events (key "" for none).
func enqueue(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys ...string) []uuid.UUID {
	t.Helper()
	ids, err := enqueueErr(pool, tbl, false, keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func enqueueErr(pool *pgxpool.Pool, tbl schema.Table, rollback bool, keys ...string) ([]uuid.UUID, error) {
	ctx := context.Background()
	ids := make([]uuid.UUID, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
		_ = tx.Rollback(ctx)
		return nil, err
	}
	if rollback {
		return ids, tx.Rollback(ctx)
	}
	return ids, tx.Commit(ctx)
}

// TestWALOrderAndRollback: writers commit and roll back keyed events
// concurrently; every committed event is delivered, none rolled back is,
// and each key's events arrive in commit order.
func TestWALOrderAndRollback(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	var (
		mu                  sync.Mutex
		committed, rollback []uuid.UUID
		wg                  sync.WaitGroup
	)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				// Each key belongs to one writer, so its commit order is
				// its sequence order.
				k1, k2 := fmt.Sprintf("w%d-k%d", w, i%5), fmt.Sprintf("w%d-k%d", w, (i+1)%5)
				ids, err := enqueueErr(pool, tbl, i%7 == 3, k1, k2, "")
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if i%7 == 3 {
					rollback = append(rollback, ids...)
				} else {
					committed = append(committed, ids...)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	rec.waitAcked(t, committed, 30*time.Second)
	time.Sleep(200 * time.Millisecond)
	for _, id := range rollback {
		if rec.has(id) {
			t.Fatalf("rolled-back event %s was delivered", id)
		}
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for k, seqs := range rec.byKey {
		if k == "" {
			continue
		}
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s delivered out of commit order: %v", k, seqs)
			}
		}
	}
	// Nothing was written to the rows on the happy path.
	var touched int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE attempts <> 0 OR locked_at IS NOT NULL OR published_at IS NOT NULL`).Scan(&touched); err != nil {
		t.Fatal(err)
	}
	if touched != 0 {
		t.Fatalf("the WAL relay updated %d rows on the happy path", touched)
	}
}

// TestWALFailureIsolation: a nacked event holds only its key; it is
// retried and delivered before the key's next event; an event that fails
// for good goes dead with its last_error and holds its key (listed by the
// runbook), and a replay delivers it, then the key's next event.
func TestWALFailureIsolation(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	held := enqueue(t, pool, tbl, "held", "held")
	doomed := enqueue(t, pool, tbl, "doomed", "doomed")
	var (
		mu       sync.Mutex
		failures = map[string]int{held[0].String(): 3}
		fixed    bool
		early    bool // the held key's second event came while its first was retrying
	)
	rec := newRecorder()
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	rec.consume(t, relay(t, pool, tbl, func(c *walrelay.Config) {
		c.MaxAttempts = 5
		c.Backoff = func(int) time.Duration { return 100 * time.Millisecond }
		c.Metrics = m
	}), func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if msg.UUID == doomed[0].String() && !fixed {
			return subscriber.Permanent(errors.New("consumer rejects it: password=s3cret"))
		}
		if msg.UUID == held[1].String() && !rec.has(held[0]) {
			early = true
		}
		if failures[msg.UUID] > 0 {
			failures[msg.UUID]--
			return errors.New("broker down")
		}
		return nil
	})
	free := enqueue(t, pool, tbl, "free", "free", "free")
	rec.waitAcked(t, free, 10*time.Second)
	rec.waitAcked(t, held, 10*time.Second)
	mu.Lock()
	if early {
		t.Error("the held key's second event was delivered while its first was retrying")
	}
	mu.Unlock()
	rec.mu.Lock()
	order := append([]int64(nil), rec.byKey["held"]...)
	rec.mu.Unlock()
	if len(order) != 2 || order[0] > order[1] {
		t.Fatalf("held key delivered %v", order)
	}
	var (
		attempts int
		lastErr  *string
		dead     bool
	)
	waitFor(t, liveness, "the doomed row dead", func() bool {
		if err := pool.QueryRow(ctx, `SELECT attempts, last_error, dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, doomed[0]).Scan(&attempts, &lastErr, &dead); err != nil {
			t.Fatal(err)
		}
		return dead
	})
	if !dead || attempts != 1 || lastErr == nil || !strings.Contains(*lastErr, "consumer rejects it") || strings.Contains(*lastErr, "s3cret") {
		t.Fatalf("permanent failure: dead %v attempts %d last_error %v", dead, attempts, lastErr)
	}
	// The dead row holds its key: the key's next row waits, listed as held.
	time.Sleep(300 * time.Millisecond)
	if rec.has(doomed[1]) {
		t.Fatal("the row after a dead row of its key was delivered")
	}
	var keys []runbook.HeldKey
	waitFor(t, liveness, "the doomed key held", func() bool {
		keys, err = runbook.New(pool, tbl).HeldKeys(ctx, 0)
		return err != nil || len(keys) > 0
	})
	if err != nil || len(keys) != 1 || keys[0].Key != "doomed" || keys[0].EventID != doomed[0].String() || keys[0].DeadAt == nil {
		t.Fatalf("held keys %+v (%v), want doomed held by %s", keys, err, doomed[0])
	}
	mu.Lock()
	fixed = true
	mu.Unlock()
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, doomed[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, doomed, 10*time.Second)
	rec.mu.Lock()
	order = append([]int64(nil), rec.byKey["doomed"]...)
	rec.mu.Unlock()
	if len(order) != 2 || order[0] > order[1] {
		t.Fatalf("doomed key delivered %v after the replay, want its dead row first", order)
	}
	for deadline := time.Now().Add(liveness); ; {
		keys, err = runbook.New(pool, tbl).HeldKeys(ctx, 0)
		if err == nil && len(keys) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("hold not released after the replay: %+v %v", keys, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The table relay's metrics: leader, dispatches by result, dead rows.
	// The last ack is counted when the relay takes it, just after the
	// handler returned.
	label := tbl.Qualified()
	for deadline := time.Now().Add(liveness); testutil.ToFloat64(m.DispatchTotal.WithLabelValues(label, "org.wal.changed.v1", "success")) < 7 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if v := testutil.ToFloat64(m.RelayLeader.WithLabelValues(label)); v != 1 {
		t.Errorf("outbox_relay_leader %v, want 1", v)
	}
	if v := testutil.ToFloat64(m.DispatchTotal.WithLabelValues(label, "org.wal.changed.v1", "failure")); v != 4 {
		t.Errorf("failed dispatches %v, want 4 (3 retries, 1 permanent)", v)
	}
	if v := testutil.ToFloat64(m.DispatchTotal.WithLabelValues(label, "org.wal.changed.v1", "success")); v != 7 {
		t.Errorf("successful dispatches %v, want 7 (2 held, 1 doomed, 3 free, 1 replay)", v)
	}
	if v := testutil.ToFloat64(m.DeadTotal.WithLabelValues(label, "org.wal.changed.v1")); v != 1 {
		t.Errorf("outbox_dead_total %v, want 1", v)
	}
}

// TestWALHandover: a standby takes over when the active relay closes;
// nothing is lost, and the standby starts where the active one confirmed.
func TestWALHandover(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	a := relay(t, pool, tbl, nil)
	b := relay(t, pool, tbl, nil)
	rec := newRecorder()
	rec.consume(t, a, nil)
	deadline := time.Now().Add(liveness)
	for !a.Active() {
		if time.Now().After(deadline) {
			t.Fatal("the first relay never became active")
		}
		time.Sleep(10 * time.Millisecond)
	}
	rec.consume(t, b, nil)
	var all []uuid.UUID
	for i := range 50 {
		all = append(all, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%7))...)
	}
	rec.waitAcked(t, all, 10*time.Second)
	if b.Active() {
		t.Fatal("two relays active on one slot")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	var after []uuid.UUID
	for i := range 50 {
		after = append(after, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%7))...)
	}
	rec.waitAcked(t, after, 10*time.Second)
	if !b.Active() {
		t.Fatal("the standby did not take over")
	}
	rec.mu.Lock()
	dups := 0
	for _, n := range rec.acked {
		dups += n - 1
	}
	rec.mu.Unlock()
	if dups != 0 {
		t.Fatalf("%d duplicates after a clean handover (the closing relay confirms what it settled)", dups)
	}
}

// TestWALLongTransactionHoldsNothingBack: an open transaction that wrote
// an event does not delay events committed after it; its own event is
// delivered when it commits.
func TestWALLongTransactionHoldsNothingBack(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	long := uuid.New()
	if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: long, Payload: json.RawMessage(`{}`), OrderingKey: "k"}); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	later := enqueue(t, pool, tbl, "k2", "other", "")
	rec.waitAcked(t, later, 5*time.Second)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, []uuid.UUID{long}, 5*time.Second)
}

// TestWALBadSetup: a server without wal_level = logical, a table without a
// slot and a topic subscription are refused with what to do.
func TestWALBadSetup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	shared := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	var level string
	if err := shared.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		t.Fatal(err)
	}
	if level != "logical" {
		_, err := walrelay.Setup(ctx, shared, tbl, walrelay.Names{})
		if !errors.Is(err, walrelay.ErrWALLevel) || !strings.Contains(err.Error(), "wal_level = logical") {
			t.Fatalf("setup on wal_level %s: %v", level, err)
		}
	}
	pool, _ := cluster(t)
	other := schema.MustParseTable("public.other_outbox")
	if err := schema.Migrate(ctx, pool, other); err != nil {
		t.Fatal(err)
	}
	if _, err := walrelay.New(ctx, pool, walrelay.Config{Table: other}, nil); !errors.Is(err, walrelay.ErrNotSetUp) || !strings.Contains(err.Error(), "walrelay.Setup") {
		t.Fatalf("new without setup: %v", err)
	}
	if _, err := walrelay.New(ctx, pool, walrelay.Config{Table: other, Names: walrelay.Names{Slot: "Bad-Name"}}, nil); err == nil || !strings.Contains(err.Error(), "a-z, 0-9") {
		t.Fatalf("bad slot name: %v", err)
	}
	if _, err := walrelay.Setup(ctx, pool, other, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: other}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := s.Subscribe(ctx, "org.one.topic.v1"); err == nil || !strings.Contains(err.Error(), "AllTopics") {
		t.Fatalf("topic subscription: %v", err)
	}
	if err := walrelay.Teardown(ctx, pool, other, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	var slots int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, schema.WALSlotName(other)).Scan(&slots); err != nil || slots != 0 {
		t.Fatalf("teardown left %d slots (%v)", slots, err)
	}
}

// TestWALChaos: producers commit keyed events while the relay's
// replication session is terminated again and again (as if the relay's
// host died) and one delivery in ten is nacked: nothing is lost, each
// key's first deliveries keep commit order, and duplicates are counted.
func TestWALChaos(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	rec := newRecorder()
	a := relay(t, pool, tbl, nil)
	b := relay(t, pool, tbl, nil)
	// One delivery in ten is nacked (a transient failure): the key waits
	// for the retry, the others flow.
	var nacks atomic.Int64
	flaky := func(msg *message.Message) error {
		if rand.IntN(10) == 0 {
			nacks.Add(1)
			return errors.New("transient")
		}
		return nil
	}
	rec.consume(t, a, flaky)
	rec.consume(t, b, flaky)
	var (
		mu        sync.Mutex
		committed []uuid.UUID
		wg        sync.WaitGroup
		stop      = make(chan struct{})
	)
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				ids, err := enqueueErr(pool, tbl, false, fmt.Sprintf("w%d-k%d", w, i%4), fmt.Sprintf("w%d-k%d", w, (i+1)%4))
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				committed = append(committed, ids...)
				mu.Unlock()
			}
		}()
	}
	// Eight sessions terminated, 150 ms or more apart: a round that finds
	// no session (the next one not started yet, on a loaded machine) does
	// not count.
	kills := 0
	for deadline := time.Now().Add(liveness); kills < 8 && time.Now().Before(deadline); {
		time.Sleep(150 * time.Millisecond)
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_replication WHERE application_name = 'outbox-walrelay'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		kills += n
	}
	close(stop)
	wg.Wait()
	rec.waitAcked(t, committed, 30*time.Second)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	dups := 0
	for _, n := range rec.acked {
		dups += n - 1
	}
	for k, seqs := range rec.byKey {
		seen := map[int64]bool{}
		var last int64
		for _, s := range seqs {
			if seen[s] {
				continue // a duplicate: delivered again after a restart
			}
			seen[s] = true
			if s < last {
				t.Fatalf("key %s: first deliveries out of commit order: %v", k, seqs)
			}
			last = s
		}
	}
	if kills < 4 {
		t.Fatalf("only %d replication sessions terminated", kills)
	}
	if nacks.Load() == 0 {
		t.Fatal("no delivery was nacked")
	}
	t.Logf("%d events, %d sessions terminated, %d nacks, %d duplicates", len(committed), kills, nacks.Load(), dups)
}

// TestWALSlotLag: while a row waits for its verdict the collector shows the
// relay active, unconfirmed WAL and the age of the oldest unsettled
// commit; once it is acked and confirmed, the age is 0 and the unconfirmed
// WAL shrinks; a dropped slot is an error that names Setup.
func TestWALSlotLag(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	s := relay(t, pool, tbl, nil)
	release := make(chan struct{})
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			<-release
			msg.Ack()
		}
	}()
	reg := prometheus.NewRegistry()
	reg.MustRegister(s.Collector())
	gauge := func(name string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		t.Fatalf("no metric %s", name)
		return 0
	}
	enqueue(t, pool, tbl, "k")
	// Make WAL the relay cannot confirm while the row is in flight.
	if _, err := pool.Exec(ctx, `CREATE TABLE filler AS SELECT g, repeat('x', 100) AS s FROM generate_series(1, 20000) AS g`); err != nil {
		t.Fatal(err)
	}
	// The row stays in flight until release: the gauges get there however
	// slow the machine (the age grows, the WAL is not confirmed).
	for deadline := time.Now().Add(liveness); gauge("outbox_wal_relay_active") != 1 || gauge("outbox_wal_oldest_unsettled_age_seconds") < 1 || gauge("outbox_wal_slot_unconfirmed_bytes") < 1e6; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("while a row is in flight: active %v, oldest unsettled %vs, unconfirmed %v bytes",
				gauge("outbox_wal_relay_active"), gauge("outbox_wal_oldest_unsettled_age_seconds"), gauge("outbox_wal_slot_unconfirmed_bytes"))
		}
	}
	held := gauge("outbox_wal_slot_unconfirmed_bytes")
	close(release)
	deadline := time.Now().Add(liveness)
	for gauge("outbox_wal_oldest_unsettled_age_seconds") != 0 || gauge("outbox_wal_slot_unconfirmed_bytes") >= held {
		if time.Now().After(deadline) {
			t.Fatalf("after the ack: oldest unsettled %vs, unconfirmed %v bytes (was %v)",
				gauge("outbox_wal_oldest_unsettled_age_seconds"), gauge("outbox_wal_slot_unconfirmed_bytes"), held)
		}
		time.Sleep(50 * time.Millisecond)
	}
	_ = s.Close()
	if err := walrelay.Teardown(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.SlotLag(ctx); err == nil || !strings.Contains(err.Error(), "walrelay.Setup") {
		t.Fatalf("lag of a dropped slot: %v", err)
	}
}

// TestWALRetention: the relay records a horizon; the runbook counts the
// rows it settled as streamed, not pending; the cleaner deletes them after
// the retention, and never a row not streamed yet (one of a transaction
// open while the horizons were taken, one committed while no relay runs),
// nor a dead one.
func TestWALRetention(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	var logBuf bytes.Buffer
	var logMu sync.Mutex
	logger := watermill.NewStdLoggerWithOut(lockedWriter{&logMu, &logBuf}, true, true)
	defer func() {
		if t.Failed() {
			logMu.Lock()
			t.Log(logBuf.String())
			logMu.Unlock()
		}
	}()
	s := relayLogged(t, pool, tbl, nil, logger)
	rec := newRecorder()
	rec.consume(t, s, func(msg *message.Message) error {
		if msg.Metadata.Get(schema.MetadataOrderingKey) == "bad" {
			return subscriber.Permanent(errors.New("rejected"))
		}
		return nil
	})
	var streamed []uuid.UUID
	for i := range 20 {
		streamed = append(streamed, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%3))...)
	}
	enqueue(t, pool, tbl, "bad")
	rec.waitAcked(t, streamed, 10*time.Second)
	stats := func() runbook.TableStats {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	deadline := time.Now().Add(liveness)
	for st := stats(); st.StreamedUnpublished != 20 || st.Pending != 0 || st.Dead != 1; st = stats() {
		if time.Now().After(deadline) {
			t.Fatalf("stats after the relay streamed 20 rows: %+v", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// A transaction open while the next horizons are taken.
	open, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = open.Rollback(ctx) }()
	late := uuid.New()
	if _, err := publisher.Enqueue(ctx, open, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: late, Payload: json.RawMessage(`{}`), OrderingKey: "late"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // several status ticks
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Committed while no relay runs: not streamed.
	waiting := enqueue(t, pool, tbl, "k0")
	if st := stats(); st.Pending != 2 || st.StreamedUnpublished != 20 {
		t.Fatalf("stats with two rows not streamed: %+v", st)
	}
	c, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(10 * time.Millisecond)
	deleted, _, err := c.CleanOnce(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT event_id::text FROM `+tbl.Sanitize()+` WHERE dead_at IS NULL ORDER BY sequence`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		left = append(left, id)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if deleted != 20 || len(left) != 2 || left[0] != late.String() || left[1] != waiting[0].String() || stats().Dead != 1 {
		t.Fatalf("cleaner deleted %d; rows left (not dead) %v, want %s and %s", deleted, left, late, waiting[0])
	}
}

// TestWALSlotLossFallback: the slot is dropped while no relay runs and rows
// are committed; the next relay recreates it, reads the rows it missed from
// the table (from the recorded horizon) and delivers them before the
// stream, in key order, and says so in its metrics; the relay after it does
// not read them again.
func TestWALSlotLossFallback(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	rec := newRecorder()
	a := relay(t, pool, tbl, nil)
	rec.consume(t, a, nil)
	var before []uuid.UUID
	for i := range 10 {
		before = append(before, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%3))...)
	}
	rec.waitAcked(t, before, 10*time.Second)
	time.Sleep(400 * time.Millisecond) // the horizon passes them
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	var missed []uuid.UUID
	for i := range 15 {
		missed = append(missed, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%3))...)
	}
	dropSlot(t, pool, tbl)
	b := relay(t, pool, tbl, nil)
	reg := prometheus.NewRegistry()
	reg.MustRegister(b.Collector())
	rec.consume(t, b, nil)
	rec.waitAcked(t, missed, 10*time.Second)
	after := enqueue(t, pool, tbl, "k0", "k1", "k2")
	rec.waitAcked(t, after, 10*time.Second)
	counter := func(name string) float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0].GetCounter().GetValue()
			}
		}
		t.Fatalf("no metric %s", name)
		return 0
	}
	if lost, filled := counter("outbox_wal_slot_lost_total"), counter("outbox_wal_backfilled_total"); lost != 1 || filled < 15 || filled > 25 {
		t.Fatalf("slot lost %v times, %v rows backfilled; want 1 and 15 to 25 (the missed rows, maybe some settled ones)", lost, filled)
	}
	rec.mu.Lock()
	for k, seqs := range rec.byKey {
		seen := map[int64]bool{}
		var last int64
		for _, s := range seqs {
			if seen[s] {
				continue
			}
			seen[s] = true
			if s < last {
				t.Fatalf("key %s: first deliveries out of order: %v", k, seqs)
			}
			last = s
		}
	}
	dupsBefore := 0
	for _, n := range rec.acked {
		dupsBefore += n - 1
	}
	rec.mu.Unlock()
	time.Sleep(300 * time.Millisecond) // b records its position
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	c := relay(t, pool, tbl, nil)
	rec.consume(t, c, nil)
	last := enqueue(t, pool, tbl, "k0")
	rec.waitAcked(t, last, 10*time.Second)
	rec.mu.Lock()
	dups := 0
	for _, n := range rec.acked {
		dups += n - 1
	}
	rec.mu.Unlock()
	if dups != dupsBefore {
		t.Fatalf("the relay after the backfill delivered %d rows again", dups-dupsBefore)
	}
}

// TestWALSkipSurvivesRestart: a dead row holds its key across a relay
// restart; a skip (runbook.Runbook.SkipEvent) lets the key's later rows through in
// order, the skipped row is marked skipped (not dead) and is never delivered.
func TestWALSkipSurvivesRestart(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "s", "s", "s")
	rec := newRecorder()
	reject := func(msg *message.Message) error {
		if msg.UUID == ids[0].String() {
			return subscriber.Permanent(errors.New("never"))
		}
		return nil
	}
	a := relay(t, pool, tbl, nil)
	rec.consume(t, a, reject)
	other := enqueue(t, pool, tbl, "o")
	rec.waitAcked(t, other, 10*time.Second)
	for deadline := time.Now().Add(liveness); ; {
		keys, err := runbook.New(pool, tbl).HeldKeys(ctx, 0)
		if err == nil && len(keys) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no hold: %+v %v", keys, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	more := enqueue(t, pool, tbl, "s")
	b := relay(t, pool, tbl, nil)
	rec.consume(t, b, reject)
	later := enqueue(t, pool, tbl, "o")
	rec.waitAcked(t, later, 10*time.Second)
	time.Sleep(300 * time.Millisecond)
	for _, id := range append(ids[1:], more...) {
		if rec.has(id) {
			t.Fatal("a row behind the dead row was delivered after the restart")
		}
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, ids[1], false); !errors.Is(err, runbook.ErrNotHeld) {
		t.Fatalf("skip of a row that holds nothing: %v", err)
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, ids[0], false); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, append(ids[1:], more...), 10*time.Second)
	rec.mu.Lock()
	order := append([]int64(nil), rec.byKey["s"]...)
	rec.mu.Unlock()
	if len(order) != 3 || order[0] > order[1] || order[1] > order[2] {
		t.Fatalf("key s delivered %v after the skip", order)
	}
	if rec.has(ids[0]) {
		t.Fatal("the skipped row was delivered")
	}
	var skipped, dead bool
	if err := pool.QueryRow(ctx, `SELECT skipped_at IS NOT NULL, dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[0]).Scan(&skipped, &dead); err != nil || !skipped || dead {
		t.Fatalf("the skipped row: skipped_at set %t, dead_at set %t (%v); want skipped, not dead", skipped, dead, err)
	}
}

// TestWALCaughtUpRecordsAtOnce: once the relay has settled everything it
// read, it records its progress at once instead of at the next
// StatusInterval tick (the horizon takes two records), so the runbook
// counts a delivered burst as settled at once.
//
// The verdict does not depend on the machine's speed: StatusInterval is 10
// minutes and the server asks for a reply only after 15 minutes of silence
// (wal_sender_timeout 30 minutes), so no tick and no requested reply
// records anything during the test's 4-minute wait: only the caught-up
// records can settle the burst. Every row is read before any is settled
// (the handler holds them until PeakRows counts all 30), so the first
// caught-up record is not put off by an earlier one (records other than a
// burst's last are StatusInterval/4 apart) and comes as soon as the last
// row settles.
func TestWALCaughtUpRecordsAtOnce(t *testing.T) {
	t.Parallel()
	const statusInterval = 10 * time.Minute
	pool, tbl, _ := clusterWith(t, map[string]string{"wal_sender_timeout": "30min"})
	ctx := context.Background()
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.StatusInterval = statusInterval })
	rec := newRecorder()
	release := make(chan struct{})
	rec.consume(t, s, func(*message.Message) error {
		<-release
		return nil
	})
	var ids []uuid.UUID
	for i := range 30 {
		ids = append(ids, enqueue(t, pool, tbl, fmt.Sprintf("k%d", i%4), "")...)
	}
	for deadline := time.Now().Add(2 * time.Minute); walrelay.PeakRows(s) < int64(len(ids)); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			close(release)
			t.Fatalf("the relay read %d of %d rows within 2 minutes", walrelay.PeakRows(s), len(ids))
		}
	}
	close(release)
	rec.waitAcked(t, ids, 2*time.Minute)
	acked := time.Now()
	for {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 && st.StreamedUnpublished == int64(len(ids)) {
			t.Logf("settled %s after the last ack", time.Since(acked).Round(time.Millisecond))
			return
		}
		if time.Since(acked) > 4*time.Minute {
			t.Fatalf("4 minutes after the last ack, with a %s status interval: %+v (want 0 pending, %d streamed)", statusInterval, st, len(ids))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestWALDrainsABacklog: a backlog of 20,000 rows over 500 keys, written
// before the relay starts, is delivered in full and in order per key. With
// 500 keys in flight, acks pile up faster than the loop takes them one at a
// time, so the loop takes them in batches; a settle lost at a batch's end
// stalls its key and fails this test.
func TestWALDrainsABacklog(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	var ids []uuid.UUID
	for range 20 {
		keys := make([]string, 1000)
		for i := range keys {
			keys[i] = fmt.Sprintf("k%d", (len(ids)+i)%500)
		}
		ids = append(ids, enqueue(t, pool, tbl, keys...)...)
	}
	s := relay(t, pool, tbl, nil)
	rec := newRecorder()
	rec.consume(t, s, nil)
	rec.waitAcked(t, ids, 60*time.Second)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	for key, seqs := range rec.byKey {
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s: sequence %d delivered after %d", key, seqs[i], seqs[i-1])
			}
		}
	}
}

// TestWALCloseTimeoutWithManyInFlight: more messages in flight than the
// loop buffers verdicts for (1,024), none acked: Close gives up on them
// after CloseTimeout and returns, and the next relay delivers them all.
func TestWALCloseTimeoutWithManyInFlight(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	const n = 1500
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%d", i)
	}
	ids := enqueue(t, pool, tbl, keys...)
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.CloseTimeout = 300 * time.Millisecond })
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	held := make([]*message.Message, 0, n)
	for len(held) < n {
		select {
		case msg := <-ch:
			held = append(held, msg) // never acked
		case <-time.After(liveness):
			t.Fatalf("%d of %d messages in flight after %s", len(held), n, liveness)
		}
	}
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(liveness):
		t.Fatalf("Close did not return within %s with %d messages in flight (CloseTimeout 300 ms)", liveness, n)
	}
	rec := newRecorder()
	rec.consume(t, relay(t, pool, tbl, nil), nil)
	rec.waitAcked(t, ids, 60*time.Second)
}

// TestWALStreamLossKeepsOneInFlightPerKey: the slot is lost, so the relay
// backfills 300 keys from the table; its replication connection is cut while
// those deliveries wait for a consumer that has not started reading. The
// stream's deliveries end with the stream: the next stream backfills the
// rows again, and no key ever has a stale copy in flight beside the new one
// (the backfill's deliveries once had a context of their own that the
// stream's end did not cancel).
func TestWALStreamLossKeepsOneInFlightPerKey(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	rec := newRecorder()
	a := relay(t, pool, tbl, nil)
	rec.consume(t, a, nil)
	rec.waitAcked(t, enqueue(t, pool, tbl, "k0", "k1"), 10*time.Second)
	time.Sleep(400 * time.Millisecond) // a records its position
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	const n = 300
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%d", i)
	}
	ids := enqueue(t, pool, tbl, keys...)
	dropSlot(t, pool, tbl)
	b := relay(t, pool, tbl, nil)
	ch, err := b.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	// b backfills; nobody reads yet: every row is read and waits.
	waitFor(t, liveness, "b's backfill read", func() bool { return walrelay.PeakRows(b) >= n })
	terminateWalsender(t, pool)
	// The next stream starts and backfills again.
	waitFor(t, liveness, "b's next stream", func() bool {
		var active bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_replication WHERE application_name = 'outbox-walrelay')`).Scan(&active); err != nil {
			t.Fatal(err)
		}
		return active
	})
	time.Sleep(500 * time.Millisecond) // its backfill: more rows waiting for the consumer
	var (
		mu       sync.Mutex
		inFlight = map[string]int{}
		acked    = map[string]bool{}
		overlap  []string
	)
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for msg := range ch {
			key := msg.Metadata.Get(schema.MetadataOrderingKey)
			mu.Lock()
			inFlight[key]++
			if inFlight[key] > 1 {
				overlap = append(overlap, key)
			}
			mu.Unlock()
			go func(msg *message.Message) {
				time.Sleep(10 * time.Millisecond)
				mu.Lock()
				inFlight[key]--
				acked[msg.UUID] = true
				mu.Unlock()
				msg.Ack()
			}(msg)
		}
	}()
	deadline := time.Now().Add(liveness)
	for {
		mu.Lock()
		missing := 0
		for _, id := range ids {
			if !acked[id.String()] {
				missing++
			}
		}
		mu.Unlock()
		if missing == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events not acked within 60 s after the stream was cut", missing, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := b.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	<-consumed
	mu.Lock()
	defer mu.Unlock()
	if len(overlap) > 0 {
		t.Fatalf("%d times a key had two messages in flight after the stream was cut (first: %s)", len(overlap), overlap[0])
	}
}

// dropSlot drops tbl's slot, as an operator would, once the walsender of a
// relay closed just before has let it go: the server ends that session a
// moment after Close returns (object_in_use, 55006, meanwhile).
func dropSlot(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) {
	t.Helper()
	for deadline := time.Now().Add(liveness); ; time.Sleep(50 * time.Millisecond) {
		_, err := pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, schema.WALSlotName(tbl))
		var pgErr *pgconn.PgError
		if err == nil {
			return
		}
		if !errors.As(err, &pgErr) || pgErr.Code != "55006" || time.Now().After(deadline) {
			t.Fatal(err)
		}
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
