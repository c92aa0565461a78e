package walrelay_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// A transaction is streamed once its commit record is flushed, and becomes
// visible to other sessions a moment later, when its backend leaves the
// process array: under load, or while a synchronous standby has not
// confirmed it, the relay can hold a row its own statements cannot see.
// These tests keep a writer's commit waiting for a synchronous standby
// that never comes ("ghost"): the row is streamed, invisible to every other
// session, until the test cancels the wait (the transaction stays
// committed).

// unseenCluster is a cluster whose commits wait for a synchronous standby
// that does not exist when a session asks for it (synchronous_commit on);
// every other session commits locally.
func unseenCluster(t *testing.T) (*pgxpool.Pool, schema.Table) {
	t.Helper()
	pool, tbl, _ := clusterWith(t, map[string]string{
		"synchronous_standby_names": "ghost",
		"synchronous_commit":        "local",
	})
	return pool, tbl
}

// enqueueUnseen commits one event of key in a transaction that stays
// invisible (its commit waits for the ghost standby) until see is called;
// see returns once the commit returned.
func enqueueUnseen(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, key string) (id uuid.UUID, see func()) {
	t.Helper()
	id = uuid.New()
	see = unseen(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: id,
			Payload: json.RawMessage(`{"n":1}`), OrderingKey: key})
		return err
	})
	return id, see
}

// unseen runs write in a transaction whose commit waits for the ghost
// standby: committed and streamed, invisible to other sessions until see
// is called. It returns once the commit waits.
func unseen(t *testing.T, pool *pgxpool.Pool, write func(context.Context, pgx.Tx) error) (see func()) {
	t.Helper()
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SET synchronous_commit = on`); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := write(ctx, tx); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- tx.Commit(ctx) }()
	var once sync.Once
	see = func() {
		once.Do(func() {
			if _, err := pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid); err != nil {
				t.Error(err)
			}
			if err := <-done; err != nil {
				t.Errorf("commit: %v", err) // a cancelled wait keeps the local commit
			}
			_, _ = conn.Exec(ctx, `RESET synchronous_commit`)
			conn.Release()
		})
	}
	t.Cleanup(see)
	// The commit record is written and the backend waits for the standby.
	waitFor(t, 5*time.Second, "the commit waits for the standby", func() bool {
		var waiting bool
		if err := pool.QueryRow(ctx, `SELECT COALESCE(wait_event = 'SyncRep', false) FROM pg_stat_activity WHERE pid = $1`, pid).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	return see
}

var errRejected = errors.New("rejected")

// rejectK returns a handler that rejects the messages of key k for good
// while rejecting is set (it starts set) and accepts the rest.
func rejectK() (rejecting *atomic.Bool, handle func(*message.Message) error) {
	rejecting = &atomic.Bool{}
	rejecting.Store(true)
	return rejecting, func(msg *message.Message) error {
		if msg.Metadata.Get(schema.MetadataOrderingKey) == "k" && rejecting.Load() {
			return subscriber.Permanent(errRejected)
		}
		return nil
	}
}

// waitHeldOnce waits until one row of tbl is dead and holds its key.
func waitHeldOnce(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) {
	t.Helper()
	waitFor(t, 10*time.Second, "the key held by its dead row", func() bool {
		st, err := runbook.New(pool, tbl).Stats(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st.Dead == 1 && st.HeldKeys == 1
	})
}

// A row rejected for good while its transaction is not visible yet: the
// relay's dead write found no row, and the row was counted settled (never
// dead, later counted streamed by the runbook and deleted by the cleaner).
// Now the verdict waits until the row is visible and then parks it dead;
// the handler is not called again.
func TestWALDeadVerdictWaitsForTheRowToBeVisible(t *testing.T) {
	t.Parallel()
	pool, tbl := unseenCluster(t)
	ctx := context.Background()
	s := relay(t, pool, tbl, nil)
	rec := newRecorder()
	var calls atomic.Int32
	rec.consume(t, s, func(msg *message.Message) error {
		if msg.Metadata.Get(schema.MetadataOrderingKey) == "bad" {
			calls.Add(1)
			return subscriber.Permanent(errRejected)
		}
		return nil
	})
	warm := enqueue(t, pool, tbl, "k")
	rec.waitAcked(t, warm, 10*time.Second)
	_, see := enqueueUnseen(t, pool, tbl, "bad")
	waitFor(t, 10*time.Second, "the invisible row delivered", func() bool { return calls.Load() > 0 })
	// Later rows of other keys go on meanwhile.
	after := enqueue(t, pool, tbl, "k", "z")
	rec.waitAcked(t, after, 10*time.Second)
	time.Sleep(300 * time.Millisecond) // several status ticks: the verdict is not recorded as anything yet
	st, err := runbook.New(pool, tbl).Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Dead != 0 {
		t.Fatalf("a row nobody can see yet counted dead: %+v", st)
	}
	see()
	waitFor(t, 10*time.Second, "the rejected row dead once visible", func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Dead == 1 && st.HeldKeys == 1
	})
	if n := calls.Load(); n != 1 {
		t.Fatalf("the handler rejected the row %d times, want once (the verdict waits, not the delivery)", n)
	}
}

// parkedInvisible starts a relay on a cluster whose writers wait for a
// synchronous standby that does not exist, makes the first row of key k
// dead (doomed), then commits a row of k (parked) that the relay streams
// and parks behind the hold while nobody can see it: see makes it visible.
// The relay's handler rejects k's rows only until the hold exists.
func parkedInvisible(t *testing.T) (pool *pgxpool.Pool, tbl schema.Table, rec *recorder, s *walrelay.Subscriber, doomed []uuid.UUID, parked uuid.UUID, see func()) {
	t.Helper()
	pool, tbl = unseenCluster(t)
	s = relay(t, pool, tbl, nil)
	rec = newRecorder()
	rejecting, handle := rejectK()
	rec.consume(t, s, handle)
	doomed = enqueue(t, pool, tbl, "k")
	waitHeldOnce(t, pool, tbl)
	rejecting.Store(false)
	parked, see = enqueueUnseen(t, pool, tbl, "k")
	// Streamed in commit order: once z is delivered, the invisible row of
	// k was read and parked behind the hold.
	z := enqueue(t, pool, tbl, "z")
	rec.waitAcked(t, z, 10*time.Second)
	return pool, tbl, rec, s, doomed, parked, see
}

// A held key's drain while a parked row of the key is not visible yet: the
// drain read nothing, released the hold, and the parked row was never
// delivered. Now the drain waits until every streamed row is visible.
func TestWALDrainWaitsForParkedRowsToBeVisible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl, rec, _, doomed, parked, see := parkedInvisible(t)
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, doomed[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, doomed, 10*time.Second)
	time.Sleep(300 * time.Millisecond) // the drain's first attempt is over
	if rec.has(parked) {
		t.Fatal("a row nobody can see yet was delivered")
	}
	see()
	rec.waitAcked(t, []uuid.UUID{parked}, 10*time.Second)
	waitFor(t, 10*time.Second, "the hold resolved", func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.HeldKeys == 0 && st.Pending == 0
	})
}

// A parked row that is not visible yet when its session ends: the next
// session starts after its transaction (the ended session confirmed it,
// parked), so its own stream never saw it, and its drain (after a skip)
// read nothing, released the hold, and the row was never delivered (found
// by TestWALHistory once in CI). Now a transaction that parked a row is
// confirmed only once it is visible: the next session streams it again,
// parks the row itself, and its drain waits for it.
func TestWALDrainInANewSessionWaitsForRowsParkedInvisible(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl, rec, s, doomed, parked, see := parkedInvisible(t)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, doomed[0], false); err != nil {
		t.Fatal(err)
	}
	rejecting, handle := rejectK()
	rejecting.Store(false)
	s2 := relay(t, pool, tbl, nil)
	rec.consume(t, s2, handle)
	time.Sleep(500 * time.Millisecond) // the new session's drain has tried
	if rec.has(parked) {
		t.Fatal("a row nobody can see yet was delivered")
	}
	see()
	rec.waitAcked(t, []uuid.UUID{parked}, 10*time.Second)
	if rec.has(doomed[0]) {
		t.Fatal("the skipped row was delivered")
	}
}

// The replay of a row whose payload is stored out of line (TOAST): its
// UPDATE leaves the payload out and the relay reads the row. With the
// replay's transaction not visible yet, the read found the row still dead
// and the replay was dropped ("Replayed row not found"): the key stayed
// held behind a row that is no longer dead. Now the read waits for the
// replay to be visible.
func TestWALReplayOfAnOutOfLineRowWaitsForItToBeVisible(t *testing.T) {
	t.Parallel()
	pool, tbl := unseenCluster(t)
	ctx := context.Background()
	s := relay(t, pool, tbl, nil)
	rec := newRecorder()
	rejecting, handle := rejectK()
	rec.consume(t, s, handle)
	// 64 KiB of random text: stored out of line, not compressible.
	noise := make([]byte, 48<<10)
	for i := range noise {
		noise[i] = byte(rand.IntN(256))
	}
	payload, _ := json.Marshal(map[string]string{"noise": base64.StdEncoding.EncodeToString(noise)})
	big := uuid.New()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: "org.wal.changed.v1", EventID: big,
		Payload: payload, OrderingKey: "k"}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitHeldOnce(t, pool, tbl)
	rejecting.Store(false)
	see := unseen(t, pool, func(ctx context.Context, tx pgx.Tx) error {
		_, err := runbook.New(tx, tbl).ReplayEvent(ctx, big, runbook.ReplayOptions{})
		return err
	})
	time.Sleep(300 * time.Millisecond) // the relay has read the replay's UPDATE
	if rec.has(big) {
		t.Fatal("a replay nobody can see yet was delivered")
	}
	see()
	rec.waitAcked(t, []uuid.UUID{big}, 10*time.Second)
	waitFor(t, 10*time.Second, "the hold resolved", func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.HeldKeys == 0 && st.Pending == 0 && st.Dead == 0
	})
}

// The held row's replay acked while its drain waits for the stream's rows
// to be visible, and the relay closed before the drain was written: the
// confirmed position had passed the replay's UPDATE, the next relay read
// the hold as plain dead and never streamed the replay again, so the rows
// parked behind it were never delivered (found by TestWALHistory's late
// batches). Now the replay is settled only once the hold says draining
// (a replay's ack waits for its drain): the next relay streams the replay again and drains.
func TestWALReplayAckedBeforeItsDrainSurvivesClose(t *testing.T) {
	t.Parallel()
	pool, tbl := unseenCluster(t)
	ctx := context.Background()
	first := relay(t, pool, tbl, nil)
	rec := newRecorder()
	rejecting, handle := rejectK()
	rec.consume(t, first, handle)
	doomed := enqueue(t, pool, tbl, "k")
	waitHeldOnce(t, pool, tbl)
	rejecting.Store(false)
	parked := enqueue(t, pool, tbl, "k")
	// A row of another key that nobody can see yet: the drain waits for it.
	z, see := enqueueUnseen(t, pool, tbl, "z")
	rec.waitAcked(t, []uuid.UUID{z}, 10*time.Second)
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, doomed[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, doomed, 10*time.Second)
	time.Sleep(400 * time.Millisecond) // status ticks: the drain is not written, the position must not pass the replay
	if rec.has(parked[0]) {
		t.Fatal("the parked row was delivered before its drain could read it")
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	see()
	second := relay(t, pool, tbl, nil)
	rec.consume(t, second, handle)
	rec.waitAcked(t, parked, 15*time.Second)
	waitFor(t, 10*time.Second, "the hold resolved", func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.HeldKeys == 0 && st.Pending == 0 && st.Dead == 0
	})
}
