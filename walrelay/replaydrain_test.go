package walrelay_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestWALReplayBesideADrainIsDelivered: a keyed row that went dead under
// the default relay (it holds no key) is replayed as the WAL relay starts
// to drain its key's hold past it: the drain has read the key's parked
// rows (the dead row was not among them) and not yet marked the hold
// draining, so the runbook accepts the replay. The stream's copy of the
// replay is new work: the drain will not read the row again. Before, the
// relay parked it as a copy of a drained row and settled its transaction:
// the event was never delivered, the runbook read it delivered and the
// next switch away from the WAL relay marked it published (found by
// make switch_history).
func TestWALReplayBesideADrainIsDelivered(t *testing.T) {
	t.Parallel()
	pool, tbl, _ := startCluster(t, nil, false)
	ctx := context.Background()
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeDefault, "test"); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, pool, tbl, "k", "k") // r1, r2
	r1, r2 := ids[0], ids[1]
	// r2 dead, holding nothing; r1 pending.
	failUnderDefault(t, pool, tbl, r2, r1)
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	r3 := enqueue(t, pool, tbl, "k")[0]

	// The WAL relay fails r1 for good: its key is held dead, r3 parked.
	// When the operator skips r1, the drain reads r3; between that read
	// and the write that marks the hold draining, r2 is replayed.
	rb := runbook.New(pool, tbl)
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxAttempts = 1 })
	var once sync.Once
	replayed := make(chan error, 1)
	walrelay.SetFenceHook(s, func(op, phase string) {
		if op == "drain" && phase == "before" {
			once.Do(func() {
				_, err := rb.ReplayEvent(ctx, r2, runbook.ReplayOptions{})
				replayed <- err
			})
		}
	})
	rec := newRecorder()
	rec.consume(t, s, func(m *message.Message) error {
		if m.UUID == r1.String() {
			return subscriber.Permanent(errors.New("broken"))
		}
		return nil
	})
	waitFor(t, 30*time.Second, "the WAL relay holds key k by r1, dead", func() bool { return rowDead(t, pool, tbl, r1.String()) })
	if _, err := rb.SkipEvent(ctx, r1, false); err != nil {
		t.Fatalf("skip r1: %v", err)
	}
	select {
	case err := <-replayed:
		if err != nil {
			t.Fatalf("replay r2 before the drain marks the hold draining: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("the skip's drain did not start")
	}
	rec.waitAcked(t, []uuid.UUID{r3}, 30*time.Second)
	rec.waitAcked(t, []uuid.UUID{r2}, 10*time.Second)
}

// failUnderDefault runs a default relay on tbl (recorded in default mode)
// that fails the row dead for good and the rows pending once, their retry
// an hour away, and closes it once dead is dead and each pending row
// failed: dead is dead without holding its key (a default relay holds
// none), the pending rows stay pending.
func failUnderDefault(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, dead uuid.UUID, pending ...uuid.UUID) {
	t.Helper()
	ctx := context.Background()
	def, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, MaxAttempts: 5, PollInterval: 20 * time.Millisecond,
		Backoff: func(int) time.Duration { return time.Hour }}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := def.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range ch {
			err := errors.New("not yet")
			if m.UUID == dead.String() {
				err = subscriber.Permanent(errors.New("broken"))
			}
			subscriber.RecordError(m, err)
			m.Nack()
		}
	}()
	waitFor(t, 30*time.Second, "the default relay parks the row dead and fails the pending ones once", func() bool {
		for _, id := range pending {
			var failed bool
			if err := pool.QueryRow(ctx, `SELECT attempts > 0 FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).Scan(&failed); err != nil {
				t.Fatal(err)
			}
			if !failed {
				return false
			}
		}
		return rowDead(t, pool, tbl, dead.String())
	})
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}
}

// TestWALReplayQueuedBehindARowThatDiesIsDelivered: a keyed row that went
// dead under the default relay is replayed while a later row of its key
// is in a handler; the stream queues the replay behind that row, which
// then fails for good and holds the key. The replay is of an earlier row:
// new work, delivered. Before, the hold parked every row queued on the key,
// the replay with them, and its drains read only rows after the held one:
// the event was never delivered, and the next switch away from the WAL
// relay marked it published (make switch_history, seed 1796216280815522229).
func TestWALReplayQueuedBehindARowThatDiesIsDelivered(t *testing.T) {
	t.Parallel()
	pool, tbl, _ := startCluster(t, nil, false)
	ctx := context.Background()
	if err := schema.SwitchMode(ctx, pool, tbl, schema.ModeDefault, "test"); err != nil {
		t.Fatal(err)
	}
	x := enqueue(t, pool, tbl, "k")[0]
	failUnderDefault(t, pool, tbl, x)
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	y := enqueue(t, pool, tbl, "k")[0]
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxAttempts = 1 })
	inHandler, release := make(chan struct{}), make(chan struct{})
	rec := newRecorder()
	rec.consume(t, s, func(m *message.Message) error {
		if m.UUID == y.String() {
			close(inHandler)
			<-release
			return subscriber.Permanent(errors.New("broken"))
		}
		return nil
	})
	select {
	case <-inHandler:
	case <-time.After(time.Minute):
		t.Fatal("y was not delivered")
	}
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, x, runbook.ReplayOptions{}); err != nil {
		close(release)
		t.Fatalf("replay x: %v", err)
	}
	time.Sleep(300 * time.Millisecond) // the stream queues the replay behind y, in its handler
	close(release)
	waitFor(t, 30*time.Second, "y dead, holding k", func() bool { return rowDead(t, pool, tbl, y.String()) })
	rec.waitAcked(t, []uuid.UUID{x}, 10*time.Second)
}
