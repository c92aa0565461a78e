package runbook_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
)

func sequenceOf(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) int64 {
	t.Helper()
	var seq int64
	if err := pool.QueryRow(context.Background(), replaceTable(`SELECT sequence FROM %s WHERE event_id = $1`, tbl), id).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	return seq
}

func TestReplayEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "replay_one_outbox")
	ids := enqueue(t, pool, tbl, tenantA, repeat(topicA, 8), nil)
	var (
		dead, failed, pending, published = ids[0], ids[1], ids[2], ids[3]
		leasedDead, staleLeasedDead      = ids[4], ids[5]
		leasedFailed, leasedFirstTry     = ids[6], ids[7]
	)
	markDead(t, pool, tbl, "HTTP 503", dead)
	exec(t, pool, tbl, `UPDATE %s SET attempts = 3, last_error = 'timeout', available_at = now() + interval '1 hour' WHERE event_id = $1`, failed)
	exec(t, pool, tbl, `UPDATE %s SET published_at = now(), attempts = 1 WHERE event_id = $1`, published)
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'x', locked_at = now() WHERE event_id = $1`, leasedDead)
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'relay crashed', locked_at = now() - interval '2 hours', available_at = now() - interval '3 hours' WHERE event_id = $1`, staleLeasedDead)
	exec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = 'x', locked_at = now() WHERE event_id = $1`, leasedFailed)
	exec(t, pool, tbl, `UPDATE %s SET attempts = 1, locked_at = now() WHERE event_id = $1`, leasedFirstTry)
	before := states(t, pool, tbl, ids)

	// A dry run checks and shows, and changes nothing.
	res, err := runbook.New(pool, tbl).ReplayEvent(ctx, dead, runbook.ReplayOptions{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if !res.DryRun || res.Changed != 0 || !res.Dead || res.Row.EventID != dead || res.Row.Attempts != 25 || res.Table != tbl.String() ||
		!strings.Contains(res.Statement.SQL, "UPDATE "+tbl.Sanitize()) || res.Statement.Args[0] != dead.String() {
		t.Fatalf("dry run: %+v", res)
	}
	assertUnchanged(t, "dry run", before, states(t, pool, tbl, ids))

	// Refusals say why and change nothing.
	refusals := []struct {
		id     uuid.UUID
		reason error
		says   string
	}{
		{pending, runbook.ErrNotFailed, "neither dead nor failed"},
		{published, runbook.ErrAlreadyPublished, "already published"},
		{leasedDead, runbook.ErrLocked, "leased it"},
		{leasedFailed, runbook.ErrLocked, "leased it"},
		{leasedFirstTry, runbook.ErrNotFailed, "neither dead nor failed"},
		{uuid.New(), runbook.ErrEventNotFound, "no row has this event_id"},
	}
	for _, dry := range []bool{true, false} {
		for _, r := range refusals {
			_, err := runbook.New(pool, tbl).ReplayEvent(ctx, r.id, runbook.ReplayOptions{DryRun: dry})
			var nre *runbook.NotReplayableError
			if !errors.Is(err, r.reason) || !errors.As(err, &nre) || nre.EventID != r.id ||
				!strings.Contains(err.Error(), r.says) || !strings.Contains(err.Error(), "nothing changed") || !strings.Contains(err.Error(), tbl.String()) {
				t.Errorf("replay %s (dry run %v): got %v, want %v saying %q", r.id, dry, err, r.reason, r.says)
			}
		}
	}
	assertUnchanged(t, "refused replays", before, states(t, pool, tbl, ids))

	// Dead, failed, and failed with an abandoned lease (not yet parked dead
	// by a claim) are replayed.
	for _, id := range []uuid.UUID{dead, failed, staleLeasedDead} {
		res, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
		if err != nil {
			t.Fatalf("replay %s: %v", id, err)
		}
		if res.Changed != 1 || res.DryRun || res.Row.EventID != id || res.Dead != (id == dead) {
			t.Fatalf("replay %s: %+v", id, res)
		}
		assertReset(t, pool, tbl, id)
	}
	after := states(t, pool, tbl, ids)
	for i, id := range ids {
		if id != dead && id != failed && id != staleLeasedDead {
			assertUnchanged(t, "replay of other rows", before[i:i+1], after[i:i+1])
		}
	}

	// A replayed row is pending and not failed: a second replay is refused.
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, dead, runbook.ReplayOptions{}); !errors.Is(err, runbook.ErrNotFailed) {
		t.Fatalf("second replay: %v", err)
	}
	// Dead is dead_at, not a number of attempts: many attempts without
	// dead_at or last_error is pending.
	exec(t, pool, tbl, `UPDATE %s SET attempts = 30, locked_at = NULL, last_error = NULL WHERE event_id = $1`, pending)
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, pending, runbook.ReplayOptions{}); !errors.Is(err, runbook.ErrNotFailed) {
		t.Fatalf("30 attempts, not dead: %v", err)
	}
	// The lock TTL comes from the options.
	time.Sleep(20 * time.Millisecond)
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, leasedDead, runbook.ReplayOptions{LockTTL: 10 * time.Millisecond}); err != nil {
		t.Fatalf("lease older than a 10ms lock TTL: %v", err)
	}
	assertReset(t, pool, tbl, leasedDead)

	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, uuid.Nil, runbook.ReplayOptions{}); err == nil || !strings.Contains(err.Error(), "nil UUID") {
		t.Errorf("nil event_id: %v", err)
	}
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, dead, runbook.ReplayOptions{LockTTL: -time.Second}); err == nil {
		t.Error("negative lock TTL accepted")
	}
}

// TestReplayWakesRelays: a replay notifies the table's channel, so relays
// deliver at once rather than at their next poll.
func TestReplayWakesRelays(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "wake_outbox")
	ids := enqueue(t, pool, tbl, tenantA, repeat(topicA, 2), nil)
	markDead(t, pool, tbl, "boom", ids...)

	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{sqlq.NotifyChannel(tbl)}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	wait := func(what string) {
		t.Helper()
		wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
		defer wcancel()
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			t.Fatalf("%s: no notification: %v", what, err)
		}
		if n.Channel != sqlq.NotifyChannel(tbl) {
			t.Fatalf("%s: notification on %q", what, n.Channel)
		}
	}
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, ids[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	wait("replay one")
	if _, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{Topic: topicA}, false); err != nil {
		t.Fatal(err)
	}
	wait("bulk replay")
}

func TestReplayDead(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "replay_bulk_outbox")
	a := enqueue(t, pool, tbl, tenantA, []string{topicA, topicA, topicA, topicA, topicB, topicB}, nil)
	b := enqueue(t, pool, tbl, tenantB, []string{topicA, topicA}, nil)
	markDead(t, pool, tbl, "publish: timeout", a[0], a[4], a[5], b[1])
	markDead(t, pool, tbl, "HTTP 503", a[1], b[0])
	exec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'timeout', locked_at = now() WHERE event_id = $1`, a[2]) // leased right now
	all := append(append([]uuid.UUID{}, a...), b...)
	before := states(t, pool, tbl, all)

	// No unfiltered default.
	for _, bad := range []runbook.DeadFilter{{}, {TenantID: tenantA}, {ErrorContains: "timeout"}, {Topic: topicA, AllTopics: true}, {Topic: topicA, Limit: -1}} {
		for _, dry := range []bool{true, false} {
			if _, err := runbook.New(pool, tbl).ReplayDead(ctx, bad, dry); err == nil {
				t.Errorf("ReplayDead(%+v, dry run %v) accepted", bad, dry)
			}
		}
	}
	if _, err := runbook.New(pool, tbl).ReplayDead(ctx, runbook.DeadFilter{}, false); !errors.Is(err, runbook.ErrNoReplayFilter) || !strings.Contains(err.Error(), "AllTopics") {
		t.Errorf("no filter: %v", err)
	}
	assertUnchanged(t, "refused bulk replays", before, states(t, pool, tbl, all))

	// replay runs the dry run, checks that it changed nothing, then the real
	// run, and checks both counts.
	replay := func(f runbook.DeadFilter, want int64, reset ...uuid.UUID) {
		t.Helper()
		snapshot := states(t, pool, tbl, all)
		dry, err := runbook.New(pool, tbl).ReplayDead(ctx, f, true)
		if err != nil {
			t.Fatalf("dry run %+v: %v", f, err)
		}
		assertUnchanged(t, "dry run", snapshot, states(t, pool, tbl, all))
		f.Expect = &dry.Snapshot // exactly the previewed rows
		real, err := runbook.New(pool, tbl).ReplayDead(ctx, f, false)
		if err != nil {
			t.Fatalf("replay %+v: %v", f, err)
		}
		if !dry.DryRun || real.DryRun || dry.Rows != want || real.Rows != dry.Rows || real.Statement.SQL != dry.Statement.SQL {
			t.Fatalf("filter %+v: dry run %+v, real run %+v, want %d rows", f, dry, real, want)
		}
		resetSet := map[uuid.UUID]bool{}
		for _, id := range reset {
			resetSet[id] = true
			assertReset(t, pool, tbl, id)
		}
		now := states(t, pool, tbl, all)
		for i, id := range all {
			if !resetSet[id] {
				assertUnchanged(t, "replay of other rows", snapshot[i:i+1], now[i:i+1])
			}
		}
	}
	// Topic and error text; the leased row a[2] is left alone.
	replay(runbook.DeadFilter{Topic: topicA, ErrorContains: "TIMEOUT"}, 2, a[0], b[1])
	replay(runbook.DeadFilter{Topic: topicA, ErrorContains: "TIMEOUT"}, 0)
	// Every topic of one tenant, oldest first, one row.
	replay(runbook.DeadFilter{AllTopics: true, TenantID: tenantA, Limit: 1}, 1, a[1])
	// A cursor.
	replay(runbook.DeadFilter{Topic: topicB, AfterSequence: sequenceOf(t, pool, tbl, a[4])}, 1, a[5])
	// Everything left but the leased row.
	replay(runbook.DeadFilter{AllTopics: true}, 2, a[4], b[0])
	if s := state(t, pool, tbl, a[2]); s.Attempts != 25 || s.LockedAt == nil {
		t.Fatalf("leased dead row touched: %+v", s)
	}

	// Without Expect, a replay runs the plain statement: it takes the rows
	// FOR UPDATE, the filter's values as parameters.
	rb := runbook.New(pool, tbl)
	res, err := rb.ReplayDead(ctx, runbook.DeadFilter{Topic: topicA, Limit: 10}, false)
	if st := res.Statement; err != nil || !strings.Contains(st.SQL, "FOR UPDATE") || !strings.Contains(st.SQL, tbl.Sanitize()) || len(st.Args) != 3 {
		t.Fatalf("statement: %v %+v", err, res)
	}
	if _, err := rb.ReplayDead(ctx, runbook.DeadFilter{}, true); !errors.Is(err, runbook.ErrNoReplayFilter) {
		t.Fatalf("replay without filter: %v", err)
	}
}
