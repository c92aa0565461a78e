package subscriber_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// deliveries records when each event was delivered and acks it.
type deliveries struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

func consumeAll(t *testing.T, s *subscriber.Subscriber) *deliveries {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	d := &deliveries{seen: map[string]time.Time{}}
	go func() {
		for m := range ch {
			d.mu.Lock()
			d.seen[m.UUID] = time.Now()
			d.mu.Unlock()
			m.Ack()
		}
	}()
	return d
}

// wait returns how long the events ids took to be delivered from now.
func (d *deliveries) wait(t *testing.T, ids []string, within time.Duration) time.Duration {
	t.Helper()
	took, ok := d.within(ids, within)
	if !ok {
		t.Fatalf("%d events not delivered within %s", len(ids), within)
	}
	return took
}

// within is wait that reports false, instead of failing the test, when
// the events ids were not all delivered within limit.
func (d *deliveries) within(ids []string, limit time.Duration) (time.Duration, bool) {
	start := time.Now()
	for {
		d.mu.Lock()
		n := 0
		for _, id := range ids {
			if _, ok := d.seen[id]; ok {
				n++
			}
		}
		d.mu.Unlock()
		if n == len(ids) {
			return time.Since(start), true
		}
		if time.Since(start) >= limit {
			return time.Since(start), false
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lateWriter begins a transaction on pool now that writes one event to tbl
// only when write is called (business work first, the outbox last), and
// commits it.
func lateWriter(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (write func() string) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	return func() string {
		id := uuid.New()
		if _, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: tenant, Topic: "org.bounded.v1", EventID: id,
			Payload: json.RawMessage(`{"late":true}`)}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		return id.String()
	}
}

// TestBoundedClaimIsTheDefault: a table made by Migrate (available_at
// defaults to clock_timestamp()) is claimed with the bound; a table with
// the older default, DisableBoundedClaim and ordered relays claim without.
func TestBoundedClaimIsTheDefault(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_default_outbox")
	if !subscriber.Bounded(newSub(t, pool, subscriber.Config{Table: tbl})) {
		t.Fatal("a migrated table is claimed without the bound")
	}
	if subscriber.Bounded(newSub(t, pool, subscriber.Config{Table: tbl, DisableBoundedClaim: true})) {
		t.Fatal("DisableBoundedClaim: the claim takes a bound")
	}
	old := testdb.Table(t, "bounded_old_outbox")
	if _, err := pool.Exec(context.Background(), `ALTER TABLE `+old.Sanitize()+` ALTER COLUMN available_at SET DEFAULT now()`); err != nil {
		t.Fatal(err)
	}
	if subscriber.Bounded(newSub(t, pool, subscriber.Config{Table: old})) {
		t.Fatal("available_at DEFAULT now(): the claim takes a bound its cut cannot keep")
	}
}

// TestBoundedClaimBoundFollowsTheHead: while rows arrive, the bound trails
// the newest row by at most BoundedCutEvery plus BoundedMargin (and a round
// trip): that is all a claim walks under a pinned horizon. The claim that
// delivers a row starts after the row was formed, and it carries a cut
// unless one was sent less than BoundedCutEvery before it.
func TestBoundedClaimBoundFollowsTheHead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_head_outbox")
	s := newSub(t, pool, subscriber.Config{Table: tbl})
	d := consumeAll(t, s)
	for range 30 {
		d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 1), time.Minute)
		time.Sleep(3 * time.Millisecond)
	}
	var newest time.Time
	if err := pool.QueryRow(context.Background(), `SELECT max(available_at) FROM `+tbl.Sanitize()).Scan(&newest); err != nil {
		t.Fatal(err)
	}
	const slack = 100 * time.Millisecond // round trips, a writer's open transaction at the cut
	limit := subscriber.BoundedCutEvery + subscriber.BoundedMargin + slack
	at, set := subscriber.BoundOf(s)
	if !set {
		t.Fatal("no bound after 30 deliveries: every claim walks from the oldest entry")
	}
	if behind := newest.Sub(at); behind > limit {
		t.Fatalf("the bound trails the newest row by %s, want at most %s", behind, limit)
	}
}

// TestBoundedClaimLateLockTaker: a transaction that began long before the
// claims' bound moved and wrote the outbox only after it (business work
// first, the outbox last) is delivered at once, not by the sweep: its row's
// available_at is the time the row was formed (clock_timestamp()), above
// the bound. With available_at = now() (the transaction's start, the
// default before migration 000009) the bound would pass it and only the
// sweep would find it, LockTTL/4 later.
//
// The verdict does not depend on the machine's speed: the sweep runs every
// 5 minutes (LockTTL 20 minutes), its first run long after the test's
// 2-minute wait, and only the sweep claims a row below the bound; so a
// delivery within the wait is the bounded claim's, and
// outbox_sweep_claimed_total stays 0.
func TestBoundedClaimLateLockTaker(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	const lockTTL = 20 * time.Minute
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: lockTTL, Metrics: m})
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 5), time.Minute)
	late := lateWriter(t, pool, tbl)
	// Meanwhile short transactions flow, and the bound moves past the late
	// transaction's start.
	for range 5 {
		time.Sleep(200 * time.Millisecond)
		took := d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 3), time.Minute)
		t.Logf("short transactions' events delivered %s after their commit", took.Round(time.Millisecond))
	}
	id := late()
	took, ok := d.within([]string{id}, 2*time.Minute)
	if !ok {
		t.Fatalf("the late writer's event was not delivered within %s of its commit (the sweep runs every %s): the bound passed it", took.Round(time.Second), lockTTL/4)
	}
	t.Logf("late writer's event delivered %s after its commit", took.Round(time.Millisecond))
	if n := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); n != 0 {
		t.Fatalf("the sweep claimed %v rows, want 0: the bound passed them", n)
	}
}

// TestBoundedClaimSweepFindsWhatTheBoundMissed: a row whose available_at
// lies below the bound when it commits (written with an explicit old
// available_at, as a row formed long before its writer took the table's
// lock would be) is still delivered, by the sweep, and counted in
// outbox_sweep_claimed_total.
func TestBoundedClaimSweepFindsWhatTheBoundMissed(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "bounded_sweep_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	s := newSub(t, pool, subscriber.Config{Table: tbl, LockTTL: 4 * time.Second, Metrics: m})
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 5), 5*time.Second)
	for range 3 { // the bound moves on
		time.Sleep(200 * time.Millisecond)
		d.wait(t, enqueue(t, pool, tbl, "org.bounded.v1", 1), time.Minute)
	}
	id := uuid.New()
	if _, err := pool.Exec(context.Background(), `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, available_at)
VALUES ($1, 'org.bounded.v1', '{}', $2, now() - interval '1 minute')`, tenant, id); err != nil {
		t.Fatal(err)
	}
	took := d.wait(t, []string{id.String()}, 10*time.Second)
	t.Logf("the row below the bound was delivered %s after its commit (sweep every LockTTL/4 = 1s)", took.Round(time.Millisecond))
	if n := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); n < 1 {
		t.Fatalf("outbox_sweep_claimed_total = %v, want at least 1", n)
	}
}

// TestBoundedClaimHiddenWriter: a relay whose role cannot read other
// roles' transaction starts (not a member of pg_read_all_stats) must not
// move the bound past an open writer of another role (a hidden lock holder stops the bound): the writer's
// late row, formed before the cut, is delivered at once, not by the sweep.
// Before, pg_stat_activity's NULL xact_start was ignored and the bound
// passed the row. As in TestBoundedClaimLateLockTaker, the sweep runs every
// 5 minutes, so a delivery within the test's 2-minute wait is the bounded
// claim's whatever the machine's speed, and outbox_sweep_claimed_total
// stays 0.
func TestBoundedClaimHiddenWriter(t *testing.T) {
	t.Parallel()
	admin := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "bounded_hidden_outbox")
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("outbox_relay_%d", time.Now().UnixNano()%1_000_000_000)
	for _, stmt := range []string{
		`CREATE ROLE ` + role + ` LOGIN`,
		`GRANT USAGE ON SCHEMA ` + pgx.Identifier{tbl.Schema()}.Sanitize() + ` TO ` + role,
		`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA ` + pgx.Identifier{tbl.Schema()}.Sanitize() + ` TO ` + role,
		`GRANT USAGE ON ALL SEQUENCES IN SCHEMA ` + pgx.Identifier{tbl.Schema()}.Sanitize() + ` TO ` + role,
	} {
		if _, err := admin.Exec(ctx, stmt); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := pgxpool.ParseConfig(testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = role
	relayPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		relayPool.Close()
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = admin.Exec(context.Background(), `DROP ROLE IF EXISTS `+role)
	})
	var member bool
	if err := relayPool.QueryRow(ctx, `SELECT pg_has_role('pg_read_all_stats', 'member')`).Scan(&member); err != nil || member {
		t.Fatalf("the relay's role reads all stats (%v, %v): the test needs one that does not", member, err)
	}
	const lockTTL = 20 * time.Minute
	s, err := subscriber.New(context.Background(), relayPool, subscriber.Config{Table: tbl, LockTTL: lockTTL, Metrics: m}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if !subscriber.Bounded(s) {
		t.Fatal("the relay claims without the bound")
	}
	d := consumeAll(t, s)
	d.wait(t, enqueue(t, admin, tbl, "org.bounded.v1", 3), time.Minute)
	// Another role's writer forms its row now, holds the table's lock and
	// commits only after the bound would have moved past the row.
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	id := uuid.New()
	if _, err := tx.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id) VALUES ($1, 'org.bounded.v1', '{}', $2)`, tenant, id); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		time.Sleep(200 * time.Millisecond)
		d.wait(t, enqueue(t, relayPool, tbl, "org.bounded.v1", 1), time.Minute)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	took, ok := d.within([]string{id.String()}, 2*time.Minute)
	if !ok {
		t.Fatalf("the hidden writer's row was not delivered within %s of its commit (the sweep runs every %s): the bound passed it", took.Round(time.Second), lockTTL/4)
	}
	t.Logf("the hidden writer's row delivered %s after its commit", took.Round(time.Millisecond))
	if n := testutil.ToFloat64(m.SweepClaimed.WithLabelValues(tbl.Qualified())); n != 0 {
		t.Fatalf("the sweep claimed %v rows, want 0: the bound passed them", n)
	}
}
