// Package walrelay is the WAL relay: a Watermill subscriber that streams
// the rows of an outbox table from PostgreSQL's logical replication
// (pgoutput, through github.com/jackc/pglogrepl) instead of polling the
// table. Rows are written as always, by package publisher; the relay reads
// each committed transaction once, in commit order, and never updates a row
// on the happy path.
//
// Delivery: one message in flight per ordering key (the ordering_key
// column; rows without a key are ordered by topic), keys concurrent, in
// commit order within a key. Progress is the log position (LSN) up to which
// every message was settled (acked, or dead); the relay confirms it to the
// server, which then frees the WAL before it. A relay that stops or dies
// leaves the rest to the next one, from that position: delivery is at least
// once, consumers dedup on the event_id (the message UUID).
//
// A nacked message holds its key: it is retried after Backoff, the key's
// later messages wait, other keys flow. A key whose backlog behind its
// retrying head passes MaxInFlight rows (or whose backlog stops the
// stream's read-ahead) is spilled: a retrying hold is written for it at
// the head (schema.WALQueries.Spill), then its queued rows leave memory
// (they are in the table, parked behind the hold, as behind a dead row),
// and the stream is read on for the other keys; at the retry the key
// drains from the table, head first. After MaxAttempts (or at once for a
// permanent error, subscriber.Permanent) the row is parked dead in the table
// (dead_at, last_error) and the key goes on. A replay (runbook.ReplayEvent,
// `outbox dead replay`) resets the row with an UPDATE, which the relay
// streams and delivers again.
//
// One relay reads a slot at a time: the server refuses a second reader of
// an active slot, and a standby retries every ElectionInterval, taking over
// when the active relay stops or its session ends. See docs/WAL.md.
//
// Sessions are terms of the relay's term ledger (package internal/term, the
// core the ordered relay uses too; docs/WAL.md, "Sessions are terms"):
// every message is handed out as a copy registered under the live session
// (term.Term.Hand), so the core's invariants hold here: (I1) at most one
// copy of a key is out in the relay, and a session hands out no key that a
// copy of an ended session still holds (term.Ledger.Stale; its end wakes
// the loop through term.Ledger.Freed); (I2) a session's end cancels the
// contexts of its messages still in handlers; (I3) a verdict counts only
// if its copy ended under the live session, and only the session's loop
// applies verdicts, before it ends its term (the position it confirms at
// its end covers only those); (I4) a
// copy an ended session left in a handler ends at its verdict, CloseTimeout
// after the session ended, or the relay's stop.
//
// (F) The session fences its writes in the database, across relay
// processes: every write of holds, dead rows or progress (the statements
// of schema.WALQueries: MarkDeadHold, Spill, Drain, which applies skips
// too, RetryDrain, Release, Forget, Progress) applies only while the session's own
// walsender holds the slot (pg_replication_slots.active_pid equals the
// replication connection's PID), checked in the statement under the
// slot's fence lock taken shared; a session, once it holds the slot and
// before it reads the holds, takes and releases that lock exclusively
// (schema.WALFenceHandover). So every write of an earlier session, in this
// process or another, either committed before the new session read the
// holds, or changes nothing. A refused write is counted
// (outbox_fence_rejected_total), logged, not retried, and ends the session.
//
// (S) A spill never loses a row nor lets a key's later row pass its head:
// the retrying hold commits (fenced, F) before the key's rows leave
// memory, so the confirmed position passes a row only once it is settled
// or covered by a hold in the table; while the hold is retrying, every
// streamed row of the key from the head on is parked; its retry reads the
// key's rows from the head on from the table and delivers them in
// sequence order, before the key's rows streamed after that read; a
// session that finds a retrying hold (after a crash, a cut or a restart)
// retries it at once, from the head.
//
// (R) A replay's ack does not outrun its drain: the acked replay of a held
// row stays unsettled (the confirmed position does not pass its UPDATE)
// until the drain it starts is written and the hold says draining. A
// session that ends first (its drain waiting for invariant V, or a failed
// write) leaves the replay to be streamed again by the next session, which
// delivers it again and drains; before, the next session read the hold as
// plain dead and the rows parked behind it were never delivered.
package walrelay

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Defaults of Config.
const (
	MaxInFlightDefault      = 4096
	StatusIntervalDefault   = time.Second
	ElectionIntervalDefault = time.Second
	CloseTimeoutDefault     = 30 * time.Second
)

// Config configures a Subscriber.
type Config struct {
	// Table is the outbox table; required.
	Table schema.Table
	// Names are the publication and slot; empty fields take DefaultNames.
	Names Names
	// ConnString is the connection of the replication session. Empty: the
	// pool's connection string with replication=database.
	ConnString string
	// MaxAttempts is the number of deliveries of a row before it is parked
	// dead. Defaults to subscriber.MaxAttemptsDefault.
	MaxAttempts int
	// Backoff is the delay before the next attempt after attempt n failed.
	// Defaults to subscriber.DefaultBackoff.
	Backoff func(n int) time.Duration
	// MaxInFlight bounds the messages handed out and not settled, and the
	// rows read and not settled: the relay stops reading the stream beyond
	// it, not counting the rows queued behind a key whose head waits for
	// its retry, up to 4 x MaxInFlight rows in all. A keyed row's backlog
	// behind its retrying head is spilled to a retrying hold once it
	// passes MaxInFlight rows, or when the 4 x MaxInFlight bound is
	// reached, so a retrying key does not stop the stream; rows without an
	// ordering key (ordered by topic) are not spilled. A transaction's rows
	// count as they are read (they are not buffered until its commit).
	// Defaults to MaxInFlightDefault.
	MaxInFlight int
	// StatusInterval is how often the relay confirms its position to the
	// server. Defaults to StatusIntervalDefault.
	StatusInterval time.Duration
	// ElectionInterval is how often a standby tries to take the slot.
	// Defaults to ElectionIntervalDefault.
	ElectionInterval time.Duration
	// CloseTimeout bounds how long Close waits for messages in flight.
	// Defaults to CloseTimeoutDefault.
	CloseTimeout time.Duration
	// DispatchTimeout is how long a handler may keep a message: the
	// message's context ends DispatchTimeout after it was handed over (or
	// earlier, at its ack or nack or the session's end). A handler that
	// returns when its context ends and nacks has its row retried after
	// Backoff, as for any nack; the relay does not hand the key's message
	// out again before the verdict (one copy per key), so a handler that
	// ignores its context keeps its key until it answers or its session
	// ends. Set it to the router's dispatch timeout, as for
	// subscriber.Config.DispatchTimeout. Defaults to
	// subscriber.DispatchTimeoutDefault.
	DispatchTimeout time.Duration
	// LastErrorMaxBytes bounds last_error. Defaults to
	// subscriber.LastErrorMaxBytesDefault.
	LastErrorMaxBytes int
	// Metrics records outbox_relay_leader (1 while this relay reads the
	// slot), outbox_dispatch_total, outbox_dead_total and
	// outbox_delivery_lag_seconds (from the commit), as the table relay
	// does. Defaults to nil (no metrics); the slot's own gauges are
	// Subscriber.Collector.
	Metrics *metrics.Metrics
}

func (c *Config) setDefaults() {
	if c.MaxAttempts == 0 {
		c.MaxAttempts = subscriber.MaxAttemptsDefault
	}
	if c.Backoff == nil {
		c.Backoff = subscriber.DefaultBackoff
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = MaxInFlightDefault
	}
	if c.StatusInterval == 0 {
		c.StatusInterval = StatusIntervalDefault
	}
	if c.ElectionInterval == 0 {
		c.ElectionInterval = ElectionIntervalDefault
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = CloseTimeoutDefault
	}
	if c.DispatchTimeout == 0 {
		c.DispatchTimeout = subscriber.DispatchTimeoutDefault
	}
	if c.LastErrorMaxBytes == 0 {
		c.LastErrorMaxBytes = subscriber.LastErrorMaxBytesDefault
	}
}

func (c Config) validate() error {
	switch {
	case c.Table.IsZero():
		return errors.New("walrelay: invalid config: no table; build one with schema.ParseTable")
	case c.MaxAttempts < 1:
		return fmt.Errorf("walrelay: invalid config: MaxAttempts %d; use at least 1", c.MaxAttempts)
	case c.MaxInFlight < 1, c.StatusInterval < 0, c.ElectionInterval < 0, c.CloseTimeout < 0, c.LastErrorMaxBytes < 0:
		return errors.New("walrelay: invalid config: MaxInFlight must be positive and the intervals not negative")
	case c.DispatchTimeout < 0:
		return fmt.Errorf("walrelay: invalid config: DispatchTimeout %s is negative; leave it 0 for the default (%s) or set a positive value", c.DispatchTimeout, subscriber.DispatchTimeoutDefault)
	}
	return nil
}

// Subscriber streams one outbox table's rows from its replication slot. It
// implements message.Subscriber.
type Subscriber struct {
	pool   *pgxpool.Pool
	cfg    Config
	cols   schema.Columns
	q      schema.WALQueries
	logger watermill.LoggerAdapter
	conn   string

	mu         sync.Mutex
	subscribed bool
	closed     bool
	cancel     context.CancelFunc
	done       chan struct{}

	active          atomic.Bool
	confirmed       atomic.Uint64
	slotLost        atomic.Int64 // times the slot was found gone or invalidated and recreated
	backfilled      atomic.Int64 // rows read from the table after a lost slot
	malformed       atomic.Int64 // sessions ended by a malformed replication frame
	oldestUnsettled atomic.Int64 // commit time (Unix ns) of the oldest unsettled transaction, 0 when none
	peakRows        atomic.Int64 // the most rows a session held read and not settled (tests)

	// terms is the relay's term ledger (package internal/term, the core
	// the ordered relay uses too): each session is a term of scope 0, its
	// deliveries are copies registered under it, and a copy that a
	// session's end left in a handler holds its key back from the later
	// sessions until its verdict, CloseTimeout after the session ended, or
	// the relay's stop (docs/WAL.md, "Sessions are terms").
	terms    *term.Ledger
	sessions atomic.Int64 // sessions started: the epoch of each term

	// spills: the holds table has its retrying column, so a retrying
	// key's backlog can be spilled to a retrying hold (schema.WALQueries.Spill).
	spills  bool
	spilled atomic.Int64 // keys spilled (tests)
	unseen  atomic.Int64 // statements put off until a streamed transaction was visible (tests)

	// fenceHook, set by tests only (export_test.go), runs before each
	// fenced write ("before") and, when set, the write runs in a
	// transaction and the hook runs again after its statement and before
	// its commit ("checked").
	fenceHook func(op, phase string)
}

// New checks the table, its publication and its slot (Setup), and returns
// a Subscriber. It does not connect for replication until Subscribe.
func New(ctx context.Context, pool *pgxpool.Pool, cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if pool == nil {
		return nil, errors.New("walrelay: nil pool")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	var err error
	if cfg.Names, err = cfg.Names.withDefaults(cfg.Table); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	cols, err := schema.DetectColumns(ctx, pool, cfg.Table)
	if err != nil {
		return nil, fmt.Errorf("walrelay: %w", err)
	}
	if err := checkSetUp(ctx, pool, cfg.Table, cfg.Names); err != nil {
		return nil, err
	}
	conn := cfg.ConnString
	if conn == "" {
		conn = replicationConnString(pool)
	}
	s := &Subscriber{pool: pool, cfg: cfg, cols: cols, q: schema.NewWALQueries(cfg.Table, cols), conn: conn,
		logger: logger.With(watermill.LogFields{"table": cfg.Table.String(), "slot": cfg.Names.Slot})}
	if err := s.checkRetryingColumn(ctx); err != nil {
		return nil, err
	}
	s.terms = s.newTerms()
	return s, nil
}

// checkRetryingColumn adds the retrying column to a holds table created
// before it (schema.WALAddRetryingColumn, a metadata-only change). When
// the relay's role may not, it runs as before the column: retrying rows
// stay in memory, bounded by the read-ahead (docs/WAL.md, Limits), and it
// says so once.
func (s *Subscriber) checkRetryingColumn(ctx context.Context) error {
	if !s.cols.OrderingKey {
		s.q = schema.NewWALQueriesWithoutRetrying(s.cfg.Table, s.cols)
		return nil
	}
	var has bool
	if err := s.pool.QueryRow(ctx, schema.WALHoldsHaveRetrying(s.cfg.Table)).Scan(&has); err != nil {
		return fmt.Errorf("walrelay: look up the holds table of %s: %w", s.cfg.Table, err)
	}
	if !has {
		if _, err := s.pool.Exec(ctx, schema.WALAddRetryingColumn(s.cfg.Table)); err != nil {
			s.logger.Error("The WAL holds table has no retrying column and the relay could not add it: a retrying key's backlog stays in memory; run `outbox migrate --wal` (walrelay.Setup) as the table's owner", err, nil)
			s.q = schema.NewWALQueriesWithoutRetrying(s.cfg.Table, s.cols)
			return nil
		}
	}
	s.spills = true
	return nil
}

// newTerms is the relay's term ledger: a copy a session's end left in a
// handler holds its key back for CloseTimeout at most after the session
// ended.
func (s *Subscriber) newTerms() *term.Ledger {
	return term.New(term.Config{Overrun: s.cfg.CloseTimeout, OnStaleEnd: s.staleEnded})
}

// staleEnded logs the end of a copy that a session's end left in a handler.
func (s *Subscriber) staleEnded(key string, why term.Reason) {
	if why == term.Overran {
		s.logger.Info("A handler kept a message of an ended session past CloseTimeout; its key is delivered again", nil)
	}
	s.logger.Trace("Stale copy ended", watermill.LogFields{"key": key, "why": why.String()})
}

// replicationConnString is the pool's connection with replication=database,
// as a keyword/value string. A pool that uses TLS gets sslmode=require;
// set Config.ConnString to keep its verification settings.
func replicationConnString(pool *pgxpool.Pool) string {
	cc := pool.Config().ConnConfig
	kv := [][2]string{{"host", cc.Host}, {"port", strconv.Itoa(int(cc.Port))}, {"dbname", cc.Database}, {"user", cc.User},
		{"replication", "database"}, {"application_name", "outbox-walrelay"}, {"sslmode", "disable"}}
	if cc.TLSConfig != nil {
		kv[6][1] = "require"
	}
	if cc.Password != "" {
		kv = append(kv, [2]string{"password", cc.Password})
	}
	var b strings.Builder
	for _, p := range kv {
		v := strings.ReplaceAll(strings.ReplaceAll(p[1], `\`, `\\`), `'`, `\'`)
		fmt.Fprintf(&b, "%s='%s' ", p[0], v)
	}
	return strings.TrimSpace(b.String())
}

// Active reports whether this relay reads the slot now (the others are
// standbys).
func (s *Subscriber) Active() bool { return s.active.Load() }

func (s *Subscriber) setActive(v bool) {
	s.active.Store(v)
	if m := s.cfg.Metrics; m != nil {
		g := 0.0
		if v {
			g = 1
		}
		m.RelayLeader.WithLabelValues(s.cfg.Table.Qualified()).Set(g)
	}
}

// IsLeader is Active, under the name the table relay uses (readiness
// probes report leaders and standbys).
func (s *Subscriber) IsLeader() bool { return s.active.Load() }

// Table is the outbox table the relay streams.
func (s *Subscriber) Table() schema.Table { return s.cfg.Table }

// Confirmed is the log position the relay last confirmed to the server.
func (s *Subscriber) Confirmed() pglogrepl.LSN { return pglogrepl.LSN(s.confirmed.Load()) }

// Subscribe starts the relay. The WAL relay streams every topic of its
// table: topic must be subscriber.AllTopics, and there is one subscription
// per Subscriber. The channel is closed by Close.
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if topic != subscriber.AllTopics {
		return nil, fmt.Errorf("walrelay: subscribe to topic %q: the WAL relay streams every topic of its table; subscribe with subscriber.AllTopics (%q)", topic, subscriber.AllTopics)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return nil, subscriber.ErrSubscriberClosed
	case s.subscribed:
		return nil, errors.New("walrelay: already subscribed: one subscription per Subscriber")
	}
	s.subscribed = true
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	s.done = make(chan struct{})
	out := make(chan *message.Message)
	go func() {
		select {
		case <-ctx.Done():
			cancel()
		case <-rctx.Done(): // Close
		}
	}()
	go s.run(rctx, out)
	return out, nil
}

// Close stops the relay: no new message is delivered, those in flight get
// up to CloseTimeout to settle, the position is confirmed, and the
// subscription's channel is closed. It is idempotent.
func (s *Subscriber) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	cancel, done := s.cancel, s.done
	s.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	return nil
}

// run streams while it holds the slot, and waits as a standby otherwise.
func (s *Subscriber) run(ctx context.Context, out chan *message.Message) {
	defer close(s.done)
	defer close(out)
	// After the last session: the copies left in handlers by ended
	// sessions no longer hold anything back, and the goroutines that
	// follow them end (term I4).
	defer s.terms.Close()
	for ctx.Err() == nil {
		err := s.stream(ctx, out)
		if ctx.Err() != nil {
			return
		}
		s.countMalformed(err)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55006" { // object_in_use: another relay reads the slot
			s.logger.Debug("Slot in use: standing by", nil)
		} else if errors.Is(err, errFenced) {
			s.logger.Info("WAL session ended: it no longer holds the slot", nil)
		} else if err != nil {
			s.logger.Error("WAL stream ended; retrying", err, watermill.LogFields{"retry_in": s.cfg.ElectionInterval.String()})
		}
		select {
		case <-ctx.Done():
		case <-time.After(s.cfg.ElectionInterval):
		}
	}
}

// item is one row to deliver.
type item struct {
	row      schema.ClaimedRow
	key      string
	tx       *txn // nil for a row read from the table when a hold drains
	attempts int
	replay   bool   // streamed as the UPDATE of a replay
	lastErr  string // the last failure, redacted, while the item waits for its retry
	unseen   int    // how often its verdict waited for its transaction to be visible
}

// hold is an ordering key held back by a dead row (persisted in the holds
// table): the key's later rows are parked, not delivered, until the dead
// row is delivered again (a replay) or skipped; then the parked rows are
// read from the table and delivered in order (draining) and the hold
// becomes a tombstone until the relay's confirmed position passes every
// row the drain read: the stream's own copies of those rows (the relay may
// be behind) are parked, not delivered again.
//
// A retrying hold (retrying) holds the key of a row that failed and waits
// for its retry, its key's backlog spilled to the table (spill): at
// retryAt the relay reads the key's rows from the held row on and delivers
// them (startRetry), the held row first, with its attempts.
type hold struct {
	retrying  bool      // the held row is not dead: it is retried at retryAt
	retryAt   time.Time // retrying: when the held row is due
	attempts  int       // retrying: the held row's attempts so far
	seq       int64     // the held row's sequence
	through   int64     // rows of the key up to it went through a drain (or were skipped): park their copies
	draining  bool
	released  bool          // a tombstone
	untilLSN  pglogrepl.LSN // the WAL position after the last drain's read
	wantDrain bool          // a drain was asked for and its statements failed
	maxRead   int64         // draining: the last sequence read from the table
	left      int           // draining: rows read and not settled yet
	// more: the drain's last batch was full; the key's rows after maxRead
	// are read from the table in the next batch once this one is settled
	// (drained), and their streamed copies are parked meanwhile.
	more   bool
	unseen int // the drain waits for streamed rows to be visible: its tries so far (visible.go)
	// acked is the held row's replay, acked and not settled until the
	// drain it starts is written (invariant R): the confirmed position
	// does not pass the replay's UPDATE before the hold says draining, so
	// a session that ends first leaves the replay to be streamed again.
	acked *item
}

// txn is one committed transaction: its end position and its rows not
// settled yet. pgoutput sends only committed transactions, and its BEGIN
// carries the commit time: a transaction's rows are queued as they are read
// (the stream's reading pauses at the in-flight bounds, readable), and the
// confirmed position passes the transaction once its COMMIT was read
// (committed) and its rows are settled. A transaction that may have been
// settled before a server restart (settledThrough) is buffered whole
// instead (buffered, items) and decided at its COMMIT by its end.
type txn struct {
	xid       uint32        // the transaction id (BEGIN): its rows are visible once it is (visible.go)
	final     pglogrepl.LSN // its commit record's position (BEGIN)
	end       pglogrepl.LSN
	commit    time.Time
	pending   int
	items     []*item
	buffered  bool
	committed bool
	rows      int // rows read
}

type keyQueue struct {
	items    []*item
	inFlight bool
	retryAt  time.Time
	waiting  bool // in stream.waiting: ready, held back by MaxInFlight
	backoff  bool // the head failed and waits for its retry: the queue's streamed rows count in stream.behind
}

// settle is the verdict on a delivered message.
type settle struct {
	it      *item
	ack     bool
	err     error
	stopped bool // the relay stopped before a verdict: the row stays unsettled
}

// stream is one session on the slot.
type stream struct {
	s         *Subscriber
	conn      *pgconn.PgConn
	sendMu    sync.Mutex
	out       chan *message.Message
	rels      map[uint32]*relation
	cur       *txn
	txns      []*txn
	keys      map[string]*keyQueue
	unsettled int
	confirmed pglogrepl.LSN
	idleEnd   pglogrepl.LSN // the server's position, when nothing was pending
	settles   chan settle
	gone      chan struct{} // closed when the loop ends: verdicts are dropped
	term      *term.Term    // the session's term in the relay's ledger
	draining  bool          // no new deliveries
	retry     *time.Timer
	retryAt   time.Time      // when retry fires; zero when it is not armed
	inFlight  sync.WaitGroup // deliveries under way
	readyMu   sync.Mutex
	ready     []delivery    // queued by the loop for the pump, oldest first
	readyWake chan struct{} // capacity 1: the pump has deliveries
	waits     chan waiting  // to an idle waiter
	// horizon candidates (xid8 text, the WAL position after it), oldest
	// first; one becomes the horizon once the confirmed position passes it.
	candidates []candidate
	holds      map[string]*hold // by ordering key
	// unseen are the transactions the stream read rows of that a snapshot
	// has not shown visible yet (visible.go).
	unseen []uint32
	// delivering counts the keys with a message handed out and not
	// settled: at most MaxInFlight, however many keys one transaction
	// brings. Keys ready beyond it wait in waiting, in order.
	delivering int
	waiting    []string
	// behind counts the streamed rows queued on keys whose head waits for
	// its retry: the stream is read on while the other unsettled rows are
	// under MaxInFlight (a retrying key does not stop the other keys), up
	// to backoffReadAhead x MaxInFlight rows in all.
	behind int
	// fromTable counts the rows drains read from the table (items without
	// a transaction) and not settled yet.
	fromTable int
	// spillPause: a spill failed (a database error); none is tried again
	// before it.
	spillPause time.Time
	// settledThrough: transactions ending at or before it were settled by
	// an earlier session (the slot moved back after a server restart).
	settledThrough pglogrepl.LSN
	// backfillIDs are the ids of the rows the session's backfill read,
	// until the confirmed position passes backfillUntil (the WAL position
	// after the read): their streamed inserts are not delivered again.
	backfillIDs   map[string]struct{}
	backfillUntil pglogrepl.LSN
	oid           uint32 // the outbox table's relation id
	// The session's write fence: its walsender's pid and the slot's fence
	// lock key (schema.WALQueries); fencedOut once a write was refused (the
	// session no longer holds the slot: it ends).
	pid         int64
	fenceKey    int64
	fencedOut   bool
	warnedOther bool // rows of another table were ignored
	// Caught up: the progress is recorded at once, not at the next tick.
	lastStatus time.Time     // when status last ran
	recorded   pglogrepl.LSN // the position status last recorded
	burst      burstState
	burstLSN   pglogrepl.LSN // with burstRecorded: the candidate that closes the burst
	prompt     *time.Timer   // a record put off by the rate limit
	promptSet  bool
}

// burstState follows the records after a burst of transactions: the first
// record after the burst takes a horizon candidate; the record that takes it
// as the horizon goes at once when the position passes it.
type burstState uint8

const (
	burstNone     burstState = iota
	burstRead                // a transaction was read since the last record
	burstRecorded            // recorded since; burstLSN closes the burst
)

type candidate struct {
	xid string
	lsn pglogrepl.LSN
}

// send hands a verdict to the loop, or drops it once the loop ended (the
// row stays unsettled; the next relay delivers it again).
func (st *stream) send(v settle) {
	select {
	case st.settles <- v:
	case <-st.gone:
	}
}

// received is one message of the stream, parsed by the reader goroutine:
// a keepalive, a logical replication message, or the error that ended the
// stream.
type received struct {
	ka  *pglogrepl.PrimaryKeepaliveMessage
	lm  pglogrepl.Message
	err error
}

// parse turns one backend message into a received.
func parse(raw pgproto3.BackendMessage) received {
	switch m := raw.(type) {
	case *pgproto3.ErrorResponse:
		return received{err: pgconn.ErrorResponseToPgError(m)}
	case *pgproto3.CopyData:
		if len(m.Data) == 0 {
			return received{}
		}
		switch m.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := decodeKeepalive(m.Data[1:])
			return received{ka: ka, err: err}
		case pglogrepl.XLogDataByteID:
			// Bounds-checked (frame.go): a malformed frame is an error
			// that ends the session, never a panic.
			lm, err := decodeXLogData(m.Data[1:])
			return received{lm: lm, err: err}
		}
	}
	return received{}
}

func (s *Subscriber) stream(ctx context.Context, out chan *message.Message) error {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	conn, err := pgconn.Connect(cctx, s.conn)
	cancel()
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if err := s.ensureSlot(ctx); err != nil {
		return err
	}
	err = pglogrepl.StartReplication(ctx, conn, s.cfg.Names.Slot, 0, pglogrepl.StartReplicationOptions{
		// Binary values: the server skips the text output functions of
		// uuid, int8, jsonb and timestamptz.
		PluginArgs: []string{"proto_version '1'", "publication_names '" + s.cfg.Names.Publication + "'", "binary 'true'"},
	})
	if err != nil {
		return fmt.Errorf("start replication on slot %s: %w", s.cfg.Names.Slot, err)
	}
	s.setActive(true)
	defer s.setActive(false)
	defer s.oldestUnsettled.Store(0)
	s.logger.Info("WAL relay active", nil)
	st := &stream{s: s, conn: conn, out: out, rels: map[uint32]*relation{}, keys: map[string]*keyQueue{},
		settles: make(chan settle, 1024), gone: make(chan struct{}), readyWake: make(chan struct{}, 1), waits: make(chan waiting)}
	if err := s.pool.QueryRow(ctx, schema.WALTableOID, s.cfg.Table.Sanitize()).Scan(&st.oid); err != nil {
		return fmt.Errorf("look up the relation id of %s: %w", s.cfg.Table, err)
	}
	defer close(st.gone)
	// The session is a term of the relay's ledger; its context is the
	// deliveries' context, the backfill's included. Every return of the
	// stream ends the term (the contexts of its messages still in handlers
	// are cancelled: term I2) and waits for the deliveries first (deferred
	// calls run in reverse): none outlives the stream, so none is handed to
	// out once it may be closed, and a copy the term's end left in a
	// handler holds its key back from the next sessions (I1).
	st.term = s.terms.Begin(ctx, 0, s.sessions.Add(1))
	dctx := st.term.Context()
	defer st.stop()
	go st.pump()
	// The session's writes are fenced by its walsender (the fence
	// invariant, at the top of this file): it holds the slot now; every
	// write of an earlier session either committed before the holds are
	// read or finds another walsender on the slot and does nothing.
	st.pid, st.fenceKey = int64(conn.PID()), schema.WALFenceKey(s.cfg.Names.Slot)
	if _, err := s.pool.Exec(ctx, schema.WALFenceHandover, st.fenceKey); err != nil {
		return fmt.Errorf("wait for the writes of the slot's earlier sessions: %w", err)
	}
	backfill, err := st.start(ctx)
	if err != nil {
		return err
	}
	st.retry = time.NewTimer(time.Hour)
	for _, h := range st.holds {
		if h.retrying {
			st.schedule(h.retryAt) // a retrying hold of an earlier session: due at once
		}
	}
	if backfill != nil {
		st.commit(dctx, backfill)
	}
	return st.loop(ctx, dctx)
}

// ensureSlot recreates the slot when it is gone or the server invalidated
// it (max_slot_wal_keep_size); the stream then starts with a backfill
// from the table (start).
func (s *Subscriber) ensureSlot(ctx context.Context) error {
	var plugin, confirmed string
	var active, lost bool
	err := s.pool.QueryRow(ctx, schema.WALSlotState, s.cfg.Names.Slot).Scan(&plugin, &active, &confirmed, &lost)
	gone := errors.Is(err, pgx.ErrNoRows)
	if err != nil && !gone {
		return fmt.Errorf("look up replication slot %s: %w", s.cfg.Names.Slot, err)
	}
	if !gone && !lost {
		return nil
	}
	s.logger.Error("Replication slot lost: recreating it and reading the rows it missed from the table", nil,
		watermill.LogFields{"invalidated": lost, "dropped": gone})
	s.slotLost.Add(1)
	if lost {
		if _, err := s.pool.Exec(ctx, schema.WALDropSlot, s.cfg.Names.Slot); err != nil {
			return fmt.Errorf("drop the invalidated replication slot %s: %w", s.cfg.Names.Slot, err)
		}
	}
	var lsn string
	if err := s.pool.QueryRow(ctx, schema.WALCreateSlot, s.cfg.Names.Slot).Scan(&lsn); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42710" { // duplicate_object: another relay recreated it
			return nil
		}
		return privilegeHint(err, "recreate replication slot "+s.cfg.Names.Slot)
	}
	return nil
}

// start reads where the slot and the progress record stand. A slot ahead
// of the recorded position was recreated (by this relay or another one
// that stopped before it finished), or was never read since Setup (which
// records the slot's start minus one: the rows written before Setup are
// not in the stream): the rows it never streamed are read from the table
// (schema.WALBackfill) and delivered first, as one transaction ending
// where the slot begins.
func (st *stream) start(ctx context.Context) (*txn, error) {
	s := st.s
	var slotText, recorded string
	if err := s.pool.QueryRow(ctx, s.q.Start, s.cfg.Names.Slot).Scan(&slotText, &recorded); err != nil {
		return nil, fmt.Errorf("read the position of slot %s: %w", s.cfg.Names.Slot, err)
	}
	slot, err := pglogrepl.ParseLSN(slotText)
	if err != nil {
		return nil, fmt.Errorf("slot %s position %q: %w", s.cfg.Names.Slot, slotText, err)
	}
	if err := st.loadHolds(ctx); err != nil {
		return nil, err
	}
	st.confirmed = slot
	if recorded == "" {
		return nil, nil // first start after Setup
	}
	rec, err := pglogrepl.ParseLSN(recorded)
	if err != nil {
		return nil, fmt.Errorf("recorded position %q: %w", recorded, err)
	}
	if slot < rec {
		// The slot is behind the record: the server restarted before it
		// saved the slot's confirmed position (PostgreSQL saves it only
		// when the slot is dirty otherwise). Transactions that end at or
		// before rec were settled; their copies are not delivered again (a
		// skipped row among them would be, its tombstone forgotten).
		st.settledThrough = rec
		s.logger.Info("Slot behind the recorded position: the transactions up to it are settled already", watermill.LogFields{"slot": slot.String(), "recorded": rec.String()})
		return nil, nil
	}
	if slot == rec {
		return nil, nil
	}
	st.confirmed = rec
	// The slot Setup created, never read, is one ahead of Setup's record:
	// the rows written before Setup; otherwise the slot was recreated.
	beforeSetup := slot == rec+1
	var commitTS bool
	if err := s.pool.QueryRow(ctx, schema.WALCommitTimestamps).Scan(&commitTS); err != nil {
		return nil, fmt.Errorf("read track_commit_timestamp: %w", err)
	}
	items, err := st.readItems(ctx, schema.WALBackfill(s.cfg.Table, s.cols, beforeSetup, commitTS), s.cfg.Names.Slot)
	if err != nil {
		return nil, fmt.Errorf("read the rows the slot did not stream: %w", err)
	}
	// The rows read that the stream brings too (committed after the slot
	// began and before the read) are not delivered twice: their streamed
	// inserts, of transactions that committed before this position, are
	// settled without delivery (backfilledCopy).
	var untilText string
	if err := s.pool.QueryRow(ctx, s.q.InsertPosition).Scan(&untilText); err != nil {
		return nil, fmt.Errorf("read the WAL position after the backfill: %w", err)
	}
	if st.backfillUntil, err = pglogrepl.ParseLSN(untilText); err != nil {
		return nil, fmt.Errorf("WAL position %q: %w", untilText, err)
	}
	tx := &txn{end: slot, commit: time.Now(), items: items}
	st.backfillIDs = make(map[string]struct{}, len(items))
	for _, it := range items {
		it.tx = tx
		st.backfillIDs[it.row.ID] = struct{}{}
	}
	s.backfilled.Add(int64(len(tx.items)))
	why := "Backfill from the table after a lost slot"
	if beforeSetup {
		why = "Backfill from the table at the first start: rows written before Setup"
	}
	if !commitTS {
		s.logger.Debug("track_commit_timestamp is off: the backfill reads unkeyed rows in sequence order", nil)
	}
	s.logger.Info(why, watermill.LogFields{"rows": len(tx.items), "from": rec.String(), "slot_starts": slot.String()})
	return tx, nil
}

func (st *stream) loop(ctx, dctx context.Context) error {
	s := st.s
	// The reader outlives ctx until the loop returns (the final status must
	// still go out), then a read deadline in the past stops it. Its reads
	// take context.Background(): pgconn then skips watching a context for
	// every message, which cost a sixth of the reader's time.
	rctx, stopReading := context.WithCancel(context.WithoutCancel(ctx))
	readerDone := make(chan struct{})
	defer func() {
		stopReading()
		_ = st.conn.Conn().SetReadDeadline(time.Now())
		<-readerDone // before the connection is closed
	}()
	recv := make(chan received, 256)
	go func() { //nolint:gosec // G118: Background on purpose (above); the read deadline stops the reads
		defer close(readerDone)
		for {
			m, err := st.conn.ReceiveMessage(context.Background())
			r := received{err: err}
			if err == nil {
				r = parse(m)
			}
			select {
			case recv <- r:
			case <-rctx.Done():
				return
			}
			if r.err != nil {
				return
			}
		}
	}()
	tick := time.NewTicker(s.cfg.StatusInterval)
	defer tick.Stop()
	defer st.retry.Stop()
	st.prompt = time.NewTimer(time.Hour)
	st.prompt.Stop()
	defer st.prompt.Stop()
	for {
		if st.fencedOut {
			return errFenced
		}
		if !st.readable() && ctx.Err() == nil {
			st.relieve(dctx) // spill retrying keys' backlogs, so that the stream is read on
		}
		var in chan received
		if st.readable() {
			in = recv
		}
		select {
		case <-ctx.Done():
			return st.drain(recv)
		case r := <-in:
			// What else is ready is taken without another full select
			// (its timers make it the loop's dearest step), a bounded
			// number at a time so that the timers are not starved.
			for n := 0; ; n++ {
				if err := st.onReceived(dctx, r); err != nil {
					return err
				}
				if n == loopBatch || !st.readable() {
					break
				}
				var ok bool
				if r, ok = tryReceive(recv); !ok {
					break
				}
			}
		case v := <-st.settles:
			for n := 0; ; n++ {
				st.onSettle(dctx, v)
				if n == loopBatch {
					break
				}
				var ok bool
				if v, ok = tryReceive(st.settles); !ok {
					break
				}
			}
			if err := st.caughtUp(); err != nil {
				return err
			}
		case <-st.retry.C:
			st.retryAt = time.Time{}
			if ctx.Err() == nil { // closing: the drain comes next, nothing new goes out
				st.dispatchAll(dctx)
				st.retryHolds(dctx)
			}
		case <-s.terms.Freed():
			// A copy an ended session left in a handler ended: its key
			// may go out again.
			if ctx.Err() == nil {
				st.dispatchAll(dctx)
			}
		case <-st.prompt.C:
			st.promptSet = false
			if err := st.caughtUp(); err != nil {
				return err
			}
		case <-tick.C:
			if err := st.status(false); err != nil {
				return err
			}
			st.tickHolds(dctx)
		}
	}
}

// loopBatch bounds the messages of one channel the loop handles per wake-up.
const loopBatch = 64

// replayReadTimeout bounds the wait of the read of a replayed row for the
// replay's transaction to be visible; past it the session ends and the
// next one reads the replay again.
const replayReadTimeout = 30 * time.Second

// tryReceive takes a value from c if one is ready.
func tryReceive[T any](c chan T) (T, bool) {
	select {
	case v := <-c:
		return v, true
	default:
		var zero T
		return zero, false
	}
}

// onReceived handles one message of the reader.
func (st *stream) onReceived(ctx context.Context, r received) error {
	if r.err != nil {
		return fmt.Errorf("read the replication stream: %w", r.err)
	}
	if err := st.handle(ctx, r); err != nil {
		return err
	}
	if r.ka != nil {
		return st.caughtUp()
	}
	return nil
}

// drain waits up to CloseTimeout for the messages in flight, confirms the
// position and returns. A transaction whose rows went out before its COMMIT
// was read is read on to its COMMIT (nothing new is handed out while
// draining): without it the position stopped before rows already acked,
// and the next relay delivered them again (TestWALHandover).
func (st *stream) drain(recv chan received) error {
	st.draining = true
	deadline := time.After(st.s.cfg.CloseTimeout)
	for st.unsettledInFlight() > 0 || (st.cur != nil && !st.cur.buffered) {
		var in chan received
		if st.cur != nil && !st.cur.buffered {
			in = recv
		}
		select {
		case v := <-st.settles:
			st.onSettle(context.Background(), v)
		case r := <-in:
			if err := st.onReceived(context.Background(), r); err != nil {
				st.s.logger.Info("The stream ended while closing; the rows of its open transaction are left to the next relay", watermill.LogFields{"error": err.Error()})
				st.stop()
				return st.status(true)
			}
		case <-deadline:
			st.s.logger.Info("Close timeout: messages in flight are left to the next relay", watermill.LogFields{"in_flight": st.unsettledInFlight()})
			st.stop()
			return st.status(true)
		}
	}
	st.stop()
	return st.status(true)
}

// stop ends the session's term and waits for the deliveries, dropping the
// verdicts they still send: more of them than the settles buffer holds
// would block on it while the loop waits. A dropped verdict leaves its row
// unsettled (the next relay delivers it again); the position recorded does
// not pass it. The loop applies verdicts only before it calls stop: no
// verdict of an ended term is recorded (term I3). It is idempotent.
func (st *stream) stop() {
	st.term.End()
	done := make(chan struct{})
	go func() {
		st.inFlight.Wait()
		close(done)
	}()
	for {
		select {
		case <-done:
			return
		case <-st.settles:
		}
	}
}

func (st *stream) unsettledInFlight() int {
	n := 0
	for _, q := range st.keys {
		if q.inFlight {
			n++
		}
	}
	return n
}

// position is the position the relay can confirm: the end of the settled
// prefix of transactions, or the server's position when nothing is pending.
func (st *stream) position() pglogrepl.LSN {
	pos := st.confirmed
	if st.cur == nil && len(st.txns) == 0 && st.idleEnd > pos {
		pos = st.idleEnd
	}
	return pos
}

// status records the progress and confirms the settled position to the
// server.
func (st *stream) status(final bool) error {
	pos := st.position()
	st.s.confirmed.Store(uint64(pos))
	st.lastStatus = time.Now()
	// The record goes first: the slot is never ahead of it unless it was
	// recreated (start relies on it).
	if !st.progress(pos) && !final {
		return nil // not recorded: the slot waits for the next tick
	}
	st.recorded = pos
	st.sendMu.Lock()
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), st.conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: pos})
	st.sendMu.Unlock()
	if err != nil && !final {
		return fmt.Errorf("confirm position %s: %w", pos, err)
	}
	return nil
}

// progress records the confirmed position and the newest horizon it
// covers, and takes the next horizon candidate: one statement per status
// tick. A failure is logged; the horizon then waits for the next tick.
func (st *stream) progress(pos pglogrepl.LSN) bool {
	var horizon *string
	n := 0
	for n < len(st.candidates) && st.candidates[n].lsn <= pos {
		horizon = &st.candidates[n].xid
		n++
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var c candidate
	var lsn string
	ok, err := st.write(ctx, "progress", st.s.q.Progress, []any{&c.xid, &lsn}, st.s.cfg.Names.Slot, pos.String(), horizon)
	if err == nil && ok {
		c.lsn, err = pglogrepl.ParseLSN(lsn)
	}
	if err != nil {
		st.s.logger.Error("Could not record the WAL relay's progress; the cleaner waits", err, nil)
		return false
	}
	if !ok {
		return false // refused: the session ends
	}
	st.candidates = st.candidates[n:]
	if xmin, err := strconv.ParseUint(c.xid, 10, 64); err == nil {
		st.pruneBefore(xmin) // older transactions are visible
	}
	kept := len(st.candidates) < maxCandidates
	if kept {
		st.candidates = append(st.candidates, c)
	}
	switch {
	case st.burst == burstRead && kept:
		st.burst, st.burstLSN = burstRecorded, c.lsn
	case st.burst == burstRead:
		// No candidate kept (a row retries and holds the horizon back):
		// nothing for a prompt record to close; the ticks go on.
		st.burst = burstNone
	case st.burst == burstRecorded && pos >= st.burstLSN:
		st.burst = burstNone // this record took the burst's candidate
	}
	return true
}

// recordSpacing: records other than the one that closes a burst are at
// least StatusInterval/recordSpacing apart.
const recordSpacing = 4

// caughtUp records the progress soon after the relay has settled everything
// it read, instead of at the next StatusInterval tick, so that the runbook
// and the cleaner see a burst settled as soon as it is. Two records close a
// burst: the first takes a horizon candidate; the second takes it as the
// horizon once the position has passed it (the server's keepalive tells,
// after it has sent the first record's own WAL) and goes at once. Other
// records wait for StatusInterval/4 after the last one: a steady trickle of
// small transactions costs one statement per StatusInterval/4, not one per
// transaction, and an idle relay records only at its ticks.
func (st *stream) caughtUp() error {
	if st.burst == burstNone || st.draining || st.unsettled > 0 || st.cur != nil || len(st.txns) > 0 {
		return nil
	}
	pos := st.position()
	if pos <= st.recorded {
		return nil
	}
	closes := st.burst == burstRecorded && pos >= st.burstLSN
	if wait := st.s.cfg.StatusInterval/recordSpacing - time.Since(st.lastStatus); !closes && wait > 0 {
		// Put off, not dropped: the last record of a burst must come.
		if !st.promptSet {
			st.promptSet = true
			st.prompt.Reset(wait)
		}
		return nil
	}
	return st.status(false)
}

// maxCandidates bounds the horizon candidates kept while the confirmed
// position does not move (a row retrying): the oldest are kept, they pass
// first.
const maxCandidates = 120

func (st *stream) handle(ctx context.Context, r received) error {
	if ka := r.ka; ka != nil {
		if st.cur == nil && len(st.txns) == 0 {
			st.idleEnd = max(st.idleEnd, ka.ServerWALEnd)
		}
		if ka.ReplyRequested {
			return st.status(false)
		}
		return nil
	}
	if r.lm == nil {
		return nil
	}
	return st.decode(ctx, r.lm)
}

func (st *stream) decode(ctx context.Context, lm pglogrepl.Message) error {
	switch m := lm.(type) {
	case *pglogrepl.RelationMessage:
		st.rels[m.RelationID] = newRelation(m)
	case *pglogrepl.BeginMessage:
		st.cur = &txn{commit: m.CommitTime, xid: m.Xid, final: m.FinalLSN}
		if st.settledThrough != 0 && m.FinalLSN <= st.settledThrough {
			// Perhaps settled before the server restarted: its end, read
			// at its COMMIT, tells.
			st.cur.buffered = true
		} else {
			st.txns = append(st.txns, st.cur)
			st.markOldest()
		}
	case *pglogrepl.InsertMessage:
		return st.row(ctx, m.RelationID, m.Tuple, false)
	case *pglogrepl.UpdateMessage:
		return st.row(ctx, m.RelationID, m.NewTuple, true)
	case *pglogrepl.CommitMessage:
		tx := st.cur
		st.cur = nil
		if tx == nil {
			return nil
		}
		tx.end, tx.commit = m.TransactionEndLSN, m.CommitTime
		if tx.buffered && tx.end <= st.settledThrough {
			tx.items = nil // settled before the restart
			tx.rows = 0
		}
		if tx.rows > 0 {
			// Only a transaction with rows opens a burst: before
			// PostgreSQL 15, pgoutput also sends the empty transactions,
			// among them the relay's own progress records, which would
			// otherwise keep prompting records.
			st.burst = burstRead
		}
		if tx.buffered {
			st.commit(ctx, tx)
			return nil
		}
		tx.committed = true
		st.advance()
	}
	return nil
}

// queue queues a row of the transaction being read behind its key and
// dispatches the key; the row of a held key is parked (settled without
// delivery).
func (st *stream) queue(ctx context.Context, it *item) {
	if st.parks(it) || st.backfilledCopy(it) {
		return
	}
	st.replayed(it)
	it.tx.pending++
	st.unsettled++
	st.peakRows()
	q := st.keys[it.key]
	if q == nil {
		q = &keyQueue{}
		st.keys[it.key] = q
	}
	q.items = append(q.items, it)
	if q.backoff {
		st.behind++
		if len(q.items) > st.s.cfg.MaxInFlight && st.spill(ctx, it.key, q) {
			return
		}
	}
	st.dispatch(ctx, it.key)
}

// backfilledCopy reports whether a streamed row is the insert of a row
// the session's backfill read from the table (it committed after the slot
// began and before the read): settled without delivery, the backfill
// delivers it.
func (st *stream) backfilledCopy(it *item) bool {
	if st.backfillIDs == nil || it.replay || it.tx.final >= st.backfillUntil {
		return false
	}
	_, ok := st.backfillIDs[it.row.ID]
	return ok
}

// replayed: an operator's replay of the held row of a retrying hold is
// delivered now, as the replay of a dead held row is; the hold no longer
// retries on its own (its drain follows the replay's ack).
func (st *stream) replayed(it *item) {
	if h := st.holdOf(it); h != nil && h.retrying && !h.draining && it.replay && it.row.Sequence == h.seq {
		h.retrying = false
	}
}

// peakRows records the most rows the session held read and not settled
// (buffered transactions included), for the tests.
func (st *stream) peakRows() {
	n := int64(st.unsettled + st.fromTable)
	if st.cur != nil && st.cur.buffered {
		n += int64(len(st.cur.items))
	}
	if n > st.s.peakRows.Load() {
		st.s.peakRows.Store(n)
	}
}

// commit queues the rows of a committed transaction read whole (a
// backfill, or a transaction buffered after a server restart) behind their
// keys; the rows of a held key are parked (settled without delivery).
func (st *stream) commit(ctx context.Context, tx *txn) {
	tx.committed = true
	kept := tx.items[:0]
	for _, it := range tx.items {
		if !st.parks(it) {
			st.replayed(it)
			kept = append(kept, it)
		}
	}
	tx.items = kept
	tx.pending = len(tx.items)
	if tx.pending == 0 {
		if len(st.txns) == 0 {
			st.confirmed = max(st.confirmed, tx.end)
		} else {
			st.txns = append(st.txns, tx)
		}
		return
	}
	st.txns = append(st.txns, tx)
	st.unsettled += tx.pending
	st.peakRows()
	for _, it := range tx.items {
		q := st.keys[it.key]
		if q == nil {
			q = &keyQueue{}
			st.keys[it.key] = q
		}
		q.items = append(q.items, it)
		if q.backoff {
			st.behind++ // every item here is streamed (it.tx != nil)
		}
	}
	st.markOldest()
	// Only the keys of this transaction can have become deliverable.
	for _, it := range tx.items {
		st.dispatch(ctx, it.key)
	}
	tx.items = nil
}

// keyOf is the ordering of a row: its ordering key, else its topic.
func keyOf(r schema.ClaimedRow) string {
	if r.OrderingKey != nil && *r.OrderingKey != "" {
		return "k:" + *r.OrderingKey
	}
	return "t:" + r.Topic
}

// relation is a table's columns as the stream describes them, with the
// position of each column the relay reads (-1: the table has none).
type relation struct {
	*pglogrepl.RelationMessage
	id, eventID, tenantID, topic, payload, sequence, traceParent, traceState,
	headers, orderingKey, publishedAt, deadAt, lockedAt, attempts int
}

func newRelation(m *pglogrepl.RelationMessage) *relation {
	r := &relation{RelationMessage: m}
	for _, f := range []struct {
		name string
		pos  *int
	}{
		{"id", &r.id}, {"event_id", &r.eventID}, {"tenant_id", &r.tenantID}, {"topic", &r.topic}, {"payload", &r.payload},
		{"sequence", &r.sequence}, {"traceparent", &r.traceParent}, {"tracestate", &r.traceState}, {"headers", &r.headers},
		{"ordering_key", &r.orderingKey}, {"published_at", &r.publishedAt}, {"dead_at", &r.deadAt}, {"locked_at", &r.lockedAt},
		{"attempts", &r.attempts},
	} {
		*f.pos = -1
		for i, c := range m.Columns {
			if c.Name == f.name {
				*f.pos = i
				break
			}
		}
	}
	return r
}

// text is the text of column i of tuple; ok is false when the table has no
// such column, the value is NULL or unchanged (an UPDATE that left it in
// TOAST).
func (r *relation) text(tuple *pglogrepl.TupleData, i int) (v string, ok bool, err error) {
	if i < 0 || i >= len(tuple.Columns) || i >= len(r.Columns) {
		return "", false, nil
	}
	c := tuple.Columns[i]
	switch c.DataType {
	case 't':
		return string(c.Data), true, nil
	case 'b':
		v, err := binaryText(r.Columns[i].DataType, c.Data)
		if err != nil {
			return "", false, fmt.Errorf("walrelay: column %s: %w", r.Columns[i].Name, err)
		}
		return v, true, nil
	}
	return "", false, nil
}

// value is text as a pointer: nil when it is not ok.
func (r *relation) value(tuple *pglogrepl.TupleData, i int) (*string, error) {
	v, ok, err := r.text(tuple, i)
	if !ok {
		return nil, err
	}
	return &v, nil
}

// int is column i of tuple as an integer, read from the binary form of an
// int8 or int4 without a detour through text.
func (r *relation) int(tuple *pglogrepl.TupleData, i int) (int64, error) {
	if i >= 0 && i < len(tuple.Columns) && i < len(r.Columns) {
		if c := tuple.Columns[i]; c.DataType == 'b' {
			switch {
			case r.Columns[i].DataType == 20 && len(c.Data) == 8: // int8
				return int64(binary.BigEndian.Uint64(c.Data)), nil //nolint:gosec // a bit pattern
			case r.Columns[i].DataType == 23 && len(c.Data) == 4: // int4
				return int64(int32(binary.BigEndian.Uint32(c.Data))), nil //nolint:gosec // a bit pattern
			}
		}
	}
	v, _, err := r.text(tuple, i)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(v, 10, 64)
}

// bytes is the text of column i of tuple as a new byte slice (nil as for
// value): the payload goes to the message as it is read, in one copy.
func (r *relation) bytes(tuple *pglogrepl.TupleData, i int) ([]byte, error) {
	if i >= 0 && i < len(tuple.Columns) && i < len(r.Columns) {
		c := tuple.Columns[i]
		switch {
		case c.DataType == 't':
			return bytes.Clone(c.Data), nil
		case c.DataType == 'b' && r.Columns[i].DataType == 3802 && len(c.Data) > 0 && c.Data[0] == 1: // jsonb, version 1
			return bytes.Clone(c.Data[1:]), nil
		}
	}
	v, err := r.value(tuple, i)
	if v == nil {
		return nil, err
	}
	return []byte(*v), err
}

// row turns an INSERT (or the UPDATE of a replay) into an item of the
// current transaction. It reads only the columns a message needs.
func (st *stream) row(ctx context.Context, rel uint32, tuple *pglogrepl.TupleData, update bool) error {
	if rel != st.oid {
		// Another table of the publication (New refuses such a
		// publication; a table added later is ignored, with a warning).
		if !st.warnedOther {
			st.warnedOther = true
			st.s.logger.Error("The publication streams rows of another table; ignoring them (give the outbox table a publication of its own)", nil,
				watermill.LogFields{"relation": rel})
		}
		return nil
	}
	r := st.rels[rel]
	if r == nil || tuple == nil || st.cur == nil {
		return fmt.Errorf("walrelay: row of an unknown relation %d", rel)
	}
	var err error
	get := func(i int) *string {
		v, verr := r.value(tuple, i)
		if verr != nil && err == nil {
			err = verr
		}
		return v
	}
	str := func(i int) string {
		v, _, verr := r.text(tuple, i)
		if verr != nil && err == nil {
			err = verr
		}
		return v
	}
	replay := false
	unchanged := false
	if update {
		replay = true
		// Only a replay's reset is delivered: not published, not dead,
		// attempts 0, no lease. The relay's own UPDATE (a dead row) is not.
		if get(r.publishedAt) != nil || get(r.deadAt) != nil || get(r.lockedAt) != nil || str(r.attempts) != "0" {
			return err
		}
		for _, c := range tuple.Columns {
			unchanged = unchanged || c.DataType == 'u'
		}
		if !unchanged {
			// The replay of an earlier row of a held key is delivered if
			// the row is still reset: read it, as below (earlierOfHeld).
			seq, serr := r.int(tuple, r.sequence)
			unchanged = serr == nil && st.earlierOfHeld(get(r.orderingKey), seq)
		}
	}
	var row schema.ClaimedRow
	if update && unchanged {
		// The payload was not in the UPDATE (or the replay is of an
		// earlier row of a held key): read the row.
		id := str(r.id)
		if err != nil {
			return err
		}
		// The read must see the replay, not the row before it.
		wctx, cancel := context.WithTimeout(ctx, replayReadTimeout)
		err = st.waitVisible(wctx, st.cur.xid)
		cancel()
		if err != nil {
			return err
		}
		if serr := row.Scan(st.s.pool.QueryRow(ctx, st.s.q.Row, id), st.s.cols); serr != nil {
			st.s.logger.Info("Replayed row not found; skipped", watermill.LogFields{"sequence": str(r.sequence)})
			return nil //nolint:nilerr // the row was deleted, published or dead again since
		}
	} else {
		row = schema.ClaimedRow{ID: str(r.id), EventID: str(r.eventID), TenantID: str(r.tenantID), Topic: str(r.topic),
			TraceParent: get(r.traceParent), TraceState: get(r.traceState), Headers: get(r.headers)}
		if err != nil {
			return err
		}
		if row.Payload, err = r.bytes(tuple, r.payload); err != nil {
			return err
		}
		if row.Sequence, err = r.int(tuple, r.sequence); err != nil {
			return fmt.Errorf("walrelay: row without a sequence in relation %s: %w", r.RelationName, err)
		}
	}
	row.OrderingKey = get(r.orderingKey)
	if err != nil {
		return err
	}
	it := &item{row: row, key: keyOf(row), tx: st.cur, replay: replay}
	st.saw(st.cur.xid)
	st.cur.rows++
	if st.cur.buffered {
		st.cur.items = append(st.cur.items, it)
		st.peakRows()
		return nil
	}
	st.queue(ctx, it)
	return nil
}

// earlierOfHeld reports whether a replayed row of key (its sequence seq)
// comes before the row that holds its key (a hold not resolved): parks
// delivers such a replay as new work, so the row reads the row from the
// table first and drops the replay when the row is no longer reset (dead
// again, or skipped since: the stream carries an old replay again after a
// session's end).
func (st *stream) earlierOfHeld(key *string, seq int64) bool {
	if key == nil || *key == "" {
		return false
	}
	h := st.holds[*key]
	return h != nil && !h.released && seq < h.seq
}

// dispatchAll delivers the head of every key that is free and due, with
// dispatch's rules (the retry timer armed for the earliest retry).
func (st *stream) dispatchAll(ctx context.Context) {
	if st.draining {
		return
	}
	for key := range st.keys {
		st.dispatch(ctx, key)
	}
}

// schedule arms the retry timer for t unless it fires earlier already.
func (st *stream) schedule(t time.Time) {
	if !st.retryAt.IsZero() && !t.Before(st.retryAt) {
		return
	}
	st.retryAt = t
	st.retry.Reset(time.Until(t))
}

func (st *stream) dispatch(ctx context.Context, key string) {
	q := st.keys[key]
	if q == nil {
		return
	}
	if len(q.items) == 0 {
		delete(st.keys, key)
		return
	}
	if q.inFlight || st.draining || st.s.terms.Stale(key) {
		return // a stale copy's end dispatches again (terms.Freed); term I1
	}
	if q.retryAt.After(time.Now()) {
		st.schedule(q.retryAt)
		return
	}
	if st.full(key, q) {
		return
	}
	st.deliver(ctx, q, q.items[0])
}

// backoffReadAhead bounds the unsettled rows, those behind retrying heads
// included, at this many times MaxInFlight.
const backoffReadAhead = 4

// backingOff counts q's streamed rows in behind: its head waits for a retry.
func (st *stream) backingOff(q *keyQueue) {
	if !q.backoff {
		q.backoff = true
		st.behind += streamed(q.items)
	}
}

// backedOff takes q's rows out of behind: its head goes out again (or the
// key is held and its rows parked).
func (st *stream) backedOff(q *keyQueue) {
	if q.backoff {
		q.backoff = false
		st.behind -= streamed(q.items)
	}
}

// streamed counts the items read from the stream (not from the table).
func streamed(items []*item) int {
	n := 0
	for _, it := range items {
		if it.tx != nil {
			n++
		}
	}
	return n
}

// readable reports whether the loop reads the stream on: fewer than
// MaxInFlight unsettled rows besides those behind retrying heads, and
// fewer than backoffReadAhead x MaxInFlight in all.
func (st *stream) readable() bool {
	limit := st.s.cfg.MaxInFlight
	return st.unsettled-st.behind < limit && st.unsettled < backoffReadAhead*limit
}

// full reports whether MaxInFlight messages are handed out already; the
// key then waits for a settle (unwait).
func (st *stream) full(key string, q *keyQueue) bool {
	if st.delivering < st.s.cfg.MaxInFlight {
		return false
	}
	if !q.waiting {
		q.waiting = true
		st.waiting = append(st.waiting, key)
	}
	return true
}

// unwait dispatches the keys that waited for room, oldest first, while
// there is room.
func (st *stream) unwait(ctx context.Context) {
	n := 0
	for n < len(st.waiting) && st.delivering < st.s.cfg.MaxInFlight {
		key := st.waiting[n]
		n++
		if q := st.keys[key]; q != nil {
			q.waiting = false
			st.dispatch(ctx, key)
		}
	}
	if n > 0 {
		st.waiting = append(st.waiting[:0], st.waiting[n:]...)
	}
}

func (st *stream) deliver(ctx context.Context, q *keyQueue, it *item) {
	q.inFlight = true
	st.delivering++
	st.backedOff(q)
	it.attempts++
	it.row.Attempts = int32(it.attempts) //nolint:gosec // bounded by MaxAttempts
	st.inFlight.Add(1)
	// The message is built by the pump, off the loop: the row is not
	// written again until the delivery settles.
	st.readyMu.Lock()
	st.ready = append(st.ready, delivery{ctx: ctx, it: it})
	st.readyMu.Unlock()
	select {
	case st.readyWake <- struct{}{}:
	default:
	}
}

// delivery is one delivery of an item, queued for the pump.
type delivery struct {
	ctx context.Context //nolint:containedctx // the delivery's own context, queued with it
	it  *item
}

// waiting is a message handed to the subscriber's channel, waiting for its
// ack or nack.
type waiting struct {
	delivery
	msg      *message.Message
	recorded func() error
	cp       *term.Copy         // the message's copy in the relay's ledger
	cancel   context.CancelFunc // ends the DispatchTimeout of the message's context
}

// waiterIdle is how long a waiter goroutine stays for the next message
// before it ends.
const waiterIdle = time.Second

// pump hands the queued deliveries to the subscriber's channel one by one,
// in the order the loop queued them, and each handed message to a waiter.
// One goroutine blocks on the channel, where a goroutine per delivery had a
// goroutine per key in flight parked on it (a fifth of the relay's CPU in a
// drain went to waking them). It ends with the stream.
func (st *stream) pump() {
	var batch []delivery
	for {
		select {
		case <-st.readyWake:
		case <-st.gone:
			return
		}
		st.readyMu.Lock()
		batch, st.ready = st.ready, batch[:0]
		st.readyMu.Unlock()
		for i, d := range batch {
			st.handOver(d)
			batch[i] = delivery{}
		}
	}
}

// handOver builds d's message, hands it to the subscriber's channel and then
// to a waiter, or settles d when it cannot.
func (st *stream) handOver(d delivery) {
	if d.ctx.Err() != nil {
		// Stopped: not handed over (a select with out ready too would
		// pick at random).
		st.send(settle{it: d.it, stopped: true})
		st.inFlight.Done()
		return
	}
	msg, err := d.it.row.Message(st.s.cfg.Table)
	if err != nil {
		// A row that cannot become a message (bad headers) is dead at once.
		st.send(settle{it: d.it, err: subscriber.Permanent(err)})
		st.inFlight.Done()
		return
	}
	// The message's context carries the session's values; the term sets
	// it, cancelled when the session ends or the copy does (term I2).
	// It also ends at DispatchTimeout (cancelled with the copy, below).
	mctx, recorded := subscriber.ContextWithErrorRecorder(context.WithoutCancel(d.ctx))
	mctx, cancel := context.WithTimeout(mctx, st.s.cfg.DispatchTimeout)
	cp, err := st.term.Hand(mctx, d.it.key, msg)
	if err != nil {
		cancel()
		if errors.Is(err, term.ErrKeyOut) {
			// Not expected: dispatch asked the ledger, and a key has one
			// delivery at a time in a session.
			st.s.logger.Error("A copy of the key is still in a handler; not delivering it again", err, watermill.LogFields{"sequence": d.it.row.Sequence})
		}
		st.send(settle{it: d.it, stopped: true})
		st.inFlight.Done()
		return
	}
	select {
	case st.out <- msg:
	case <-d.ctx.Done():
		cp.End(term.Withdrawn)
		cancel()
		st.send(settle{it: d.it, stopped: true})
		st.inFlight.Done()
		return
	}
	w := waiting{delivery: d, msg: msg, recorded: recorded, cp: cp, cancel: cancel}
	select {
	case st.waits <- w: // an idle waiter took it
	default:
		go st.waiter(w)
	}
}

// waiter waits for w's verdict, sends it to the loop, then waits for the
// messages handed to it while it is idle, up to waiterIdle: a goroutine
// grows its stack once, not once per message. It ends with the stream.
func (st *stream) waiter(w waiting) {
	idle := time.NewTimer(waiterIdle)
	defer idle.Stop()
	for {
		select {
		case <-w.msg.Acked():
			if w.cp.End(term.Acked) {
				st.send(settle{it: w.it, ack: true})
			} else {
				st.send(settle{it: w.it, stopped: true}) // the session ended first: not recorded (term I3)
			}
		case <-w.msg.Nacked():
			if !w.cp.End(term.Nacked) {
				st.send(settle{it: w.it, stopped: true}) // term I3
				break
			}
			err := w.recorded()
			if err == nil {
				err = errors.New("nacked")
			}
			st.send(settle{it: w.it, err: err})
		case <-w.ctx.Done():
			// The session ended with the message in a handler: its
			// context is cancelled (term I2), and the ledger follows the
			// copy; no later session delivers its key until the copy ends
			// (its verdict, recorded nowhere, CloseTimeout, or the relay's
			// stop: I1, I3, I4).
			st.send(settle{it: w.it, stopped: true})
		}
		w.cancel()
		st.inFlight.Done()
		idle.Reset(waiterIdle)
		select {
		case w = <-st.waits:
		case <-idle.C:
			return
		case <-st.gone:
			return
		}
	}
}

func (st *stream) onSettle(ctx context.Context, v settle) {
	it := v.it
	q := st.keys[it.key]
	if q == nil {
		return
	}
	q.inFlight = false
	st.delivering--
	if v.stopped {
		return // stopping: the row stays unsettled, the next relay delivers it
	}
	defer st.unwait(ctx)
	if dead := !v.ack && (subscriber.IsPermanent(v.err) || it.attempts >= st.s.cfg.MaxAttempts); dead && it.tx != nil {
		// The dead write must find the row (invariant V): it waits for the
		// row's transaction to be visible, the verdict kept, the row not
		// delivered again.
		ok, err := st.visible(ctx, it.tx.xid)
		if err != nil {
			st.s.logger.Error("Could not tell whether a rejected row is visible; trying again", err, watermill.LogFields{"sequence": it.row.Sequence})
		}
		if err != nil || !ok {
			q.inFlight = true
			st.delivering++
			st.inFlight.Add(1)
			time.AfterFunc(visibleDelay(it.unseen), func() {
				defer st.inFlight.Done()
				st.send(v)
			})
			it.unseen++
			st.s.unseen.Add(1)
			return
		}
	}
	if m := st.s.cfg.Metrics; m != nil {
		label := st.s.cfg.Table.Qualified()
		result := metrics.ResultFailure
		if v.ack {
			result = metrics.ResultSuccess
			if it.tx != nil {
				m.DeliveryLag.WithLabelValues(label).Observe(time.Since(it.tx.commit).Seconds())
			}
		}
		m.DispatchTotal.WithLabelValues(label, it.row.Topic, result).Inc()
	}
	if !v.ack && !subscriber.IsPermanent(v.err) && it.attempts < st.s.cfg.MaxAttempts {
		q.retryAt = time.Now().Add(st.s.cfg.Backoff(it.attempts))
		it.lastErr = redact.Summary(v.err.Error(), it.row.Payload, st.s.cfg.LastErrorMaxBytes)
		st.backingOff(q)
		st.s.logger.Debug("Nacked: key held until the retry", watermill.LogFields{"sequence": it.row.Sequence, "attempts": it.attempts})
		if (len(q.items) > st.s.cfg.MaxInFlight || st.moreInTable(it)) && st.spill(ctx, it.key, q) {
			return
		}
		st.dispatch(ctx, it.key)
		return
	}
	deadChanged := false
	if !v.ack {
		last := redact.Summary(v.err.Error(), it.row.Payload, st.s.cfg.LastErrorMaxBytes)
		var key *string
		if k := it.row.OrderingKey; k != nil && *k != "" && st.s.cols.OrderingKey {
			key = k
		}
		var changed, held int
		ok, err := st.write(ctx, "dead", st.s.q.MarkDeadHold, []any{&changed, &held}, it.row.ID, it.attempts, last, key)
		if err == nil && !ok {
			// Refused: this session no longer holds the slot. The row
			// stays as it is, unsettled; the session that holds the slot
			// delivers it. Nothing more goes out here: the session ends.
			st.draining = true
			return
		}
		if err != nil {
			// Not recorded: keep the key held and try again later.
			st.s.logger.Error("Could not park a row dead; retrying", err, watermill.LogFields{"sequence": it.row.Sequence})
			q.retryAt = time.Now().Add(st.s.cfg.Backoff(it.attempts))
			it.attempts--
			st.backingOff(q)
			st.dispatch(ctx, it.key)
			return
		}
		// A row already dead (a copy of a skipped row) or published holds
		// nothing: the statement changed no row.
		// An earlier row of a key that a later dead row holds goes dead
		// without moving the hold (MarkDeadHold keeps it).
		deadChanged = changed > 0 && held > 0
		st.s.logger.Info("Row dead", watermill.LogFields{"sequence": it.row.Sequence, "attempts": it.attempts})
		if k := it.row.OrderingKey; k != nil {
			st.s.logger.Trace("Dead", watermill.LogFields{"key": *k, "sequence": it.row.Sequence, "drained": it.tx == nil, "replay": it.replay})
		}
		if m := st.s.cfg.Metrics; m != nil {
			m.DeadTotal.WithLabelValues(st.s.cfg.Table.Qualified(), it.row.Topic).Inc()
		}
	}
	q.items = q.items[1:]
	q.retryAt = time.Time{}
	if h := st.holdOf(it); v.ack && it.tx != nil && h.replayedBy(it) {
		// The held row's replay: settled once its drain is written
		// (invariant R, hold.acked).
		st.settleAcked(h)
		h.acked = it
	} else {
		st.settled(it)
	}
	if !v.ack && it.row.OrderingKey != nil && *it.row.OrderingKey != "" && st.s.cols.OrderingKey && deadChanged {
		st.holdKey(*it.row.OrderingKey, it.row.Sequence, q)
	} else if v.ack {
		st.afterAck(ctx, it)
	}
	st.advance()
	st.dispatch(ctx, it.key)
}

// settled accounts for a row that needs nothing more.
func (st *stream) settled(it *item) {
	if it.tx != nil {
		st.unsettled--
		it.tx.pending--
		return
	}
	st.fromTable--
	if h := st.holdOf(it); h != nil && h.draining {
		h.left--
	}
}

// replayedBy reports whether it, acked, is the held row delivered again
// (a replay): its ack starts the hold's drain. A nil hold holds nothing.
func (h *hold) replayedBy(it *item) bool {
	return h != nil && !h.draining && !h.released && it.row.Sequence == h.seq
}

// settleAcked settles the held row's acked replay that waited for its
// drain (hold.acked), if any.
func (st *stream) settleAcked(h *hold) {
	if h != nil && h.acked != nil {
		st.settled(h.acked)
		h.acked = nil
	}
}

// holdOf is the hold of the item's key, or nil.
func (st *stream) holdOf(it *item) *hold {
	if it.row.OrderingKey == nil || *it.row.OrderingKey == "" {
		return nil
	}
	return st.holds[*it.row.OrderingKey]
}

// parks reports whether a streamed row of a held key is parked instead of
// delivered: a copy of a row a drain delivered (or skipped), every row of
// the key from the dead row on but the dead row's own replay, and while the
// hold drains, the rows it read from the table.
func (st *stream) parks(it *item) bool {
	h := st.holdOf(it)
	if h == nil {
		return false
	}
	seq := it.row.Sequence
	replayOfHeld := it.replay && seq == h.seq && !h.draining && !h.released
	switch {
	case replayOfHeld:
		return false
	case it.replay && h.released:
		// An operator's replay after the hold was resolved (of the skipped
		// row, say) is new work, not a copy of a drained row.
		return false
	case it.replay && seq < h.seq:
		// An operator's replay of an earlier row of the key (a dead row the
		// key went past): new work too. The hold's own drains read only
		// rows after its row; an earlier drain that read this row after
		// the replay delivered it already, and this is a copy (at least
		// once). Parked, it was lost: no drain reads it again.
		return false
	case seq <= h.through:
		return true
	case h.released:
		return false
	case h.draining:
		return seq <= h.maxRead || h.more
	}
	return seq >= h.seq
}

// holdKey holds the key of a row that went dead: its queued rows are
// parked (the holds table keeps them back). A tombstone's or an earlier
// drain's through is kept.
func (st *stream) holdKey(key string, seq int64, q *keyQueue) {
	st.backedOff(q)
	h := &hold{seq: seq}
	if old := st.holds[key]; old != nil {
		h.through = max(old.through, old.maxRead)
		st.settleAcked(old)
	}
	st.holds[key] = h
	for _, it := range q.items {
		st.settled(it)
	}
	q.items = nil
	st.s.logger.Info("Key held by a dead row: its later rows wait for a replay or a skip", watermill.LogFields{"sequence": seq})
	st.s.logger.Trace("Hold", watermill.LogFields{"key": key, "sequence": seq, "parked": len(q.items)})
}

// afterAck drains a hold whose dead row was delivered again, and releases
// a draining hold once its rows are delivered.
func (st *stream) afterAck(ctx context.Context, it *item) {
	h := st.holdOf(it)
	if h == nil {
		return
	}
	key := *it.row.OrderingKey
	switch {
	case h.replayedBy(it):
		st.startDrain(ctx, key, h)
	case h.draining && h.left == 0:
		st.drained(ctx, key, h)
	}
}

// drained follows a drain whose rows read so far are all settled: it
// reads the next batch when the last one was full, and releases the hold
// otherwise.
func (st *stream) drained(ctx context.Context, key string, h *hold) {
	if h.more {
		st.drainFrom(ctx, key, h, drainNext)
		return
	}
	st.release(ctx, key, h)
}

// drainMode is what drainFrom reads: the rows after the held row (a
// replay's ack or a skip), the held row and those after it (the retry of a
// retrying hold), or the batch after the last one read (a drain under way).
type drainMode uint8

const (
	drainStart drainMode = iota
	drainRetry
	drainNext
)

// startDrain reads the rows the hold kept back and queues them first.
func (st *stream) startDrain(ctx context.Context, key string, h *hold) {
	st.drainFrom(ctx, key, h, drainStart)
}

// startRetry retries a retrying hold: it reads the key's rows from the
// held row on and queues them, the held row first with its attempts.
// When a skip was requested meanwhile (RetryDrain changes nothing), the
// skip is applied instead (startDrain).
func (st *stream) startRetry(ctx context.Context, key string, h *hold) {
	st.drainFrom(ctx, key, h, drainRetry)
}

// drainFrom reads the rows of the hold's key after its row (and, for a
// retry, the held row too; for drainNext, after the last row read) and
// queues them in sequence order before the key's rows streamed after the
// read. It reads at most MaxInFlight rows (a batch): when the batch is
// full (more), the key's streamed rows stay parked and the next batch is
// read once this one is settled (drained), so a drain holds at most
// MaxInFlight rows read from the table and not settled, however long the
// key's backlog.
func (st *stream) drainFrom(ctx context.Context, key string, h *hold, mode drainMode) {
	retry := mode == drainRetry
	s := st.s
	h.wantDrain = true
	// The drain reads the rows parked behind the hold from the table: it
	// waits until every row the stream parked is visible (invariant V).
	if ok, err := st.visible(ctx); err != nil || !ok {
		if err != nil {
			s.logger.Error("Could not tell whether the streamed rows are visible; retrying at the next tick", err, nil)
			return
		}
		st.schedule(time.Now().Add(visibleDelay(h.unseen)))
		h.unseen++
		s.unseen.Add(1)
		return
	}
	h.unseen = 0
	after, sql, op := h.seq, s.q.Drain, "drain"
	switch mode {
	case drainRetry:
		after, sql, op = h.seq-1, s.q.RetryDrain, "retry"
	case drainNext:
		after = h.maxRead
	}
	batch := s.cfg.MaxInFlight
	items, err := st.readItems(ctx, s.q.Parked, key, after, batch)
	if err != nil {
		s.logger.Error("Could not read the rows of a held key; retrying at the next tick", err, nil)
		return
	}
	// Every row read was committed before this position: once the relay
	// confirmed it, the stream holds no more copies of them.
	var lsnText string
	if err := s.pool.QueryRow(ctx, s.q.InsertPosition).Scan(&lsnText); err != nil {
		s.logger.Error("Could not read the WAL position; retrying at the next tick", err, nil)
		return
	}
	lsn, err := pglogrepl.ParseLSN(lsnText)
	if err != nil {
		s.logger.Error("Could not read the WAL position; retrying at the next tick", err, nil)
		return
	}
	maxRead := h.seq
	if mode == drainNext {
		maxRead = h.maxRead
	}
	if len(items) > 0 {
		maxRead = max(maxRead, items[len(items)-1].row.Sequence)
	}
	var n int
	if ok, err := st.write(ctx, op, sql, []any{&n}, key, h.seq, maxRead, lsnText); err != nil || !ok {
		if err != nil {
			s.logger.Error("Could not mark a hold draining; retrying at the next tick", err, nil)
		}
		return
	}
	if retry && n == 0 {
		// A skip was requested while the hold was retrying: the held row
		// is not delivered, the rows behind it are.
		h.retrying = false
		st.startDrain(ctx, key, h)
		return
	}
	if retry && len(items) > 0 && items[0].row.Sequence == h.seq {
		items[0].attempts = max(h.attempts, int(items[0].row.Attempts))
	}
	// A drain after the held row's ack or skip retries no more; nor does
	// a retry's next batch (its held row was acked: the batch before it
	// is settled).
	h.retrying = h.retrying && retry
	h.draining, h.wantDrain, h.maxRead, h.left, h.untilLSN = true, false, maxRead, len(items), lsn
	h.more = len(items) == batch
	if h.acked != nil {
		st.settleAcked(h) // the hold says draining: the replay's position may pass
		st.advance()
	}
	if mode != drainNext {
		s.logger.Info("Hold drains: the key's parked rows are delivered", watermill.LogFields{"rows": len(items), "retry": retry, "more": h.more})
	}
	s.logger.Trace("Drain", watermill.LogFields{"key": key, "sequence": h.seq, "rows": len(items), "max_read": h.maxRead, "retry": retry, "more": h.more})
	if len(items) == 0 {
		st.release(ctx, key, h)
		return
	}
	k := keyOf(items[0].row)
	q := st.keys[k]
	if q == nil {
		q = &keyQueue{}
		st.keys[k] = q
	}
	q.items = mergeDrained(q, items)
	st.fromTable += len(items)
	st.peakRows()
	st.dispatch(ctx, k)
}

// spill spills the backlog of q, whose head waits for its retry, to a
// retrying hold (invariant S): the hold is written first, at the head
// (schema.WALQueries.Spill, fenced, with the head's attempts and last
// error on its row); then the key's rows leave memory, settled in the
// stream as parked rows, and the hold retries at the head's retry time.
// It reports whether the key was spilled; a key that cannot be
// (spillable) or a failed write leaves q as it is.
func (st *stream) spill(ctx context.Context, key string, q *keyQueue) bool {
	if !st.spillable(q) || time.Now().Before(st.spillPause) {
		return false
	}
	head := q.items[0]
	okey := *head.row.OrderingKey
	var through int64
	if old := st.holds[okey]; old != nil {
		through = max(old.through, old.maxRead)
	}
	var n int
	ok, err := st.write(ctx, "spill", st.s.q.Spill, []any{&n}, head.row.ID, okey, through, head.attempts, head.lastErr)
	switch {
	case err == nil && !ok:
		st.draining = true // refused: the session ends (as for a dead row)
		return false
	case err != nil || n == 0:
		if err == nil {
			err = errors.New("the key's hold could not be written")
		}
		st.s.logger.Error("Could not spill a retrying key's rows; they stay in memory", err, watermill.LogFields{"sequence": head.row.Sequence})
		st.spillPause = time.Now().Add(st.s.cfg.StatusInterval)
		return false
	}
	st.backedOff(q)
	rows := len(q.items)
	for _, it := range q.items {
		if it.tx != nil {
			st.unsettled--
			it.tx.pending--
		} else {
			st.fromTable-- // a drained row is read again at the retry
		}
	}
	h := &hold{seq: head.row.Sequence, through: through, retrying: true, retryAt: q.retryAt, attempts: head.attempts}
	st.holds[okey] = h
	q.items, q.retryAt = nil, time.Time{}
	st.s.spilled.Add(1)
	st.schedule(h.retryAt)
	st.s.logger.Info("A retrying key's rows spilled to its hold: they are delivered from the table at the retry", watermill.LogFields{"sequence": h.seq, "rows": rows})
	st.s.logger.Trace("Spill", watermill.LogFields{"key": okey, "sequence": h.seq, "rows": rows})
	st.advance()
	st.dispatch(ctx, key) // drops the empty queue
	return true
}

// moreInTable reports whether the key of it drains a backlog longer than
// the batch it read (hold.more): the key's backlog is in the table, and
// its head that waits for a retry is spilled again rather than kept in
// memory with the batch.
func (st *stream) moreInTable(it *item) bool {
	h := st.holdOf(it)
	return h != nil && h.draining && h.more
}

// spillable reports whether q's backlog can be spilled: the relay is not
// stopping, the table has the retrying column, q's head waits for its
// retry and has an ordering key, no queued row is an operator's replay (a
// replayed head's later rows may have been delivered, and a replayed row
// behind the head may come before it in sequence order: the retry reads
// neither back), and its key is not held by a dead row.
func (st *stream) spillable(q *keyQueue) bool {
	if !st.s.spills || st.draining || !q.backoff || q.inFlight || len(q.items) == 0 {
		return false
	}
	head := q.items[0]
	if k := head.row.OrderingKey; k == nil || *k == "" {
		return false
	}
	for _, it := range q.items {
		if it.replay {
			return false
		}
	}
	h := st.holdOf(head)
	return h == nil || h.released || h.draining
}

// relieve spills the retrying keys with the most rows queued while the
// read-ahead bound (backoffReadAhead x MaxInFlight rows, those behind
// retrying heads included) is what stops the stream, until it no longer
// does or no key can be spilled.
func (st *stream) relieve(ctx context.Context) {
	limit := st.s.cfg.MaxInFlight
	for st.s.spills && !st.draining && st.behind > 0 && st.unsettled-st.behind < limit && st.unsettled >= backoffReadAhead*limit {
		var key string
		var most *keyQueue
		for k, q := range st.keys {
			if (most == nil || len(q.items) > len(most.items)) && st.spillable(q) {
				key, most = k, q
			}
		}
		if most == nil || !st.spill(ctx, key, most) {
			return
		}
	}
}

// retryHolds retries the retrying holds that are due, and arms the retry
// timer for the others.
func (st *stream) retryHolds(ctx context.Context) {
	if st.draining {
		return
	}
	now := time.Now()
	for key, h := range st.holds {
		if h.draining && h.left == 0 && h.more && h.wantDrain {
			st.drainFrom(ctx, key, h, drainNext) // its next batch waited for the stream's rows to be visible
			continue
		}
		if h.draining || h.released {
			continue
		}
		if !h.retrying {
			if h.unseen > 0 && h.wantDrain {
				st.startDrain(ctx, key, h) // it waited for the stream's rows to be visible
			}
			continue
		}
		if h.retryAt.After(now) {
			st.schedule(h.retryAt)
			continue
		}
		st.startRetry(ctx, key, h)
		if st.fencedOut {
			return
		}
	}
}

// mergeDrained puts the rows a drain read into q in sequence order. The
// head of q stays first while it is in flight: its verdict settles q's
// first item (a skip while the held row's replay is in flight, or a drain
// restarted behind a streamed row of the key).
func mergeDrained(q *keyQueue, drained []*item) []*item {
	head := 0
	if q.inFlight && len(q.items) > 0 {
		head = 1
	}
	rest := q.items[head:]
	out := make([]*item, 0, len(q.items)+len(drained))
	out = append(out, q.items[:head]...)
	i, j := 0, 0
	for i < len(rest) || j < len(drained) {
		if j == len(drained) || (i < len(rest) && rest[i].row.Sequence <= drained[j].row.Sequence) {
			out = append(out, rest[i])
			i++
			continue
		}
		out = append(out, drained[j])
		j++
	}
	return out
}

// release turns a drained hold into a tombstone.
func (st *stream) release(ctx context.Context, key string, h *hold) {
	through := max(h.through, h.maxRead)
	var n int
	if ok, err := st.write(ctx, "release", st.s.q.Release, []any{&n}, key, h.seq, through); err != nil || !ok {
		if err != nil {
			st.s.logger.Error("Could not release a hold; retrying at the next tick", err, nil)
		}
		return
	}
	h.released, h.draining, h.retrying, h.through = true, false, false, through
	st.s.logger.Trace("Release", watermill.LogFields{"key": key, "sequence": h.seq, "through": through})
	st.forget(ctx, key, h)
}

// forget deletes a tombstone once the confirmed position passed every copy
// of the rows it parks.
func (st *stream) forget(ctx context.Context, key string, h *hold) {
	if !h.released || h.untilLSN > st.confirmed {
		return
	}
	var n int
	if ok, err := st.write(ctx, "forget", st.s.q.Forget, []any{&n}, key, h.seq); err != nil || !ok {
		if err != nil {
			st.s.logger.Error("Could not delete a hold's tombstone; retrying at the next tick", err, nil)
		}
		return
	}
	delete(st.holds, key)
}

// errFenced ends a session whose write the fence refused: another
// walsender holds the slot (or none does), so the session has ended on the
// server.
var errFenced = errors.New("walrelay: the session no longer holds the slot")

// write runs one of the session's fenced writes (schema.WALQueries): sql
// with args and the fence's arguments (the slot, the session's walsender
// pid, the slot's fence key), its columns scanned into dest and the last
// one into ok. A write the fence refused (ok false) changed nothing: it is
// counted (outbox_fence_rejected_total{op}), logged, not retried, and the
// session ends (fencedOut).
func (st *stream) write(ctx context.Context, op, sql string, dest []any, args ...any) (bool, error) {
	s := st.s
	args = append(args, s.cfg.Names.Slot, st.pid, st.fenceKey)
	var ok bool
	dest = append(dest, &ok)
	if hook := s.fenceHook; hook != nil {
		hook(op, "before")
		// Tests: a transaction, so that the hook runs between the
		// statement (its check passed or not) and the commit.
		tx, err := s.pool.Begin(ctx)
		if err != nil {
			return false, err
		}
		if err := tx.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			return false, err
		}
		hook(op, "checked")
		if err := tx.Commit(ctx); err != nil {
			return false, err
		}
	} else if err := s.pool.QueryRow(ctx, sql, args...).Scan(dest...); err != nil {
		return false, err
	}
	if !ok {
		st.fencedOut = true
		if m := s.cfg.Metrics; m != nil {
			m.FenceRejected.WithLabelValues(s.cfg.Table.Qualified(), op).Inc()
		}
		s.logger.Info("A write of a session that no longer holds the slot was refused; the session ends", watermill.LogFields{"op": op})
	}
	return ok, nil
}

// holdRow is one row of the holds table.
type holdRow struct {
	key                                 string
	seq, through                        int64
	draining, skipd, released, retrying bool
	until                               string
}

func (st *stream) readHolds(ctx context.Context) ([]holdRow, error) {
	rows, err := st.s.pool.Query(ctx, st.s.q.Holds)
	if err != nil {
		return nil, fmt.Errorf("read the holds: %w", err)
	}
	defer rows.Close()
	var out []holdRow
	for rows.Next() {
		var r holdRow
		if err := rows.Scan(&r.key, &r.seq, &r.draining, &r.skipd, &r.through, &r.released, &r.until, &r.retrying); err != nil {
			return nil, fmt.Errorf("read the holds: %w", err)
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// loadHolds reads the holds table at the start of a session.
func (st *stream) loadHolds(ctx context.Context) error {
	st.holds = map[string]*hold{}
	if !st.s.cols.OrderingKey {
		return nil
	}
	list, err := st.readHolds(ctx)
	if err != nil {
		return err
	}
	for _, r := range list {
		h := &hold{seq: r.seq, through: r.through, released: r.released}
		if r.until != "" {
			if h.untilLSN, err = pglogrepl.ParseLSN(r.until); err != nil {
				return fmt.Errorf("read the holds: %w", err)
			}
		}
		// A hold that was draining drains again from the start (at the
		// first tick): until then its key's rows are parked. A retrying
		// hold is retried at once, from its held row (draining or not:
		// its held row's ack was not recorded).
		h.retrying = r.retrying && !r.released
		if h.retrying {
			h.retryAt = time.Now()
		}
		h.wantDrain = r.draining && !r.released && !h.retrying
		st.holds[r.key] = h
	}
	return nil
}

// tickHolds, at each status tick while keys are held, applies skips,
// restarts drains (a session that began with a draining hold, or a drain
// whose statements failed), retries releases and forgets tombstones the
// confirmed position passed.
func (st *stream) tickHolds(ctx context.Context) {
	if len(st.holds) == 0 {
		return
	}
	list, err := st.readHolds(ctx)
	if err != nil {
		st.s.logger.Error("Could not read the holds", err, nil)
		return
	}
	for _, r := range list {
		h := st.holds[r.key]
		if h == nil || h.seq != r.seq {
			continue
		}
		switch {
		case h.released:
			st.forget(ctx, r.key, h)
		case h.retrying && !h.draining && !r.skipd:
			if !time.Now().Before(h.retryAt) {
				st.startRetry(ctx, r.key, h) // a retry whose statements failed before
			}
		case !h.draining && (r.skipd || r.draining || h.wantDrain):
			st.startDrain(ctx, r.key, h)
		case h.draining && h.left == 0:
			st.drained(ctx, r.key, h) // a next batch or a release that failed before
		}
	}
}

// readItems reads rows from the table (the columns of ClaimedRow.Scan,
// then ordering_key) as items without a transaction.
func (st *stream) readItems(ctx context.Context, sql string, args ...any) ([]*item, error) {
	rows, err := st.s.pool.Query(ctx, sql, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (*item, error) {
		var r schema.ClaimedRow
		err := r.ScanKeyed(row, st.s.cols)
		return &item{row: r, key: keyOf(r)}, err
	})
}

// advance moves the confirmed position over the settled prefix of
// transactions.
func (st *stream) advance() {
	n := 0
	for n < len(st.txns) && st.txns[n].committed && st.txns[n].pending == 0 {
		st.confirmed = max(st.confirmed, st.txns[n].end)
		n++
	}
	if n > 0 {
		st.txns = append(st.txns[:0], st.txns[n:]...)
	}
	if st.backfillIDs != nil && st.confirmed >= st.backfillUntil {
		st.backfillIDs = nil // the stream is past every copy
	}
	st.markOldest()
}

// markOldest publishes the commit time of the oldest unsettled
// transaction for SlotLag.
func (st *stream) markOldest() {
	if len(st.txns) == 0 {
		st.s.oldestUnsettled.Store(0)
		return
	}
	st.s.oldestUnsettled.Store(st.txns[0].commit.UnixNano())
}

// binaryText renders a binary-format value of type oid as the text the
// row needs. Timestamps are not used by the message and render as "".
func binaryText(oid uint32, b []byte) (string, error) {
	switch oid {
	case 25, 1043, 19: // text, varchar, name
		return string(b), nil
	case 2950: // uuid
		if len(b) != 16 {
			return "", fmt.Errorf("uuid of %d bytes", len(b))
		}
		u, _ := uuid.FromBytes(b)
		return u.String(), nil
	case 20: // int8
		if len(b) != 8 {
			return "", fmt.Errorf("int8 of %d bytes", len(b))
		}
		return strconv.FormatInt(int64(binary.BigEndian.Uint64(b)), 10), nil //nolint:gosec // a bit pattern
	case 23: // int4
		if len(b) != 4 {
			return "", fmt.Errorf("int4 of %d bytes", len(b))
		}
		return strconv.FormatInt(int64(int32(binary.BigEndian.Uint32(b))), 10), nil //nolint:gosec // a bit pattern
	case 3802: // jsonb: version byte 1, then the text
		if len(b) == 0 || b[0] != 1 {
			return "", errors.New("jsonb of an unknown binary version")
		}
		return string(b[1:]), nil
	case 1184, 1114: // timestamptz, timestamp: set or not is all the relay reads
		return "", nil
	}
	return "", fmt.Errorf("type oid %d in binary form is not read by the WAL relay", oid)
}
