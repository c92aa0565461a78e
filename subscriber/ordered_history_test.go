package subscriber_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestOrderedHistory is a randomized history checker for ordered mode.
// Relays join, close and are killed (Abandon) while producers commit on
// many keys (some transactions held open, some rolled back), handlers nack
// or fail permanently at random, and an operator skips and replays rows.
// Every delivery and every operator action is logged; at the end the log is
// checked against the promises of docs/ORDERING.md:
//
//  1. per key, first deliveries are in sequence order;
//  2. every committed row is delivered at least once, unless it was skipped
//     before its first delivery; no rolled-back row is delivered;
//  3. no row is delivered after its skip was acknowledged (beyond a read in
//     flight when the skip committed: skipGrace), unless replayed after it;
//  4. a nacked row is delivered again before any later row of its key,
//     unless it is skipped first;
//  5. a replayed row is delivered once more after its replay;
//  6. no key stays held without a dead or retrying row (at the end, once
//     the operator has dealt with the dead rows, no hold is left);
//  7. every partition's floor reaches its last row;
//  8. at no instant does a handler hold two messages of one key (checked
//     when each message is handed to a handler).
//
// Faults beside the churn of relays: database outages longer than the
// lease (the membership table locked for 2 x LockTTL, so every heartbeat
// hangs and the same relays take their partitions again), during which
// handlers hang too until their message's context is cancelled (the
// contract: a handler returns when its message's context ends); the
// cleaner with a retention of one millisecond; and transactions of
// hundreds of rows of one key.
//
// Size: ORDERED_HISTORY_EVENTS (default 2,000; `make ordered_history` runs
// 30,000). ORDERED_HISTORY_SEED replays a run's random choices (the
// interleaving of goroutines is not replayed).
func TestOrderedHistory(t *testing.T) {
	t.Parallel()
	events := 2000
	if v, err := strconv.Atoi(os.Getenv("ORDERED_HISTORY_EVENTS")); err == nil && v > 0 {
		events = v
	}
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("ORDERED_HISTORY_SEED"), 10, 64); err == nil {
		seed = v
	}
	h := newHistory(t, seed, events)
	h.run()
	h.check()
}

const skipGrace = 250 * time.Millisecond

type hRow struct {
	id        uuid.UUID
	key       string
	seq       int64
	committed bool
}

type hDelivery struct {
	n     int64 // log order
	at    time.Time
	id    string
	key   string
	seq   int64
	relay string
	nack  bool
	end   int64 // log order of the verdict
}

type hSkip struct {
	id   string
	req  int64 // logged before the call: the relay may act on it from then on
	n    int64 // logged once the call returned (acknowledged)
	done time.Time
}

type hReplay struct {
	id   string
	n    int64 // logged before the call
	held bool  // a retry of a held row (not a replay of a relayed one)
}

type history struct {
	t      *testing.T
	seed   uint64
	events int
	pool   *pgxpool.Pool
	tbl    schema.Table
	oq     *sqlq.OrderedQueries
	cfg    subscriber.Config
	clock  atomic.Int64

	mu         sync.Mutex
	rnd        *rand.Rand
	rows       map[string]*hRow // event_id -> row
	deliveries []hDelivery
	skips      []hSkip
	replays    []hReplay
	poison     map[string]bool // event_id -> always fails
	permanent  map[string]bool // event_id -> fails permanently once
	acked      map[string]bool
	healthy    atomic.Bool // end phase: handlers ack everything
	counts     map[string]int

	memoryBroken bool // checkMemory reported a broken invariant

	inHand   map[string]int // key -> messages in a handler now
	overlaps []string
	outage   atomic.Bool // the database "is down": handlers hang until their context ends
}

func newHistory(t *testing.T, seed uint64, events int) *history {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	cfg := orderedCfg(tbl)
	cfg.BatchSize = 10
	cfg.MaxAttempts = 3
	cfg.PollInterval = time.Second
	cfg.CloseTimeout = 200 * time.Millisecond
	return &history{t: t, seed: seed, events: events, pool: pool, tbl: tbl, cfg: cfg,
		oq:   sqlq.NewOrderedQueries(tbl, schema.Columns{TraceContext: true, Headers: true, OrderingKey: true}),
		rnd:  rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		rows: map[string]*hRow{}, poison: map[string]bool{}, permanent: map[string]bool{}, acked: map[string]bool{},
		counts: map[string]int{}, inHand: map[string]int{}}
}

func (h *history) intn(n int) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rnd.IntN(n)
}

func (h *history) count(what string) {
	h.mu.Lock()
	h.counts[what]++
	h.mu.Unlock()
}

// handle is every relay's handler: it logs the delivery and decides.
func (h *history) handle(relay string, msg *message.Message) {
	seq, _ := strconv.ParseInt(msg.Metadata.Get(schema.MetadataSequence), 10, 64)
	d := hDelivery{n: h.clock.Add(1), at: time.Now(), id: msg.UUID, key: msg.Metadata.Get(schema.MetadataOrderingKey), seq: seq, relay: relay}
	h.mu.Lock()
	if h.inHand[d.key] > 0 && len(h.overlaps) < 30 {
		h.overlaps = append(h.overlaps, fmt.Sprintf("key %s: sequence %d handed to %s while %d other message(s) of the key are in a handler (log %d)",
			d.key, seq, relay, h.inHand[d.key], d.n))
	}
	h.inHand[d.key]++
	fail, perm := false, false
	if !h.healthy.Load() {
		switch {
		case h.poison[msg.UUID]:
			fail = true
		case h.permanent[msg.UUID]:
			fail, perm = true, true
			delete(h.permanent, msg.UUID)
		default:
			fail = h.rnd.IntN(100) < 8
		}
	}
	slow := h.rnd.IntN(100) < 2
	h.mu.Unlock()
	switch {
	case h.outage.Load():
		// The handler's own calls hang like the relay's: it returns when
		// its message's context ends, or a while after the outage.
		h.count("handlers hung in an outage")
		for h.outage.Load() && msg.Context().Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		// Its calls time out and retry a while after the database is back.
		after := time.Now().Add(time.Duration(300+h.intn(1200)) * time.Millisecond)
		for time.Now().Before(after) && msg.Context().Err() == nil {
			time.Sleep(5 * time.Millisecond)
		}
		if msg.Context().Err() != nil {
			h.count("handlers released by their context")
			fail = true
		}
	case slow:
		time.Sleep(150 * time.Millisecond)
	default:
		time.Sleep(time.Duration(h.intn(3)) * time.Millisecond)
	}
	h.mu.Lock()
	h.inHand[d.key]--
	h.mu.Unlock()
	if fail {
		d.nack = true
		if perm {
			subscriber.RecordError(msg, subscriber.Permanent(errors.New("history: permanent failure")))
		}
		h.mu.Lock()
		d.end = h.clock.Add(1)
		h.deliveries = append(h.deliveries, d)
		h.mu.Unlock()
		msg.Nack()
		return
	}
	h.mu.Lock()
	d.end = h.clock.Add(1)
	h.deliveries = append(h.deliveries, d)
	h.acked[msg.UUID] = true
	h.mu.Unlock()
	msg.Ack()
}

type hRelay struct {
	name string
	pool *pgxpool.Pool
	sub  *subscriber.Subscriber
	done chan struct{}
}

func (h *history) startRelay(n int) *hRelay {
	t := h.t
	p := testdb.NewPool(t, nil)
	s, err := subscriber.New(context.Background(), p, h.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := s.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	r := &hRelay{name: "r" + strconv.Itoa(n), pool: p, sub: s, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		var wg sync.WaitGroup
		for msg := range ch {
			wg.Add(1)
			go func(msg *message.Message) {
				defer wg.Done()
				h.handle(r.name, msg)
			}(msg)
		}
		wg.Wait()
	}()
	h.count("relays started")
	return r
}

func (r *hRelay) stop(kill bool) {
	if kill {
		subscriber.Abandon(r.sub)
	}
	_ = r.sub.Close()
	<-r.done
	r.pool.Close()
}

// produce commits transactions of 1-3 keyed events until its share is
// written; some transactions stay open a while, some roll back.
func (h *history) produce(ctx context.Context, keys []string, share int) error {
	for written := 0; written < share; {
		n := 1 + h.intn(3)
		big := h.intn(200) == 0 // a transaction of hundreds of rows of one key
		if big {
			n = 200 + h.intn(200)
			h.count("large transactions")
		}
		bigKey := keys[h.intn(len(keys))]
		msgs := make([]publisher.Message, n)
		rows := make([]*hRow, n)
		for i := range msgs {
			k := keys[h.intn(len(keys))]
			if big {
				k = bigKey
			}
			id := uuid.New()
			msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.thing.changed.v1", EventID: id, Payload: json.RawMessage(`{}`), OrderingKey: k}
			rows[i] = &hRow{id: id, key: k}
		}
		roll := h.intn(100) < 5
		hold := time.Duration(0)
		if h.intn(100) < 5 {
			hold = time.Duration(50+h.intn(400)) * time.Millisecond
		}
		tx, err := h.pool.Begin(ctx)
		if err != nil {
			return err
		}
		seqs, err := publisher.EnqueueBatch(ctx, tx, h.tbl, msgs)
		if err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		time.Sleep(hold)
		h.mu.Lock()
		for i, r := range rows {
			r.seq = seqs[i]
			h.rows[r.id.String()] = r
			switch x := h.rnd.IntN(1000); {
			case x < 8:
				h.poison[r.id.String()] = true
			case x < 16:
				h.permanent[r.id.String()] = true
			}
		}
		h.mu.Unlock()
		if roll {
			if err := tx.Rollback(ctx); err != nil {
				return err
			}
			h.count("transactions rolled back")
			continue
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		h.mu.Lock()
		for _, r := range rows {
			r.committed = true
		}
		h.mu.Unlock()
		written += n
		time.Sleep(time.Duration(h.intn(25)) * time.Millisecond)
	}
	return nil
}

// operate skips or retries dead rows, skips some retrying rows, and
// replays rows already acked.
func (h *history) operate(ctx context.Context) {
	held, err := runbook.New(h.pool, h.tbl).HeldKeys(ctx, 0)
	if err != nil {
		if ctx.Err() == nil {
			h.t.Errorf("held keys: %v", err)
		}
		return
	}
	for _, k := range held {
		if k.EventID == "" || k.SkipRequestedAt != nil || (k.Replay && k.DeadAt == nil) {
			continue // a pending replay is left to the relay; a dead one needs the operator like any dead row
		}
		id := uuid.MustParse(k.EventID)
		switch {
		case k.DeadAt != nil && (h.healthy.Load() || h.intn(2) == 0):
			h.mu.Lock()
			delete(h.poison, k.EventID)
			h.mu.Unlock()
			n := h.clock.Add(1)
			if rep, err := runbook.New(h.pool, h.tbl).ReplayEvent(ctx, id, runbook.ReplayOptions{}); err == nil && rep.Changed == 1 {
				h.mu.Lock()
				h.replays = append(h.replays, hReplay{id: k.EventID, n: n, held: rep.Statement.SQL != h.oq.ReplayDone})
				h.counts["replays of dead rows"]++
				h.mu.Unlock()
			}
		case k.DeadAt != nil || h.intn(10) == 0:
			req := h.clock.Add(1)
			if sk, err := runbook.New(h.pool, h.tbl).SkipEvent(ctx, id, false); err == nil && sk.Changed == 1 {
				h.mu.Lock()
				h.skips = append(h.skips, hSkip{id: k.EventID, req: req, n: h.clock.Add(1), done: time.Now()})
				h.counts["skips"]++
				h.mu.Unlock()
			}
		}
	}
	if h.healthy.Load() || h.intn(3) != 0 {
		return
	}
	h.mu.Lock()
	var done []string
	for id := range h.acked {
		done = append(done, id)
	}
	h.mu.Unlock()
	if len(done) == 0 {
		return
	}
	sort.Strings(done)
	id := done[h.intn(len(done))]
	n := h.clock.Add(1)
	rep, err := runbook.New(h.pool, h.tbl).ReplayEvent(ctx, uuid.MustParse(id), runbook.ReplayOptions{})
	switch {
	case err == nil && rep.Changed == 1:
		h.mu.Lock()
		h.replays = append(h.replays, hReplay{id: id, n: n, held: rep.Statement.SQL != h.oq.ReplayDone})
		h.counts["replays of relayed rows"]++
		h.mu.Unlock()
	case errors.Is(err, runbook.ErrEventNotFound):
		h.count("replays refused (deleted by the cleaner)")
	case err != nil && !errors.Is(err, runbook.ErrNotRelayedYet) && !strings.Contains(err.Error(), "held"):
		h.t.Errorf("replay of %s: %v", id, err)
	default:
		h.count("replays refused (not relayed yet, or key held)")
	}
}

func (h *history) run() {
	t := h.t
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	keys := make([]string, 150)
	for i := range keys {
		keys[i] = "k" + strconv.Itoa(i)
	}
	start := time.Now()
	var relays []*hRelay
	next := 0
	defer func() {
		for _, r := range relays {
			r.stop(false)
		}
	}()
	for i := 0; i < 2; i++ {
		relays = append(relays, h.startRelay(next))
		next++
	}
	const producers = 4
	prodErr := make(chan error, producers)
	for i := 0; i < producers; i++ {
		go func() { prodErr <- h.produce(ctx, keys, h.events/producers) }()
	}
	finished := 0
	churn := time.NewTicker(400 * time.Millisecond)
	defer churn.Stop()
	op := time.NewTicker(150 * time.Millisecond)
	defer op.Stop()
	faults := time.NewTicker(1500 * time.Millisecond)
	defer faults.Stop()
	clean, err := cleaner.New(h.pool, cleaner.Config{Table: h.tbl, Retention: time.Millisecond, BatchSize: 500}, nil)
	if err != nil {
		t.Fatal(err)
	}
	outages := 0
	outageDone := make(chan struct{})
	close(outageDone)
	defer func() { <-outageDone }()
	for finished < producers {
		select {
		case <-faults.C:
			if _, _, err := clean.CleanOnce(ctx); err != nil && ctx.Err() == nil {
				t.Errorf("cleaner: %v", err)
			}
			h.count("cleaner passes")
			select {
			case <-outageDone:
			default:
				continue // an outage is under way
			}
			if outages == 0 || h.intn(3) == 0 { // at least one outage in every run
				outages++
				outageDone = make(chan struct{})
				go h.outageFor(ctx, 2*h.cfg.LockTTL, outageDone)
			}
		case err := <-prodErr:
			if err != nil {
				t.Fatalf("producer: %v (seed %d)", err, h.seed)
			}
			finished++
		case <-op.C:
			h.operate(ctx)
			h.checkMemory(relays)
		case <-churn.C:
			switch x := h.intn(10); {
			case len(relays) < 3 && x < 4:
				relays = append(relays, h.startRelay(next))
				next++
			case len(relays) > 1 && x < 7:
				i := h.intn(len(relays))
				relays[i].stop(false)
				relays = append(relays[:i], relays[i+1:]...)
				h.count("relays closed")
			case len(relays) > 1:
				i := h.intn(len(relays))
				relays[i].stop(true)
				relays = append(relays[:i], relays[i+1:]...)
				h.count("relays killed")
			}
		}
	}
	// End phase: handlers ack, the operator retries every dead row, and
	// the relays settle.
	h.healthy.Store(true)
	deadline := time.Now().Add(2 * time.Minute)
	for {
		h.operate(ctx)
		h.checkMemory(relays)
		if h.settled(ctx) {
			break
		}
		if time.Now().After(deadline) {
			dumpOrdered(t, h.pool, h.tbl)
			for _, r := range relays {
				t.Logf("%s in memory:\n%s", r.name, subscriber.DumpOrderedMemory(r.sub))
			}
			t.Errorf("history did not settle within 2 minutes after the producers finished (seed %d)", h.seed)
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	h.counts["relays alive at the end"] = len(relays)
	t.Logf("history of %s (seed %d)", time.Since(start).Round(time.Millisecond), h.seed)
}

// outageFor makes the database "unreachable" for the ordered relays for d:
// the membership table is locked, so every heartbeat hangs and the leases
// run out; handlers hang meanwhile (handle).
func (h *history) outageFor(ctx context.Context, d time.Duration, done chan struct{}) {
	defer close(done)
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		return
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `LOCK TABLE `+h.tbl.RelaysTable()+` IN ACCESS EXCLUSIVE MODE`); err != nil {
		return
	}
	h.outage.Store(true)
	h.count("database outages")
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	_ = tx.Rollback(context.Background())
	h.outage.Store(false)
}

// checkMemory checks the in-memory invariants of every live relay
// (subscriber.CheckOrderedMemory); the first broken one fails the test.
func (h *history) checkMemory(relays []*hRelay) {
	if h.memoryBroken {
		return
	}
	for _, r := range relays {
		if err := subscriber.CheckOrderedMemory(r.sub); err != nil {
			h.memoryBroken = true
			h.t.Errorf("%s: in-memory invariant broken: %v (seed %d)\n%s", r.name, err, h.seed, subscriber.DumpOrderedMemory(r.sub))
			return
		}
	}
}

// settled reports whether every expected delivery happened, no hold is
// left and every floor reached its partition's last row.
func (h *history) settled(ctx context.Context) bool {
	var holds, behind int
	err := h.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+h.tbl.HoldsTable()+`),
  (SELECT count(*) FROM (SELECT ordering_partition AS p, max(sequence) AS m FROM `+h.tbl.Sanitize()+`
     WHERE ordering_key IS NOT NULL GROUP BY 1) x JOIN `+h.tbl.PartitionsTable()+` pt ON pt.partition = x.p
   WHERE pt.floor_sequence < x.m)`).Scan(&holds, &behind)
	if err != nil {
		h.t.Fatal(err)
	}
	if holds > 0 || behind > 0 {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	skipped := map[string]bool{}
	for _, s := range h.skips {
		skipped[s.id] = true
	}
	for id, r := range h.rows {
		if r.committed && !h.acked[id] && !skipped[id] {
			return false
		}
	}
	return true
}

func (h *history) check() {
	t := h.t
	h.mu.Lock()
	defer h.mu.Unlock()
	var violations []string
	violate := func(format string, args ...any) {
		if len(violations) < 30 {
			violations = append(violations, fmt.Sprintf(format, args...))
		}
		h.counts["violations"]++
	}
	for _, o := range h.overlaps {
		violate("rule 8: %s", o)
	}
	dels := h.deliveries
	sort.Slice(dels, func(i, j int) bool { return dels[i].n < dels[j].n })
	byID := map[string][]hDelivery{}
	byKey := map[string][]hDelivery{}
	for _, d := range dels {
		byID[d.id] = append(byID[d.id], d)
		byKey[d.key] = append(byKey[d.key], d)
	}
	skipOf := map[string]hSkip{}
	for _, s := range h.skips {
		skipOf[s.id] = s
	}
	// 1. First deliveries per key in sequence order.
	for k, ds := range byKey {
		seen := map[string]bool{}
		last := int64(0)
		for _, d := range ds {
			if seen[d.id] {
				continue
			}
			seen[d.id] = true
			if d.seq <= last {
				violate("key %s: first delivery of sequence %d after %d", k, d.seq, last)
			}
			last = max(last, d.seq)
		}
	}
	// 2. Committed rows delivered (unless skipped first); rolled back never.
	committed, rolled := 0, 0
	for id, r := range h.rows {
		if !r.committed {
			rolled++
			if len(byID[id]) > 0 {
				violate("rolled-back row %s (key %s) delivered", id, r.key)
			}
			continue
		}
		committed++
		if len(byID[id]) == 0 {
			if _, ok := skipOf[id]; !ok {
				violate("committed row %s (key %s, sequence %d) never delivered", id, r.key, r.seq)
			}
		}
	}
	// 3. Nothing delivered after its skip was acknowledged, unless replayed.
	for id, s := range skipOf {
		for _, d := range byID[id] {
			if d.n < s.n || d.at.Sub(s.done) < skipGrace {
				continue
			}
			replayed := false
			for _, rp := range h.replays {
				if rp.id == id && rp.n > s.n && rp.n < d.n {
					replayed = true
				}
			}
			if !replayed {
				violate("row %s delivered %s after its skip was acknowledged", id, d.at.Sub(s.done).Round(time.Millisecond))
			}
		}
	}
	// 4. A nacked row is delivered again before any later row of its key.
	for k, ds := range byKey {
		for i, d := range ds {
			if !d.nack {
				continue
			}
			for _, e := range ds[i+1:] {
				if e.id == d.id {
					break
				}
				if e.seq > d.seq {
					if s, ok := skipOf[d.id]; ok && s.req < e.n {
						break
					}
					violate("key %s: sequence %d delivered after the nack of %d and before its redelivery; %s", k, e.seq, d.seq, h.keyTrace(ds, i))
					break
				}
			}
		}
	}
	// 5. A replayed row is delivered once more after its replay, unless it
	// is skipped first. A retry of a held row is satisfied by a delivery
	// whose verdict came after it (an attempt in flight when the operator
	// asked may succeed).
	for _, rp := range h.replays {
		again := false
		for _, d := range byID[rp.id] {
			if d.n > rp.n || (rp.held && d.end > rp.n) {
				again = true
				break
			}
		}
		for _, sk := range h.skips {
			if sk.id == rp.id && sk.req > rp.n {
				again = true // skipped after the replay, before the relay got to it
			}
		}
		if !again {
			var trace []string
			for _, d := range byID[rp.id] {
				trace = append(trace, fmt.Sprintf("%s:%d-%d nack=%v", d.relay, d.n, d.end, d.nack))
			}
			violate("row %s replayed at %d (retry of a held row: %v) but not delivered after the replay: %v", rp.id, rp.n, rp.held, trace)
		}
	}
	// 6 and 7 are what settled waits for: no hold left, floors at the end.
	dups, nacks := 0, 0
	for _, ds := range byID {
		dups += len(ds) - 1
		for _, d := range ds {
			if d.nack {
				nacks++
			}
		}
	}
	h.counts["violations"] += 0 // printed also when none
	h.counts["events committed"] = committed
	h.counts["events rolled back"] = rolled
	h.counts["deliveries"] = len(dels)
	h.counts["deliveries beyond the first"] = dups
	h.counts["nacks"] = nacks
	names := make([]string, 0, len(h.counts))
	for n := range h.counts {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "  %-48s %d\n", n, h.counts[n])
	}
	t.Logf("ordered history, seed %d:\n%s", h.seed, b.String())
	if len(violations) > 0 {
		t.Fatalf("%d violations (seed %d, rerun with ORDERED_HISTORY_SEED=%d):\n%s", h.counts["violations"], h.seed, h.seed,
			strings.Join(violations, "\n"))
	}
}

// keyTrace describes the deliveries of a key from the i-th on, and the
// operator's actions on their rows, for a violation's message.
func (h *history) keyTrace(ds []hDelivery, i int) string {
	var b strings.Builder
	ids := map[string]bool{}
	for j, d := range ds[i:] {
		if j == 8 {
			break
		}
		ids[d.id] = true
		fmt.Fprintf(&b, "[%s seq %d n %d-%d nack=%v] ", d.relay, d.seq, d.n, d.end, d.nack)
	}
	for _, s := range h.skips {
		if ids[s.id] {
			fmt.Fprintf(&b, "skip of %d at n %d-%d; ", h.rows[s.id].seq, s.req, s.n)
		}
	}
	for _, r := range h.replays {
		if ids[r.id] {
			fmt.Fprintf(&b, "replay (held=%v) of %d at n %d; ", r.held, h.rows[r.id].seq, r.n)
		}
	}
	return b.String()
}
