package subscriber_test

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// idleHeld reports whether some session holds the table's idle lock: a relay
// is idle and enqueues send NOTIFY.
func idleHeld(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) bool {
	t.Helper()
	return idleKeyHeld(t, pool, sqlq.IdleLockKey(tbl))
}

// idleKeyHeld reports whether a session holds the advisory lock key
// exclusively.
func idleKeyHeld(t *testing.T, pool *pgxpool.Pool, key int64) bool {
	t.Helper()
	var held bool
	err := pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND ((classid::bigint << 32) | objid::bigint) = $1 AND mode = 'ExclusiveLock' AND granted)`, key).Scan(&held)
	if err != nil {
		t.Fatal(err)
	}
	return held
}

// notifications counts the notifications on a table's channel, from a
// connection of its own, until the test ends.
type notifications struct {
	n             atomic.Int64
	markerChannel string // a channel of the test's own, for settle's markers
	mu            sync.Mutex
	marked        map[string]bool
}

// Load is the number of notifications on the table's channel so far.
func (c *notifications) Load() int64 { return c.n.Load() }

// settle returns once every notification committed before it was called has
// been counted: PostgreSQL delivers notifications to a listener in commit
// order, so once a marker committed now has arrived, so has everything
// committed before it. No sleep guesses when a late notification is in.
func (c *notifications) settle(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	marker := uuid.NewString()
	if _, err := pool.Exec(context.Background(), `SELECT pg_notify($1, $2)`, c.markerChannel, marker); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(5 * time.Millisecond) {
		c.mu.Lock()
		in := c.marked[marker]
		c.mu.Unlock()
		if in {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("a notification did not reach the test's listener within 2 minutes")
		}
	}
}

// countNotifications LISTENs on the table's channel from a connection of its
// own and counts what arrives until the test ends.
func countNotifications(t *testing.T, tbl schema.Table) *notifications {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	c := &notifications{markerChannel: "test_sync_" + strings.ReplaceAll(uuid.NewString(), "-", ""), marked: map[string]bool{}}
	for _, ch := range []string{sqlq.NotifyChannel(tbl), c.markerChannel} {
		if _, err := conn.Exec(ctx, sqlq.ListenStatement(ch)); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			msg, err := conn.WaitForNotification(ctx)
			if err != nil {
				return
			}
			if msg.Channel == c.markerChannel {
				c.mu.Lock()
				c.marked[msg.Payload] = true
				c.mu.Unlock()
				continue
			}
			c.n.Add(1)
		}
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		_ = conn.Close(context.Background())
	})
	return c
}

// TestWakeUpHandshake: an idle relay holds the idle lock and an enqueue wakes
// it within milliseconds, with a poll interval of 10 minutes; a busy relay
// does not hold it and enqueues send no NOTIFY. A delivery within the
// 2-minute wait is not the poll's, however slow the machine; notifications
// are counted once a later marker has arrived (commit order), not after a
// sleep.
func TestWakeUpHandshake(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "wake_outbox")
	notified := countNotifications(t, tbl)
	const poll = 10 * time.Minute
	s := newSub(t, pool, subscriber.Config{Table: tbl, PollInterval: poll, BatchSize: 10, MaxInFlight: 10})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	idle := func() bool { return idleHeld(t, pool, tbl) }
	waitFor(t, "the relay to go idle", 2*time.Minute, idle)
	// The session that holds the idle lock: the relay's LISTEN connection.
	var listener int
	if err := pool.QueryRow(ctx, `SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1
  AND ((classid::bigint << 32) | objid::bigint) = $1 AND mode = 'ExclusiveLock' AND granted`, sqlq.IdleLockKey(tbl)).Scan(&listener); err != nil {
		t.Fatal(err)
	}

	// Idle: each enqueue wakes the relay.
	var worst time.Duration
	for i := range 5 {
		start := time.Now()
		id := enqueue(t, pool, tbl, "org.wake.v1", 1)[0]
		select {
		case msg := <-ch:
			if msg.UUID != id {
				t.Fatalf("got %s, want %s", msg.UUID, id)
			}
			worst = max(worst, time.Since(start))
			msg.Ack()
		case <-time.After(2 * time.Minute):
			t.Fatalf("event %d not delivered within 2 minutes (PollInterval %s): the wake-up was lost", i, poll)
		}
		waitFor(t, "the relay to go idle again", 2*time.Minute, idle)
	}
	// Delivery before the poll is the proof that the wake-up reached the
	// sleeping relay. Notifications number at most two per event: the
	// writer's, and the relay's own when it gives the lock back after
	// finding rows that no notification woke it for (a commit just before
	// its look under the lock; relays covered by its lock must hear that it
	// is awake). A relay between two idle spells is not idle, and the writer
	// rightly skips the NOTIFY; under the race detector that window is wide
	// enough to be hit, so only at least one is required.
	notified.settle(t, pool)
	if n := notified.Load(); n < 1 || n > 10 {
		t.Fatalf("%d notifications for 5 events enqueued while the relay was idle, want 1 to 10", n)
	}
	t.Logf("idle relay: worst enqueue-to-delivery %s, %d notifications for 5 events", worst, notified.Load())

	// Busy: the relay has MaxInFlight messages in flight and claims as soon
	// as a slot frees; it is not idle, and enqueues do not notify.
	enqueue(t, pool, tbl, "org.wake.v1", 10)
	held := make([]interface{ Ack() bool }, 0, 10)
	for len(held) < 10 {
		select {
		case msg := <-ch:
			held = append(held, msg)
		case <-ctx.Done():
			t.Fatal("batch not delivered")
		}
	}
	waitFor(t, "the relay to be busy", 2*time.Minute, func() bool { return !idle() })
	// The statement that gave the lock back (and may notify) has committed
	// once its session is idle; then every notification of the batch above
	// is counted once a later marker is in.
	waitFor(t, "the relay's LISTEN session to finish giving the lock back", 2*time.Minute, func() bool {
		var state string
		if err := pool.QueryRow(ctx, `SELECT COALESCE((SELECT state FROM pg_stat_activity WHERE pid = $1), 'gone')`, listener).Scan(&state); err != nil {
			t.Fatal(err)
		}
		return state != "active"
	})
	notified.settle(t, pool)
	before := notified.Load()
	for range 30 {
		enqueue(t, pool, tbl, "org.wake.v1", 1)
	}
	notified.settle(t, pool)
	if got := notified.Load() - before; got != 0 {
		t.Fatalf("%d notifications for 30 events enqueued while the relay was busy", got)
	}
	for _, m := range held {
		m.Ack()
	}
	for got := 0; got < 30; got++ {
		select {
		case msg := <-ch:
			msg.Ack()
		case <-ctx.Done():
			t.Fatalf("%d of 30 events delivered after the relay got slots back", got)
		}
	}
	waitFor(t, "the relay to go idle after draining", 2*time.Minute, idle)
}

// TestWakeUpCommitBeforeIdleLock is the dangerous case of the handshake,
// made deterministic: a writer enqueues while the relay is busy (so it sends
// no NOTIFY) and commits after the relay's last empty claim, just before the
// relay takes the idle lock. The relay must claim once more after taking it,
// or the event waits for the poll (10 minutes here: a delivery within the
// 2-minute wait is not the poll's, however slow the machine).
func TestWakeUpCommitBeforeIdleLock(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "wake_outbox")
	const poll = 10 * time.Minute
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, PollInterval: poll}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	var (
		armed   atomic.Bool
		once    sync.Once
		id      string
		hookErr error
		at      time.Time
	)
	subscriber.SetBeforeIdle(s, func() {
		if !armed.Load() {
			return
		}
		once.Do(func() {
			m := publisher.Message{TenantID: tenant, Topic: "org.wake.v1", EventID: uuid.New(), Payload: json.RawMessage(`{"n":1}`)}
			id = m.EventID.String()
			hookErr = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := publisher.Enqueue(ctx, tx, tbl, m)
				return err
			})
			at = time.Now()
		})
	})
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	// Settle: the relay is idle and the wake-ups of its start are spent.
	waitFor(t, "the relay to go idle", 2*time.Minute, func() bool { return idleHeld(t, pool, tbl) })
	time.Sleep(100 * time.Millisecond)
	// Wake it with an event; once it has found the table empty again, the
	// hook commits the writer's event. (Should a wake-up of its start still
	// be due, the hook runs before that cycle's idle lock instead, and its
	// event may come first: the same dangerous case.)
	armed.Store(true)
	first := enqueue(t, pool, tbl, "org.wake.v1", 1)[0]
	got := map[string]time.Time{}
	for range 2 {
		select {
		case msg := <-ch:
			got[msg.UUID] = time.Now()
			msg.Ack()
		case <-time.After(2 * time.Minute):
			if _, ok := got[first]; !ok {
				t.Fatal("first event not delivered")
			}
			t.Fatalf("the event committed just before the relay took the idle lock was not delivered within 2 minutes (PollInterval %s): the relay did not claim again", poll)
		}
	}
	if hookErr != nil {
		t.Fatal(hookErr)
	}
	_, okFirst := got[first]
	arrived, okHook := got[id]
	if !okFirst || !okHook {
		t.Fatalf("delivered %v, want the first event %s and the hook's %s", got, first, id)
	}
	t.Logf("the event committed just before the idle lock delivered %s after its commit", arrived.Sub(at).Round(time.Millisecond))
}

// TestWakeUpRace: writers commit at random moments, some keeping their
// transaction open after the enqueue, while relays toggle between busy and
// idle; with a poll interval of 10 minutes, a lost wake-up would show as an
// event waiting for the poll. Every event must arrive well under it: within
// 30 s of its commit (about 0.2 s at most on a quiet machine; the relays'
// own pauses are at most a second) and 2 minutes of the writers' end.
func TestWakeUpRace(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		relays int
		cfg    subscriber.Config
	}{
		{"single-active", 1, subscriber.Config{}},
		// Two relays on pools of their own: each has its own lock
		// connection, so one may hold the lock while the other cannot.
		{"two relays, SingleActive off", 2, subscriber.Config{DisableSingleActive: true}},
	}
	const poll = 10 * time.Minute
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			tbl := testdb.Table(t, "race_outbox")
			writers := testdb.Pool(t)
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			var (
				mu      sync.Mutex
				arrived = map[string]time.Time{}
			)
			for range c.relays {
				pool := testdb.NewPool(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 6 })
				cfg := c.cfg
				cfg.Table, cfg.PollInterval = tbl, poll
				s := newSub(t, pool, cfg)
				ch, err := s.Subscribe(ctx, subscriber.AllTopics)
				if err != nil {
					t.Fatal(err)
				}
				go func() {
					for m := range ch {
						mu.Lock()
						if _, dup := arrived[m.UUID]; !dup {
							arrived[m.UUID] = time.Now()
						}
						mu.Unlock()
						m.Ack()
					}
				}()
			}
			time.Sleep(300 * time.Millisecond)
			var (
				cmu       sync.Mutex
				committed = map[string]time.Time{}
				wg        sync.WaitGroup
			)
			stop := time.Now().Add(3 * time.Second)
			for w := range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 42))
					for time.Now().Before(stop) {
						// Pauses from none to 20ms: the relay finds the
						// table empty now and then and goes idle.
						time.Sleep(time.Duration(rng.IntN(20_000)) * time.Microsecond)
						n := 1 + rng.IntN(2)*rng.IntN(5)
						msgs := make([]publisher.Message, n)
						for i := range msgs {
							msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.race.v1", EventID: uuid.New(), Payload: json.RawMessage(`{"n":1}`)}
						}
						tx, err := writers.Begin(ctx)
						if err != nil {
							t.Error(err)
							return
						}
						if n == 1 {
							_, err = publisher.Enqueue(ctx, tx, tbl, msgs[0])
						} else {
							_, err = publisher.EnqueueBatch(ctx, tx, tbl, msgs)
						}
						if err != nil {
							t.Error(err)
							_ = tx.Rollback(ctx)
							return
						}
						// The dangerous case: the enqueue checked the lock
						// before the relay took it, the commit comes after.
						if rng.IntN(3) == 0 {
							time.Sleep(time.Duration(rng.IntN(5_000)) * time.Microsecond)
						}
						if err := tx.Commit(ctx); err != nil {
							t.Error(err)
							return
						}
						at := time.Now()
						cmu.Lock()
						for _, m := range msgs {
							committed[m.EventID.String()] = at
						}
						cmu.Unlock()
					}
				}()
			}
			wg.Wait()
			deadline := time.Now().Add(2 * time.Minute)
			for {
				mu.Lock()
				n := len(arrived)
				mu.Unlock()
				if n >= len(committed) || time.Now().After(deadline) {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			mu.Lock()
			defer mu.Unlock()
			lat := make([]time.Duration, 0, len(committed))
			for id, c := range committed {
				a, ok := arrived[id]
				if !ok {
					t.Fatalf("event %s not delivered 2 minutes after the writers stopped (poll interval %s): a wake-up was lost", id, poll)
				}
				lat = append(lat, max(0, a.Sub(c)))
			}
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			p := func(q int) time.Duration { return lat[(len(lat)*q+99)/100-1] }
			t.Logf("%d events: p50 %s, p99 %s, max %s", len(lat), p(50), p(99), lat[len(lat)-1])
			if worst := lat[len(lat)-1]; worst > 30*time.Second {
				t.Fatalf("an event took %s from commit to delivery (poll interval %s)", worst, poll)
			}
		})
	}
}

// TestOrderedWakeUp: an idle ordered subscriber holds both idle locks (its
// claim loop's and its ordered relay's), so keyed and unkeyed events
// enqueued while it waits wake it, with a poll interval of 10 minutes: a
// delivery within the 2-minute wait is not the poll's, however slow the
// machine.
func TestOrderedWakeUp(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	cfg := orderedCfg(tbl)
	cfg.PollInterval = 10 * time.Minute
	s := orderedSub(t, pool, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the idle locks to be held", 2*time.Minute, func() bool {
		return idleHeld(t, pool, tbl) && idleKeyHeld(t, pool, sqlq.OrderedIdleLockKey(tbl))
	})
	time.Sleep(300 * time.Millisecond) // partitions assigned, first cycles done
	for i, key := range []string{"a", "b", "", "a"} {
		start := time.Now()
		m := publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: uuid.New(), Payload: json.RawMessage(`{"n":1}`), OrderingKey: key}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, tbl, m)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		select {
		case msg := <-ch:
			if msg.UUID != m.EventID.String() {
				t.Fatalf("got %s, want %s", msg.UUID, m.EventID)
			}
			msg.Ack()
			t.Logf("event %d (key %q) delivered %s after its enqueue began", i, key, time.Since(start).Round(time.Millisecond))
		case <-time.After(2 * time.Minute):
			t.Fatalf("event %d (key %q) not delivered within 2 minutes (PollInterval %s): the wake-up was lost", i, key, cfg.PollInterval)
		}
	}
}

// TestWakeUpKeyedAndUnkeyedLocks: keyed rows try the ordered relays' idle
// lock and unkeyed rows the claim loop's, so an idle claim loop does not
// make every keyed commit notify (nor the reverse); a batch with both kinds
// notifies when either kind's relay sleeps.
func TestWakeUpKeyedAndUnkeyedLocks(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	n := countNotifications(t, tbl)
	enqueue := func(keys ...string) {
		t.Helper()
		msgs := make([]publisher.Message, len(keys))
		for i, k := range keys {
			msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: uuid.New(), Payload: json.RawMessage(`{}`), OrderingKey: k}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if len(msgs) == 1 {
				_, err := publisher.Enqueue(ctx, tx, tbl, msgs[0])
				return err
			}
			_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	expect := func(what string, want int64, keys ...string) {
		t.Helper()
		n.settle(t, pool)
		before := n.Load()
		enqueue(keys...)
		n.settle(t, pool) // every notification of the enqueue is in
		if got := n.Load() - before; got != want {
			t.Errorf("%s: %d notifications, want %d", what, got, want)
		}
	}
	for _, c := range []struct {
		name string
		key  int64
		// notifications for: keyed, unkeyed, keyed batch, unkeyed batch, mixed batch
		want [5]int64
	}{
		{"claim loop asleep", sqlq.IdleLockKey(tbl), [5]int64{0, 1, 0, 1, 1}},
		{"ordered relay asleep", sqlq.OrderedIdleLockKey(tbl), [5]int64{1, 0, 1, 0, 1}},
	} {
		holder, err := pgx.Connect(ctx, testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := holder.Exec(ctx, sqlq.TryIdleLock, c.key); err != nil {
			t.Fatal(err)
		}
		expect(c.name+", keyed", c.want[0], "k1")
		expect(c.name+", unkeyed", c.want[1], "")
		expect(c.name+", keyed batch", c.want[2], "k1", "k2")
		expect(c.name+", unkeyed batch", c.want[3], "", "")
		expect(c.name+", mixed batch", c.want[4], "k1", "")
		if _, err := holder.Exec(ctx, `SELECT pg_advisory_unlock_all()`); err != nil {
			t.Fatal(err)
		}
		_ = holder.Close(ctx)
	}
	expect("nobody asleep, mixed batch", 0, "k1", "")
}
