package runbook_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// walCluster starts a private PostgreSQL with wal_level = logical (the
// shared server runs at replica) and returns a pool on it and an outbox
// table set up for the WAL relay.
func walCluster(t *testing.T) (*pgxpool.Pool, schema.Table) {
	t.Helper()
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{
		"wal_level": "logical", "max_replication_slots": "4", "max_wal_senders": "4", "wal_sender_timeout": "10s",
	}})
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tbl := schema.MustParseTable("public.wal_outbox")
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); err != nil {
		t.Fatal(err)
	}
	return pool, tbl
}

// TestHoldLifecycleWAL drives, with a real WAL relay, a hold into every
// state the WAL relay has (retrying: a transient nack with an hour's
// backoff and more than MaxInFlight rows of its key behind it, spilled to
// the hold; dead: a permanent error; replay: the dead row replayed and
// held in its handler; draining: a dead row replayed and acked, its parked
// row held in its handler; skip_requested: a skip while no relay runs),
// checks that HeldKeys reports each, and that skip and
// replay are accepted or refused exactly per the rules table, with nothing
// changed on a refusal. The resolved state (a tombstone) is written with
// SQL: the relay forgets it at the status tick its confirmed position
// passes it, which a test cannot catch deterministically.
func TestHoldLifecycleWAL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, tbl := walCluster(t)
	keys := []string{"d1", "d2", "k", "k", "p", "p", "g", "g", "x", "r", "r", "r", "r", "r", "r", "q", "q", "q", "q", "q", "q"}
	msgs := make([]publisher.Message, len(keys))
	ids := make([]uuid.UUID, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		msgs[i] = publisher.Message{TenantID: tenantA, Topic: topicA, EventID: ids[i], Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, msgs)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	d1, d2, k, p, g, gNext, x := ids[0], ids[1], ids[2], ids[4], ids[6], ids[7], ids[8]
	dies := map[uuid.UUID]bool{d1: true, d2: true, k: true, p: true, g: true, x: true}
	r, q := ids[9], ids[15] // their first delivery fails, and they wait an hour: their keys' rows are spilled
	retries := map[uuid.UUID]bool{r: true, q: true}
	release := make(chan struct{})
	inHandler := make(chan uuid.UUID, 16)
	s, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: time.Second, MaxInFlight: 4, Backoff: func(int) time.Duration { return time.Hour }}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			close(release)
			_ = s.Close()
		}
	})
	c := consume(t, s, func(msg *message.Message, n int) error {
		id := uuid.MustParse(msg.UUID)
		switch {
		case dies[id] && n == 0:
			return subscriber.Permanent(errors.New("poison"))
		case retries[id] && n == 0:
			return errors.New("transient")
		case id == p || id == gNext: // the replay of p, and g's parked row as its hold drains
			select {
			case inHandler <- id:
			default:
			}
			select {
			case <-release:
			case <-msg.Context().Done():
			}
			return errors.New("held by the test")
		}
		return nil
	})
	want := map[string]runbook.HoldState{"d1": runbook.HoldDead, "d2": runbook.HoldDead, "k": runbook.HoldDead,
		"p": runbook.HoldDead, "g": runbook.HoldDead, "x": runbook.HoldDead, "r": runbook.HoldRetrying, "q": runbook.HoldRetrying}
	waitUntil(t, 20*time.Second, "six dead holds and two retrying", func() bool { return sameStates(holdStates(t, pool, tbl, false), want) })

	for _, id := range []uuid.UUID{p, g} {
		if rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{}); err != nil || rep.Changed != 1 {
			t.Fatalf("replay of a dead held row: %+v, %v", rep, err)
		}
	}
	for got := map[uuid.UUID]bool{}; !got[p] || !got[gNext]; {
		select {
		case id := <-inHandler:
			got[id] = true
		case <-time.After(2 * time.Minute):
			t.Fatalf("in the handlers: %v; want the replay of p and g's parked row", got)
		}
	}
	want["p"], want["g"] = runbook.HoldReplay, runbook.HoldDraining
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("holds with p's replay and g's drain in handlers: %v, want %v", got, want)
	}
	if c.count(c.acked, g) != 1 {
		t.Fatalf("g's replay acked %d times, want once", c.count(c.acked, g))
	}
	refuses(t, pool, tbl, tbl.HoldsTable(), p, runbook.HoldReplay, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), g, runbook.HoldDraining, runbook.OpSkip, runbook.OpReplay)

	// Close ends the session: it cancels the held messages' contexts and
	// records no verdict for them, so p's row stays reset and g's hold
	// stays draining.
	closed = true
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	close(release)
	c.wg.Wait()
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("holds after the relay closed: %v, want %v", got, want)
	}

	// No relay runs now: a skip stays requested.
	if sk, err := runbook.New(pool, tbl).SkipEvent(ctx, k, false); err != nil || sk.Changed != 1 || sk.Key != "k" {
		t.Fatalf("skip of the dead row: %+v, %v", sk, err)
	}
	want["k"] = runbook.HoldSkipRequested
	exec(t, pool, tbl, `UPDATE `+tbl.HoldsTable()+` SET resolved_at = now(), through = sequence WHERE event_id = $1`, x)
	delete(want, "x")
	withResolved := checkHoldStates(t, pool, tbl, schema.ModeWAL, want)

	refuses(t, pool, tbl, tbl.HoldsTable(), k, runbook.HoldSkipRequested, runbook.OpSkip, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), p, runbook.HoldReplay, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), g, runbook.HoldDraining, runbook.OpSkip, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), x, runbook.HoldResolved, runbook.OpSkip)
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, x, false); !errors.Is(err, runbook.ErrNotHeld) {
		t.Errorf("skip of a resolved hold: %v, want ErrNotHeld too", err)
	}

	dry, err := runbook.New(pool, tbl).SkipEvent(ctx, d1, true)
	if err != nil || !dry.DryRun || dry.Key != "d1" {
		t.Fatalf("dry run of a skip of a dead row: %+v, %v", dry, err)
	}
	dryReplay, err := runbook.New(pool, tbl).ReplayEvent(ctx, d1, runbook.ReplayOptions{DryRun: true})
	if err != nil || !dryReplay.DryRun {
		t.Fatalf("dry run of a replay of a dead row: %+v, %v", dryReplay, err)
	}
	for _, a := range []struct {
		id   uuid.UUID
		op   runbook.HoldOp
		key  string
		then runbook.HoldState
	}{
		{d1, runbook.OpSkip, "d1", runbook.HoldSkipRequested},
		{d2, runbook.OpReplay, "d2", runbook.HoldReplay},
		{p, runbook.OpSkip, "p", runbook.HoldSkipRequested},
		{x, runbook.OpReplay, "x", runbook.HoldResolved},
		{r, runbook.OpSkip, "r", runbook.HoldSkipRequested},
		{q, runbook.OpReplay, "q", runbook.HoldRetrying},
	} {
		changed := applyHoldOp(ctx, t, pool, tbl, a.id, a.op, a.key)
		if changed != 1 {
			t.Errorf("%s of %s changed %d", a.op, a.key, changed)
		}
		withResolved[a.key] = a.then
	}
	if got := holdStates(t, pool, tbl, true); !sameStates(got, withResolved) {
		t.Fatalf("holds after the accepted actions: %v, want %v", got, withResolved)
	}
	for _, id := range []uuid.UUID{d2, x, q} {
		if st := state(t, pool, tbl, id); st.Dead || st.Attempts != 0 {
			t.Errorf("replayed row %s not reset: %+v", id, st)
		}
	}
	before := holdSnapshot(t, pool, tbl, tbl.HoldsTable())
	if err := pool.QueryRow(ctx, dry.Statement.SQL, dry.Statement.Args...).Scan(new(string), new(int64)); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("the skip's statement run on a hold that moved on: %v, want no row", err)
	}
	// d1's row is still dead, but its hold is skip_requested: the replay's
	// statement leaves it.
	if err := pool.QueryRow(ctx, dryReplay.Statement.SQL, dryReplay.Statement.Args...).Scan(new(int64)); !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("the replay's statement run on a hold that moved on: %v, want no row", err)
	}
	if after := holdSnapshot(t, pool, tbl, tbl.HoldsTable()); after != before {
		t.Fatalf("the guarded statements changed a hold that moved on:\n%s\n%s", before, after)
	}

	// A relay applies the accepted actions: the skipped dead rows (and r's
	// skipped retrying row) are never delivered and their keys' parked
	// rows are; the replayed rows are delivered (q's retrying row too, then
	// its key's spilled rows); g's drain restarts and ends; no key stays
	// held. (p's row,
	// skipped while its replay was pending, is not checked: a copy the
	// stream already carries may still be delivered.)
	s2, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl, StatusInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond,
		CloseTimeout: time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s2.Close() })
	c2 := consume(t, s2, func(*message.Message, int) error { return nil })
	kNext, pNext := ids[3], ids[5]
	waitUntil(t, 20*time.Second, "the actions applied", func() bool {
		done := len(holdStates(t, pool, tbl, false)) == 0
		for _, id := range append([]uuid.UUID{kNext, pNext, gNext, d2, x}, ids[10:]...) {
			done = done && c2.count(c2.acked, id) >= 1
		}
		return done
	})
	for _, id := range []uuid.UUID{d1, k, r} {
		if n := c2.count(c2.delivers, id); n != 0 {
			t.Errorf("skipped row %s delivered %d times", id, n)
		}
	}
}
