package subscriber_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestBoundedClaimPauseReadInFlight (issue 56 item 5): a pause read while a
// bounded claim is in flight gives the claim's rows of the topic back, and
// the claim still moves the bound by what its statement took: after the
// resume, every row of the topic is delivered at the resume's wake-up, with
// the poll and the sweep 10 minutes away, and none counts as swept. Before,
// the claim counted only the rows it kept, so a claim whose rows were all
// given back counted as not full and moved the bound to the cut, above the
// topic's older rows: those waited for the sweep.
func TestBoundedClaimPauseReadInFlight(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "pause_bound_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	// The poll and the sweep (LockTTL/4) every 10 minutes: a delivery
	// within the 2-minute wait is the resume's wake-up, however slow the
	// machine.
	const poll = 10 * time.Minute
	const batch = 5
	s := newSub(t, pool, subscriber.Config{Table: tbl, BatchSize: batch, PollInterval: poll, LockTTL: 4 * poll, Metrics: m})
	if !subscriber.Bounded(s) {
		t.Fatal("the relay claims without the bound: the test needs it")
	}
	// A backlog of two batches of A, older than any cut the relay reads.
	idsA := enqueue(t, pool, tbl, topicA, 2*batch)
	var paused atomic.Bool
	subscriber.AfterClaimQuery(s, func() {
		// The relay's first claim has leased the first batch of A: pause A
		// and let the relay read the pause before the claim's rows are read.
		if paused.Swap(true) {
			return
		}
		if res, err := runbook.New(pool, tbl).PauseTopic(ctx, topicA, "broken consumer", false); err != nil || !res.Paused {
			t.Errorf("PauseTopic: %+v, %v", res, err)
		}
		if got := subscriber.ReadPausedTopics(ctx, s); len(got) != 1 || got[0] != topicA {
			t.Errorf("paused topics read: %v, want [%s]", got, topicA)
		}
	})
	msgs, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	log := consumePaused(t, msgs)
	waitFor(t, "the relay to go idle after its first claim", 2*time.Minute, func() bool { return paused.Load() && idleHeld(t, pool, tbl) })
	if n := log.count(topicA); n != 0 {
		t.Fatalf("%d rows of paused topic A delivered", n)
	}
	for _, id := range idsA {
		if st := state(t, pool, tbl, id); st.published || st.locked || st.attempts != 0 {
			t.Fatalf("row %s of paused topic A: %+v, want pending and untouched", id, st)
		}
	}
	start := time.Now()
	if res, err := runbook.New(pool, tbl).ResumeTopic(ctx, topicA, false); err != nil || res.Changed != 1 {
		t.Fatalf("ResumeTopic: %+v, %v", res, err)
	}
	for deadline := start.Add(2 * time.Minute); log.count(topicA) < len(idsA); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			at, _ := subscriber.BoundOf(s)
			t.Fatalf("%d of the %d rows of A delivered within 2 minutes of the resume (PollInterval %s, a sweep every %s): the bound (%s) moved above the rest",
				log.count(topicA), len(idsA), poll, poll, at.Format(time.RFC3339Nano))
		}
	}
	t.Logf("A's %d rows delivered %s after the resume", len(idsA), time.Since(start).Round(time.Millisecond))
	if d := log.duplicates(); d != 0 {
		t.Fatalf("%d duplicate deliveries", d)
	}
	if c := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); c != 0 {
		t.Fatalf("outbox_sweep_claimed_total = %v, want 0", c)
	}
}
