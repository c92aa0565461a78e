package walrelay_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// The tests of this file reproduce the WAL relay's items of issue 31: a
// delivery that outlived its replication session (13), a drain that put
// rows in front of a row in flight (7), a hold replaced by an earlier dead
// row (12), a replay lost to a tombstone (11), a skipped row delivered
// after a fast server restart (10), and publications of other tables (9).

// handLog records what a consumer holds per key and every delivery.
type handLog struct {
	mu      sync.Mutex
	held    map[string]int
	overlap []string
	log     []string // event ids, in delivery order
}

func (h *handLog) take(msg *message.Message) {
	k := msg.Metadata.Get(schema.MetadataOrderingKey)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.held == nil {
		h.held = map[string]int{}
	}
	if h.held[k] > 0 {
		h.overlap = append(h.overlap, k+" sequence "+msg.Metadata.Get(schema.MetadataSequence))
	}
	h.held[k]++
	h.log = append(h.log, msg.UUID)
}

func (h *handLog) done(msg *message.Message) {
	h.mu.Lock()
	h.held[msg.Metadata.Get(schema.MetadataOrderingKey)]--
	h.mu.Unlock()
}

func (h *handLog) deliveries() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.log...)
}

func (h *handLog) count(id uuid.UUID) int {
	n := 0
	for _, d := range h.deliveries() {
		if d == id.String() {
			n++
		}
	}
	return n
}

// waitFor polls cond until it holds or fails the test after within (at
// least liveness).
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	within = max(within, liveness)
	for deadline := time.Now().Add(within); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, within)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// terminateWalsender terminates the relay's walsender and waits until it
// has let go of its slot: pg_terminate_backend only signals it, and until
// it exits the slot's active_pid still names it, so a write fenced on the
// session would still pass (TestWALSpillSurvivesASessionCut failed once in
// CI that way).
func terminateWalsender(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var pids []int32
	// A session that has not started yet (the relay's next one, on a
	// loaded machine) is waited for.
	waitFor(t, liveness, "a walsender to terminate", func() bool {
		if err := pool.QueryRow(ctx, `SELECT array_agg(pid) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_replication WHERE application_name = 'outbox-walrelay'`).Scan(&pids); err != nil || len(pids) > 1 {
			t.Fatalf("terminate the walsender: %v terminated, %v", pids, err)
		}
		return len(pids) == 1
	})
	waitFor(t, 10*time.Second, "the terminated walsender to let go of its slot", func() bool {
		var holding bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE active_pid = $1)`, pids[0]).Scan(&holding); err != nil {
			t.Fatal(err)
		}
		return !holding
	})
}

// TestWALCutSessionKeepsOneCopyPerKey (item 13): the replication session is
// cut while the consumer holds row X of a key. The held copy's context is
// cancelled; the next session does not hand out X (or anything of its key)
// while the first copy is in the handler; after its verdict X comes again
// (its ack was not recorded) and then X+1. The context of each message of
// the live session ends with its ack (the copy ends: term core a term's end cancels its messages).
func TestWALCutSessionKeepsOneCopyPerKey(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	s := relay(t, pool, tbl, nil)
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	hand := &handLog{}
	first := make(chan *message.Message, 1)
	release := make(chan struct{})
	var once sync.Once
	ctxEnded := make(chan bool, 16) // per message of the live session: its context ended after its ack
	go func() {
		for msg := range ch {
			go func(msg *message.Message) {
				hand.take(msg)
				held := false
				once.Do(func() { held = true })
				if held {
					first <- msg
					<-release
				}
				hand.done(msg)
				msg.Ack()
				if held {
					return
				}
				select {
				case <-msg.Context().Done():
					ctxEnded <- true
				case <-time.After(liveness):
					ctxEnded <- false
				}
			}(msg)
		}
	}()
	ids := enqueue(t, pool, tbl, "cut-k", "cut-k")
	var x *message.Message
	select {
	case x = <-first:
	case <-time.After(liveness):
		t.Fatal("row X not delivered")
	}
	terminateWalsender(t, pool)
	select {
	case <-x.Context().Done():
	case <-time.After(liveness):
		t.Error("the held message's context was not cancelled when its session ended")
	}
	// The next session starts (ElectionInterval 100 ms) and streams X again.
	time.Sleep(1500 * time.Millisecond)
	if got := hand.deliveries(); len(got) != 1 {
		t.Errorf("deliveries while the first copy of X is in the handler: %v, want only the first", got)
	}
	close(release)
	waitFor(t, 10*time.Second, "X+1 delivered", func() bool { return hand.count(ids[1]) > 0 })
	for range 2 { // X again, X+1
		select {
		case ok := <-ctxEnded:
			if !ok {
				t.Errorf("a message's context still live %s after its ack", liveness)
			}
		case <-time.After(liveness + time.Minute):
			t.Fatal("the acked messages' contexts were not checked")
		}
	}
	hand.mu.Lock()
	defer hand.mu.Unlock()
	if len(hand.overlap) > 0 {
		t.Errorf("two copies of a key in the consumer's hands: %v", hand.overlap)
	}
	if want := []string{ids[0].String(), ids[0].String(), ids[1].String()}; strings.Join(hand.log, ",") != strings.Join(want, ",") {
		t.Errorf("deliveries %v, want X, X again, X+1", hand.log)
	}
}

// waitRecorded waits until the relay of tbl has recorded (in its progress
// table, which a restart starts from) a position at or past the WAL
// written so far.
func waitRecorded(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) {
	t.Helper()
	ctx := context.Background()
	var target string
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		t.Fatal(err)
	}
	waitFor(t, liveness, "the relay's progress recorded past "+target, func() bool {
		var past bool
		if err := pool.QueryRow(ctx, `SELECT COALESCE((SELECT confirmed_lsn >= $2::pg_lsn FROM `+tbl.WALProgressTable()+` WHERE slot = $1), false)`,
			schema.WALSlotName(tbl), target).Scan(&past); err != nil {
			t.Fatal(err)
		}
		return past
	})
}

// heldBy waits until key is held by event id in the WAL holds table.
func heldBy(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id uuid.UUID) {
	t.Helper()
	waitFor(t, 10*time.Second, "the key held by "+id.String(), func() bool {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.HoldsTable()+` WHERE event_id = $1 AND resolved_at IS NULL`, id).Scan(&n)
		return err == nil && n == 1
	})
}

// TestWALSkipWhileReplayInFlight (item 7): a dead row holds its key; the
// operator replays it and, while the replay is in a handler, skips it. The
// key's parked rows are all delivered, in order, once each, and the hold
// ends (it used to stay draining with a row lost).
func TestWALSkipWhileReplayInFlight(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "sr", "sr", "sr")
	var (
		mu      sync.Mutex
		dead    = true
		inReply = make(chan struct{})
		release = make(chan struct{})
		once    sync.Once
	)
	rec := newRecorder()
	s := relay(t, pool, tbl, nil)
	rec.consume(t, s, func(msg *message.Message) error {
		if msg.UUID != ids[0].String() {
			return nil
		}
		mu.Lock()
		d := dead
		mu.Unlock()
		if d {
			return subscriber.Permanent(errors.New("poison"))
		}
		once.Do(func() { close(inReply) })
		<-release
		return nil
	})
	heldBy(t, pool, tbl, ids[0])
	mu.Lock()
	dead = false
	mu.Unlock()
	if _, err := runbook.New(pool, tbl).ReplayEvent(ctx, ids[0], runbook.ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inReply:
	case <-time.After(liveness):
		t.Fatal("the replay was not delivered")
	}
	if _, err := pool.Exec(ctx, sqlq.WALSkipHold(tbl), ids[0].String()); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond) // the relay's ticks see the skip and drain behind the replay
	close(release)
	rec.waitAcked(t, ids, 10*time.Second)
	waitFor(t, 10*time.Second, "the hold resolved", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()+` WHERE resolved_at IS NULL`).Scan(&n)
		return err == nil && n == 0
	})
	time.Sleep(300 * time.Millisecond)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	order := rec.byKey["sr"]
	for i := 1; i < len(order); i++ {
		if order[i] <= order[i-1] {
			t.Errorf("key delivered out of order: %v", order)
		}
	}
	for _, id := range ids {
		if rec.acked[id.String()] != 1 {
			t.Errorf("event %s acked %d times, want once", id, rec.acked[id.String()])
		}
	}
}

// TestWALEarlierDeadRowKeepsHold (item 12): a row of a key goes dead while
// a later row of the key already holds it (a copy delivered again): the
// later row keeps the hold.
func TestWALEarlierDeadRowKeepsHold(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "eh", "eh")
	cols, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	q := sqlq.NewWALQueries(tbl, cols)
	rowID := func(ev uuid.UUID) string {
		var id string
		if err := pool.QueryRow(ctx, `SELECT id::text FROM `+tbl.Sanitize()+` WHERE event_id = $1`, ev).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// The statements are fenced by a replication session on the slot.
	fence := holdSlot(t, pool, tbl)
	var changed, held int
	var ok bool
	if err := pool.QueryRow(ctx, q.MarkDeadHold, append([]any{rowID(ids[1]), 3, "later", "eh"}, fence...)...).Scan(&changed, &held, &ok); err != nil || changed != 1 || held != 1 || !ok {
		t.Fatalf("later row dead: changed %d held %d fence ok %v, %v", changed, held, ok, err)
	}
	if err := pool.QueryRow(ctx, q.MarkDeadHold, append([]any{rowID(ids[0]), 3, "earlier", "eh"}, fence...)...).Scan(&changed, &held, &ok); err != nil || changed != 1 || held != 0 || !ok {
		t.Fatalf("earlier row dead: changed %d held %d fence ok %v, %v; want the row dead and the hold kept", changed, held, ok, err)
	}
	var holder uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT event_id FROM `+tbl.HoldsTable()+` WHERE ordering_key = 'eh'`).Scan(&holder); err != nil {
		t.Fatal(err)
	}
	if holder != ids[1] {
		t.Fatalf("the key is held by %s, want the later dead row %s", holder, ids[1])
	}
}

// TestWALReplayOfSkippedRowWhileTombstoned (item 11): a skipped row is
// replayed while its hold's tombstone lasts; the replay is delivered.
func TestWALReplayOfSkippedRowWhileTombstoned(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "rt", "rt")
	// A row of another key stays in its handler: the confirmed position
	// stays before it, so the tombstone (until the position passes the
	// drain) lasts.
	blocker := enqueue(t, pool, tbl, "blocker")
	unblock := make(chan struct{})
	defer close(unblock)
	var mu sync.Mutex
	poison := true
	rec := newRecorder()
	s := relay(t, pool, tbl, nil)
	rec.consume(t, s, func(msg *message.Message) error {
		if msg.UUID == blocker[0].String() {
			<-unblock
			return nil
		}
		mu.Lock()
		defer mu.Unlock()
		if msg.UUID == ids[0].String() && poison {
			return subscriber.Permanent(errors.New("poison"))
		}
		return nil
	})
	heldBy(t, pool, tbl, ids[0])
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, ids[0], false); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, ids[1:], 15*time.Second)
	waitFor(t, 10*time.Second, "the skipped row's tombstone", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()+` WHERE resolved_at IS NOT NULL`).Scan(&n)
		return err == nil && n == 1
	})
	mu.Lock()
	poison = false
	mu.Unlock()
	rep, err := runbook.New(pool, tbl).ReplayEvent(ctx, ids[0], runbook.ReplayOptions{})
	if err != nil || rep.Changed != 1 {
		t.Fatalf("replay: %+v, %v", rep, err)
	}
	rec.waitAcked(t, ids[:1], 5*time.Second)
}

// TestWALCrashRestartKeepsSkip (item 10): a row is skipped and the relay
// moves past it; the server then crashes (immediate stop) before it saved
// the slot's confirmed position, so the slot streams those transactions
// again. The skipped row is not delivered, nor is anything delivered twice.
func TestWALCrashRestartKeepsSkip(t *testing.T) {
	t.Parallel()
	pool, tbl, pg := clusterPG(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "cr", "cr")
	var mu sync.Mutex
	poison := true
	rec := newRecorder()
	s := relay(t, pool, tbl, nil)
	rec.consume(t, s, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if msg.UUID == ids[0].String() && poison {
			return subscriber.Permanent(errors.New("poison"))
		}
		return nil
	})
	heldBy(t, pool, tbl, ids[0])
	if _, err := runbook.New(pool, tbl).SkipEvent(ctx, ids[0], false); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, ids[1:], 15*time.Second)
	more := enqueue(t, pool, tbl, "other")
	rec.waitAcked(t, more, 10*time.Second)
	waitFor(t, 15*time.Second, "the tombstone forgotten", func() bool {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM `+tbl.HoldsTable()).Scan(&n)
		return err == nil && n == 0
	})
	waitRecorded(t, pool, tbl) // progress recorded past everything
	mu.Lock()
	poison = false // a delivery of the skipped row would be acked, and seen
	mu.Unlock()
	pg.Crash()
	var after []uuid.UUID
	waitFor(t, 30*time.Second, "a write after the crash", func() bool {
		var err error
		after, err = enqueueErr(pool, tbl, false, "after") // the pool's old connections fail first
		return err == nil
	})
	rec.waitAcked(t, after, 30*time.Second)
	time.Sleep(500 * time.Millisecond)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if n := rec.acked[ids[0].String()]; n != 0 {
		t.Errorf("the skipped row was delivered %d times after the crash", n)
	}
	for _, id := range append(ids[1:], more...) {
		if n := rec.acked[id.String()]; n != 1 {
			t.Errorf("event %s delivered %d times, want once (settled before the crash)", id, n)
		}
	}
}

// TestWALRefusesSharedPublication (item 9): a publication that also
// publishes another table is refused by New and Setup, naming the fix; a
// table added to it while the relay runs is ignored (the relay used to
// stall on its rows).
func TestWALRefusesSharedPublication(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	rec := newRecorder()
	s := relay(t, pool, tbl, nil)
	rec.consume(t, s, nil)
	rec.waitAcked(t, enqueue(t, pool, tbl, "p"), 10*time.Second)
	names := walrelay.DefaultNames(tbl)
	if _, err := pool.Exec(ctx, `CREATE TABLE public.other_things (id int PRIMARY KEY, note text);
CREATE SCHEMA IF NOT EXISTS shadow;
CREATE TABLE shadow.wal_outbox (LIKE public.wal_outbox INCLUDING ALL);
ALTER PUBLICATION `+names.Publication+` ADD TABLE public.other_things, shadow.wal_outbox`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO public.other_things VALUES (1, 'x');
INSERT INTO shadow.wal_outbox (id, tenant_id, topic, payload, event_id) SELECT gen_random_uuid(), tenant_id, topic, payload, gen_random_uuid() FROM public.wal_outbox LIMIT 1`); err != nil {
		t.Fatal(err)
	}
	ids := enqueue(t, pool, tbl, "p", "q")
	rec.waitAcked(t, ids, 10*time.Second)
	if _, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl}, nil); !errors.Is(err, walrelay.ErrPublicationHasOtherTables) ||
		!strings.Contains(err.Error(), "other_things") {
		t.Errorf("New with a shared publication: %v, want ErrPublicationHasOtherTables naming the other table", err)
	}
	if _, err := walrelay.Setup(ctx, pool, tbl, walrelay.Names{}); !errors.Is(err, walrelay.ErrPublicationHasOtherTables) {
		t.Errorf("Setup with a shared publication: %v, want ErrPublicationHasOtherTables", err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if n := len(rec.acked); n != 3 {
		t.Errorf("%d events delivered, want the outbox's 3 (none of the other tables)", n)
	}
}

// TestWALSubscribeNamesAllTopics (item 17): the error of a topic other than
// subscriber.AllTopics names it as it is.
func TestWALSubscribeNamesAllTopics(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	s := relay(t, pool, tbl, nil)
	_, err := s.Subscribe(context.Background(), "orders")
	if err == nil || !strings.Contains(err.Error(), `subscriber.AllTopics ("`+subscriber.AllTopics+`")`) {
		t.Fatalf("Subscribe(orders): %v, want the error to name subscriber.AllTopics as %q", err, subscriber.AllTopics)
	}
}

// TestWALRefusesCachedSequence: a sequence with CACHE > 1 hands a key's
// rows sequence values out of commit order; New refuses it, naming the fix.
func TestWALRefusesCachedSequence(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `DO $$BEGIN EXECUTE format('ALTER SEQUENCE %s CACHE 10', pg_get_serial_sequence('`+tbl.Sanitize()+`', 'sequence')); END$$`); err != nil {
		t.Fatal(err)
	}
	_, err := walrelay.New(ctx, pool, walrelay.Config{Table: tbl}, nil)
	if !errors.Is(err, schema.ErrSequenceCached) || !strings.Contains(err.Error(), "CACHE 1") {
		t.Fatalf("New with a cached sequence: %v, want ErrSequenceCached naming CACHE 1", err)
	}
}

// TestWALTableStateIsTrue (issue 33, the WAL mode): a real WAL relay drives
// the table to a known mix (rows delivered, a dead row that holds its key,
// a row parked behind it, an unkeyed dead row); runbook.Runbook.Stats, Dead and
// Event report exactly that mix once the relay's horizon has passed the
// delivered rows: none of them pending, the parked row pending and waiting.
func TestWALTableStateIsTrue(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	ctx := context.Background()
	ids := enqueue(t, pool, tbl, "held", "held", "ok", "ok", "")
	poison := enqueue(t, pool, tbl, "")
	rec := newRecorder()
	s := relay(t, pool, tbl, nil)
	rec.consume(t, s, func(msg *message.Message) error {
		if msg.UUID == ids[0].String() || msg.UUID == poison[0].String() {
			return subscriber.Permanent(errors.New("boom"))
		}
		return nil
	})
	rec.waitAcked(t, []uuid.UUID{ids[2], ids[3], ids[4]}, 10*time.Second)
	heldBy(t, pool, tbl, ids[0])
	var st runbook.TableStats
	waitFor(t, 15*time.Second, "the stats of the mix", func() bool {
		var err error
		st, err = runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st.Pending == 1 && st.Dead == 2
	})
	if st.Mode != schema.ModeWAL || st.WaitingBehindHeldKeys != 1 || st.HeldKeys != 1 || st.DeadHeldKeys != 1 || st.Retrying != 0 || st.Locked != 0 {
		t.Errorf("stats %+v, want mode wal, 1 pending waiting behind 1 dead held key, 2 dead", st)
	}
	// The console's /api/counts is the same Stats.
	h, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, Token: "0123456789abcdef0123456789abcdef"})
	if err != nil {
		t.Fatal(err)
	}
	req := httptest.NewRequest(http.MethodGet, "/api/counts", nil)
	req.Header.Set("Authorization", "Bearer 0123456789abcdef0123456789abcdef")
	rec2 := httptest.NewRecorder()
	h.ServeHTTP(rec2, req)
	var counts map[string]struct {
		Stats runbook.TableStats `json:"stats"`
	}
	if err := json.NewDecoder(rec2.Body).Decode(&counts); err != nil {
		t.Fatal(err)
	}
	if cs := counts[tbl.String()].Stats; cs.Mode != st.Mode || cs.Pending != st.Pending || cs.Dead != st.Dead ||
		cs.WaitingBehindHeldKeys != st.WaitingBehindHeldKeys || cs.HeldKeys != st.HeldKeys {
		t.Errorf("console /api/counts %+v, runbook's Stats %+v", cs, st)
	}
	dead, err := runbook.New(pool, tbl).Dead(ctx, runbook.DeadFilter{})
	if err != nil || len(dead) != 2 {
		t.Fatalf("dead rows: %d, %v", len(dead), err)
	}
	for _, c := range []struct {
		id                        uuid.UUID
		delivered, dead, held, wb bool
	}{
		{ids[0], false, true, true, false},
		{ids[1], false, false, false, true},
		{ids[2], true, false, false, false},
		{ids[4], true, false, false, false},
		{poison[0], false, true, false, false},
	} {
		ev, err := runbook.New(pool, tbl).Event(ctx, c.id)
		if err != nil {
			t.Fatal(err)
		}
		if ev.Delivered != c.delivered || (ev.DeadAt != nil) != c.dead || ev.Held != c.held || (ev.WaitingBehind != nil) != c.wb {
			t.Errorf("event %s: delivered %v dead %v held %v waiting %v; want %v %v %v %v", c.id, ev.Delivered, ev.DeadAt != nil, ev.Held,
				ev.WaitingBehind != nil, c.delivered, c.dead, c.held, c.wb)
		}
	}
}

// TestWALMaxInFlightBoundsATransaction (item 15, the delivery half): one
// transaction of 50 rows over 50 keys with MaxInFlight 4 puts at most 4
// messages in the consumer's hands at once (it put all 50), and delivers
// them all.
func TestWALMaxInFlightBoundsATransaction(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	keys := make([]string, 50)
	for i := range keys {
		keys[i] = "m" + strconv.Itoa(i)
	}
	var mu sync.Mutex
	now, most := 0, 0
	rec := newRecorder()
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxInFlight = 4 })
	rec.consume(t, s, func(*message.Message) error {
		mu.Lock()
		now++
		most = max(most, now)
		mu.Unlock()
		time.Sleep(5 * time.Millisecond)
		mu.Lock()
		now--
		mu.Unlock()
		return nil
	})
	ids := enqueue(t, pool, tbl, keys...)
	rec.waitAcked(t, ids, 15*time.Second)
	mu.Lock()
	defer mu.Unlock()
	if most > 4 {
		t.Fatalf("%d messages in the consumer's hands at once, want at most MaxInFlight 4", most)
	}
}

// TestWALRetryingKeyDoesNotStopOthers (item 14): a key whose head waits
// for a long backoff, with a backlog larger than MaxInFlight behind it,
// does not stop the relay reading the stream: another key's row is
// delivered before the backoff ends (it waited for the backoff). "Before"
// is read from the order of the deliveries, not from the clock: the cold
// row is acked before the hot head comes back; the backoff is 10 s so that
// a loaded machine has time to read and deliver one row.
func TestWALRetryingKeyDoesNotStopOthers(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	const backoff = 10 * time.Second
	var mu sync.Mutex
	failed, retried := false, false
	var coldID string
	rec := newRecorder()
	hot := make([]string, 21)
	for i := range hot {
		hot[i] = "hot"
	}
	ids := enqueue(t, pool, tbl, hot...)
	s := relay(t, pool, tbl, func(c *walrelay.Config) {
		c.MaxInFlight = 8
		c.Backoff = func(int) time.Duration { return backoff }
	})
	rec.consume(t, s, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if msg.UUID == ids[0].String() {
			if !failed {
				failed = true
				return errors.New("transient")
			}
			if !retried {
				retried = true
				if coldID == "" || !rec.has(uuid.MustParse(coldID)) {
					t.Errorf("the hot key's head came back after its %s backoff before another key's row was delivered", backoff)
				}
			}
		}
		return nil
	})
	waitFor(t, 2*time.Minute, "the hot key's first failure", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return failed
	})
	start := time.Now()
	cold := enqueue(t, pool, tbl, "cold")
	mu.Lock()
	coldID = cold[0].String()
	mu.Unlock()
	rec.waitAcked(t, cold, 2*time.Minute)
	t.Logf("another key's row delivered %s after its commit (the hot key's backoff: %s)", time.Since(start).Round(time.Millisecond), backoff)
	rec.waitAcked(t, ids, 2*time.Minute)
	rec.mu.Lock()
	defer rec.mu.Unlock()
	order := rec.byKey["hot"]
	for i := 1; i < len(order); i++ {
		if order[i] <= order[i-1] {
			t.Fatalf("hot key out of order: %v", order)
		}
	}
}

// TestWALLargeTransactionIsNotBufferedWhole (item 15, the buffering half):
// one transaction of 3,000 rows over 10 keys, MaxInFlight 4, a consumer
// that takes 1 ms a message. The relay never holds more than MaxInFlight
// rows read and not settled (it held the whole transaction before its
// COMMIT was read), and delivers every row once, in order per key.
func TestWALLargeTransactionIsNotBufferedWhole(t *testing.T) {
	t.Parallel()
	pool, tbl := cluster(t)
	const n, inFlight = 3000, 4
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "big" + strconv.Itoa(i%10)
	}
	rec := newRecorder()
	s := relay(t, pool, tbl, func(c *walrelay.Config) { c.MaxInFlight = inFlight })
	rec.consume(t, s, func(*message.Message) error {
		time.Sleep(time.Millisecond)
		return nil
	})
	ids := enqueue(t, pool, tbl, keys...)
	rec.waitAcked(t, ids, 60*time.Second)
	if peak := walrelay.PeakRows(s); peak > inFlight {
		t.Errorf("%d rows held read and not settled at once, want at most MaxInFlight %d", peak, inFlight)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	total := 0
	for k, seqs := range rec.byKey {
		total += len(seqs)
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				t.Fatalf("key %s: sequence %d delivered after %d", k, seqs[i], seqs[i-1])
			}
		}
	}
	if total != n {
		t.Errorf("%d deliveries, want %d (each row once)", total, n)
	}
}
