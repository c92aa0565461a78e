package console_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// leaseOf reads the row's locked_at and attempts, to check that a refused
// action left them.
func leaseOf(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) (lockedAt *time.Time, attempts int, dead bool) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT locked_at, attempts, dead_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, id).
		Scan(&lockedAt, &attempts, &dead); err != nil {
		t.Fatal(err)
	}
	return lockedAt, attempts, dead
}

// TestConsoleJudgesLeasesByTheRelaysLockTTL: the relays of a table run
// with LockTTL 5m (OUTBOX_RELAY_LOCK_TTL=5m) and record it when they
// start; a failed row and a dead row were leased 90 s ago (a copy may be
// in a handler, and the relay will not claim them again for 3.5 minutes).
// The console, which has no lock TTL of its own, refuses to replay or skip
// them and leaves them out of a bulk replay's preview, as `outbox dead
// replay` with OUTBOX_RELAY_LOCK_TTL=5m does (runbook, LockTTL 5m); before,
// it judged them by the 60 s default and replayed them, and the relay
// delivered them again beside the copy in the handler.
func TestConsoleJudgesLeasesByTheRelaysLockTTL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox")
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, LockTTL: 5 * time.Minute}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}

	failed, dead := deadRow(t, pool, tbl), deadRow(t, pool, tbl)
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET dead_at = NULL, attempts = 2, available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, failed); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, dead); err != nil {
		t.Fatal(err)
	}
	topic := hostileTopic // deadRow's

	// The CLI's rule, with OUTBOX_RELAY_LOCK_TTL=5m.
	for _, id := range []uuid.UUID{failed, dead} {
		if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{LockTTL: 5 * time.Minute, DryRun: true}); err == nil {
			t.Fatalf("the CLI's replay accepts a row leased 90 s ago")
		}
	}

	const token = "s3cret-token-of-the-console"
	srv := server(t, pool, tbl, token)
	bearer := map[string]string{"Authorization": "Bearer " + token}
	for _, id := range []uuid.UUID{failed, dead} {
		lockedAt, attempts, wasDead := leaseOf(t, pool, tbl, id)
		base := srv.URL + "/t/" + tbl.String() + "/event/" + id.String()
		if r := do(t, "POST", base+"/replay", url.Values{}, bearer); r.code != 409 || !strings.Contains(r.body, "leased it") || !strings.Contains(r.body, "lock TTL 5m0s") {
			t.Errorf("console replay of a row leased 90 s ago: %d %s, want 409 naming the lease and the relays' lock TTL", r.code, r.body)
		}
		if r := do(t, "POST", base+"/skip", url.Values{}, bearer); r.code != 409 || !strings.Contains(r.body, "in_flight") {
			t.Errorf("console skip of a row leased 90 s ago: %d %s, want 409 (in flight)", r.code, r.body)
		}
		if l, a, d := leaseOf(t, pool, tbl, id); l == nil || !l.Equal(*lockedAt) || a != attempts || d != wasDead {
			t.Fatalf("a refused action changed the row: locked_at %v attempts %d dead %v, was %v %d %v", l, a, d, lockedAt, attempts, wasDead)
		}
	}
	preview := do(t, "GET", srv.URL+"/t/"+tbl.String()+"/replay?"+url.Values{"topic": {topic}}.Encode(), nil, bearer)
	if !strings.Contains(preview.body, `<dd id="preview-rows">0</dd>`) {
		t.Errorf("the bulk replay preview counts the dead row leased 90 s ago:\n%s", preview.body)
	}
}
