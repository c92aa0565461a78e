package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The tests of this file check the term fencing of ordered mode (issue 31,
// items 1-5): a delivery never outlives the partition lease it was made
// under, and nothing it does is written after that lease ended.

// inHand tracks the messages a consumer holds (delivered, neither acked nor
// nacked yet) per ordering key, and fails when a key has two.
type inHand struct {
	t       *testing.T
	mu      sync.Mutex
	held    map[string][]*message.Message
	log     []string // per delivery: key:sequence
	overlap []string
}

func newInHand(t *testing.T) *inHand {
	return &inHand{t: t, held: map[string][]*message.Message{}}
}

func (h *inHand) take(msg *message.Message) {
	k := msg.Metadata.Get(schema.MetadataOrderingKey)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.log = append(h.log, k+":"+msg.Metadata.Get(schema.MetadataSequence))
	if len(h.held[k]) > 0 {
		h.overlap = append(h.overlap, fmt.Sprintf("key %s: sequence %s delivered while sequence %s is in the handler", k,
			msg.Metadata.Get(schema.MetadataSequence), h.held[k][0].Metadata.Get(schema.MetadataSequence)))
	}
	h.held[k] = append(h.held[k], msg)
}

func (h *inHand) done(msg *message.Message) {
	k := msg.Metadata.Get(schema.MetadataOrderingKey)
	h.mu.Lock()
	defer h.mu.Unlock()
	kept := h.held[k][:0]
	for _, m := range h.held[k] {
		if m != msg {
			kept = append(kept, m)
		}
	}
	h.held[k] = kept
}

func (h *inHand) deliveries() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.log...)
}

func (h *inHand) check() {
	h.t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, o := range h.overlap {
		h.t.Error(o)
	}
}

// lockRelaysTable holds an ACCESS EXCLUSIVE lock on the membership table
// for d: every heartbeat of the table's ordered relays blocks, as in a
// database that stops answering for d.
func lockRelaysTable(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, d time.Duration) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE `+tbl.RelaysTable()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(d)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
}

// TestOrderedLostLeaseKeepsOneCopyPerKey (items 1 and 2): the heartbeats
// fail for longer than the lease while the handler holds row X of a key;
// the same relay takes the partition again. The held copy's context is
// cancelled when the term ends, no second copy of the key is handed out
// while it is in the handler, and its late verdict (a nack here) writes no
// hold: afterwards X and X+1 are delivered in order and nothing holds the
// key.
func TestOrderedLostLeaseKeepsOneCopyPerKey(t *testing.T) {
	t.Parallel()
	for _, lateNack := range []bool{false, true} {
		t.Run("nack="+strconv.FormatBool(lateNack), func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t)
			tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
			cfg := orderedCfg(tbl)
			s := orderedSub(t, pool, cfg)
			hand := newInHand(t)
			first := make(chan *message.Message, 1)
			release := make(chan struct{})
			ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
			if err != nil {
				t.Fatal(err)
			}
			var once sync.Once
			go func() {
				for msg := range ch {
					go func(msg *message.Message) {
						hand.take(msg)
						held := false
						once.Do(func() { held = true })
						if held {
							first <- msg
							<-release
							hand.done(msg)
							if lateNack {
								msg.Nack()
							} else {
								msg.Ack()
							}
							return
						}
						hand.done(msg)
						msg.Ack()
					}(msg)
				}
			}()
			evs := enqueueKeyed(t, pool, tbl, "term-k", "term-k")
			var x *message.Message
			select {
			case x = <-first:
			case <-time.After(2 * time.Minute):
				t.Fatal("row X not delivered")
			}
			if x.UUID != evs[0].event.String() {
				t.Fatalf("first delivery is %s, want row X %s", x.UUID, evs[0].event)
			}
			// The outage: longer than the lease (LockTTL 1 s).
			outage := make(chan struct{})
			go func() {
				defer close(outage)
				lockRelaysTable(t, pool, tbl, 2*cfg.LockTTL)
			}()
			// The term ends about a second in; 15 s allow a loaded machine
			// and stay below the handler's overrun (DispatchTimeout, 30 s),
			// which would cancel the context too.
			select {
			case <-x.Context().Done():
			case <-time.After(15 * time.Second):
				t.Error("the held message's context was not cancelled when its partition's term ended")
			}
			<-outage
			// The relay's heartbeats work again; X is still in the handler.
			time.Sleep(3 * cfg.LockTTL)
			if got := hand.deliveries(); len(got) != 1 {
				t.Errorf("deliveries while the first copy of X is in the handler: %v, want only the first", got)
			}
			close(release)
			deadline := time.Now().Add(2 * time.Minute)
			for {
				got := hand.deliveries()
				if n := len(got); n >= 2 && got[n-1] == "term-k:"+strconv.FormatInt(seqOf(t, pool, tbl, evs[1].event.String()), 10) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("X+1 not delivered after the first copy's verdict: %v", got)
				}
				time.Sleep(20 * time.Millisecond)
			}
			hand.check()
			got := hand.deliveries()
			if want := []string{got[0], got[0], got[len(got)-1]}; strings.Join(got, ",") != strings.Join(want, ",") {
				t.Errorf("deliveries %v, want X, X again (the first copy's term ended unanswered), X+1", got)
			}
			time.Sleep(300 * time.Millisecond)
			if n := holdCount(t, pool, tbl, "resolved_at IS NULL"); n != 0 {
				dumpOrdered(t, pool, tbl)
				t.Errorf("%d active holds after X and X+1 were acked, want 0 (a late nack of an ended term wrote one)", n)
			}
		})
	}
}

// seqOf reads the sequence of the row of event id.
func seqOf(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, id string) int64 {
	t.Helper()
	var seq int64
	if err := pool.QueryRow(context.Background(), `SELECT sequence FROM `+tbl.Sanitize()+` WHERE event_id = $1::uuid`, id).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	return seq
}

// TestOrderedTermFencesWrites (item 2): a nack or an advance made under an
// ended term is refused by the database even when the relay that made it
// owns the partition again (a later term).
func TestOrderedTermFencesWrites(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns(), schema.WithMode(schema.ModeOrdered)) // ordered mode's tables, no relay
	ctx := context.Background()
	cols, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	oq := sqlq.NewOrderedQueries(tbl, cols)
	evs := enqueueKeyed(t, pool, tbl, "fence-k", "fence-k")
	seq := seqOf(t, pool, tbl, evs[0].event.String())
	var part int
	if err := pool.QueryRow(ctx, `SELECT ordering_partition FROM `+tbl.Sanitize()+` WHERE event_id = $1::uuid`, evs[0].event).Scan(&part); err != nil {
		t.Fatal(err)
	}
	acquire := func() int64 {
		var p int
		var floor, epoch int64
		if err := pool.QueryRow(ctx, oq.Acquire, "relay-a", []int32{int32(part)}, 30.0).Scan(&p, &floor, &epoch); err != nil {
			t.Fatal(err)
		}
		return epoch
	}
	old := acquire()
	cur := acquire() // the same relay takes the partition again: a new term
	if cur != old+1 {
		t.Fatalf("terms %d then %d, want consecutive", old, cur)
	}
	var dead, skip bool
	var n int
	err = oq.Fail(sqlq.FailArgs{Relay: "relay-a", Partition: part, Key: "fence-k", Sequence: seq, LastError: "boom", MaxAttempts: 5, Backoff: 1.0, Epoch: old}).QueryRow(ctx, pool).Scan(&dead, &n, &skip)
	if !errors.Is(err, pgx.ErrNoRows) {
		t.Errorf("nack under the ended term %d: err %v, want no row (fenced)", old, err)
	}
	if n := holdCount(t, pool, tbl, "true"); n != 0 {
		t.Errorf("%d holds after a fenced nack, want 0", n)
	}
	if err := oq.Fail(sqlq.FailArgs{Relay: "relay-a", Partition: part, Key: "fence-k", Sequence: seq, LastError: "boom", MaxAttempts: 5, Backoff: 1.0, Epoch: cur}).QueryRow(ctx, pool).Scan(&dead, &n, &skip); err != nil {
		t.Fatalf("nack under the current term: %v", err)
	}
	var owned, resolved, deleted bool
	var next *int64
	if err := oq.Advance(sqlq.AdvanceArgs{Relay: "relay-a", Partition: part, Key: "fence-k", Sequence: seq, Bound: seq + 10, Epoch: old}).QueryRow(ctx, pool).Scan(&owned, &next, &resolved, &deleted); err != nil {
		t.Fatal(err)
	}
	if owned || next != nil || resolved {
		t.Errorf("advance under the ended term: owned %v next %v resolved %v, want refused", owned, next, resolved)
	}
	var renewed []int
	rows, err := pool.Query(ctx, oq.Renew, "relay-a", []int32{int32(part)}, []int64{seq}, 30.0, []int64{old})
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var p int
		if err := rows.Scan(&p); err != nil {
			t.Fatal(err)
		}
		renewed = append(renewed, p)
	}
	if len(renewed) != 0 {
		t.Errorf("renew under the ended term renewed %v, want nothing", renewed)
	}
}

// TestOrderedRefusesCachedSequence (item 3): a sequence with CACHE > 1
// hands out lower values later; ordered mode refuses it, naming the fix.
func TestOrderedRefusesCachedSequence(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `DO $$BEGIN EXECUTE format('ALTER SEQUENCE %s CACHE 20', pg_get_serial_sequence('`+tbl.Sanitize()+`', 'sequence')); END$$`); err != nil {
		t.Fatal(err)
	}
	_, err := subscriber.New(context.Background(), pool, orderedCfg(tbl), nil)
	if !errors.Is(err, schema.ErrSequenceCached) || !strings.Contains(err.Error(), "CACHE 1") {
		t.Fatalf("New with a cached sequence: %v, want ErrSequenceCached naming ALTER SEQUENCE ... CACHE 1", err)
	}
}

// TestOrderedLargeTransactionKeepsReadAhead (item 5): one transaction of
// 3,000 rows of one key commits while the relay watches its writer; the
// relay never holds more rows open than its read-ahead bound (4 x
// BatchSize, plus one rescan batch), and delivers them all in order.
func TestOrderedLargeTransactionKeepsReadAhead(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 20
	s := orderedSub(t, pool, cfg)
	rec := newRecorder()
	consume(t, s, rec, func(*message.Message) bool {
		time.Sleep(200 * time.Microsecond)
		return true
	})
	// A row of the key first, so that the relay scans past the writer
	// while it holds the key lock (a watch).
	head := enqueueKeyed(t, pool, tbl, "big-k")
	rec.waitAcked(t, head, 10*time.Second)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	keys := make([]string, 3000)
	for i := range keys {
		keys[i] = "big-k"
	}
	evs := enqueueKeyedTx(t, tx, tbl, keys...)
	// A later row of another key in the same partition moves the scan past
	// the open writer's range.
	enqueueKeyed(t, pool, tbl, sameSlot(t, pool, "big-k"))
	time.Sleep(500 * time.Millisecond)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	maxOpen := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		for !rec.isAcked(evs[len(evs)-1].event) {
			if n := subscriber.OrderedOpenRows(s); n > maxOpen {
				maxOpen = n
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	rec.waitAcked(t, evs, 60*time.Second)
	<-done
	rec.checkOrder(t)
	if bound := 4*cfg.BatchSize + cfg.BatchSize; maxOpen > bound {
		t.Errorf("up to %d rows open at once, want at most %d (read-ahead 4 x BatchSize plus one rescan batch)", maxOpen, bound)
	}
	t.Logf("at most %d rows open at once", maxOpen)
}

// enqueueKeyedTx enqueues the events of keys, in order, in tx.
func enqueueKeyedTx(t *testing.T, tx pgx.Tx, tbl schema.Table, keys ...string) []keyed {
	t.Helper()
	out := make([]keyed, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		out[i] = keyed{k, uuid.New()}
		msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: out[i].event,
			Payload: json.RawMessage(`{"n":1}`), OrderingKey: k}
	}
	if _, err := publisher.EnqueueBatch(context.Background(), tx, tbl, msgs); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestRelayModesDoNotMix (item 6): a default-mode relay on a table whose
// partitions ordered relays lease is refused, and so is an ordered relay on
// a table a default-mode relay works on (a rolling deploy that flips
// OUTBOX_RELAY_ORDERED waits for the old relays instead).
func TestRelayModesDoNotMix(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	def := subscriber.Config{Table: tbl, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond}
	o := orderedSub(t, pool, orderedCfg(tbl))
	consume(t, o, newRecorder(), nil)
	waitUntil(t, 5*time.Second, func() bool { return liveLeases(t, pool, tbl) > 0 })
	if _, err := subscriber.New(context.Background(), pool, def, nil); !errors.Is(err, schema.ErrRelayModeMix) || !strings.Contains(err.Error(), "OUTBOX_RELAY_ORDERED") {
		t.Errorf("default relay beside ordered relays: %v, want ErrRelayModeMix naming OUTBOX_RELAY_ORDERED", err)
	}
	if err := o.Close(); err != nil {
		t.Fatal(err)
	}
	d := orderedSub(t, pool, def) // a default-mode relay once the ordered ones stopped
	ch, err := d.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for msg := range ch {
			msg.Ack()
		}
	}()
	waitUntil(t, 5*time.Second, d.IsLeader)
	if _, err := subscriber.New(context.Background(), pool, orderedCfg(tbl), nil); !errors.Is(err, schema.ErrRelayModeMix) {
		t.Errorf("ordered relay beside a default-mode relay: %v, want ErrRelayModeMix", err)
	}
}

func liveLeases(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.PartitionsTable()+` WHERE lease_until > now()`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func waitUntil(t *testing.T, within time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(within); !cond(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s", within)
		}
	}
}

// TestOrderedGaugesAgreeWithRunbook (issue 33): the outbox_pending and
// outbox_dead gauges of an ordered relay read the table as the runbook
// does: rows the relay delivered (at or below a floor, or covered by a
// resolved hold) are not pending, a dead row that holds its key is dead,
// and the row waiting behind it is pending.
func TestOrderedGaugesAgreeWithRunbook(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	cfg := orderedCfg(tbl)
	cfg.Metrics = m
	cfg.MaxAttempts = 1
	cfg.StatsInterval = 100 * time.Millisecond
	s := orderedSub(t, pool, cfg)
	rec := newRecorder()
	evs := enqueueKeyed(t, pool, tbl, "g-dead", "g-ok", "g-ok", "g-dead", "g-ok")
	consume(t, s, rec, func(msg *message.Message) bool { return msg.UUID != evs[0].event.String() })
	rec.waitAcked(t, []keyed{evs[1], evs[2], evs[4]}, 10*time.Second)
	label := tbl.Qualified()
	waitUntil(t, 10*time.Second, func() bool {
		st, err := runbook.New(pool, tbl).Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		pending := testutil.ToFloat64(m.Pending.WithLabelValues(label))
		dead := testutil.ToFloat64(m.Dead.WithLabelValues(label))
		return st.Pending == 1 && st.Dead == 1 && pending == 1 && dead == 1
	})
}

// TestOrderedCutSeesLegacyWriters: during a rolling upgrade a writer of an
// earlier version takes the key lock in the name-hash class; the relay's
// cut still sees it, so its late row is not overtaken by a later row of its
// key that committed first.
func TestOrderedCutSeesLegacyWriters(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	s := orderedSub(t, pool, orderedCfg(tbl))
	rec := newRecorder()
	consume(t, s, rec, nil)
	k := "legacy-k"
	first := enqueueKeyed(t, pool, tbl, k)
	rec.waitAcked(t, first, 10*time.Second)
	// An old writer: the legacy class lock, its row inserted by hand.
	tx := legacyWriter(t, pool, tbl, k)
	late := uuid.New()
	if _, err := tx.Exec(ctx, `INSERT INTO `+tbl.Sanitize()+` (tenant_id, topic, payload, event_id, ordering_key) VALUES ($1, 'org.thing.changed.v1', '{}', $2, $3)`,
		tenant, late, k); err != nil {
		t.Fatal(err)
	}
	// Later rows of the partition commit and pass the relay's scan; then
	// a later row of the key itself (an upgraded writer waits for the lock,
	// so this one goes in with the old writer still open: a row of another
	// key of the same partition is enough to move the scan).
	other := enqueueKeyed(t, pool, tbl, sameSlot(t, pool, k))
	rec.waitAcked(t, other, 10*time.Second)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	next := enqueueKeyed(t, pool, tbl, k)
	rec.waitAcked(t, append([]keyed{{k, late}}, next...), 10*time.Second)
	rec.checkOrder(t)
}

// TestOrderedFullPartitionEndsWatches: rows of a key parked behind an open
// writer's watch fill the partition's read-ahead window (4 x BatchSize);
// when the writer ends, its watch ends although the partition is full, and
// the parked rows are delivered in order. The history checker found the
// stall: a full partition ended no watch, and nothing else could empty it.
func TestOrderedFullPartitionEndsWatches(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	ctx := context.Background()
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 5 // a window of 20 rows
	s := orderedSub(t, pool, cfg)
	rec := newRecorder()
	consume(t, s, rec, nil)
	k := "full-k"
	first := enqueueKeyed(t, pool, tbl, k)
	rec.waitAcked(t, first, 10*time.Second)
	// An old writer holds the key's lock in the legacy class: writers of
	// this version do not wait for it, and the relay's cut sees it.
	tx := legacyWriter(t, pool, tbl, k)
	// A row of another key of the partition moves the scan past the
	// writer: the relay watches the key's hash from there.
	other := enqueueKeyed(t, pool, tbl, sameSlot(t, pool, k))
	rec.waitAcked(t, other, 10*time.Second)
	// 30 rows of the key commit meanwhile: each is parked behind the watch,
	// and 20 of them fill the window.
	var parked []keyed
	for range 30 {
		parked = append(parked, enqueueKeyed(t, pool, tbl, k)...)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	rec.waitAcked(t, parked, 30*time.Second)
	rec.checkOrder(t)
}

// legacyWriter opens a transaction holding key's lock in the name-hash class
// of writers before the OID class (an old writer during a rolling upgrade);
// the test's end rolls it back if the test did not end it.
func legacyWriter(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, key string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1::int4, hashtext($2))`, sqlq.LegacyOrderingLockClass(tbl), key); err != nil {
		t.Fatal(err)
	}
	return tx
}
