package switchhistory_test

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// TestSwitchHistory is the cross-mode history checker of issue 54. One
// table on a private wal_level=logical cluster; writers commit events with
// and without ordering keys (each key belongs to one writer, so a key's
// commit order is its sequence order; some transactions roll back);
// relays of the three modes (the default table relay, ordered mode, the
// WAL relay) are started, closed, killed (the relay's database role loses
// LOGIN and its sessions are terminated: it can never write again, as after
// a SIGKILL) and have their sessions cut (terminated, the relay lives on);
// the table is switched between every pair of modes by the documented
// paths (schema.Migrate with WithMode for default and ordered,
// walrelay.Setup for wal) and by starting a relay of the other mode (a
// relay records its mode when it starts), sometimes with the old mode's
// relays still running. A refused switch is counted (ErrRelayModeMix: the
// old relays are stopped, then the switch is tried again; ErrKeysHeld: the
// operator resolves the holds with a relay of the old mode running, then
// the switch is tried again). An operator acts at random through package
// runbook: skips and replays of held rows, single and bulk replays of dead
// rows, replays of delivered rows, and the cleaner (retention 1 ms for
// delivered rows; dead rows kept). Handlers fail some events, decided by
// the seed, the event and its attempt: a few events fail for good until
// replayed (they go dead and, in the keyed modes, hold their key), others
// fail once or twice.
//
// Every delivery (event, relay, mode, time), operator action (with the
// time it was applied) and switch is recorded. The promises, checked while
// it runs (published rows, a sample of events read through runbook.Event,
// each hand-over) and at quiescence (every relay of the final mode
// drained; every event read through the runbook's state reader):
//
//   - lost: every committed event is delivered, skipped or dead, and read
//     as such by the runbook; none is deleted before it was delivered or
//     skipped; no rolled-back event is delivered;
//   - skip: a skipped event is never handed to a handler after its skip
//     was applied, unless replayed after it: when the skip call returned
//     for a skip recorded on the row at once (EventSkip.Applied), at the
//     row's skipped_at for a skip the call requested of the relay (a held
//     row of a keyed mode: the relay applies it, and a copy it handed out
//     before may still be in a handler); a skip applied last is final (the
//     event reads as skipped);
//   - dead: a dead event is never marked published, and no event is marked
//     published or read as delivered without a delivery;
//   - order: while the table is in a keyed mode, keyed events are first
//     delivered in sequence order per key (an earlier event is delivered,
//     skipped, or was left failing by a default relay, first);
//   - switch: no switch is accepted while a relay of another mode runs
//     (unless its sessions were cut: its locks are gone until they come
//     back) or a hold of either keyed mode is open; a relay of the old mode
//     left running claims nothing more: it delivers no event committed after
//     its mode ended.
//
// Duplicates (deliveries beyond the first, around handovers, kills and
// switches) are counted, not failures. Size: SWITCH_HISTORY_EVENTS
// (default 1,500) and SWITCH_HISTORY_SWITCHES (default 7; `make
// switch_history` runs 20,000 events and 32 switches). SWITCH_HISTORY_SEED
// replays a run's random choices (the interleaving of goroutines is not
// replayed); SWITCH_HISTORY_LOG=<file> writes the relays' log lines there.
func TestSwitchHistory(t *testing.T) {
	t.Parallel()
	events := envInt("SWITCH_HISTORY_EVENTS", 1500)
	switches := envInt("SWITCH_HISTORY_SWITCHES", 7)
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("SWITCH_HISTORY_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("switch history: seed %d (replay with SWITCH_HISTORY_SEED=%d), %d events, %d switches", seed, seed, events, switches)
	h := newHarness(t, seed, events, switches)
	h.run()
	h.check()
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

const (
	// relayLockTTL is the lease of the default and ordered relays.
	relayLockTTL = time.Second
	// settleWithin bounds every wait on a condition (a switch's
	// resolution, the final drain): generous, so that a slow machine only
	// waits longer.
	settleWithin = 3 * time.Minute
	writers      = 4
	// maxAttempts is every relay's MaxAttempts.
	maxAttempts  = 3
	keysPerWrite = 8
)

var modes = []schema.Mode{schema.ModeDefault, schema.ModeOrdered, schema.ModeWAL}

func keyed(m schema.Mode) bool { return m == schema.ModeOrdered || m == schema.ModeWAL }

// event is one event a writer wrote.
type event struct {
	id         uuid.UUID
	key        string // "" for an unkeyed event
	seq        int64
	committed  bool
	rolledBack bool
	// commitFrom is just before its transaction's COMMIT was sent: no
	// relay can have claimed it earlier.
	commitFrom time.Time
	gen        int         // replay generation: a doomed event fails only in generation 0
	attempts   map[int]int // per generation

	acks         int
	firstAck     time.Time
	firstAckBy   string
	firstAckMode schema.Mode
	handed       int
	// defaultDead is when a default relay failed it for good (a permanent
	// error, or the row's last attempt, as the row counts them: attempts
	// handed to a killed relay count): the default relay holds no key, so
	// later events of its key may pass it.
	defaultDead time.Time

	skipReqs []time.Time // before each skip call that recorded a skip
	skips    []time.Time // when each such call returned
	// onRow[i] is true when the i-th skip was recorded on the row at once
	// (EventSkip.Applied: applied when the call returned); false for a
	// request of the relay (a held row of a keyed mode), which the relay
	// applies later, writing skipped_at: check reads when.
	onRow   []bool
	replays []time.Time // before each replay call that changed the row
	lastOp  string      // "skip" or "replay": the last operator action that changed the row
}

// skippedAt reports whether a hand-over at `at` comes after a skip applied
// with no replay after it.
func (e *event) skippedAt(at time.Time) (time.Time, bool) {
	var last time.Time
	for i, s := range e.skips {
		if e.onRow[i] && s.Before(at) && s.After(last) {
			last = s
		}
	}
	if last.IsZero() {
		return time.Time{}, false
	}
	for _, r := range e.replays {
		if r.After(last) && r.Before(at) {
			return time.Time{}, false
		}
	}
	return last, true
}

type delivery struct {
	ev     *event
	relay  string
	mode   schema.Mode
	handed time.Time
	at     time.Time
	ok     bool
}

type switchRec struct {
	from, to schema.Mode
	path     string
	// begun is before the call that made the switch, at when it returned:
	// the switch committed in between.
	begun, at time.Time
	refusals  []string
	done      bool
}

type relay struct {
	name   string
	role   string
	mode   schema.Mode
	pool   *pgxpool.Pool
	sub    interface{ Close() error }
	killed bool // guarded by harness.mu
	// cut is set (guarded by harness.mu) once the relay's sessions were
	// terminated: until its connections come back, its locks are gone and a
	// switch of mode may be accepted beside it (the relay then claims
	// nothing more, which check judges).
	cut  bool
	done chan struct{}
}

type harness struct {
	t        *testing.T
	seed     uint64
	events   int
	switches int
	pg       *pgtest.Cluster
	pool     *pgxpool.Pool // the operator's and the writers' pool
	tbl      schema.Table
	rb       *runbook.Runbook
	clean    *cleaner.Cleaner
	rng      *rand.Rand // the controller's choices (one goroutine)

	allowed   atomic.Int64 // events the writers may write so far
	claimed   atomic.Int64
	committed atomic.Int64

	mu         sync.Mutex
	byID       map[uuid.UUID]*event
	byKey      map[string][]*event
	deliveries []delivery
	unanswered []delivery // handed to a relay killed before the verdict (for traces)
	counts     map[string]int
	violations map[string][]string
	vcount     map[string]int
	reported   map[string]bool // kind+event already reported
	switchLog  []switchRec

	mode      schema.Mode
	firstMode schema.Mode // the table's mode before the first switch
	relays    []*relay    // live relays (not killed, not closed)
	nextRelay int
	closing   sync.WaitGroup // background closes of killed relays
	lastPub   time.Time      // database time of the last check of published rows
	log       *os.File       // SWITCH_HISTORY_LOG, or nil
	// aborted is set when no relay of the recorded mode can start: the
	// history stops there (quiescence cannot come) and is checked as it is.
	aborted bool
}

func newHarness(t *testing.T, seed uint64, events, switches int) *harness {
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{
		"wal_level": "logical", "max_replication_slots": "10", "max_wal_senders": "20", "wal_sender_timeout": "10s",
		"max_connections": "300",
	}})
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	tbl := schema.MustParseTable("public.switch_outbox")
	if err := schema.Migrate(ctx, pool, tbl, schema.WithAllColumns()); err != nil {
		t.Fatal(err)
	}
	clean, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Millisecond, BatchSize: 500}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var log *os.File
	if path := os.Getenv("SWITCH_HISTORY_LOG"); path != "" {
		if log, err = os.Create(path); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = log.Close() })
	}
	return &harness{t: t, seed: seed, log: log, events: events, switches: switches, pg: pg, pool: pool, tbl: tbl,
		rb: runbook.New(pool, tbl), clean: clean, rng: rand.New(rand.NewPCG(seed, seed^0x5eed5eed5eed5eed)),
		byID: map[uuid.UUID]*event{}, byKey: map[string][]*event{}, counts: map[string]int{},
		violations: map[string][]string{}, vcount: map[string]int{}, reported: map[string]bool{}, mode: schema.ModeDefault}
}

func (h *harness) count(what string, n int) {
	h.mu.Lock()
	h.counts[what] += n
	h.mu.Unlock()
}

// violate records a broken promise; the caller holds h.mu. A kind is
// reported once per event.
func (h *harness) violate(kind string, e *event, format string, args ...any) {
	if e != nil {
		k := kind + "/" + e.id.String()
		if h.reported[k] {
			return
		}
		h.reported[k] = true
	}
	h.vcount[kind]++
	if len(h.violations[kind]) < 5 {
		msg := fmt.Sprintf(format, args...)
		if e != nil {
			msg = fmt.Sprintf("event %s (key %q, seq %d): %s; %s", e.id, e.key, e.seq, msg, h.trace(e))
		}
		h.violations[kind] = append(h.violations[kind], msg)
	}
}

// trace describes an event's history for a violation's message; the
// caller holds h.mu.
func (h *harness) trace(e *event) string {
	type item struct {
		at time.Time
		s  string
	}
	var items []item
	for _, d := range h.deliveries {
		if d.ev == e {
			v := "ack"
			if !d.ok {
				v = "fail"
			}
			items = append(items, item{d.handed, fmt.Sprintf("handed to %s (%s) -> %s", d.relay, d.mode, v)})
		}
	}
	for _, d := range h.unanswered {
		if d.ev == e {
			items = append(items, item{d.handed, fmt.Sprintf("handed to %s (%s) -> killed, no verdict", d.relay, d.mode)})
		}
	}
	for i, s := range e.skips {
		if e.onRow[i] {
			items = append(items, item{e.skipReqs[i], "skip requested"}, item{s, "skip applied"})
		} else {
			items = append(items, item{e.skipReqs[i], "skip requested of the relay"})
		}
	}
	for _, r := range e.replays {
		items = append(items, item{r, "replay requested"})
	}
	for _, s := range h.switchLog {
		if s.done {
			items = append(items, item{s.at, fmt.Sprintf("switch %s->%s (%s)", s.from, s.to, s.path)})
		}
	}
	sort.Slice(items, func(i, j int) bool { return items[i].at.Before(items[j].at) })
	var b strings.Builder
	b.WriteString("history:")
	shown := 0
	for _, it := range items {
		if strings.HasPrefix(it.s, "switch") && shown == 0 {
			continue // switches before the event's first action say little
		}
		if shown == 24 {
			b.WriteString(" ...")
			break
		}
		shown++
		fmt.Fprintf(&b, " [%s %s]", it.at.Format("15:04:05.000"), it.s)
	}
	return b.String()
}

// mix is the deterministic choice of the seed for an event.
func (h *harness) mix(id uuid.UUID, parts ...int) uint64 {
	f := fnv.New64a()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], h.seed)
	_, _ = f.Write(b[:])
	_, _ = f.Write(id[:])
	for _, p := range parts {
		binary.LittleEndian.PutUint64(b[:], uint64(int64(p)))
		_, _ = f.Write(b[:])
	}
	return f.Sum64()
}

// verdict decides an attempt of e, by the seed, the event, its replay
// generation and its attempt: 3% of the events fail for good until
// replayed (half of them with a permanent error), 5% of attempts 0 and 1
// fail once. The caller holds h.mu.
func (h *harness) verdict(e *event) (fail, permanent bool, attempt int) {
	attempt = e.attempts[e.gen]
	e.attempts[e.gen]++
	if e.gen == 0 && h.mix(e.id, -1)%1000 < 30 {
		return true, h.mix(e.id, -2)%2 == 0, attempt
	}
	return attempt < 2 && h.mix(e.id, e.gen, attempt)%100 < 5, false, attempt
}

// ---- writers

func (h *harness) write(ctx context.Context, w int) error {
	rng := rand.New(rand.NewPCG(h.seed+uint64(w)+1, uint64(w)*0x9e3779b97f4a7c15))
	tenant := uuid.MustParse("5e1f0000-0000-4000-8000-000000000001")
	for {
		n := 1 + rng.IntN(4)
		for {
			c := h.claimed.Load()
			if c >= int64(h.events) {
				return nil
			}
			if left := h.allowed.Load() - c; left > 0 {
				n = int(min(int64(n), left)) // the phase's last events: a smaller transaction
				if h.claimed.CompareAndSwap(c, c+int64(n)) {
					break
				}
				continue
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(10 * time.Millisecond):
			}
		}
		msgs := make([]publisher.Message, n)
		evs := make([]*event, n)
		for i := range msgs {
			var id uuid.UUID
			binary.LittleEndian.PutUint64(id[:8], rng.Uint64())
			binary.LittleEndian.PutUint64(id[8:], rng.Uint64())
			id[6] = id[6]&0x0f | 0x40
			id[8] = id[8]&0x3f | 0x80
			k := ""
			if rng.IntN(4) != 0 {
				k = fmt.Sprintf("w%dk%d", w, rng.IntN(keysPerWrite))
			}
			msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.switch.changed.v1", EventID: id, Payload: json.RawMessage(`{}`), OrderingKey: k}
			evs[i] = &event{id: id, key: k, attempts: map[int]int{}}
		}
		roll := rng.IntN(100) < 3
		pause := time.Duration(40+rng.IntN(80)) * time.Millisecond
		tx, err := h.pool.Begin(ctx)
		if err != nil {
			return err
		}
		seqs, err := publisher.EnqueueBatch(ctx, tx, h.tbl, msgs)
		if err != nil {
			_ = tx.Rollback(ctx)
			return err
		}
		// Registered before the commit: a relay may deliver an event before
		// the commit returns here.
		h.mu.Lock()
		commitFrom := time.Now()
		for i, e := range evs {
			e.seq = seqs[i]
			e.commitFrom = commitFrom
			h.byID[e.id] = e
			if e.key != "" {
				h.byKey[e.key] = append(h.byKey[e.key], e)
			}
		}
		h.mu.Unlock()
		if roll {
			err = tx.Rollback(ctx)
		} else {
			err = tx.Commit(ctx)
		}
		if err != nil {
			return err
		}
		h.mu.Lock()
		for _, e := range evs {
			e.committed, e.rolledBack = !roll, roll
		}
		if roll {
			h.counts["events rolled back"] += n
		}
		h.mu.Unlock()
		if roll {
			h.claimed.Add(-int64(n)) // the share is written again
		} else {
			h.committed.Add(int64(n))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(pause):
		}
	}
}

// ---- relays

// startRelay starts a relay of mode m under its own database role, so that
// kill can shut it out for good.
func (h *harness) startRelay(ctx context.Context, m schema.Mode) (*relay, error) {
	h.nextRelay++
	name := fmt.Sprintf("r%d", h.nextRelay)
	r := &relay{name: name + "-" + string(m), role: "relay_" + name, mode: m, done: make(chan struct{})}
	if _, err := h.pool.Exec(ctx, `CREATE ROLE `+r.role+` LOGIN SUPERUSER REPLICATION`); err != nil {
		return nil, fmt.Errorf("create role %s: %w", r.role, err)
	}
	cfg, err := pgxpool.ParseConfig(h.pg.URL("", ""))
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.User = r.role
	cfg.MaxConns = 8
	if r.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	var ch <-chan *message.Message
	switch m {
	case schema.ModeWAL:
		s, err := walrelay.New(ctx, r.pool, walrelay.Config{Table: h.tbl, MaxAttempts: maxAttempts, StatusInterval: 100 * time.Millisecond,
			ElectionInterval: 100 * time.Millisecond, CloseTimeout: time.Second, Backoff: func(int) time.Duration { return 20 * time.Millisecond }}, h.logger(r))
		if err != nil {
			r.pool.Close()
			return nil, err
		}
		r.sub = s
		ch, err = s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			_ = s.Close()
			r.pool.Close()
			return nil, err
		}
	default:
		s, err := subscriber.New(ctx, r.pool, subscriber.Config{Table: h.tbl, Ordered: m == schema.ModeOrdered, LockTTL: relayLockTTL,
			ElectionInterval: 100 * time.Millisecond, PollInterval: 100 * time.Millisecond, BatchSize: 50, MaxAttempts: maxAttempts,
			CloseTimeout: time.Second, Backoff: func(int) time.Duration { return 20 * time.Millisecond }}, h.logger(r))
		if err != nil {
			r.pool.Close()
			return nil, err
		}
		r.sub = s
		ch, err = s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			_ = s.Close()
			r.pool.Close()
			return nil, err
		}
	}
	go func() {
		defer close(r.done)
		var wg sync.WaitGroup
		for msg := range ch {
			wg.Add(1)
			go func() {
				defer wg.Done()
				h.handle(r, msg)
			}()
		}
		wg.Wait()
	}()
	h.mu.Lock()
	h.relays = append(h.relays, r)
	h.counts["relays started ("+string(m)+")"]++
	h.mu.Unlock()
	return r, nil
}

// logger is r's logger: nil (the relays' default) unless
// SWITCH_HISTORY_LOG names a file, which then gets every relay's lines at
// info level and above, each with the relay's name (to read a failing
// seed's history beside the relays' own account of it); with
// SWITCH_HISTORY_LOG_TRACE set, at debug and trace levels too.
func (h *harness) logger(r *relay) watermill.LoggerAdapter {
	if h.log == nil {
		return nil
	}
	trace := os.Getenv("SWITCH_HISTORY_LOG_TRACE") != ""
	return watermill.NewStdLoggerWithOut(h.log, trace, trace).With(watermill.LogFields{"relay": r.name})
}

// handle is every relay's handler: it records the delivery and decides.
func (h *harness) handle(r *relay, msg *message.Message) {
	handed := time.Now()
	id, err := uuid.Parse(msg.UUID)
	h.mu.Lock()
	e := h.byID[id]
	if err != nil || e == nil {
		h.violate("unknown event delivered", nil, "relay %s delivered message %s, which no writer wrote", r.name, msg.UUID)
		h.mu.Unlock()
		msg.Ack()
		return
	}
	e.handed++
	if e.rolledBack {
		h.violate("rolled-back event delivered", e, "handed to %s (%s)", r.name, r.mode)
	}
	if at, ok := e.skippedAt(handed); ok {
		h.violate("delivered after its skip was applied", e, "handed to %s (%s) %s after the skip applied, no replay since",
			r.name, r.mode, handed.Sub(at).Round(time.Millisecond))
	}
	h.mu.Unlock()
	if rand.IntN(50) == 0 {
		time.Sleep(time.Duration(50+rand.IntN(200)) * time.Millisecond)
	} else {
		time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
	}
	// The row's attempts as handed (the claim counted this one): a
	// default relay parks the row dead when this attempt fails, or, when
	// its process is killed before the verdict, at the next claim after
	// the lease. Attempts handed to a killed relay get no verdict, so the
	// harness's own count of them (verdict) may be lower than the row's.
	lastAttempt := false
	if n, err := strconv.Atoi(msg.Metadata.Get(schema.MetadataAttempts)); err == nil && n >= maxAttempts {
		lastAttempt = true
	}
	h.mu.Lock()
	if r.killed {
		// The process is gone: no verdict reaches anyone.
		if r.mode == schema.ModeDefault && lastAttempt && e.defaultDead.IsZero() {
			e.defaultDead = time.Now()
		}
		h.unanswered = append(h.unanswered, delivery{ev: e, relay: r.name, mode: r.mode, handed: handed, at: time.Now()})
		h.mu.Unlock()
		msg.Nack()
		return
	}
	fail, permanent, _ := h.verdict(e)
	now := time.Now()
	h.deliveries = append(h.deliveries, delivery{ev: e, relay: r.name, mode: r.mode, handed: handed, at: now, ok: !fail})
	if fail {
		if r.mode == schema.ModeDefault && e.defaultDead.IsZero() && (permanent || lastAttempt) {
			e.defaultDead = now
		}
	} else {
		if e.acks == 0 {
			e.firstAck, e.firstAckBy, e.firstAckMode = now, r.name, r.mode
		}
		e.acks++
	}
	h.mu.Unlock()
	if fail {
		err := errors.New("switch history: handler failed")
		if permanent {
			err = subscriber.Permanent(err)
		}
		subscriber.RecordError(msg, err)
		msg.Nack()
		return
	}
	msg.Ack()
}

// takeRelay removes r from the live relays.
func (h *harness) takeRelay(r *relay) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, x := range h.relays {
		if x == r {
			h.relays = append(h.relays[:i], h.relays[i+1:]...)
			return
		}
	}
}

// closeRelay closes r cleanly.
func (h *harness) closeRelay(r *relay) {
	h.takeRelay(r)
	_ = r.sub.Close()
	<-r.done
	r.pool.Close()
	h.count("relays closed ("+string(r.mode)+")", 1)
}

// killRelay stops r as a SIGKILL would: its role loses LOGIN and its
// sessions are terminated, so it never writes again (leases, acks and
// positions it held are left as they were); its handlers' verdicts are
// dropped. Its goroutines are closed in the background.
func (h *harness) killRelay(ctx context.Context, r *relay) {
	h.takeRelay(r)
	h.mu.Lock()
	r.killed = true
	h.mu.Unlock()
	h.exec(ctx, `ALTER ROLE `+r.role+` NOLOGIN`)
	h.terminate(ctx, r)
	h.count("relays killed ("+string(r.mode)+")", 1)
	h.closing.Add(1)
	go func() {
		defer h.closing.Done()
		_ = r.sub.Close()
		<-r.done
		r.pool.Close()
	}()
}

// cut ends r's sessions (a network partition that heals at once: the
// relay connects again).
func (h *harness) cut(ctx context.Context, r *relay) {
	h.mu.Lock()
	r.cut = true
	h.mu.Unlock()
	h.terminate(ctx, r)
	h.count("relay sessions cut", 1)
}

// terminate ends r's sessions and waits until they are gone.
func (h *harness) terminate(ctx context.Context, r *relay) {
	deadline := time.Now().Add(settleWithin)
	for {
		var left int
		err := h.pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = $1`, r.role).Scan(&left)
		if err == nil && left == 0 {
			return
		}
		if time.Now().After(deadline) {
			h.t.Errorf("the sessions of %s did not end within %s: %v", r.name, settleWithin, err)
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (h *harness) exec(ctx context.Context, sql string, args ...any) {
	if _, err := h.pool.Exec(ctx, sql, args...); err != nil {
		h.t.Errorf("%s: %v", sql, err)
	}
}

func (h *harness) live() []*relay {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]*relay(nil), h.relays...)
}

// liveOf lists the live relays of mode m.
func (h *harness) liveOf(m schema.Mode) []*relay {
	var out []*relay
	for _, r := range h.live() {
		if r.mode == m {
			out = append(out, r)
		}
	}
	return out
}

// stopRelays closes (or kills) every live relay.
func (h *harness) stopRelays(ctx context.Context, kill bool) {
	for _, r := range h.live() {
		if kill {
			h.killRelay(ctx, r)
		} else {
			h.closeRelay(r)
		}
	}
}

// ensureRelay starts a relay of the current mode when none runs, trying
// again until settleWithin (a killed ordered relay's leases run out first).
func (h *harness) ensureRelay(ctx context.Context) {
	if h.aborted || len(h.liveOf(h.mode)) > 0 {
		return
	}
	deadline := time.Now().Add(settleWithin)
	for {
		_, err := h.startRelay(ctx, h.mode)
		if err == nil {
			return
		}
		h.count("relay starts refused ("+string(h.mode)+")", 1)
		if time.Now().After(deadline) {
			h.mu.Lock()
			h.violate("no relay of the recorded mode can start", nil, "no %s relay could start within %s: %v", h.mode, settleWithin, err)
			h.mu.Unlock()
			h.aborted = true
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// ---- the operator

// resolveHolds skips or replays every held row (all when all, else each
// with some chance); it reports how many holds it saw.
func (h *harness) resolveHolds(ctx context.Context, all bool) int {
	held, err := h.rb.HeldKeys(ctx, 1000)
	if err != nil {
		h.count("operator reads failed", 1)
		return 0
	}
	for _, k := range held {
		if k.EventID == "" || k.SkipRequestedAt != nil {
			continue
		}
		id, err := uuid.Parse(k.EventID)
		if err != nil {
			continue
		}
		x := h.rng.IntN(10)
		switch {
		case !all && k.DeadAt == nil && x != 0:
			continue // a retrying key: mostly left to the relay
		case !all && x >= 8:
			continue
		case x < 5 && k.CanSkip():
			h.skip(ctx, id, "skips of held rows")
		case k.CanReplay():
			h.replay(ctx, id, "replays of held rows")
		case k.CanSkip():
			h.skip(ctx, id, "skips of held rows")
		}
	}
	return len(held)
}

func (h *harness) skip(ctx context.Context, id uuid.UUID, what string) {
	req := time.Now()
	res, err := h.rb.SkipEvent(ctx, id, false)
	if err != nil || res.Changed != 1 {
		h.count("skips refused", 1)
		return
	}
	done := time.Now()
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts[what]++
	if e := h.byID[id]; e != nil {
		e.skipReqs = append(e.skipReqs, req)
		e.skips = append(e.skips, done)
		e.onRow = append(e.onRow, res.Applied)
		e.lastOp = "skip"
	}
}

// replay replays one row. The event's replay generation is bumped before
// the call: from then on its handler accepts it.
func (h *harness) replay(ctx context.Context, id uuid.UUID, what string) {
	req := time.Now()
	h.mu.Lock()
	e := h.byID[id]
	if e != nil {
		e.gen++
	}
	h.mu.Unlock()
	res, err := h.rb.ReplayEvent(ctx, id, runbook.ReplayOptions{LockTTL: relayLockTTL})
	if err != nil || res.Changed != 1 {
		h.count("replays refused", 1)
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts[what]++
	if e != nil {
		e.replays = append(e.replays, req)
		e.lastOp = "replay"
	}
}

func (h *harness) replayDeadOne(ctx context.Context) {
	dead, err := h.rb.Dead(ctx, runbook.DeadFilter{Limit: 100})
	if err != nil || len(dead) == 0 {
		return
	}
	r := dead[h.rng.IntN(len(dead))]
	if h.rng.IntN(4) == 0 {
		h.skip(ctx, r.EventID, "skips of dead rows")
		return
	}
	h.replay(ctx, r.EventID, "single replays of dead rows")
}

func (h *harness) replayDeadBulk(ctx context.Context) {
	f := runbook.DeadFilter{AllTopics: true, Limit: 1 + h.rng.IntN(20), LockTTL: relayLockTTL}
	preview, err := h.rb.ReplayDead(ctx, f, true)
	if err != nil || preview.Rows == 0 {
		return
	}
	f.Expect = &preview.Snapshot
	req := time.Now()
	// Every dead row may be in the set: bump them all before the call.
	dead, _ := h.rb.Dead(ctx, runbook.DeadFilter{Limit: 1000})
	h.mu.Lock()
	for _, r := range dead {
		if e := h.byID[r.EventID]; e != nil {
			e.gen++
		}
	}
	h.mu.Unlock()
	res, err := h.rb.ReplayDead(ctx, f, false)
	if err != nil {
		h.count("bulk replays refused", 1)
		return
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts["bulk replays"]++
	h.counts["rows replayed in bulk"] += int(res.Rows)
	for _, id := range res.EventIDs {
		if e := h.byID[id]; e != nil {
			e.replays = append(e.replays, req)
			e.lastOp = "replay"
		}
	}
}

func (h *harness) replayDelivered(ctx context.Context) {
	h.mu.Lock()
	var acked []*event
	for _, d := range h.deliveries[max(0, len(h.deliveries)-500):] {
		if d.ok {
			acked = append(acked, d.ev)
		}
	}
	h.mu.Unlock()
	if len(acked) == 0 {
		return
	}
	h.replay(ctx, acked[h.rng.IntN(len(acked))].id, "replays of delivered rows")
}

// ---- the controller

func (h *harness) run() {
	t := h.t
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	werr := make(chan error, writers)
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := h.write(ctx, w); err != nil && ctx.Err() == nil {
				werr <- err
			}
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
		h.stopRelays(context.Background(), false)
		h.closing.Wait()
	}()
	// The first mode, chosen by the seed (not counted as a switch).
	if first := modes[h.rng.IntN(len(modes))]; first != schema.ModeDefault {
		if err := h.documented(ctx, first); err != nil {
			t.Fatalf("switch the new table to %s: %v", first, err)
		}
		h.mode = first
	}
	h.firstMode = h.mode
	h.ensureRelay(ctx)
	phases := h.switches + 1
	for p := 0; p < phases && !h.aborted; p++ {
		target := int64(h.events * (p + 1) / phases)
		h.allowed.Store(target)
		for step := 0; (h.committed.Load() < target || step < 3) && !h.aborted; step++ {
			select {
			case err := <-werr:
				t.Fatalf("writer: %v (seed %d)", err, h.seed)
			case <-time.After(60 * time.Millisecond):
			}
			h.chaos(ctx)
			if step%8 == 0 {
				h.checkRunning(ctx)
			}
		}
		if p < h.switches {
			h.switchMode(ctx)
			t.Logf("%s switch %d of %d ended: the table is in %s mode; %d events committed", time.Now().Format("15:04:05.000"), p+1, h.switches, h.mode, h.committed.Load())
		}
	}
	if h.aborted {
		t.Logf("history aborted after %d events: no %s relay can start", h.committed.Load(), h.mode)
		cancel()
	}
	wg.Wait()
	select {
	case err := <-werr:
		t.Fatalf("writer: %v (seed %d)", err, h.seed)
	default:
	}
	if h.aborted {
		return
	}
	h.settle(ctx)
	h.checkRunning(ctx)
	t.Logf("history of %s (seed %d)", time.Since(start).Round(time.Millisecond), h.seed)
}

// chaos is one random step of the operator or of the relays' lifecycle.
func (h *harness) chaos(ctx context.Context) {
	n := len(h.live())
	switch x := h.rng.IntN(100); {
	case x < 30:
		h.resolveHolds(ctx, false)
	case x < 42:
		h.replayDeadOne(ctx)
	case x < 46:
		h.replayDeadBulk(ctx)
	case x < 52:
		h.replayDelivered(ctx)
	case x < 58:
		if _, _, err := h.clean.CleanOnce(ctx); err != nil {
			h.count("cleaner passes failed", 1)
		} else {
			h.count("cleaner passes", 1)
		}
	case x < 64 && n < 3:
		if _, err := h.startRelay(ctx, h.mode); err != nil {
			h.count("relay starts refused ("+string(h.mode)+")", 1)
		}
	case x < 68 && n > 1:
		h.closeRelay(h.live()[h.rng.IntN(n)])
	case x < 72 && n > 0:
		h.killRelay(ctx, h.live()[h.rng.IntN(n)])
	case x < 77 && n > 0:
		h.cut(ctx, h.live()[h.rng.IntN(n)])
	}
	// A relay of an earlier mode, left running after a switch accepted
	// beside it while its sessions were cut, is closed some time later.
	for _, r := range h.live() {
		if r.mode != h.mode && h.rng.IntN(4) == 0 {
			h.closeRelay(r)
		}
	}
	h.ensureRelay(ctx)
}

// documented switches the table to m by the documented path (Migrate with
// WithMode; walrelay.Setup for wal).
func (h *harness) documented(ctx context.Context, m schema.Mode) error {
	if m == schema.ModeWAL {
		_, err := walrelay.Setup(ctx, h.pool, h.tbl, walrelay.Names{})
		return err
	}
	return schema.Migrate(ctx, h.pool, h.tbl, schema.WithAllColumns(), schema.WithMode(m))
}

// switchMode switches the table to another mode, by a path chosen by the
// seed, resolving refusals as their errors say.
func (h *harness) switchMode(ctx context.Context) {
	from := h.mode
	var to schema.Mode
	for to = from; to == from; {
		to = modes[h.rng.IntN(len(modes))]
	}
	path := "migrate"
	if to == schema.ModeWAL {
		path = "walrelay.Setup"
	}
	if h.rng.IntN(2) == 0 {
		path = "relay start"
	}
	pair := string(from) + "->" + string(to)
	rec := switchRec{from: from, to: to, path: path}
	if h.rng.IntN(3) != 0 {
		h.stopRelays(ctx, h.rng.IntN(3) == 0)
	} else if live := h.live(); len(live) > 0 && h.rng.IntN(2) == 0 {
		// A partition just before the switch: the relay's locks are gone
		// until its connections come back, and the switch may be accepted
		// beside it.
		h.cut(ctx, live[h.rng.IntN(len(live))])
	}
	refusedOnce := map[string]bool{}
	unlisted := 0 // rounds refused with ErrKeysHeld while the runbook listed no hold
	refuse := func(why string) {
		if !refusedOnce[why] {
			refusedOnce[why] = true
			rec.refusals = append(rec.refusals, why)
			h.count("switches refused "+pair+" ("+why+")", 1)
		}
	}
	deadline := time.Now().Add(settleWithin)
	for {
		running := h.live()
		open := h.openHolds(ctx)
		var err error
		rec.begun = time.Now()
		if path == "relay start" {
			_, err = h.startRelay(ctx, to)
			if errors.Is(err, walrelay.ErrNotSetUp) {
				path = "walrelay.Setup" // never set up: the relay's start cannot switch it
				rec.path = path
				err = h.documented(ctx, to)
			}
		} else {
			err = h.documented(ctx, to)
		}
		if err == nil {
			h.mu.Lock()
			var seen, cut []string // relays of another mode: with their locks, or cut
			for _, r := range running {
				switch {
				case r.mode == to:
				case r.cut:
					cut = append(cut, r.name)
				default:
					seen = append(seen, r.name)
				}
			}
			if len(cut) > 0 {
				h.counts["switches accepted beside a relay whose sessions were cut"]++
			}
			if len(seen) > 0 {
				h.violate("switch accepted beside a relay of another mode", nil, "%s by %s accepted while relay(s) %s of another mode ran", pair, path, strings.Join(seen, ", "))
			} else if len(open) > 0 {
				// No relay ran: the holds could not change meanwhile.
				h.violate("switch accepted over open holds", nil, "%s by %s accepted while %d hold(s) were open: %s", pair, path, len(open), strings.Join(open, ", "))
			}
			h.mu.Unlock()
			break
		}
		switch {
		case errors.Is(err, schema.ErrRelayModeMix):
			refuse("relay of another mode")
			h.stopRelays(ctx, false)
			time.Sleep(200 * time.Millisecond) // a killed ordered relay's leases run out
		case errors.Is(err, schema.ErrKeysHeld):
			refuse("keys held")
			if h.resolveFor(ctx, from) > 0 {
				unlisted = 0
			} else if unlisted++; unlisted == 3 {
				// What the refusal says to do cannot be done: abandon the
				// switch, the table stays in its mode.
				h.mu.Lock()
				h.violate("switch refused for holds the runbook does not list", nil, "%s by %s: %v; the runbook of the %s table lists no hold; open: %s",
					pair, path, err, from, strings.Join(h.openHolds(ctx), ", "))
				h.counts["switches abandoned "+pair]++
				h.switchLog = append(h.switchLog, rec)
				h.mu.Unlock()
				h.ensureRelay(ctx)
				return
			}
		default:
			refuse("other: " + firstLine(err))
			h.stopRelays(ctx, false)
			time.Sleep(200 * time.Millisecond)
		}
		if h.aborted {
			return
		}
		if time.Now().After(deadline) {
			h.mu.Lock()
			h.counts["switches abandoned "+pair]++
			h.switchLog = append(h.switchLog, rec)
			h.mu.Unlock()
			h.t.Errorf("switch %s by %s not done within %s: %v", pair, path, settleWithin, err)
			return
		}
	}
	rec.at, rec.done = time.Now(), true
	// The old mode's relays still running when the switch was accepted
	// beside them (their sessions were cut) are left running for a while
	// (chaos closes them): they must claim nothing more.
	h.mu.Lock()
	h.mode = to
	h.counts["switches done "+pair+" by "+rec.path]++
	h.switchLog = append(h.switchLog, rec)
	h.mu.Unlock()
	if got, ok, err := schema.RecordedMode(ctx, h.pool, h.tbl); err != nil || !ok || got.Mode != to {
		h.t.Errorf("after the switch %s the recorded mode is %+v (recorded %v, %v)", pair, got, ok, err)
	}
	h.ensureRelay(ctx)
	if h.rng.IntN(2) == 0 {
		if _, err := h.startRelay(ctx, to); err != nil {
			h.count("relay starts refused ("+string(to)+")", 1)
		}
	}
}

// openHolds lists the holds of either keyed mode not resolved (read from
// the holds table itself: a table in default mode has no reader of them).
func (h *harness) openHolds(ctx context.Context) []string {
	rows, err := h.pool.Query(ctx, `SELECT format('%s hold of key %s at seq %s (%s)', mode, ordering_key, sequence, state) FROM `+h.tbl.HoldsTable()+
		` WHERE resolved_at IS NULL ORDER BY sequence LIMIT 5`)
	if err != nil {
		return nil // no holds table yet
	}
	list, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil
	}
	return list
}

// resolveFor resolves every hold with a relay of mode from running (what
// ErrKeysHeld says to do), then stops the relays.
// It returns the number of holds the runbook listed first.
func (h *harness) resolveFor(ctx context.Context, from schema.Mode) int {
	h.ensureRelay(ctx)
	deadline := time.Now().Add(settleWithin)
	first := -1
	for time.Now().Before(deadline) && !h.aborted {
		n := h.resolveHolds(ctx, true)
		if first < 0 {
			first = n
		}
		if n == 0 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	h.stopRelays(ctx, false)
	return max(first, 0)
}

func firstLine(err error) string {
	s := err.Error()
	if i := strings.IndexAny(s, ":\n"); i > 0 {
		s = s[:i]
	}
	return s
}

// settle ends the history: the operator resolves every hold, and the
// relays of the final mode drain, until every committed event reads as
// delivered, skipped or dead, no hold is open, and the history has a
// delivery of every event read as delivered (or settleWithin passes; check
// then reports what is left).
func (h *harness) settle(ctx context.Context) {
	h.ensureRelay(ctx)
	deadline := time.Now().Add(settleWithin)
	for {
		h.resolveHolds(ctx, true)
		rows, err := h.states(ctx)
		if err == nil && h.quiet(ctx, rows) {
			return
		}
		if time.Now().After(deadline) {
			h.t.Logf("the relays of the final mode (%s) did not drain within %s", h.mode, settleWithin)
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
}

func (h *harness) quiet(ctx context.Context, rows map[uuid.UUID]runbook.Row) bool {
	st, err := h.rb.Stats(ctx)
	if err != nil || st.Pending > 0 || st.HeldKeys > 0 || st.SkipsRequested > 0 || st.ReplaysDue > 0 {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for id, e := range h.byID {
		if !e.committed {
			continue
		}
		r, ok := rows[id]
		switch {
		case !ok:
		case r.Skipped, r.DeadAt != nil:
		case r.Delivered && e.acks > 0:
		default:
			return false
		}
	}
	return true
}

// states reads every row through the runbook's state reader (ListRows).
func (h *harness) states(ctx context.Context) (map[uuid.UUID]runbook.Row, error) {
	rows := map[uuid.UUID]runbook.Row{}
	var after int64
	for {
		page, err := h.rb.ListRows(ctx, runbook.ListFilter{State: runbook.ListAll, After: after, Limit: 1000})
		if err != nil {
			return nil, err
		}
		for _, r := range page.Rows {
			rows[r.EventID] = r
		}
		if page.Next == 0 || len(page.Rows) == 0 {
			return rows, nil
		}
		after = page.Next
	}
}

// checkRunning checks what can be checked while the history runs: rows
// marked published, and a sample of events read through runbook.Event.
func (h *harness) checkRunning(ctx context.Context) {
	var now time.Time
	if err := h.pool.QueryRow(ctx, `SELECT now()`).Scan(&now); err != nil {
		return
	}
	since := h.lastPub.Add(-5 * time.Second)
	rows, err := h.pool.Query(ctx, `SELECT event_id, dead_at IS NOT NULL FROM `+h.tbl.Sanitize()+` WHERE published_at >= $1`, since)
	if err != nil {
		return
	}
	type pub struct {
		id   uuid.UUID
		dead bool
	}
	pubs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (pub, error) {
		var p pub
		return p, r.Scan(&p.id, &p.dead)
	})
	if err != nil {
		return
	}
	h.lastPub = now
	h.mu.Lock()
	for _, p := range pubs {
		e := h.byID[p.id]
		switch {
		case e == nil:
		case p.dead:
			h.violate("dead event marked published", e, "published_at and dead_at both set")
		case e.acks == 0:
			h.violate("published without a delivery", e, "published_at set, never delivered")
		}
	}
	var sample []*event
	for _, e := range h.byID {
		if e.committed && len(sample) < 10 {
			sample = append(sample, e)
		}
	}
	h.mu.Unlock()
	for _, e := range sample {
		r, err := h.rb.Event(ctx, e.id)
		if err != nil {
			continue
		}
		h.mu.Lock()
		h.checkRow(e, r, false)
		h.mu.Unlock()
	}
}

// checkRow checks the runbook's reading r of e against the history; final
// is set at quiescence. The caller holds h.mu.
func (h *harness) checkRow(e *event, r runbook.Row, final bool) {
	if r.Delivered && e.acks == 0 {
		h.violate("read as delivered without a delivery", e, "the runbook reads it delivered (published %v, dead %v, skipped %v)", r.PublishedAt != nil, r.DeadAt != nil, r.Skipped)
	}
	if r.Skipped && len(e.skipReqs) == 0 {
		h.violate("read as skipped without a skip", e, "the runbook reads it skipped; no operator skipped it")
	}
	if r.PublishedAt != nil && r.DeadAt != nil {
		h.violate("dead event marked published", e, "the runbook reads published_at and dead_at both set")
	}
	if r.PublishedAt != nil && e.acks == 0 {
		h.violate("published without a delivery", e, "published_at set, never delivered")
	}
	if !final || h.aborted {
		return
	}
	switch {
	case r.Skipped, r.DeadAt != nil:
	case r.Delivered:
	default:
		h.violate("lost: neither delivered, skipped nor dead at quiescence", e,
			"the runbook reads it pending (held %v, waiting behind %v, skip requested %v, replay due %v, attempts %d); %d acks",
			r.Held, r.WaitingBehind != nil, r.SkipRequested, r.ReplayDue, r.Attempts, e.acks)
	}
	if e.lastOp == "skip" && !r.Skipped && !h.ackedBeforeSkip(e) {
		h.violate("skip not final", e, "skipped last, the runbook reads it delivered=%v dead=%v", r.Delivered, r.DeadAt != nil)
	}
}

// ackedBeforeSkip reports whether a copy of e handed over after its last
// replay before its last skip request, and before that request, was acked:
// the hold the skip named was then resolved by that ack, and the event is
// delivered, not skipped. The caller holds h.mu.
func (h *harness) ackedBeforeSkip(e *event) bool {
	req := e.skipReqs[len(e.skipReqs)-1]
	var from time.Time
	for _, r := range e.replays {
		if r.Before(req) && r.After(from) {
			from = r
		}
	}
	for _, d := range h.deliveries {
		if d.ev == e && d.ok && d.handed.After(from) && d.handed.Before(req) {
			return true
		}
	}
	return false
}

// check runs the checks at quiescence and prints the counts.
func (h *harness) check() {
	t := h.t
	ctx := context.Background()
	rows, err := h.states(ctx)
	if err != nil {
		t.Fatalf("read the rows' states: %v", err)
	}
	skippedAt, err := h.skippedAt(ctx)
	if err != nil {
		t.Fatalf("read the rows' skipped_at: %v", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.checkRequestedSkips(skippedAt)
	committed := 0
	for id, e := range h.byID {
		if e.rolledBack {
			if _, ok := rows[id]; ok {
				h.violate("rolled-back event in the table", e, "the runbook lists it")
			}
			continue
		}
		if !e.committed {
			continue
		}
		committed++
		r, ok := rows[id]
		if !ok {
			if e.acks == 0 && len(e.skips) == 0 {
				h.violate("lost: deleted before it was delivered or skipped", e, "no row; never delivered, never skipped")
			}
			continue
		}
		h.checkRow(e, r, true)
	}
	// Order: while the table is in a keyed mode, first deliveries per key
	// in sequence order.
	for _, list := range h.byKey {
		evs := append([]*event(nil), list...)
		sort.Slice(evs, func(i, j int) bool { return evs[i].seq < evs[j].seq })
		for i, e := range evs {
			if !e.committed || e.acks == 0 || !keyed(e.firstAckMode) {
				continue
			}
			for _, p := range evs[:i] {
				if !p.committed {
					continue
				}
				if p.acks > 0 && p.firstAck.Before(e.firstAck) {
					continue
				}
				if len(p.skipReqs) > 0 && p.skipReqs[0].Before(e.firstAck) {
					continue
				}
				if !p.defaultDead.IsZero() && p.defaultDead.Before(e.firstAck) {
					continue // left dead by a default relay, which holds no key
				}
				h.violate("keyed events out of order", e, "first delivered by %s (%s) at %s before the earlier seq %d (%s) was delivered or skipped",
					e.firstAckBy, e.firstAckMode, e.firstAck.Format("15:04:05.000"), p.seq, p.id)
				break
			}
		}
	}
	h.checkFenced()
	dups, fails := 0, 0
	for _, d := range h.deliveries {
		if !d.ok {
			fails++
		}
	}
	for _, e := range h.byID {
		if e.acks > 1 {
			dups += e.acks - 1
		}
	}
	h.counts["events committed"] = committed
	h.counts["deliveries (handler verdicts)"] = len(h.deliveries)
	h.counts["deliveries failed by a handler"] = fails
	h.counts["duplicates (acks beyond the first)"] = dups
	total := 0
	for _, n := range h.vcount {
		total += n
	}
	h.counts["violations"] = total
	var b strings.Builder
	names := make([]string, 0, len(h.counts))
	for n := range h.counts {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(&b, "  %-60s %d\n", n, h.counts[n])
	}
	kinds := make([]string, 0, len(h.vcount))
	for k := range h.vcount {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	for _, k := range kinds {
		fmt.Fprintf(&b, "  violations: %-48s %d\n", k, h.vcount[k])
	}
	t.Logf("switch history, seed %d, final mode %s:\n%s", h.seed, h.mode, b.String())
	if total == 0 {
		return
	}
	var v strings.Builder
	for _, k := range kinds {
		fmt.Fprintf(&v, "%s (%d):\n", k, h.vcount[k])
		for _, s := range h.violations[k] {
			fmt.Fprintf(&v, "  - %s\n", s)
		}
	}
	t.Errorf("%d violations (seed %d; rerun with SWITCH_HISTORY_SEED=%d):\n%s", total, h.seed, h.seed, v.String())
}

// checkFenced: a relay claims nothing once its table was switched to
// another mode, even when the switch was accepted while its sessions were
// cut: no relay delivers an event whose commit came after its mode ended
// (a switch away from it returned) unless the table was in its mode again
// before the delivery. A mode's time is taken wide: from before the call
// that switched to it to when the call that switched away returned.
func (h *harness) checkFenced() {
	type period struct {
		mode     schema.Mode
		from, to time.Time // zero to: until the end
	}
	periods := []period{{mode: h.firstMode}}
	for _, sw := range h.switchLog {
		if !sw.done {
			continue
		}
		periods[len(periods)-1].to = sw.at
		periods = append(periods, period{mode: sw.to, from: sw.begun})
	}
	for _, d := range h.deliveries {
		e := d.ev
		inMode := false
		for _, p := range periods {
			if p.mode == d.mode && !d.handed.Before(p.from) && (p.to.IsZero() || !e.commitFrom.After(p.to)) {
				inMode = true
				break
			}
		}
		if !inMode {
			h.violate("delivered by a relay of a mode switched away before the event committed", e, "handed to %s (%s) at %s",
				d.relay, d.mode, d.handed.Format("15:04:05.000"))
		}
	}
}

// skippedAt reads when the skip of each skipped row was applied (the
// row's skipped_at, written by the operation or by the relay that applied
// a requested skip).
func (h *harness) skippedAt(ctx context.Context) (map[uuid.UUID]time.Time, error) {
	rows, err := h.pool.Query(ctx, `SELECT event_id, skipped_at FROM `+h.tbl.Sanitize()+` WHERE skipped_at IS NOT NULL`)
	if err != nil {
		return nil, err
	}
	out := map[uuid.UUID]time.Time{}
	for rows.Next() {
		var id uuid.UUID
		var at time.Time
		if err := rows.Scan(&id, &at); err != nil {
			rows.Close()
			return nil, err
		}
		out[id] = at
	}
	return out, rows.Err()
}

// checkRequestedSkips: an event whose skip a relay applied later (a
// requested skip) is not handed over after the relay applied it, with no
// replay since. Called under mu.
func (h *harness) checkRequestedSkips(skippedAt map[uuid.UUID]time.Time) {
	for _, d := range h.deliveries {
		e := d.ev
		if e == nil || !slices.Contains(e.onRow, false) {
			continue
		}
		at, ok := skippedAt[e.id]
		if !ok || !d.handed.After(at) {
			continue
		}
		replayed := false
		for _, r := range e.replays {
			if r.After(at) && r.Before(d.handed) {
				replayed = true
			}
		}
		if !replayed {
			h.violate("delivered after its skip was applied", e, "handed to %s (%s) %s after the relay applied the requested skip (skipped_at), no replay since",
				d.relay, d.mode, d.handed.Sub(at).Round(time.Millisecond))
		}
	}
}
