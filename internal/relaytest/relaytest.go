// Package relaytest is the conformance suite of the module's relays: the
// default relay (subscriber.New), ordered mode (subscriber.Config.Ordered)
// and the WAL relay (walrelay.New). Like Watermill's pubsub/tests and
// river's driver test suite, it states each promise of README.md,
// docs/ORDERING.md, docs/WAL.md and docs/RELIABILITY.md once, as a test
// that takes the relay under test as a Relay; each relay's package runs it
// from a small conformance_test.go:
//
//	func TestConformance(t *testing.T) { relaytest.Run(t, relaytest.Relay{...}) }
//
// A promise a mode does not make is skipped, with the reason in the skip.
//
// Every case runs on real PostgreSQL (the relay's Pool), in a fresh schema
// of its own, in parallel with the others. Cases wait on conditions with
// generous deadlines and assert on states and counts, never on how long
// something took; where a violation can only show in a window (a row that
// must not be delivered), the window is a fixed pause after the rows that
// must be delivered were, so a slow machine can miss a violation but never
// report a false one.
package relaytest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Mode names the relay mode under test.
type Mode int

// The modes.
const (
	// ModeDefault is subscriber.New without Ordered: row leases, no order.
	ModeDefault Mode = iota + 1
	// ModeOrdered is subscriber.New with Ordered: per-key order by
	// partitions and floors.
	ModeOrdered
	// ModeWAL is walrelay.New: logical replication.
	ModeWAL
)

func (m Mode) String() string {
	switch m {
	case ModeDefault:
		return "default"
	case ModeOrdered:
		return "ordered"
	case ModeWAL:
		return "wal"
	}
	return "mode(" + strconv.Itoa(int(m)) + ")"
}

// Options are the settings a case needs of the relay under test; New maps
// them onto the relay's Config. Zero fields take the suite's defaults
// (see withDefaults), never the relay's production defaults.
type Options struct {
	// MaxAttempts is after how many failed attempts a row is dead.
	MaxAttempts int
	// MaxInFlight bounds the messages handed out and not settled per
	// subscription. 0: the relay's default (the constructor may lower a
	// batch size to fit it).
	MaxInFlight int
	// CloseTimeout bounds how long Close waits for messages in flight.
	CloseTimeout time.Duration
	// DispatchTimeout is how long a handler may keep a message, for the
	// relays that have it (ignored by the others).
	DispatchTimeout time.Duration
	// DisableSingleActive lets several default relays share the table
	// (default mode only; ignored by the others).
	DisableSingleActive bool
	// Logger is the relay's logger; nil: none. The pause case reads it to
	// know when the relay has seen a pause (the relays promise to claim no
	// row of a paused topic from the wake-up that tells them of it).
	Logger watermill.LoggerAdapter
	// Backoff is the delay before every retry of a nacked row (the relay's
	// Config.Backoff returns it for every attempt).
	Backoff time.Duration
	// PollInterval, when set, is how long the relay sleeps when nothing
	// wakes it: its poll for due rows and every periodic tick of its own
	// that could look at rows. The adapters map it: the table relays'
	// PollInterval and ElectionInterval, and a LockTTL of 3 x it (ordered
	// mode's membership tick is LockTTL/3, the default relay's sweep
	// LockTTL/4); the WAL relay's StatusInterval and ElectionInterval.
	// 0: the adapters' short test intervals (polls and ticks of about
	// 100 ms).
	PollInterval time.Duration
}

func (o Options) withDefaults() Options {
	if o.MaxAttempts == 0 {
		o.MaxAttempts = 1000
	}
	if o.CloseTimeout == 0 {
		o.CloseTimeout = 2 * time.Second
	}
	if o.Logger == nil {
		o.Logger = watermill.NopLogger{}
	}
	if o.Backoff == 0 {
		o.Backoff = 20 * time.Millisecond
	}
	return o
}

// Relay describes the relay under test.
type Relay struct {
	// Name is the relay's name in messages.
	Name string
	// Mode is the relay's mode: it decides which promises the relay makes.
	Mode Mode
	// Pool returns a pool on the server the relay runs on (the shared
	// server, or a private wal_level=logical cluster shared by the cases).
	Pool func(t testing.TB) *pgxpool.Pool
	// Migrate are the optional columns of the relay's table (the default
	// relay: none; ordered mode and the WAL relay: schema.WithAllColumns).
	// The cases about switching and mixing modes use every column
	// whatever the relay.
	Migrate []schema.MigrateOption
	// SetUp makes a migrated table ready for the relay, as an operator
	// would before starting it (walrelay.Setup). Nil: nothing to do.
	SetUp func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) error
	// New returns a relay on tbl, not subscribed yet. The suite subscribes
	// it with subscriber.AllTopics and closes it when the case ends.
	New func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table, o Options) (message.Subscriber, error)
	// EndTerm, when set, ends the running relay's term on tbl without
	// closing the relay (the WAL relay: its replication session is
	// terminated), so that a copy in a handler outlives its term.
	EndTerm func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) error
	// Enqueue, when set, commits msgs into tbl in one transaction instead of
	// publisher.EnqueueBatch in pgx.BeginFunc (the default relay with its
	// hot path: subscriber.HotPath.BeginFunc), returning their sequences.
	Enqueue func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table, msgs []publisher.Message) ([]int64, error)
	// Asleep, when set, reports whether the running relay on tbl sleeps:
	// only a wake-up (a notification, its poll, a retry coming due) makes
	// it look at rows again (the table relays: they hold the table's idle
	// lock). A case that must act while the relay sleeps waits for it. Nil:
	// the relay has no such state to wait for (the WAL relay's loop waits
	// on its stream, its handlers' verdicts and its timers at all times).
	Asleep func(ctx context.Context, pool *pgxpool.Pool, tbl schema.Table) (bool, error)
}

func (r Relay) keyed() bool { return r.Mode == ModeOrdered || r.Mode == ModeWAL }

// Run runs every case of the suite against r, each as a parallel subtest.
func Run(t *testing.T, r Relay) {
	t.Helper()
	cases := []suiteCase{
		{"OrderThroughHandoverAndRestart", TestOrderThroughHandoverAndRestart},
		{"OneCopyPerKey", TestOneCopyPerKey},
		{"PauseAndResume", TestPauseAndResume},
		{"SkipHeld", TestSkipHeld},
		{"OneHoldsTable", TestOneHoldsTable},
		{"SkippedIsAState", TestSkippedIsAState},
		{"HandlerPastDispatchTimeout", TestHandlerPastDispatchTimeout},
		{"ReplayDead", TestReplayDead},
		{"BulkReplayWhileHoldDrains", TestBulkReplayWhileHoldDrains},
		{"CleanerRacingReplays", TestCleanerRacingReplays},
		{"MaxInFlight", TestMaxInFlight},
		{"BacklogBeforeSetUp", TestBacklogBeforeSetUp},
		{"SwitchFromDefault", TestSwitchFromDefault},
		{"SwitchEveryPair", TestSwitchEveryPair},
		{"ReplayedBelowTheFloor", TestReplayedBelowTheFloor},
		{"ReplayQueuedBehindADyingRow", TestReplayQueuedBehindADyingRow},
		{"TwoModesOnOneTable", TestTwoModesOnOneTable},
		{"RetryAfterBackoffWhileIdle", TestRetryAfterBackoffWhileIdle},
		{"KafkaKeyIsOrderingKey", TestKafkaKeyIsOrderingKey},
		{"SkippedNeverDelivered", TestSkippedNeverDelivered},
		{"PoisonCopyOfEveryDeadEvent", TestPoisonCopyOfEveryDeadEvent},
	}
	for _, c := range append(append(cases, crossings...), crossings7...) {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			c.fn(t, r)
		})
	}
}

// suiteCase is one case of the suite, by name.
type suiteCase struct {
	name string
	fn   func(*testing.T, Relay)
}

// ---- the fixture of one case ----

// env is one case's table, rows and relays.
type env struct {
	t      *testing.T
	r      Relay
	pool   *pgxpool.Pool
	tbl    schema.Table
	keys   bool // the table has the ordering_key column: rows are enqueued with their keys
	tenant uuid.UUID
	rec    *recorder

	stopOnce sync.Once
	stop     chan struct{} // closed before the relays close: handlers that wait return

	unorderedMu sync.Mutex
	unordered   map[message.Subscriber]bool // default-mode relays: no per-key promise, their deliveries count as unkeyed
}

// setup creates a fresh schema with an outbox table on r's server, with
// the columns r.Migrate asks for, or opts when given; setUp runs r.SetUp
// on it.
func setup(t *testing.T, r Relay, setUp bool, opts ...schema.MigrateOption) *env {
	t.Helper()
	pool := r.Pool(t)
	ctx := context.Background()
	var b [6]byte
	_, _ = rand.Read(b[:])
	sch := "rt_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{sch}.Sanitize()); err != nil {
		t.Fatalf("create schema: %v", err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{sch}.Sanitize()+` CASCADE`); err != nil {
			t.Logf("drop schema %s: %v", sch, err)
		}
	})
	tbl := schema.MustParseTable(sch + ".outbox")
	if opts == nil {
		opts = r.Migrate
	}
	if err := schema.Migrate(ctx, pool, tbl, opts...); err != nil {
		t.Fatalf("migrate %s: %v", tbl, err)
	}
	cols, err := schema.DetectColumns(ctx, pool, tbl)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, r: r, pool: pool, tbl: tbl, keys: cols.OrderingKey, tenant: uuid.New(), rec: newRecorder(), stop: make(chan struct{})}
	if setUp {
		e.setUp()
	}
	return e
}

func (e *env) setUp() {
	e.t.Helper()
	if e.r.SetUp == nil {
		return
	}
	if err := e.r.SetUp(context.Background(), e.pool, e.tbl); err != nil {
		e.t.Fatalf("set up %s for the %s relay: %v", e.tbl, e.r.Name, err)
	}
}

// event is one enqueued row.
type event struct {
	ID    uuid.UUID
	Key   string
	Topic string
	Seq   int64
}

func (ev event) String() string { return fmt.Sprintf("%s/%d", ev.Key, ev.Seq) }

const topicA = "org.relaytest.a.v1"

// enqueue commits one transaction with a row per key (key "" for none),
// of topic.
func (e *env) enqueue(topic string, keys ...string) []event {
	e.t.Helper()
	ctx := context.Background()
	evs := make([]event, len(keys))
	msgs := make([]publisher.Message, len(keys))
	for i, k := range keys {
		evs[i] = event{ID: uuid.New(), Key: k, Topic: topic}
		msgs[i] = publisher.Message{TenantID: e.tenant, Topic: topic, EventID: evs[i].ID, Payload: json.RawMessage(`{"n":1}`)}
		if e.keys {
			msgs[i].OrderingKey = k
		}
	}
	seqs, err := e.commit(ctx, msgs)
	if err != nil {
		e.t.Fatalf("enqueue: %v", err)
	}
	for i := range evs {
		evs[i].Seq = seqs[i]
	}
	return evs
}

// commit enqueues msgs in one transaction, through r.Enqueue when set.
func (e *env) commit(ctx context.Context, msgs []publisher.Message) ([]int64, error) {
	if e.r.Enqueue != nil {
		return e.r.Enqueue(ctx, e.pool, e.tbl, msgs)
	}
	var seqs []int64
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		var err error
		seqs, err = publisher.EnqueueBatch(ctx, tx, e.tbl, msgs)
		return err
	})
	return seqs, err
}

// handler decides a message: nil acks, an error nacks (recorded with
// subscriber.RecordError, so subscriber.Permanent sends it dead).
type handler func(ctx context.Context, m *message.Message) error

// relay is one started relay.
type relay struct {
	name string
	sub  message.Subscriber
	once sync.Once
}

func (r *relay) Close() error {
	var err error
	r.once.Do(func() { err = r.sub.Close() })
	return err
}

// start creates the relay under test and consumes its messages with h.
func (e *env) start(name string, o Options, h handler) *relay {
	e.t.Helper()
	rl, err := e.tryStart(name, o, h)
	if err != nil {
		e.t.Fatalf("start the %s relay %s: %v", e.r.Name, name, err)
	}
	return rl
}

// startOnceOtherModeGone is start for a relay that replaces one of the
// other mode: the old relay's session may end on the server a moment after
// its Close returned (a connection closed rather than unlocked), so a
// refusal with schema.ErrRelayModeMix is tried again until within passes.
func (e *env) startOnceOtherModeGone(name string, o Options, h handler, within time.Duration) *relay {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for {
		rl, err := e.tryStart(name, o, h)
		if err == nil {
			return rl
		}
		if !errors.Is(err, schema.ErrRelayModeMix) || time.Now().After(deadline) {
			e.t.Fatalf("start the %s relay %s: %v", e.r.Name, name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tryStart is start that returns New's and Subscribe's errors.
func (e *env) tryStart(name string, o Options, h handler) (*relay, error) {
	e.t.Helper()
	sub, err := e.newRelay(o)
	if err != nil {
		return nil, err
	}
	return e.consume(name, sub, h)
}

// newRelay creates the relay under test with o (its defaults filled in).
func (e *env) newRelay(o Options) (message.Subscriber, error) {
	sub, err := e.r.New(context.Background(), e.pool, e.tbl, o.withDefaults())
	if err == nil && e.r.Mode == ModeDefault {
		e.markUnordered(sub)
	}
	return sub, err
}

// markUnordered records that sub is a default-mode relay: it promises no
// order, so the recorder counts its deliveries as unkeyed (no order or
// one-copy-per-key check), although its messages carry their rows'
// ordering_key metadata.
func (e *env) markUnordered(sub message.Subscriber) {
	e.unorderedMu.Lock()
	defer e.unorderedMu.Unlock()
	if e.unordered == nil {
		e.unordered = map[message.Subscriber]bool{}
	}
	e.unordered[sub] = true
}

func (e *env) isUnordered(sub message.Subscriber) bool {
	e.unorderedMu.Lock()
	defer e.unorderedMu.Unlock()
	return e.unordered[sub]
}

// consume subscribes sub and runs h over its messages, one goroutine per
// message, so that keys (and a relay's MaxInFlight) run concurrently.
func (e *env) consume(name string, sub message.Subscriber, h handler) (*relay, error) {
	rl := &relay{name: name, sub: sub}
	e.t.Cleanup(func() { _ = rl.Close() })
	e.t.Cleanup(e.release) // runs first: handlers that wait return before Close waits for them
	ch, err := sub.Subscribe(context.Background(), subscriber.AllTopics)
	if err != nil {
		return nil, err
	}
	keyed := !e.isUnordered(sub)
	go func() {
		for m := range ch {
			go e.handle(name, m, h, keyed)
		}
	}()
	return rl, nil
}

func (e *env) release() { e.stopOnce.Do(func() { close(e.stop) }) }

func (e *env) handle(name string, m *message.Message, h handler, keyed bool) {
	d := e.rec.start(name, m, keyed)
	var err error
	if h != nil {
		err = h(m.Context(), m)
	}
	e.rec.end(name, d, err == nil)
	if err != nil {
		subscriber.RecordError(m, err)
		m.Nack()
		return
	}
	m.Ack()
}

// wait sleeps d, or less when the case ends.
func (e *env) wait(d time.Duration) {
	select {
	case <-time.After(d):
	case <-e.stop:
	}
}

// block waits until gate is closed or the case ends.
func (e *env) block(gate <-chan struct{}) {
	select {
	case <-gate:
	case <-e.stop:
	}
}

// ---- conditions ----

// eventually polls cond until it holds or within passes, then fails with
// what describe says.
func (e *env) eventually(within time.Duration, cond func() bool, describe func() string) {
	e.t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("not within %s: %s", within, describe())
		}
		select {
		case <-e.rec.changed:
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// waitAcked waits until every event of evs was acked at least once.
func (e *env) waitAcked(within time.Duration, evs ...event) {
	e.t.Helper()
	e.eventually(within, func() bool { return len(e.rec.notAcked(evs)) == 0 }, func() string {
		missing := e.rec.notAcked(evs)
		return fmt.Sprintf("%d of %d events not acked, first %s; %s", len(missing), len(evs), missing[0], e.rowStates(missing[:1]))
	})
}

// rowState is what the table says of one row: its columns, and the
// runbook's reading of them in the table's mode (runbook.Runbook.Event: in an
// ordered table a keyed row's dead state and attempts are its hold's).
type rowState struct {
	Found     bool
	Published bool // published_at set
	DeadAt    bool // dead_at set
	Attempts  int
	LastError string

	Delivered    bool   // runbook: delivered in the table's mode
	HoldDead     bool   // runbook: dead (dead_at, or a dead hold at the row)
	HoldAttempts int    // runbook: attempts (the hold's at a held row)
	Held         bool   // runbook: the row its key waits for
	Skipped      bool   // runbook: skipped by an operator (done, not delivered)
	RunbookError string // runbook: last_error (the hold's at a held row)
}

// Dead is true when the row is dead, by its column or by its hold.
func (s rowState) Dead() bool { return s.DeadAt || s.HoldDead }

func (s rowState) String() string {
	if !s.Found {
		return "not in the table"
	}
	return fmt.Sprintf("published_at=%t dead_at=%t attempts=%d last_error=%q; runbook: delivered=%t skipped=%t dead=%t held=%t attempts=%d last_error=%q",
		s.Published, s.DeadAt, s.Attempts, s.LastError, s.Delivered, s.Skipped, s.HoldDead, s.Held, s.HoldAttempts, s.RunbookError)
}

func (e *env) row(id uuid.UUID) rowState {
	e.t.Helper()
	var s rowState
	var le *string
	err := e.pool.QueryRow(context.Background(), `SELECT published_at IS NOT NULL, dead_at IS NOT NULL, attempts, last_error FROM `+e.tbl.Sanitize()+` WHERE event_id = $1`, id).
		Scan(&s.Published, &s.DeadAt, &s.Attempts, &le)
	if errors.Is(err, pgx.ErrNoRows) {
		return s
	}
	if err != nil {
		e.t.Fatalf("read row %s: %v", id, err)
	}
	s.Found = true
	if le != nil {
		s.LastError = *le
	}
	r, err := runbook.New(e.pool, e.tbl).Event(context.Background(), id)
	if errors.Is(err, runbook.ErrEventNotFound) {
		return rowState{}
	}
	if err != nil {
		e.t.Fatalf("runbook's Event %s: %v", id, err)
	}
	s.Delivered, s.HoldDead, s.HoldAttempts, s.Held, s.Skipped = r.Delivered, r.DeadAt != nil, r.Attempts, r.Held, r.Skipped
	if r.LastError != nil {
		s.RunbookError = *r.LastError
	}
	return s
}

func (e *env) rowStates(evs []event) string {
	var b strings.Builder
	for _, ev := range evs {
		fmt.Fprintf(&b, "row %s: %s; ", ev, e.row(ev.ID))
	}
	return b.String()
}

// holdState returns the state of the hold at ev's row, if any.
func (e *env) holdState(ev event) (runbook.HoldState, bool) {
	e.t.Helper()
	st, held, err := runbook.New(e.pool, e.tbl).HoldOfEvent(context.Background(), ev.ID)
	if err != nil {
		e.t.Fatalf("hold of %s: %v", ev, err)
	}
	return st, held
}

func (e *env) waitHold(within time.Duration, ev event, want runbook.HoldState) {
	e.t.Helper()
	e.eventually(within, func() bool { st, held := e.holdState(ev); return held && st == want }, func() string {
		st, held := e.holdState(ev)
		return fmt.Sprintf("hold of %s: held=%t state=%s, want %s; %s", ev, held, st, want, e.rowStates([]event{ev}))
	})
}

// ---- the recorder ----

// recorder keeps what the handlers saw, across the relays of a case.
type recorder struct {
	mu      sync.Mutex
	changed chan struct{}

	deliveries map[string]int       // event_id -> deliveries
	acks       map[string]int       // event_id -> acks
	byRelay    map[string]int       // relay -> deliveries
	first      map[string][]int64   // key -> sequences in the order of their first delivery
	ackOrder   map[string][]int64   // key -> sequences in the order of their first ack
	trace      map[string][]string  // key -> deliveries, for failures
	inHand     map[string]int       // key -> copies in handlers, all relays
	inHandOf   map[[2]string]int    // (relay, key) -> copies in handlers
	open       map[string]int       // relay -> messages in handlers
	maxOpen    map[string]int       // relay -> most messages in handlers at once
	overlaps   []string             // a key with two copies in handlers, all relays
	overlapsOf []string             // a key with two copies in one relay's handlers
	relayOf    map[string]string    // event_id -> relays that delivered it
	seen       map[string]time.Time // event_id -> first delivery
}

func newRecorder() *recorder {
	return &recorder{changed: make(chan struct{}, 1), deliveries: map[string]int{}, acks: map[string]int{}, byRelay: map[string]int{},
		first: map[string][]int64{}, ackOrder: map[string][]int64{}, trace: map[string][]string{}, inHand: map[string]int{},
		inHandOf: map[[2]string]int{}, open: map[string]int{}, maxOpen: map[string]int{}, relayOf: map[string]string{}, seen: map[string]time.Time{}}
}

// delivery is one message in a handler.
type delivery struct {
	id, key string
	seq     int64
}

// start records that relay handed m to a handler; keyed false (a
// default-mode relay) records it under no key.
func (r *recorder) start(relay string, m *message.Message, keyed bool) delivery {
	seq, _ := strconv.ParseInt(m.Metadata.Get(schema.MetadataSequence), 10, 64)
	d := delivery{id: m.UUID, seq: seq}
	if keyed {
		d.key = m.Metadata.Get(schema.MetadataOrderingKey)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.deliveries[d.id]++
	r.byRelay[relay]++
	if !strings.Contains(r.relayOf[d.id], relay+" ") {
		r.relayOf[d.id] += relay + " "
	}
	if _, ok := r.seen[d.id]; !ok {
		r.seen[d.id] = time.Now()
		r.first[d.key] = append(r.first[d.key], seq)
	}
	r.trace[d.key] = append(r.trace[d.key], fmt.Sprintf("%s:%d/a%s", relay, seq, m.Metadata.Get(schema.MetadataAttempts)))
	r.open[relay]++
	if r.open[relay] > r.maxOpen[relay] {
		r.maxOpen[relay] = r.open[relay]
	}
	if d.key != "" {
		r.inHand[d.key]++
		r.inHandOf[[2]string{relay, d.key}]++
		if r.inHand[d.key] > 1 {
			r.overlaps = append(r.overlaps, fmt.Sprintf("key %s: %d copies in handlers at once (relay %s took %d): %v", d.key, r.inHand[d.key], relay, seq, r.trace[d.key]))
		}
		if n := r.inHandOf[[2]string{relay, d.key}]; n > 1 {
			r.overlapsOf = append(r.overlapsOf, fmt.Sprintf("key %s: %d copies in relay %s's handlers at once (took %d): %v", d.key, n, relay, seq, r.trace[d.key]))
		}
	}
	return d
}

func (r *recorder) end(relay string, d delivery, ack bool) {
	r.mu.Lock()
	r.open[relay]--
	if d.key != "" {
		r.inHand[d.key]--
		r.inHandOf[[2]string{relay, d.key}]--
	}
	if ack {
		if r.acks[d.id] == 0 {
			r.ackOrder[d.key] = append(r.ackOrder[d.key], d.seq)
		}
		r.acks[d.id]++
	}
	r.mu.Unlock()
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

func (r *recorder) acked(ev event) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.acks[ev.ID.String()] > 0
}

func (r *recorder) delivered(ev event) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.deliveries[ev.ID.String()]
}

func (r *recorder) notAcked(evs []event) []event {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []event
	for _, ev := range evs {
		if r.acks[ev.ID.String()] == 0 {
			out = append(out, ev)
		}
	}
	return out
}

func (r *recorder) maxOpenOf(relay string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.maxOpen[relay]
}

func (r *recorder) openOf(relay string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.open[relay]
}

func (r *recorder) deliveriesBy(relay string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byRelay[relay]
}

// checkOrder fails for every key whose first deliveries are not in
// sequence order.
func (r *recorder) checkOrder(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	keys := make([]string, 0, len(r.first))
	for k := range r.first {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	bad := 0
	for _, k := range keys {
		if k == "" {
			continue
		}
		seqs := r.first[k]
		for i := 1; i < len(seqs); i++ {
			if seqs[i] <= seqs[i-1] {
				if bad++; bad <= 3 {
					t.Errorf("key %s: first deliveries out of sequence order: %v; deliveries %v", k, seqs, r.trace[k])
				}
				break
			}
		}
	}
	if bad > 3 {
		t.Errorf("... and %d more keys out of order", bad-3)
	}
}

// ---- helpers shared by the cases ----

// hashOf is a stable small hash of an event, to pick rows at random but
// the same in every run.
func hashOf(id string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(id))
	return h.Sum32()
}

// failing is a set of events a handler fails (permanently or not).
type failing struct {
	mu  sync.Mutex
	ids map[string]bool
}

func newFailing(evs ...event) *failing {
	f := &failing{ids: map[string]bool{}}
	for _, ev := range evs {
		f.ids[ev.ID.String()] = true
	}
	return f
}

func (f *failing) has(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.ids[id]
}

func (f *failing) fix(evs ...event) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, ev := range evs {
		delete(f.ids, ev.ID.String())
	}
}

// errBroken is the error of a handler that fails a row on purpose.
var errBroken = errors.New("relaytest: the consumer fails this row on purpose")

// permanentFor fails the events of f permanently and acks the others.
func permanentFor(f *failing) handler {
	return func(_ context.Context, m *message.Message) error {
		if f.has(m.UUID) {
			return subscriber.Permanent(errBroken)
		}
		return nil
	}
}

// retry runs op until it returns nil or an error that transient does not
// accept, at most within.
func retry(within time.Duration, op func() error, transient func(error) bool) error {
	deadline := time.Now().Add(within)
	for {
		err := op()
		if err == nil || !transient(err) || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// newDefault starts a default relay on e's table as a fixture (the other
// mode of TestTwoModesOnOneTable and the old mode of
// TestSwitchFromDefault), not as the relay under test.
func (e *env) newDefault(shared bool, o Options) (message.Subscriber, error) {
	o = o.withDefaults()
	sub, err := subscriber.New(context.Background(), e.pool, subscriber.Config{Table: e.tbl, DisableSingleActive: shared, LockTTL: 2 * time.Second,
		PollInterval: 100 * time.Millisecond, ElectionInterval: 100 * time.Millisecond, MaxAttempts: o.MaxAttempts,
		CloseTimeout: o.CloseTimeout, Backoff: func(int) time.Duration { return o.Backoff }}, watermill.NopLogger{})
	if err == nil {
		e.markUnordered(sub)
	}
	return sub, err

}

// newOrdered starts an ordered relay on e's table as a fixture.
func (e *env) newOrdered(o Options) (message.Subscriber, error) {
	o = o.withDefaults()
	return subscriber.New(context.Background(), e.pool, subscriber.Config{Table: e.tbl, Ordered: true, LockTTL: time.Second, ElectionInterval: 100 * time.Millisecond,
		PollInterval: 100 * time.Millisecond, BatchSize: 50, MaxAttempts: o.MaxAttempts, CloseTimeout: o.CloseTimeout,
		Backoff: func(int) time.Duration { return o.Backoff }}, watermill.NopLogger{})

}
