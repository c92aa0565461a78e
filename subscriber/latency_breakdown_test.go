package subscriber_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// latencyEnv runs TestLatencyBreakdown (about 25 s).
const latencyEnv = "OUTBOX_TEST_LATENCY_BREAKDOWN"

// TestLatencyBreakdown measures where an event's commit-to-delivery time
// goes with the default relay, at 500 events/s offered by 8 writers, one
// event per transaction (issue 43, "And its tail"). It measures only: it
// asserts nothing about the figures. Per event, on one host clock: t0
// before COMMIT, t1 after it (the writer), the claim's start (the row's
// locked_at, the claim statement's now()), the claim's rows back in the
// relay (AfterClaimQuery), the consumer's receipt, and the ack's start (the
// row's published_at). It prints p50/p99/p99.9 of each stage beside the
// writers' COMMIT with no relay, measured first in the same run. Run:
//
//	OUTBOX_TEST_LATENCY_BREAKDOWN=1 go test -count=1 -v -run TestLatencyBreakdown ./subscriber/
func TestLatencyBreakdown(t *testing.T) {
	if os.Getenv(latencyEnv) == "" {
		t.Skip("set " + latencyEnv + "=1 to measure the default relay's latency breakdown (about 25 s)")
	}
	const (
		rate    = 500
		writers = 8
		phase   = 10 * time.Second
	)
	pool := testdb.Pool(t)
	ctx := context.Background()
	bare := testdb.Table(t, "latency_bare_outbox")
	type ev struct{ t0, t1 time.Time }
	offer := func(tbl schema.Table) map[string]ev {
		var (
			mu  sync.Mutex
			out = map[string]ev{}
			wg  sync.WaitGroup
		)
		interval := time.Second * writers / rate
		stop := time.Now().Add(phase)
		for w := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				next := time.Now().Add(time.Duration(w) * interval / writers)
				for time.Now().Before(stop) {
					time.Sleep(time.Until(next))
					next = next.Add(interval)
					id := uuid.New()
					tx, err := pool.Begin(ctx)
					if err != nil {
						t.Error(err)
						return
					}
					if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.latency.v1", EventID: id, Payload: json.RawMessage(`{"n":1}`)}); err != nil {
						t.Error(err)
						return
					}
					t0 := time.Now()
					if err := tx.Commit(ctx); err != nil {
						t.Error(err)
						return
					}
					t1 := time.Now()
					mu.Lock()
					out[id.String()] = ev{t0, t1}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		return out
	}
	bareEvents := offer(bare)

	tbl := testdb.Table(t, "latency_outbox")
	// The ack clears locked_at: a trigger keeps the claim's start in a
	// column of this test's table (a few microseconds per claim and ack).
	for _, stmt := range []string{
		`ALTER TABLE ` + tbl.Sanitize() + ` ADD COLUMN claimed_at timestamptz`,
		`CREATE FUNCTION ` + tbl.Schema() + `.keep_claimed_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.locked_at IS NOT NULL AND NEW.locked_at IS DISTINCT FROM OLD.locked_at THEN NEW.claimed_at := NEW.locked_at; END IF;
  RETURN NEW;
END $$`,
		`CREATE TRIGGER keep_claimed_at BEFORE UPDATE ON ` + tbl.Sanitize() + ` FOR EACH ROW EXECUTE FUNCTION ` + tbl.Schema() + `.keep_claimed_at()`,
	} {
		if _, err := pool.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl})
	var (
		mu      sync.Mutex
		claimed []time.Time
		got     = map[string]time.Time{}
	)
	subscriber.AfterClaimQuery(s, func() {
		now := time.Now()
		mu.Lock()
		claimed = append(claimed, now)
		mu.Unlock()
	})
	cctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	ch, err := s.Subscribe(cctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for m := range ch {
			now := time.Now()
			mu.Lock()
			got[m.UUID] = now
			mu.Unlock()
			m.Ack()
		}
	}()
	waitFor(t, "the relay to lead", 2*time.Minute, s.IsLeader)
	events := offer(tbl)
	waitFor(t, "every event delivered", time.Minute, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(got) >= len(events)
	})
	time.Sleep(500 * time.Millisecond) // the last acks
	lockedAt, publishedAt := readTimes(t, pool, tbl)

	mu.Lock()
	defer mu.Unlock()
	slices.SortFunc(claimed, func(a, b time.Time) int { return a.Compare(b) })
	var commitBare, commit, c2d, wake, claim, handover, ack []time.Duration
	for _, e := range bareEvents {
		commitBare = append(commitBare, e.t1.Sub(e.t0))
	}
	for id, e := range events {
		d := got[id]
		la, pa := lockedAt[id], publishedAt[id]
		commit = append(commit, e.t1.Sub(e.t0))
		c2d = append(c2d, d.Sub(e.t0))
		wake = append(wake, la.Sub(e.t1))
		i := sort.Search(len(claimed), func(i int) bool { return !claimed[i].Before(la) })
		if i < len(claimed) && !claimed[i].After(d) {
			claim = append(claim, claimed[i].Sub(la))
			handover = append(handover, d.Sub(claimed[i]))
		}
		if !pa.IsZero() {
			ack = append(ack, pa.Sub(d))
		}
	}
	pct := func(xs []time.Duration) string {
		if len(xs) == 0 {
			return "no samples"
		}
		slices.Sort(xs)
		at := func(p float64) time.Duration { return xs[min(len(xs)-1, int(p*float64(len(xs))))] }
		return fmt.Sprintf("p50 %6.2f ms  p99 %6.2f ms  p99.9 %6.2f ms  (n=%d)",
			ms(at(0.50)), ms(at(0.99)), ms(at(0.999)), len(xs))
	}
	t.Logf("%d events/s offered by %d writers, one event per transaction, %s per phase", rate, writers, phase)
	t.Logf("COMMIT, no relay:                      %s", pct(commitBare))
	t.Logf("COMMIT, default relay draining:        %s", pct(commit))
	t.Logf("commit-to-delivery (before COMMIT):    %s", pct(c2d))
	t.Logf("  wake-up: COMMIT done -> claim starts %s", pct(wake))
	t.Logf("  claim: starts -> its rows are back   %s", pct(claim))
	t.Logf("  hand-over: rows back -> consumer     %s", pct(handover))
	t.Logf("ack: consumer -> ack statement starts  %s", pct(ack))
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// readTimes returns each event's claimed_at (its last claim's start, kept
// by the test's trigger) and published_at (its ack's start).
func readTimes(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (locked, published map[string]time.Time) {
	t.Helper()
	locked, published = map[string]time.Time{}, map[string]time.Time{}
	rows, err := pool.Query(context.Background(), `SELECT event_id::text, claimed_at, published_at FROM `+tbl.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id     string
			la, pa *time.Time
		)
		if err := rows.Scan(&id, &la, &pa); err != nil {
			t.Fatal(err)
		}
		if la != nil {
			locked[id] = *la
		}
		if pa != nil {
			published[id] = *pa
		}
	}
	return locked, published
}
