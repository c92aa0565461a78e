package walrelay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// The tests of this file check the WAL relay's write fence (the write fence,
// walrelay.go; docs/WAL.md, "Sessions are terms"): a write of a session
// that no longer holds the slot changes nothing, and a write that passed
// the fence before the session ended commits before the next session reads
// the holds. The next session is another Subscriber on the slot: another
// relay process as far as the database can tell.

// nackAll consumes s's messages and nacks each one.
func nackAll(t *testing.T, s message.Subscriber) {
	t.Helper()
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			subscriber.RecordError(msg, errors.New("refused"))
			msg.Nack()
		}
	}()
}

// pauseWrite is a fence hook that stops the first write op at phase until
// release is called (at the latest when the test ends, before the relays
// close), and signals reached when it stops there.
func pauseWrite(t *testing.T, op, phase string) (hook func(string, string), reached chan struct{}, release func()) {
	reached, released := make(chan struct{}), make(chan struct{})
	var once, rel sync.Once
	release = func() { rel.Do(func() { close(released) }) }
	t.Cleanup(release)
	return func(o, p string) {
		if o != op || p != phase {
			return
		}
		stopped := false
		once.Do(func() { stopped = true })
		if stopped {
			close(reached)
			<-released
		}
	}, reached, release
}

// waitClosed waits until c is closed, for at most liveness.
func waitClosed(t *testing.T, c chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(liveness):
		t.Fatalf("%s: not within %s", what, liveness)
	}
}

func rowState(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) (dead bool, holds int) {
	t.Helper()
	ctx := context.Background()
	if err := pool.QueryRow(ctx, `SELECT dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&dead); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()).Scan(&holds); err != nil {
		t.Fatal(err)
	}
	return dead, holds
}

// TestWALWriteOfEndedSessionIsFenced: relay A's handler nacks row X for
// the last time; before A parks X dead (its MarkDeadHold), A's replication
// session is cut and relay B takes the slot and delivers X successfully.
// Then A's write goes: the fence refuses it (counted), so X is not dead
// and its key is not held; B delivers the key's next row, and so does the
// relay after B. Without the fence, A's write parked X dead behind B's
// back and held the key from the next session on.
func TestWALWriteOfEndedSessionIsFenced(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	a := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxAttempts = 1; c.Metrics = m })
	hook, reached, release := pauseWrite(t, "dead", "before")
	walrelay.SetFenceHook(a, hook)
	nackAll(t, a)
	ids := enqueue(t, pool, tbl, "fk")
	waitClosed(t, reached, "A's dead write")
	terminateWalsender(t, pool)
	b := relay(t, pool, tbl, nil)
	rb := newRecorder()
	rb.consume(t, b, nil)
	rb.waitAcked(t, ids, 15*time.Second)
	release()
	label := tbl.Qualified()
	waitFor(t, 10*time.Second, "A's write refused or applied", func() bool {
		dead, holds := rowState(t, pool, tbl, ids[0])
		return dead || holds > 0 || testutil.ToFloat64(m.FenceRejected.WithLabelValues(label, "dead")) == 1
	})
	if dead, holds := rowState(t, pool, tbl, ids[0]); dead || holds != 0 {
		t.Fatalf("after the ended session's write: X dead %v, %d holds; want X not dead and no hold", dead, holds)
	}
	waitFor(t, 5*time.Second, "A's session ended after the refused write", func() bool { return !a.Active() })
	next := enqueue(t, pool, tbl, "fk")
	rb.waitAcked(t, next, 15*time.Second)
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	c := relay(t, pool, tbl, nil)
	rc := newRecorder()
	rc.consume(t, c, nil)
	last := enqueue(t, pool, tbl, "fk")
	rc.waitAcked(t, last, 15*time.Second)
	rb.mu.Lock()
	defer rb.mu.Unlock()
	if rb.acked[ids[0].String()] != 1 || rb.acked[next[0].String()] != 1 {
		t.Errorf("B's acks of X %d and X+1 %d, want 1 each", rb.acked[ids[0].String()], rb.acked[next[0].String()])
	}
	if got := testutil.ToFloat64(m.FenceRejected.WithLabelValues(label, "dead")); got != 1 {
		t.Errorf("outbox_fence_rejected_total{op=dead} %v, want 1", got)
	}
}

// TestWALHandoverWaitsForAWriteThatPassedTheFence: relay A parks row X
// dead and holds its key; the statement passed the fence (A still held the
// slot) and A's session is cut before it commits. Relay B takes the slot
// and waits for that write before it reads the holds: once A commits, B
// sees the hold, parks X and the key's next row, and delivers the other
// keys. Without the wait, B read the holds before A's commit and delivered
// the dead row X and the row behind it.
func TestWALHandoverWaitsForAWriteThatPassedTheFence(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	a := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxAttempts = 1 })
	hook, reached, release := pauseWrite(t, "dead", "checked")
	walrelay.SetFenceHook(a, hook)
	nackAll(t, a)
	x := enqueue(t, pool, tbl, "hk")
	waitClosed(t, reached, "A's dead write checked")
	terminateWalsender(t, pool)
	b := relay(t, pool, tbl, nil)
	rb := newRecorder()
	rb.consume(t, b, nil)
	waitFor(t, 15*time.Second, "B holds the slot", b.Active)
	waited := false
	for deadline := time.Now().Add(liveness); !waited && time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted`).Scan(&n)
		waited = err == nil && n == 1
	}
	if !waited {
		t.Error("B did not wait for the fence lock while A's checked write was open")
	}
	behind := enqueue(t, pool, tbl, "hk")
	release()
	other := enqueue(t, pool, tbl, "other")
	rb.waitAcked(t, other, 15*time.Second)
	time.Sleep(300 * time.Millisecond) // a row of hk handed out with other's would be acked by now
	if rb.has(x[0]) || rb.has(behind[0]) {
		t.Errorf("B delivered the dead row X (%v) or the row behind it (%v); want both parked by A's hold", rb.has(x[0]), rb.has(behind[0]))
	}
	heldBy(t, pool, tbl, x[0])
}

// holdSlot starts a replication session on tbl's slot, as a relay does,
// until the test ends, and returns the fence arguments of its writes (the
// slot, its walsender pid, the fence key): for tests that run the relay's
// statements themselves.
func holdSlot(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) []any {
	t.Helper()
	ctx := context.Background()
	names := walrelay.DefaultNames(tbl)
	conn, err := pgconn.Connect(ctx, walrelay.ReplicationConnString(pool))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	if err := pglogrepl.StartReplication(ctx, conn, names.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + names.Publication + "'"},
	}); err != nil {
		t.Fatal(err)
	}
	return []any{names.Slot, int64(conn.PID()), sqlq.WALFenceKey(names.Slot)}
}
