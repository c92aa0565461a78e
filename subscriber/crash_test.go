package subscriber_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// crashRelayEnv names the table of the relay process that
// TestCrashedRelayRecovery starts (this test binary, run by TestMain) and
// kills.
const crashRelayEnv = "OUTBOX_TEST_CRASH_RELAY_TABLE"

// crashRelay is the relay process: a single-active subscriber with the
// default Config that receives messages and never acks them, printing
// "holding N" after each one, until it is killed.
func crashRelay(table string) int {
	tbl, err := schema.ParseTable(table)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pool, err := pgxpool.New(context.Background(), testdb.URL())
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	s, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl}, watermill.NopLogger{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	n := 0
	for range ch {
		n++
		fmt.Printf("holding %d\n", n)
	}
	return 1
}

// TestCrashedRelayRecovery: a relay process holding in-flight rows is
// killed (SIGKILL); with the default Config (single-active, LockTTL 60s,
// ElectionInterval 1s) its rows are delivered again at once (about a
// second), by a standby that was waiting and by a relay started after the
// kill (a restart). The lock taken after the dead session proves the
// leases orphaned, so the new leader takes them back at once instead of
// waiting LockTTL (60s before). The attempt counts, and last_error says
// why: "taken back", which is the verdict (a lease that expired says
// "expired"); the time is bounded by half of LockTTL only, so that a
// loaded machine is not read as a relay that waited for the leases to
// expire.
func TestCrashedRelayRecovery(t *testing.T) {
	t.Parallel()
	for _, standby := range []bool{true, false} {
		name := "Restart"
		if standby {
			name = "Standby"
		}
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const inFlight = 20
			pool := testdb.Pool(t)
			tbl := testdb.Table(t, "crash_outbox")
			ids := enqueue(t, pool, tbl, "org.crash.v1", inFlight)

			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), crashRelayEnv+"="+tbl.String(), "TEST_DATABASE_URL="+testdb.URL())
			cmd.Stderr = os.Stderr
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			killed := false
			t.Cleanup(func() {
				if !killed {
					_ = cmd.Process.Kill()
					_ = cmd.Wait()
				}
			})
			holding := make(chan struct{})
			go func() {
				sc := bufio.NewScanner(out)
				for sc.Scan() {
					if sc.Text() == fmt.Sprintf("holding %d", inFlight) {
						close(holding)
					}
				}
			}()
			select {
			case <-holding:
			case <-time.After(2 * time.Minute):
				t.Fatalf("the relay process did not receive the %d rows", inFlight)
			}

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var (
				mu   sync.Mutex
				got  = map[string]bool{}
				msgs []*message.Message
			)
			var b *subscriber.Subscriber
			subscribe := func() {
				b = newSub(t, testdb.NewPool(t, nil), subscriber.Config{Table: tbl})
				ch, err := b.Subscribe(ctx, subscriber.AllTopics)
				if err != nil {
					t.Fatal(err)
				}
				go func() {
					for m := range ch {
						mu.Lock()
						got[m.UUID] = true
						msgs = append(msgs, m)
						mu.Unlock()
					}
				}()
			}
			if standby {
				subscribe()
				time.Sleep(1500 * time.Millisecond) // at least one failed election
				if b.IsLeader() {
					t.Fatal("the standby leads while the relay process holds the lock")
				}
			}
			kill := time.Now()
			killed = true
			if err := cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			_ = cmd.Wait()
			if !standby {
				subscribe()
			}
			waitFor(t, "the killed relay's rows delivered again", 2*time.Minute, func() bool {
				mu.Lock()
				defer mu.Unlock()
				return len(got) == inFlight
			})
			recovery := time.Since(kill)
			t.Logf("%d in-flight rows of the killed relay delivered again %s after the kill", inFlight, recovery.Round(time.Millisecond))
			if recovery > subscriber.LockTTLDefault/2 {
				t.Errorf("recovery took %s, want well within LockTTL %s", recovery.Round(time.Millisecond), subscriber.LockTTLDefault)
			}
			for _, id := range ids {
				st := state(t, pool, tbl, id)
				lastError := ""
				if st.lastError != nil {
					lastError = *st.lastError
				}
				if st.attempts != 2 || !strings.Contains(lastError, "taken back") {
					t.Errorf("row %s: attempts %d last_error %q, want 2 attempts and a lease taken back", id, st.attempts, lastError)
				}
			}
			mu.Lock()
			for _, m := range msgs {
				m.Ack()
			}
			mu.Unlock()
			waitFor(t, "the rows published", 2*time.Minute, func() bool {
				var n int
				if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE published_at IS NOT NULL`).Scan(&n); err != nil {
					t.Fatal(err)
				}
				return n == inFlight
			})
		})
	}
}

// TestTakeBackOnLastAttemptGoesDead: when a single-active relay is
// elected, the leases left in the table (fresh ones: their holder died a
// moment ago, LockTTL is 60s) are taken back at once. A row on a later
// attempt is delivered again at once, with its attempt counted; a row
// leased on its last allowed attempt is parked dead, counted in
// outbox_dead_total and never delivered.
func TestTakeBackOnLastAttemptGoesDead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "takeback_dead_outbox")
	const topic = "org.takeback.v1"
	ids := enqueue(t, pool, tbl, topic, 2)
	for i, attempts := range []int{3, 2} {
		if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET attempts = $2, locked_at = now(), available_at = now() WHERE event_id = $1`, ids[i], attempts); err != nil {
			t.Fatal(err)
		}
	}
	_, m := newMetrics(t)
	s := newSub(t, pool, subscriber.Config{Table: tbl, MaxAttempts: 3, Metrics: m})
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	ch, err := s.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-ch:
		if msg.UUID != ids[1] || msg.Metadata.Get(schema.MetadataAttempts) != "3" {
			t.Fatalf("delivered %s on attempt %s, want %s on attempt 3", msg.UUID, msg.Metadata.Get(schema.MetadataAttempts), ids[1])
		}
		msg.Ack()
	case <-time.After(2 * time.Minute):
		t.Fatal("the orphaned lease was not taken back")
	}
	t.Logf("orphaned lease taken back and delivered %s after Subscribe", time.Since(start).Round(time.Millisecond))
	select {
	case msg := <-ch:
		t.Fatalf("row delivered after its last attempt: %s", msg.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	r := readDead(t, tbl, ids[0])
	if !r.dead || !r.parked || r.locked || r.attempts != 3 || !strings.Contains(r.lastError, "lease of attempt 3 taken back") || !strings.Contains(r.lastError, "max 3") {
		t.Fatalf("last attempt taken back: %+v, want dead, parked, unlocked, attempts 3, last_error about the lease", r)
	}
	if got := testutil.ToFloat64(m.DeadTotal.WithLabelValues(tbl.Qualified(), topic)); got != 1 {
		t.Fatalf("outbox_dead_total = %v, want 1", got)
	}
}
