package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

var tenant = uuid.MustParse("0d9b6a7e-1c1e-4b8e-9a0e-3f1f7b6f2a10")

// enqueue commits n events of topic and returns their event_ids.
func enqueue(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic string, n int) []string {
	t.Helper()
	ctx := context.Background()
	ids := make([]string, 0, n)
	for n > 0 {
		k := min(n, 500)
		msgs := make([]publisher.Message, k)
		for i := range msgs {
			msgs[i] = publisher.Message{TenantID: tenant, Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{"secret_payload_marker":"x1y2z3"}`)}
			ids = append(ids, msgs[i].EventID.String())
		}
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		n -= k
	}
	return ids
}

func newSub(t *testing.T, pool *pgxpool.Pool, cfg subscriber.Config) *subscriber.Subscriber {
	t.Helper()
	s, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return s
}

type rowState struct {
	attempts  int
	published bool
	locked    bool
	lastError *string
	due       time.Duration
	parked    bool // available_at = 'infinity': dead
}

func state(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, eventID string) rowState {
	t.Helper()
	var r rowState
	var dueSecs float64
	err := pool.QueryRow(context.Background(), `SELECT attempts, published_at IS NOT NULL, locked_at IS NOT NULL, last_error,
		available_at = 'infinity', CASE WHEN available_at = 'infinity' THEN 0 ELSE extract(epoch FROM available_at - now())::float8 END
		FROM `+tbl.Sanitize()+` WHERE event_id = $1`, eventID).
		Scan(&r.attempts, &r.published, &r.locked, &r.lastError, &r.parked, &dueSecs)
	if err != nil {
		t.Fatal(err)
	}
	r.due = time.Duration(dueSecs * float64(time.Second))
	return r
}

func waitFor(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cfg_outbox")
	bad := []struct {
		cfg  subscriber.Config
		want string
	}{
		{subscriber.Config{}, "Table is required"},
		{subscriber.Config{Table: tbl, BatchSize: -1}, "BatchSize is negative"},
		{subscriber.Config{Table: tbl, BatchSize: 100, MaxInFlight: 10}, "MaxInFlight (10) is below BatchSize"},
		{subscriber.Config{Table: tbl, LockTTL: time.Millisecond}, "too short"},
		{subscriber.Config{Table: tbl, DisableLeaseExtension: true, LockTTL: time.Second}, "CloseTimeout"},
		{subscriber.Config{Table: tbl, LeaderTimeout: 2 * time.Second}, "LeaderTimeout: 2s is below 3s"},
		{subscriber.Config{Table: tbl, LeaderTimeout: -time.Second}, "LeaderTimeout is negative"},
	}
	for _, b := range bad {
		if _, err := subscriber.New(context.Background(), pool, b.cfg, nil); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("config %+v: got %v, want %q", b.cfg, err, b.want)
		}
	}
	// One mistake, one message: a negative BatchSize does not also report
	// the MaxInFlight derived from it.
	if _, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, BatchSize: -1}, nil); err == nil || strings.Contains(err.Error(), "MaxInFlight") {
		t.Errorf("BatchSize -1: %v, want only the BatchSize error", err)
	}
	if _, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: schema.MustParseTable(tbl.Schema() + ".missing")}, nil); !errors.Is(err, schema.ErrTableNotFound) {
		t.Errorf("missing table: %v", err)
	}
	if _, err := subscriber.New(context.Background(), nil, subscriber.Config{Table: tbl}, nil); err == nil {
		t.Error("nil pool accepted")
	}
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	b := &subscriber.ExponentialBackoff{Base: time.Second, Max: time.Minute}
	want := []time.Duration{time.Second, 2 * time.Second, 4 * time.Second, 8 * time.Second, 16 * time.Second, 32 * time.Second, time.Minute, time.Minute}
	for i, w := range want {
		if got := b.Delay(i + 1); got != w {
			t.Errorf("Delay(%d) = %s, want %s", i+1, got, w)
		}
	}
	if got := b.Delay(1000); got != time.Minute {
		t.Errorf("Delay(1000) = %s", got)
	}
	for range 100 {
		d := subscriber.DefaultBackoff(1)
		if d < time.Second || d >= time.Second+200*time.Millisecond {
			t.Fatalf("DefaultBackoff(1) = %s, want [1s, 1.2s)", d)
		}
	}
}

// TestConcurrentSubscribersDrainExactlyOnce: four subscribers with
// single-active off share 20,000 rows through SKIP LOCKED; with no crash every
// event is delivered exactly once.
func TestConcurrentSubscribersDrainExactlyOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "drain_outbox")
	const total = 20000
	ids := enqueue(t, pool, tbl, "org.drain.done.v1", total)
	var (
		mu   sync.Mutex
		seen = make(map[string]int, total)
		got  atomic.Int64
	)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var wg sync.WaitGroup
	for range 4 {
		s := newSub(t, pool, subscriber.Config{Table: tbl, DisableSingleActive: true, BatchSize: 200})
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range ch {
				mu.Lock()
				seen[m.UUID]++
				mu.Unlock()
				m.Ack()
				if got.Add(1) == total {
					cancel()
				}
			}
		}()
	}
	wg.Wait()
	for _, id := range ids {
		if seen[id] != 1 {
			t.Fatalf("event %s delivered %d times", id, seen[id])
		}
	}
	if len(seen) != total {
		t.Fatalf("%d distinct events, want %d", len(seen), total)
	}
	var published int
	waitFor(t, "all rows published", 2*time.Minute, func() bool {
		_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NOT NULL AND locked_at IS NULL`).Scan(&published)
		return published == total
	})
}

// TestLeaseRecovery: a row claimed and abandoned comes back after LockTTL, and
// the old holder's late ack is rejected by the fence. Each relay takes one
// message at a time (MaxInFlight 1), so the holders of the two leases
// cannot claim anything more, and the first is closed once its stale ack
// is rejected: the second lease cannot expire and pass on while the test
// looks at it, however slow the machine. LockTTL is measured between the
// two leases' locked_at, in the database's clock.
func TestLeaseRecovery(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "lease_outbox")
	ids := enqueue(t, pool, tbl, "org.lease.taken.v1", 1)
	reg, m := newMetrics(t)
	_ = reg
	const lockTTL = 3 * time.Second
	cfg := subscriber.Config{Table: tbl, DisableSingleActive: true, LockTTL: lockTTL, BatchSize: 1, MaxInFlight: 1,
		PollInterval: 50 * time.Millisecond, DisableLeaseExtension: true, CloseTimeout: 100 * time.Millisecond, Metrics: m}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	lockedAt := func() time.Time {
		var at time.Time
		if err := pool.QueryRow(ctx, `SELECT locked_at FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ids[0]).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}

	first := newSub(t, pool, cfg)
	ch1, err := first.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	old := <-ch1 // claimed, never acked in time: the holder "hangs"
	if old.UUID != ids[0] || old.Metadata.Get(schema.MetadataAttempts) != "1" {
		t.Fatalf("first delivery %s attempts %s", old.UUID, old.Metadata.Get(schema.MetadataAttempts))
	}
	firstLease := lockedAt()
	second := newSub(t, pool, cfg)
	ch2, err := second.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var again *message.Message
	select {
	case again = <-ch2:
	case again = <-ch1:
	case <-ctx.Done():
		t.Fatal("abandoned row was not claimed again")
	}
	if d := lockedAt().Sub(firstLease); d < lockTTL {
		t.Fatalf("row re-claimed %s after its first lease, before the lease (%s) expired", d, lockTTL)
	}
	if again.UUID != ids[0] || again.Metadata.Get(schema.MetadataAttempts) != "2" {
		t.Fatalf("second delivery %s attempts %s", again.UUID, again.Metadata.Get(schema.MetadataAttempts))
	}
	if st := state(t, pool, tbl, ids[0]); st.lastError == nil || !strings.Contains(*st.lastError, "lease of attempt 1 expired") {
		t.Fatalf("re-claim after an expired lease did not record it: %+v", st)
	}
	// The old holder wakes up and acks: the fence rejects it.
	old.Ack()
	waitFor(t, "the stale ack to be rejected", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.FenceRejected.WithLabelValues(tbl.Qualified(), "ack")) == 1
	})
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	if st := state(t, pool, tbl, ids[0]); st.published || !st.locked || st.attempts != 2 {
		t.Fatalf("stale ack changed the row: %+v", st)
	}
	again.Ack()
	waitFor(t, "the current holder's ack", 2*time.Minute, func() bool {
		st := state(t, pool, tbl, ids[0])
		return st.published && !st.locked
	})
}

func newMetrics(t *testing.T) (any, *metrics.Metrics) {
	t.Helper()
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return nil, m
}

// TestRetryBackoffThenDead: a failing message is retried with backoff and
// goes dead at MaxAttempts, counted once; last_error is truncated on a UTF-8
// boundary, without the payload or the DSN password.
func TestRetryBackoffThenDead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "retry_outbox")
	ids := enqueue(t, pool, tbl, "org.retry.failed.v1", 1)
	_, m := newMetrics(t)
	const maxBytes = 64
	var delays []int
	var mu sync.Mutex
	s := newSub(t, pool, subscriber.Config{Table: tbl, MaxAttempts: 3, PollInterval: 20 * time.Millisecond, Metrics: m,
		LastErrorMaxBytes: maxBytes,
		Backoff: func(n int) time.Duration {
			mu.Lock()
			delays = append(delays, n)
			mu.Unlock()
			return time.Duration(n) * 200 * time.Millisecond
		}})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var deliveredAt []time.Time
	for attempt := 1; attempt <= 3; attempt++ {
		msg := <-ch
		deliveredAt = append(deliveredAt, time.Now())
		if msg.Metadata.Get(schema.MetadataAttempts) != string(rune('0'+attempt)) {
			t.Fatalf("attempt %d has metadata attempts %s", attempt, msg.Metadata.Get(schema.MetadataAttempts))
		}
		cause := errors.New("dial postgres://relay:hunter2@db:5432/x: " + `{"secret_payload_marker": "x1y2z3"}` + strings.Repeat("é", 40))
		subscriber.RecordError(msg, cause)
		nacked := time.Now()
		msg.Nack()
		if attempt < 3 {
			waitFor(t, "the nack", 2*time.Minute, func() bool { return !state(t, pool, tbl, ids[0]).locked })
			st := state(t, pool, tbl, ids[0])
			// The nack set available_at = (its time) + backoff, its time
			// after nacked: due plus the time since nacked is at least the
			// backoff, however late the state was read.
			if since := time.Since(nacked); st.due+since < time.Duration(attempt)*200*time.Millisecond-20*time.Millisecond {
				t.Fatalf("after attempt %d the row is due in %s, %s after the nack, want ~%dms after it", attempt, st.due, since, attempt*200)
			}
		}
	}
	if d := deliveredAt[2].Sub(deliveredAt[1]); d < 350*time.Millisecond {
		t.Fatalf("third attempt %s after the second; backoff not applied", d)
	}
	waitFor(t, "dead", 2*time.Minute, func() bool {
		st := state(t, pool, tbl, ids[0])
		return !st.locked && st.attempts == 3
	})
	select {
	case msg := <-ch:
		t.Fatalf("dead row delivered again: %s", msg.UUID)
	case <-time.After(500 * time.Millisecond):
	}
	st := state(t, pool, tbl, ids[0])
	if st.published || st.lastError == nil || !st.parked {
		t.Fatalf("dead row: %+v", st)
	}
	le := *st.lastError
	if len(le) > maxBytes || !utf8.ValidString(le) || strings.Contains(le, "hunter2") || strings.Contains(le, "x1y2z3") {
		t.Fatalf("last_error %q (%d bytes) not redacted or truncated", le, len(le))
	}
	if !strings.Contains(le, "relay:***@") {
		t.Fatalf("last_error %q lost its summary", le)
	}
	if got := testutil.ToFloat64(m.DeadTotal.WithLabelValues(tbl.Qualified(), "org.retry.failed.v1")); got != 1 {
		t.Fatalf("outbox_dead_total = %v, want 1", got)
	}
	if got := testutil.ToFloat64(m.DispatchTotal.WithLabelValues(tbl.Qualified(), "org.retry.failed.v1", metrics.ResultFailure)); got != 3 {
		t.Fatalf("failures = %v, want 3", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(delays) != 3 || delays[0] != 1 || delays[1] != 2 {
		t.Fatalf("backoff called with %v", delays)
	}
}

// TestPoisonMessagesDoNotBlock: one message that errors permanently, one that
// panics and one that times out, among healthy ones, through a Watermill
// router: the healthy ones are all delivered meanwhile; the bad ones end dead.
func TestPoisonMessagesDoNotBlock(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "poison_outbox")
	healthy := enqueue(t, pool, tbl, "org.healthy.v1", 200)
	failing := enqueue(t, pool, tbl, "org.poison.error.v1", 1)[0]
	panicking := enqueue(t, pool, tbl, "org.poison.panic.v1", 1)[0]
	slow := enqueue(t, pool, tbl, "org.poison.slow.v1", 1)[0]
	healthy = append(healthy, enqueue(t, pool, tbl, "org.healthy.v1", 200)...)

	s := newSub(t, pool, subscriber.Config{Table: tbl, MaxAttempts: 2, PollInterval: 20 * time.Millisecond,
		Backoff: func(int) time.Duration { return 50 * time.Millisecond }, CloseTimeout: time.Second})
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(subscriber.CaptureError, middleware.Recoverer, middleware.Timeout(200*time.Millisecond))
	var (
		mu      sync.Mutex
		done    = map[string]bool{}
		badSeen atomic.Int64
	)
	r.AddConsumerHandler("relay", subscriber.AllTopics, s, func(msg *message.Message) error {
		switch msg.UUID {
		case failing:
			badSeen.Add(1)
			return subscriber.Permanent(errors.New("no route for topic"))
		case panicking:
			badSeen.Add(1)
			panic("handler exploded")
		case slow:
			badSeen.Add(1)
			<-msg.Context().Done()
			return msg.Context().Err()
		}
		mu.Lock()
		done[msg.UUID] = true
		mu.Unlock()
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	defer func() { _ = r.Close() }()
	waitFor(t, "healthy messages", 2*time.Minute, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(done) == len(healthy)
	})
	waitFor(t, "bad messages dead", 2*time.Minute, func() bool {
		var dead int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NULL AND dead_at IS NOT NULL AND locked_at IS NULL`).Scan(&dead)
		return dead == 3
	})
	if st := state(t, pool, tbl, failing); st.attempts != 1 || !st.parked || !strings.Contains(*st.lastError, "permanent: no route") {
		t.Fatalf("permanent error row %+v, %v", st, *st.lastError)
	}
	if badSeen.Load() != 1+2+2 { // the permanent error is not retried
		t.Fatalf("bad messages handled %d times, want 5", badSeen.Load())
	}
	if st := state(t, pool, tbl, panicking); !strings.Contains(*st.lastError, "handler exploded") {
		t.Fatalf("panic last_error %v", *st.lastError)
	}
	if st := state(t, pool, tbl, slow); !strings.Contains(*st.lastError, "deadline exceeded") {
		t.Fatalf("timeout last_error %v", *st.lastError)
	}
}

// TestSingleActive: two subscribers on one table; only the leader dispatches.
// Killing the leader's connection lets the standby take over.
func TestSingleActive(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "single_outbox")
	_, m := newMetrics(t)
	cfg := subscriber.Config{Table: tbl, PollInterval: 20 * time.Millisecond, ElectionInterval: 50 * time.Millisecond, Metrics: m}
	a := newSub(t, testdb.NewPool(t, nil), cfg)
	b := newSub(t, testdb.NewPool(t, nil), cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var counts [2]atomic.Int64
	for i, s := range []*subscriber.Subscriber{a, b} {
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for msg := range ch {
				counts[i].Add(1)
				msg.Ack()
			}
		}()
	}
	waitFor(t, "a leader", 2*time.Minute, func() bool { return a.IsLeader() || b.IsLeader() })
	time.Sleep(200 * time.Millisecond)
	if a.IsLeader() == b.IsLeader() {
		t.Fatalf("leaders: a=%v b=%v", a.IsLeader(), b.IsLeader())
	}
	leader, standby := 0, 1
	if b.IsLeader() {
		leader, standby = 1, 0
	}
	enqueue(t, pool, tbl, "org.single.v1", 300)
	waitFor(t, "300 deliveries", 2*time.Minute, func() bool { return counts[0].Load()+counts[1].Load() == 300 })
	if counts[standby].Load() != 0 {
		t.Fatalf("standby dispatched %d messages", counts[standby].Load())
	}
	if got := testutil.ToFloat64(m.RelayLeader.WithLabelValues(tbl.Qualified())); got != 1 {
		t.Fatalf("outbox_relay_leader = %v", got)
	}
	// Kill the leader's session: its advisory lock goes with it. The relay
	// that lost it lives on and may take the lock again on a new session
	// (it waits two election intervals so that a standby usually goes
	// first, but a loaded machine may delay the standby's tries): either
	// way exactly one relay is active again and dispatches.
	killedAt := time.Now()
	var killedPid int
	err := pool.QueryRow(ctx, `SELECT pid FROM pg_locks l
		WHERE l.locktype = 'advisory' AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = $1`, sqlq.LockKey(tbl)).Scan(&killedPid)
	if err != nil {
		t.Fatalf("find the leader session: %v", err)
	}
	var ok bool
	if err := pool.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, killedPid).Scan(&ok); err != nil || !ok {
		t.Fatalf("terminate the leader session %d: %v %v", killedPid, ok, err)
	}
	subs := []*subscriber.Subscriber{a, b}
	holder := func() int {
		var pid int
		if err := pool.QueryRow(ctx, `SELECT coalesce(max(pid), 0) FROM pg_locks l
			WHERE l.locktype = 'advisory' AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = $1`, sqlq.LockKey(tbl)).Scan(&pid); err != nil {
			t.Fatal(err)
		}
		return pid
	}
	// Deliveries go on: whichever relay holds the lock on a new session
	// (the standby, or the old leader again) delivers.
	enqueue(t, pool, tbl, "org.single.v1", 100)
	waitFor(t, "all 400 delivered", time.Minute, func() bool { return counts[0].Load()+counts[1].Load() >= 400 })
	if p := holder(); p == 0 || p == killedPid {
		t.Fatalf("the lock's holder after the takeover: pid %d (the killed session was %d)", p, killedPid)
	}
	// The relay that lost its session notices at its next ping and steps
	// down: then exactly one relay is the leader, the lock's holder.
	waitFor(t, "exactly one leader", time.Minute, func() bool { return a.IsLeader() != b.IsLeader() })
	t.Logf("a relay took over %s after the leader's session ended (the standby: %v)", time.Since(killedAt).Round(time.Millisecond), subs[standby].IsLeader())
	active, other := 0, 1
	if b.IsLeader() {
		active, other = 1, 0
	}
	// The active relay's process ends: the other, standing by, takes over
	// (it is the only one left to try) and dispatches.
	if err := subs[active].Close(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the standby to take over", time.Minute, func() bool { return subs[other].IsLeader() })
	before := counts[other].Load()
	enqueue(t, pool, tbl, "org.single.v1", 100)
	waitFor(t, "the new leader to dispatch", time.Minute, func() bool { return counts[other].Load() >= before+100 })
	_ = leader
}

// TestWakeUpWithoutPolling: with PollInterval an hour, a committed enqueue is
// delivered through LISTEN/NOTIFY.
func TestWakeUpWithoutPolling(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "wake_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, "org.wake.v1")
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "leadership", 2*time.Minute, s.IsLeader)
	time.Sleep(200 * time.Millisecond) // let the first (empty) claim pass
	for i := range 3 {
		start := time.Now()
		id := enqueue(t, pool, tbl, "org.wake.v1", 1)[0]
		select {
		case msg := <-ch:
			if msg.UUID != id {
				t.Fatalf("got %s, want %s", msg.UUID, id)
			}
			msg.Ack()
			t.Logf("event %d delivered %s after commit", i, time.Since(start))
		case <-ctx.Done():
			t.Fatalf("event %d not delivered without polling", i)
		}
	}
}

// TestLeaseExtendedForSlowHandler: a handler slower than LockTTL keeps its
// lease; the message is not delivered twice. LockTTL is 2 s, renewed every
// second: a renewal on a loaded machine may come a second late before the
// other subscriber could take the row.
func TestLeaseExtendedForSlowHandler(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "slow_outbox")
	ids := enqueue(t, pool, tbl, "org.slow.v1", 1)
	_, m := newMetrics(t)
	const lockTTL = 2 * time.Second
	cfg := subscriber.Config{Table: tbl, DisableSingleActive: true, LockTTL: lockTTL, PollInterval: 20 * time.Millisecond, Metrics: m}
	a := newSub(t, pool, cfg)
	b := newSub(t, pool, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cha, _ := a.Subscribe(ctx, subscriber.AllTopics)
	chb, _ := b.Subscribe(ctx, subscriber.AllTopics)
	var msg *message.Message
	select {
	case msg = <-cha:
	case msg = <-chb:
	}
	// Hold it for three lease lengths while the other subscriber polls.
	select {
	case dup := <-cha:
		t.Fatalf("delivered twice: %s", dup.UUID)
	case dup := <-chb:
		t.Fatalf("delivered twice: %s", dup.UUID)
	case <-time.After(3 * lockTTL):
	}
	msg.Ack()
	waitFor(t, "ack", 2*time.Minute, func() bool { return state(t, pool, tbl, ids[0]).published })
	if st := state(t, pool, tbl, ids[0]); st.attempts != 1 {
		t.Fatalf("attempts %d, want 1", st.attempts)
	}
	if testutil.ToFloat64(m.LeaseExtended.WithLabelValues(tbl.Qualified())) < 2 {
		t.Fatal("lease not renewed")
	}
}

// TestCloseWhileBlockedGivesLeasesBack: Close returns while the consumer
// reads nothing, is idempotent, and the rows it had claimed come back at once
// with their attempt undone.
func TestCloseWhileBlockedGivesLeasesBack(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "close_outbox")
	enqueue(t, pool, tbl, "org.close.v1", 50)
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, BatchSize: 50, CloseTimeout: 200 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	first := <-ch // delivered, never answered
	waitFor(t, "the claim", 2*time.Minute, func() bool {
		var locked int
		_ = pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE locked_at IS NOT NULL`).Scan(&locked)
		return locked == 50
	})
	done := make(chan error, 1)
	go func() { done <- s.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("Close blocked")
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, ok := <-ch; ok {
		t.Fatal("channel not closed")
	}
	if _, err := s.Subscribe(context.Background(), subscriber.AllTopics); !errors.Is(err, subscriber.ErrSubscriberClosed) {
		t.Fatalf("Subscribe after Close: %v", err)
	}
	var locked, attempted int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE locked_at IS NOT NULL), count(*) FILTER (WHERE attempts > 0) FROM `+tbl.Sanitize()).Scan(&locked, &attempted); err != nil {
		t.Fatal(err)
	}
	if locked != 0 || attempted != 1 { // only the delivered message counts an attempt
		t.Fatalf("after Close: %d locked, %d with attempts (first %s)", locked, attempted, first.UUID)
	}
}

// TestMetricsAfterKnownRun checks the dispatch metrics and gauges after a
// known run.
func TestMetricsAfterKnownRun(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "metrics_outbox")
	enqueue(t, pool, tbl, "org.metrics.ok.v1", 10)
	_, m := newMetrics(t)
	s := newSub(t, pool, subscriber.Config{Table: tbl, Metrics: m, StatsInterval: 50 * time.Millisecond, PollInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ch, _ := s.Subscribe(ctx, "org.metrics.ok.v1")
	for range 10 {
		(<-ch).Ack()
	}
	label := tbl.Qualified()
	waitFor(t, "success count", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.DispatchTotal.WithLabelValues(label, "org.metrics.ok.v1", metrics.ResultSuccess)) == 10
	})
	waitFor(t, "gauges", 2*time.Minute, func() bool {
		return testutil.ToFloat64(m.Pending.WithLabelValues(label)) == 0 && testutil.ToFloat64(m.Locked.WithLabelValues(label)) == 0
	})
	if n := testutil.CollectAndCount(m.DeliveryLag); n != 1 {
		t.Fatalf("delivery lag series %d", n)
	}
	if n := testutil.CollectAndCount(m.DispatchLatency); n != 1 {
		t.Fatalf("dispatch latency series %d", n)
	}
	enqueue(t, pool, tbl, "org.metrics.later.v1", 3)
	waitFor(t, "pending gauge", 2*time.Minute, func() bool { return testutil.ToFloat64(m.Pending.WithLabelValues(label)) == 3 })
	if testutil.ToFloat64(m.RelayLeader.WithLabelValues(label)) != 1 {
		t.Fatal("leader gauge")
	}
}
