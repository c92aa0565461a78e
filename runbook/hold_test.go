package runbook_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/doccheck"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// wantRules is the rules table as the docs state it: for each state,
// whether ordered mode and the WAL relay have it, and whether a skip and a
// replay are allowed. The lifecycle tests hold the runbook to it.
var wantRules = map[runbook.HoldState]struct{ ordered, wal, skip, replay bool }{
	runbook.HoldRetrying:      {ordered: true, wal: true, skip: true, replay: true},
	runbook.HoldDead:          {ordered: true, wal: true, skip: true, replay: true},
	runbook.HoldSkipRequested: {ordered: true, wal: true, skip: false, replay: false},
	runbook.HoldReplay:        {ordered: true, wal: true, skip: true, replay: false},
	runbook.HoldDraining:      {ordered: false, wal: true, skip: false, replay: false},
	runbook.HoldResolved:      {ordered: true, wal: true, skip: false, replay: true},
}

// TestHoldRules: Allows, In, the words and their JSON agree with the
// table above; a refusal says the state, why and what to do, and matches
// ErrHoldRefused (and ErrNotHeld for a skip of a resolved hold).
func TestHoldRules(t *testing.T) {
	t.Parallel()
	if len(runbook.HoldStates) != len(wantRules) {
		t.Fatalf("%d states, the table has %d", len(runbook.HoldStates), len(wantRules))
	}
	for _, s := range runbook.HoldStates {
		w, ok := wantRules[s]
		if !ok {
			t.Fatalf("state %s is not in the table", s)
		}
		if runbook.HoldStateIn(s, schema.ModeOrdered) != w.ordered || runbook.HoldStateIn(s, schema.ModeWAL) != w.wal || runbook.HoldStateIn(s, schema.ModeDefault) {
			t.Errorf("%s: in ordered %v, WAL %v, default %v; want %v, %v, false", s, runbook.HoldStateIn(s, schema.ModeOrdered), runbook.HoldStateIn(s, schema.ModeWAL), runbook.HoldStateIn(s, schema.ModeDefault), w.ordered, w.wal)
		}
		for op, want := range map[runbook.HoldOp]bool{runbook.OpSkip: w.skip, runbook.OpReplay: w.replay} {
			err := s.Allows(op)
			if (err == nil) != want {
				t.Errorf("%s.Allows(%s) = %v, want allowed %v", s, op, err, want)
				continue
			}
			if err == nil {
				continue
			}
			var re *runbook.HoldRuleError
			if !errors.As(err, &re) || re.State != s || re.Op != op || re.Why == "" || re.Do == "" || !errors.Is(err, runbook.ErrHoldRefused) {
				t.Errorf("%s.Allows(%s): %#v", s, op, err)
			}
			if errors.Is(err, runbook.ErrNotHeld) != (s == runbook.HoldResolved && op == runbook.OpSkip) {
				t.Errorf("%s.Allows(%s) matches ErrNotHeld: %v", s, op, errors.Is(err, runbook.ErrNotHeld))
			}
		}
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		var back runbook.HoldState
		if err := json.Unmarshal(b, &back); err != nil || back != s || string(b) != `"`+s.String()+`"` {
			t.Errorf("JSON of %s: %s, back %v, %v", s, b, back, err)
		}
	}
	if err := runbook.HoldState(0).Allows(runbook.OpSkip); err == nil {
		t.Error("the zero state allows a skip")
	}
	if _, err := json.Marshal(runbook.HoldState(0)); err == nil {
		t.Error("the zero state has a JSON word")
	}
	if _, err := runbook.ParseHoldState("held"); err == nil {
		t.Error(`"held" parsed as a state`)
	}
}

// TestHoldRulesTableInDocs: docs/ORDERING.md, docs/WAL.md and
// docs/OPERATIONS.md carry the rules table exactly as the code renders it.
func TestHoldRulesTableInDocs(t *testing.T) {
	t.Parallel()
	table := doccheck.Normalize(runbook.HoldRulesTable())
	for _, name := range []string{"ORDERING.md", "WAL.md", "OPERATIONS.md"} {
		doccheck.ExpectIn(t, name, doccheck.Doc(t, "..", name), table)
	}
}

// holdSnapshot is every hold and every outbox row of tbl as text, to check
// that a refused action changed nothing.
func holdSnapshot(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, holds string) string {
	t.Helper()
	var s string
	err := pool.QueryRow(context.Background(), `SELECT COALESCE((SELECT string_agg(h::text, E'\n' ORDER BY h::text) FROM `+holds+` AS h), '')
  || E'\n--\n' || COALESCE((SELECT string_agg(o::text, E'\n' ORDER BY o.sequence) FROM `+tbl.Sanitize()+` AS o), '')`).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// holdStates maps each key HeldKeys (or ListHolds) lists to its state.
func holdStates(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, resolved bool) map[string]runbook.HoldState {
	t.Helper()
	list, err := runbook.New(pool, tbl).ListHolds(context.Background(), runbook.HoldsFilter{Resolved: resolved})
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]runbook.HoldState{}
	for _, h := range list {
		out[h.Key] = h.State
	}
	return out
}

func sameStates(got, want map[string]runbook.HoldState) bool {
	if len(got) != len(want) {
		return false
	}
	for k, s := range want {
		if got[k] != s {
			return false
		}
	}
	return true
}

func waitUntil(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	// At least 2 minutes: a liveness bound for a loaded machine (the relays
	// of these tests retry after an hour, or within a second).
	within = max(within, 2*time.Minute)
	for deadline := time.Now().Add(within); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// refuses checks that the actions ops on the event (its hold in state s)
// are refused by the hold's rules (HoldRuleErrors), and that the refusals
// changed nothing.
func refuses(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, holds string, id uuid.UUID, s runbook.HoldState, ops ...runbook.HoldOp) {
	t.Helper()
	ctx := context.Background()
	before := holdSnapshot(t, pool, tbl, holds)
	for _, op := range ops {
		var err error
		if op == runbook.OpSkip {
			_, err = runbook.New(pool, tbl).SkipEvent(ctx, id, false)
		} else {
			_, err = runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
		}
		var re *runbook.HoldRuleError
		if !errors.As(err, &re) || re.State != s || re.Op != op || !errors.Is(err, runbook.ErrHoldRefused) {
			t.Errorf("%s of a %s hold: %v, want a refusal by the hold's rules", op, s, err)
		}
	}
	if after := holdSnapshot(t, pool, tbl, holds); after != before {
		t.Errorf("a refused action on a %s hold changed the table:\nbefore %s\nafter  %s", s, before, after)
	}
}

// consumer hands each message to handle in its own goroutine (keys run
// concurrently; a blocked handler stops nothing else) and acks or nacks by
// its verdict: nil acks; an error is recorded (subscriber.RecordError) and
// nacked.
type consumer struct {
	mu       sync.Mutex
	acked    map[string]int
	delivers map[string]int
	wg       sync.WaitGroup
}

func consume(t *testing.T, s message.Subscriber, handle func(msg *message.Message, n int) error) *consumer {
	t.Helper()
	c := &consumer{acked: map[string]int{}, delivers: map[string]int{}}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		for msg := range ch {
			c.mu.Lock()
			n := c.delivers[msg.UUID]
			c.delivers[msg.UUID]++
			c.mu.Unlock()
			c.wg.Add(1)
			go func(msg *message.Message) {
				defer c.wg.Done()
				if err := handle(msg, n); err != nil {
					subscriber.RecordError(msg, err)
					msg.Nack()
					return
				}
				c.mu.Lock()
				c.acked[msg.UUID]++
				c.mu.Unlock()
				msg.Ack()
			}(msg)
		}
	}()
	return c
}

func (c *consumer) count(m map[string]int, id uuid.UUID) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return m[id.String()]
}

// TestHoldLifecycleOrdered drives, with a real ordered relay, a hold into
// every state ordered mode has (retrying: a transient nack with an hour's
// backoff; dead: a permanent error; replay: an operator's replay of an
// acked row, held in its handler; skip_requested: a skip while no relay
// runs), checks that HeldKeys reports each, and that skip and replay are
// accepted or refused exactly per the rules table, with nothing changed on
// a refusal. The resolved state is written with SQL: the relay deletes a
// tombstone at the tick its floor passes it, which a test cannot catch
// deterministically.
func TestHoldLifecycleOrdered(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "hold_outbox", schema.WithOrderingKeyColumn())
	ids := enqueueKeys(t, pool, tbl, "r1", "r1", "r2", "d1", "d1", "d2", "k", "p", "x")
	r1, r2, d1, d2, k, p, x := ids[0], ids[2], ids[3], ids[5], ids[6], ids[7], ids[8]
	transient := map[uuid.UUID]bool{r1: true, r2: true}
	permanent := map[uuid.UUID]bool{d1: true, d2: true, k: true}
	release := make(chan struct{})
	inReplay := make(chan struct{}, 1)
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, MaxAttempts: 100, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: time.Second,
		Backoff: func(int) time.Duration { return time.Hour }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			close(release)
			_ = sub.Close()
		}
	})
	c := consume(t, sub, func(msg *message.Message, n int) error {
		id := uuid.MustParse(msg.UUID)
		switch {
		case transient[id]:
			return errors.New("flaky")
		case permanent[id]:
			return subscriber.Permanent(errors.New("poison"))
		case id == p && n > 0: // the operator's replay: held in the handler
			select {
			case inReplay <- struct{}{}:
			default:
			}
			select {
			case <-release:
			case <-msg.Context().Done():
			}
			return errors.New("replay held by the test")
		}
		return nil
	})
	want := map[string]runbook.HoldState{"r1": runbook.HoldRetrying, "r2": runbook.HoldRetrying,
		"d1": runbook.HoldDead, "d2": runbook.HoldDead, "k": runbook.HoldDead}
	waitUntil(t, 15*time.Second, "the retrying and dead holds", func() bool {
		return sameStates(holdStates(t, pool, tbl, false), want) && c.count(c.acked, p) == 1 && c.count(c.acked, x) == 1
	})
	// The replay of the acked row p is accepted once its partition's floor
	// passed it (ErrNotRelayedYet until then).
	waitUntil(t, 15*time.Second, "the replay of an acked row accepted", func() bool {
		rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, p, runbook.ReplayOptions{})
		if err != nil && !errors.Is(err, runbook.ErrNotRelayedYet) {
			t.Fatalf("replay of the acked row: %v", err)
		}
		return err == nil && rep.Changed == 1
	})
	select {
	case <-inReplay:
	case <-time.After(2 * time.Minute):
		t.Fatal("the replay of the acked row was not delivered")
	}
	want["p"] = runbook.HoldReplay
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("holds with the replay in its handler: %v, want %v", got, want)
	}
	refuses(t, pool, tbl, tbl.HoldsTable(), p, runbook.HoldReplay, runbook.OpReplay)

	closed = true
	close(release)
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	c.wg.Wait()
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("holds after the relay closed: %v, want %v", got, want)
	}

	// No relay runs now: a skip stays requested.
	if sk, err := runbook.New(pool, tbl).SkipEvent(ctx, k, false); err != nil || sk.Changed != 1 || sk.Key != "k" {
		t.Fatalf("skip of the dead row: %+v, %v", sk, err)
	}
	want["k"] = runbook.HoldSkipRequested
	hold(t, pool, tbl, x, "resolved")
	checkHoldStates(t, pool, tbl, schema.ModeOrdered, want)

	// Refusals, per the table: nothing changes.
	refuses(t, pool, tbl, tbl.HoldsTable(), k, runbook.HoldSkipRequested, runbook.OpSkip, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), p, runbook.HoldReplay, runbook.OpReplay)
	refuses(t, pool, tbl, tbl.HoldsTable(), x, runbook.HoldResolved, runbook.OpSkip)
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, x, false); !errors.Is(err, runbook.ErrNotHeld) {
		t.Errorf("skip of a resolved hold: %v, want ErrNotHeld too", err)
	}

	// Acceptances, per the table. A dry run first: its statement, run
	// after the hold moved on, changes nothing (the guard in SQL).
	dry, err := runbook.New(pool, tbl).SkipEvent(ctx, p, true)
	if err != nil || !dry.DryRun {
		t.Fatalf("dry run of a skip of the replay: %+v, %v", dry, err)
	}
	dryReplay, err := runbook.New(pool, tbl).ReplayEvent(ctx, r1, runbook.ReplayOptions{DryRun: true})
	if err != nil || !dryReplay.DryRun {
		t.Fatalf("dry run of a replay of a retrying row: %+v, %v", dryReplay, err)
	}
	for _, a := range []struct {
		id   uuid.UUID
		op   runbook.HoldOp
		key  string
		then runbook.HoldState
	}{
		{r1, runbook.OpSkip, "r1", runbook.HoldSkipRequested},
		{r2, runbook.OpReplay, "r2", runbook.HoldRetrying},
		{d1, runbook.OpSkip, "d1", runbook.HoldSkipRequested},
		{d2, runbook.OpReplay, "d2", runbook.HoldRetrying},
		{p, runbook.OpSkip, "p", runbook.HoldSkipRequested},
		{x, runbook.OpReplay, "x", runbook.HoldReplay},
	} {
		changed := applyHoldOp(ctx, t, pool, tbl, a.id, a.op, a.key)
		want[a.key] = a.then
		if changed != 1 {
			t.Errorf("%s of %s changed %d", a.op, a.key, changed)
		}
	}
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("holds after the accepted actions: %v, want %v", got, want)
	}
	for _, h := range mustHeld(t, pool, tbl) {
		if (h.Key == "r2" || h.Key == "d2") && (h.Attempts != 0 || h.AvailableAt == nil || time.Until(*h.AvailableAt) > time.Minute || h.DeadAt != nil) {
			t.Errorf("replayed hold %s not due now with no attempts: %+v", h.Key, h)
		}
	}
	before := holdSnapshot(t, pool, tbl, tbl.HoldsTable())
	var skipped bool
	if err := pool.QueryRow(ctx, dry.Statement.SQL, dry.Statement.Args...).Scan(&skipped); err != nil || skipped {
		t.Fatalf("the skip's statement run on a hold that moved on: skipped %v, %v", skipped, err)
	}
	if tag, err := pool.Exec(ctx, dryReplay.Statement.SQL, dryReplay.Statement.Args...); err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("the replay's statement run on a hold that moved on (skip requested): %v, %v", tag, err)
	}
	if after := holdSnapshot(t, pool, tbl, tbl.HoldsTable()); after != before {
		t.Fatalf("the guarded statements changed a hold that moved on:\n%s\n%s", before, after)
	}

	// A relay applies the accepted actions: the skipped rows are never
	// delivered (p's skipped replay included) and their keys go on; the
	// replayed rows are delivered; no key stays held.
	sub2, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, Ordered: true, LockTTL: time.Second,
		ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, CloseTimeout: time.Second}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub2.Close() })
	c2 := consume(t, sub2, func(*message.Message, int) error { return nil })
	r1Next, d1Next := ids[1], ids[4]
	waitUntil(t, 15*time.Second, "the actions applied", func() bool {
		return len(holdStates(t, pool, tbl, false)) == 0 && c2.count(c2.acked, r1Next) == 1 && c2.count(c2.acked, d1Next) == 1 &&
			c2.count(c2.acked, r2) == 1 && c2.count(c2.acked, d2) == 1 && c2.count(c2.acked, x) == 1
	})
	for _, id := range []uuid.UUID{r1, d1, k, p} {
		if n := c2.count(c2.delivers, id); n != 0 {
			t.Errorf("skipped row %s delivered %d times", id, n)
		}
	}
}

func mustHeld(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) []runbook.HeldKey {
	t.Helper()
	list, err := runbook.New(pool, tbl).HeldKeys(context.Background(), 0)
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// applyHoldOp skips or replays the event id (of key, for messages) and
// returns the rows the runbook changed; it fails the test on an error.
func applyHoldOp(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID, op runbook.HoldOp, key string) int64 {
	t.Helper()
	if op == runbook.OpSkip {
		res, err := runbook.New(pool, tbl).SkipEvent(ctx, id, false)
		if err != nil {
			t.Fatalf("skip of %s: %v", key, err)
		}
		return res.Changed
	}
	res, err := runbook.New(pool, tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{})
	if err != nil {
		t.Fatalf("replay of %s: %v", key, err)
	}
	return res.Changed
}

// checkHoldStates checks that HeldKeys lists want, that ListHolds with
// resolved holds lists want plus the resolved hold of key "x", and that
// the states reached are exactly the ones mode has. It returns the holds
// with the resolved one.
func checkHoldStates(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, mode schema.Mode, want map[string]runbook.HoldState) map[string]runbook.HoldState {
	t.Helper()
	if got := holdStates(t, pool, tbl, false); !sameStates(got, want) {
		t.Fatalf("HeldKeys: %v, want %v (no resolved hold)", got, want)
	}
	withResolved := map[string]runbook.HoldState{"x": runbook.HoldResolved}
	for key, s := range want {
		withResolved[key] = s
	}
	if got := holdStates(t, pool, tbl, true); !sameStates(got, withResolved) {
		t.Fatalf("ListHolds with resolved: %v, want %v", got, withResolved)
	}
	seen := map[runbook.HoldState]bool{}
	for _, s := range withResolved {
		seen[s] = true
	}
	for _, s := range runbook.HoldStates {
		if runbook.HoldStateIn(s, mode) != seen[s] {
			t.Fatalf("the test reached state %s: %v; mode %s has it: %v", s, seen[s], mode, runbook.HoldStateIn(s, mode))
		}
	}
	return withResolved
}
