package subscriber_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// reconnectLog keeps the retry_in of every "LISTEN connection lost;
// reconnecting" the relay logs.
type reconnectLog struct {
	mu      sync.Mutex
	retries []string
}

func (l *reconnectLog) Error(msg string, _ error, fields watermill.LogFields) {
	if msg == "LISTEN connection lost; reconnecting" {
		l.mu.Lock()
		l.retries = append(l.retries, fmt.Sprint(fields["retry_in"]))
		l.mu.Unlock()
	}
}
func (l *reconnectLog) Info(string, watermill.LogFields)                 {}
func (l *reconnectLog) Debug(string, watermill.LogFields)                {}
func (l *reconnectLog) Trace(string, watermill.LogFields)                {}
func (l *reconnectLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *reconnectLog) logged() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.retries...)
}

// TestListenerReconnectsFastAfterEachLoss: the LISTEN connection, which
// holds the idle lock of the sleeping relay, is killed (pg_terminate_backend)
// six times in a row; each time the listener is back, with the idle lock,
// after the first reconnect delay (100 ms: its reconnect backoff starts
// again after every successful connection instead of growing to seconds;
// the delay is read from the relay's log, not timed), and afterwards a
// commit still wakes the relay at once, with polling every hour: a relay
// never sleeps on an idle lock whose session is gone.
func TestListenerReconnectsFastAfterEachLoss(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "relisten_outbox")
	app := "relisten_" + tbl.Schema()
	own := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
	logs := &reconnectLog{}
	s, err := subscriber.New(context.Background(), own, subscriber.Config{Table: tbl, PollInterval: time.Hour}, logs)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	// The LISTEN connection also holds the idle lock of a sleeping relay.
	listener := func() int {
		var pid int
		_ = pool.QueryRow(ctx, `SELECT COALESCE(max(a.pid), 0) FROM pg_stat_activity AS a JOIN pg_locks AS l ON l.pid = a.pid
WHERE a.application_name = $1 AND l.locktype = 'advisory' AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = $2`,
			app, sqlq.IdleLockKey(tbl)).Scan(&pid)
		return pid
	}
	waitFor(t, "the listener", 2*time.Minute, func() bool { return listener() != 0 })
	for round := 1; round <= 6; round++ {
		old := listener()
		before := len(logs.logged())
		if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, old); err != nil {
			t.Fatal(err)
		}
		killed := time.Now()
		waitFor(t, "the listener back", 2*time.Minute, func() bool { p := listener(); return p != 0 && p != old })
		retries := logs.logged()[before:]
		t.Logf("round %d: the listener came back %s after its connection was killed (retries in %v)", round, time.Since(killed).Round(time.Millisecond), retries)
		if len(retries) == 0 || retries[0] != "100ms" {
			t.Fatalf("round %d: the relay reconnected after %v, want 100ms first: the backoff did not start again", round, retries)
		}
	}
	ids := enqueue(t, pool, tbl, "org.relisten.v1", 1)
	select {
	case msg := <-ch:
		if msg.UUID != ids[0] {
			t.Fatalf("delivered %s, want %s", msg.UUID, ids[0])
		}
		msg.Ack()
	case <-time.After(2 * time.Minute): // the poll is an hour away
		t.Fatal("a NOTIFY after the reconnections did not wake the relay")
	}
}

// TestWakeUpAfterAllSessionsTerminated: two relays share a table
// (DisableSingleActive, polling every 10 minutes) and sleep; every session
// of both is terminated (a server restart, a proxy dropping them); an event
// committed afterwards is delivered at once, not at the next poll, and so
// is one committed while the relays are idle again: a delivery within the
// 2-minute wait is not the poll's, however slow the machine. Two idle
// relays cost at most 20 scans of the table a second.
func TestWakeUpAfterAllSessionsTerminated(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "allgone_outbox")
	app := "allgone_" + tbl.Schema()
	got := make(chan string, 16)
	for i := 0; i < 2; i++ {
		own := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["application_name"] = app })
		s := newSub(t, own, subscriber.Config{Table: tbl, PollInterval: 10 * time.Minute, DisableSingleActive: true})
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for msg := range ch {
				got <- msg.UUID
				msg.Ack()
			}
		}()
	}
	deliver := func(what string) time.Duration {
		t.Helper()
		start := time.Now()
		id := enqueue(t, pool, tbl, "org.allgone.v1", 1)[0]
		for {
			select {
			case u := <-got:
				if u == id {
					return time.Since(start)
				}
			case <-time.After(2 * time.Minute):
				t.Fatalf("%s: not delivered within 2 minutes (poll interval 10 min): a relay slept on a lost idle lock", what)
			}
		}
	}
	holder := func() bool { return idleHeld(t, pool, tbl) }
	waitFor(t, "a relay asleep on the idle lock", 2*time.Minute, holder)
	rate := scanRate(t, pool, 4*time.Second, tbl.String())
	t.Logf("two idle relays: %.1f scans/s", rate)
	if rate > 20 {
		t.Errorf("two idle relays scan the table %.1f times a second, want at most 20", rate)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1`, app).Scan(&n); err != nil || n == 0 {
		t.Fatalf("terminated %d sessions: %v", n, err)
	}
	d := deliver("after every session was terminated")
	waitFor(t, "a relay asleep on the idle lock again", 2*time.Minute, holder)
	d2 := deliver("idle again")
	t.Logf("%d sessions terminated; delivered %s after, then %s once idle again", n, d, d2)
}
