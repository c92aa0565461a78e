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
// the head (sqlq.WALQueries.Spill), then its queued rows leave memory
// (they are in the table, parked behind the hold, as behind a dead row),
// and the stream is read on for the other keys; at the retry the key
// drains from the table, head first. After MaxAttempts (or at once for a
// permanent error, subscriber.Permanent) the row is parked dead in the table
// (dead_at, last_error) and the key goes on. A replay (runbook.Runbook.ReplayEvent,
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
// (term.Term.Hand), so the core's invariants hold here: (one copy per key) at most one
// copy of a key is out in the relay, and a session hands out no key that a
// copy of an ended session still holds (term.Ledger.Stale; its end wakes
// the loop through term.Ledger.Freed); (a term's end cancels its messages) a session's end cancels the
// contexts of its messages still in handlers; (a verdict of an ended term is not progress) a verdict counts only
// if its copy ended under the live session, and only the session's loop
// applies verdicts, before it ends its term (the position it confirms at
// its end covers only those); (nothing waits forever) a
// copy an ended session left in a handler ends at its verdict, CloseTimeout
// after the session ended, or the relay's stop.
//
// The write fence: the session fences its writes in the database, across relay
// processes: every write of holds, dead rows or progress (the statements
// of sqlq.WALQueries: MarkDeadHold, Spill, Drain, which applies skips
// too, RetryDrain, Release, Forget, Progress) applies only while the session's own
// walsender holds the slot (pg_replication_slots.active_pid equals the
// replication connection's PID), checked in the statement under the
// slot's fence lock taken shared; a session, once it holds the slot and
// before it reads the holds, takes and releases that lock exclusively
// (sqlq.WALFenceHandover). So every write of an earlier session, in this
// process or another, either committed before the new session read the
// holds, or changes nothing. A refused write is counted
// (outbox_fence_rejected_total), logged, not retried, and ends the session.
//
// A spill loses nothing: a spill never loses a row nor lets a key's later row pass its head:
// the retrying hold commits (fenced, the write fence) before the key's rows leave
// memory, so the confirmed position passes a row only once it is settled
// or covered by a hold in the table; while the hold is retrying, every
// streamed row of the key from the head on is parked; its retry reads the
// key's rows from the head on from the table and delivers them in
// sequence order, before the key's rows streamed after that read; a
// session that finds a retrying hold (after a crash, a cut or a restart)
// retries it at once, from the head.
//
// A replay's ack waits for its drain: the acked replay of a held
// row stays unsettled (the confirmed position does not pass its UPDATE)
// until the drain it starts is written and the hold says draining. A
// session that ends first (its drain waiting for its rows to be visible, or a failed
// write) leaves the replay to be streamed again by the next session, which
// delivers it again and drains; before, the next session read the hold as
// plain dead and the rows parked behind it were never delivered.
package walrelay

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/pgmeta"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Defaults of Config.
const (
	MaxInFlightDefault    = 4096
	StatusIntervalDefault = time.Second
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
	// Backoff returns the delay before the next attempt after attempt
	// failed. Defaults to subscriber.DefaultBackoff.
	Backoff func(attempt int) time.Duration
	// MaxInFlight bounds the messages handed out and not settled (a message
	// counts until its handler returns, also after the relay gave up on it:
	// DispatchTimeout passed or its session ended), and the rows read and
	// not settled: the relay stops reading the stream beyond
	// it, not counting the rows queued behind a key whose head waits for
	// its retry, up to 4 x MaxInFlight rows in all. A keyed row's backlog
	// behind its retrying head is spilled to a retrying hold once it
	// passes MaxInFlight rows, or when the 4 x MaxInFlight bound is
	// reached, so a retrying key does not stop the stream; rows without an
	// ordering key (ordered by topic) are not spilled. A transaction's rows
	// count as they are read (they are not buffered until its commit).
	// Defaults to MaxInFlightDefault (4096). It is not the table relay's
	// 2 x BatchSize: the table relays lease what they claim, so their bound
	// is also how many leases one relay holds; the WAL relay leases
	// nothing, and its bound only limits the memory of rows read ahead.
	MaxInFlight int
	// StatusInterval is how often the relay confirms its position to the
	// server. Defaults to StatusIntervalDefault.
	StatusInterval time.Duration
	// ElectionInterval is how often a standby tries to take the slot.
	// Defaults to subscriber.ElectionIntervalDefault.
	ElectionInterval time.Duration
	// CloseTimeout bounds how long Close waits for messages in flight.
	// Defaults to subscriber.CloseTimeoutDefault.
	CloseTimeout time.Duration
	// DispatchTimeout is how long a handler may keep a message: the
	// message's context ends DispatchTimeout after it was handed over (or
	// earlier, at its ack or nack or the session's end). A handler that
	// returns when its context ends and nacks has its row retried after
	// Backoff, as for any nack. A handler that ignores its context and
	// has not answered CloseTimeout later has overrun, as in ordered mode:
	// the relay gives up on it, counts a failed attempt and delivers the
	// key again after Backoff (or the row is dead), so that a hung handler
	// does not hold its key, and the slot's confirmed position, for good;
	// until then the key's message is not handed out again (one copy per
	// key, within the overrun). Set it to the router's dispatch timeout,
	// as for subscriber.Config.DispatchTimeout. Defaults to
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
		c.ElectionInterval = subscriber.ElectionIntervalDefault
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = subscriber.CloseTimeoutDefault
	}
	if c.DispatchTimeout == 0 {
		c.DispatchTimeout = subscriber.DispatchTimeoutDefault
	}
	if c.LastErrorMaxBytes == 0 {
		c.LastErrorMaxBytes = subscriber.LastErrorMaxBytesDefault
	}
}

// validate checks c with the rule of every relay's configuration
// (keyed.CheckSettings): a table, and no negative count or duration (0
// takes the default).
func (c Config) validate() error {
	if err := keyed.CheckSettings(c.Table,
		keyed.Setting{Name: "MaxAttempts", Value: int64(c.MaxAttempts)}, keyed.Setting{Name: "MaxInFlight", Value: int64(c.MaxInFlight)},
		keyed.Setting{Name: "StatusInterval", Value: int64(c.StatusInterval)}, keyed.Setting{Name: "ElectionInterval", Value: int64(c.ElectionInterval)},
		keyed.Setting{Name: "CloseTimeout", Value: int64(c.CloseTimeout)}, keyed.Setting{Name: "DispatchTimeout", Value: int64(c.DispatchTimeout)},
		keyed.Setting{Name: "LastErrorMaxBytes", Value: int64(c.LastErrorMaxBytes)}); err != nil {
		return fmt.Errorf("walrelay: invalid config: %w", err)
	}
	return nil
}

// Subscriber streams one outbox table's rows from its replication slot. It
// implements message.Subscriber.
type Subscriber struct {
	pool   *pgxpool.Pool
	cfg    Config
	cols   schema.Columns
	q      sqlq.WALQueries
	logger watermill.LoggerAdapter
	conn   string

	mu         sync.Mutex
	subscribed bool
	closed     bool
	// deadLetters is set when the subscription's consumer refuses a
	// message carrying a cause (package deadletter: Forwarder.AddTo's
	// subscription): a row that cannot become a message is then handed
	// over without its headers, refused, so the router's poison queue
	// sees it.
	deadLetters atomic.Bool
	cancel      context.CancelFunc
	done        chan struct{}

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

	spilled atomic.Int64 // keys spilled (tests)
	unseen  atomic.Int64 // statements put off until a streamed transaction was visible (tests)

	hooks testHooks // zero in production; set by tests only (export_test.go)
}

// testHooks are the seams the tests set through export_test.go; a
// Subscriber made by New leaves them zero, which changes nothing.
type testHooks struct {
	// fence runs before each fenced write ("before") and, when set, the
	// write runs in a transaction and the hook runs again after its
	// statement and before its commit ("checked").
	fence func(op, phase string)
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
	s := &Subscriber{pool: pool, cfg: cfg, cols: cols, q: sqlq.NewWALQueries(cfg.Table, cols), conn: conn,
		logger: logger.With(watermill.LogFields{"table": cfg.Table.String(), "slot": cfg.Names.Slot})}
	if err := s.checkHolds(ctx); err != nil {
		return nil, err
	}
	s.terms = s.newTerms()
	return s, nil
}

// checkHolds verifies that the holds of t are kept where this version
// keeps them: in the one holds table both keyed modes share
// (schema.Table.HoldsTable), with no table of an older version's holds
// left (<table>_wal_holds, which Setup moves), and that t has skipped_at.
// A table without the ordering_key column holds no key.
func (s *Subscriber) checkHolds(ctx context.Context) error {
	t := s.cfg.Table
	if !s.cols.OrderingKey {
		return nil
	}
	var ready, legacy, skippedAt bool
	if err := s.pool.QueryRow(ctx, sqlq.WALHoldsReady(t)).Scan(&ready, &legacy, &skippedAt); err != nil {
		return fmt.Errorf("walrelay: look up the holds table of %s: %w", t, err)
	}
	if !skippedAt {
		return fmt.Errorf("%w: %s has no skipped_at column, where this version records a skip; run walrelay.Setup (outbox migrate --wal) once, "+
			"as the table's owner, with the table's older WAL relays stopped: it adds the column without rewriting the table", ErrNotSetUp, t)
	}
	if legacy || !ready {
		return fmt.Errorf("%w: this version keeps the WAL relay's holds of %s in %s, which is missing or not yet in this version's shape"+
			" (the holds of an older version, if any, are in %s); run walrelay.Setup (outbox migrate --wal) once, as the table's owner, with the"+
			" table's older WAL relays stopped: it moves them", ErrNotSetUp, t, t.HoldsTable(), sqlq.LegacyWALHoldsTable(t))
	}
	return nil
}

// newTerms is the relay's term ledger: a copy a session's end left in a
// handler holds its key back for CloseTimeout at most after the session
// ended, and a copy of a live session is overdue after its overrun
// (overrunAfter), as in ordered mode.
func (s *Subscriber) newTerms() *term.Ledger {
	return term.New(term.Config{Overrun: s.cfg.CloseTimeout, Overdue: s.overrunAfter(), OnStaleEnd: s.staleEnded})
}

// overrunAfter is how long a handler may keep a message before the relay
// gives up on it and counts a failed attempt: DispatchTimeout (when the
// message's context ends) plus CloseTimeout, the time a handler is given to
// answer after its context ended, as after a session's end.
func (s *Subscriber) overrunAfter() time.Duration { return s.cfg.DispatchTimeout + s.cfg.CloseTimeout }

// overrunError is the failure an overdue copy's attempt records.
func (s *Subscriber) overrunError() error {
	return fmt.Errorf("handler overran: no ack or nack %s after delivery (DispatchTimeout %s plus CloseTimeout %s); the key is delivered again",
		s.overrunAfter(), s.cfg.DispatchTimeout, s.cfg.CloseTimeout)
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
	s.deadLetters.Store(deadletter.Wanted(ctx))
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel = cancel
	s.done = make(chan struct{})
	out := make(chan *message.Message)
	// The presence lock is taken before Subscribe returns, so a mode switch
	// that starts after it sees this relay (run takes it again if it fails
	// here, or when its connection breaks).
	presence := &presence{pool: s.pool, key: pgmeta.WALRelay(s.cfg.Table.Qualified())}
	if err := presence.hold(rctx); err != nil {
		s.logger.Error("Could not take the WAL relay's presence lock; a mode switch may not see this relay until it is taken", err, nil)
	}
	go func() {
		select {
		case <-ctx.Done():
			cancel()
		case <-rctx.Done(): // Close
		}
	}()
	go s.run(rctx, out, presence)
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
func (s *Subscriber) run(ctx context.Context, out chan *message.Message, presence *presence) {
	defer close(s.done)
	defer close(out)
	// After the last session: the copies left in handlers by ended
	// sessions no longer hold anything back, and the goroutines that
	// follow them end (nothing waits forever).
	defer s.terms.Close()
	switchedAway := false // logged once per switch away
	defer presence.leave()
	for ctx.Err() == nil {
		if switchedAway && s.stillAway(ctx) {
			// Holding no presence lock: further switches of the table
			// do not wait for this relay, which streams nothing.
			if !s.waitElection(ctx) {
				return
			}
			continue
		}
		if err := presence.hold(ctx); err != nil {
			s.logger.Error("Could not take the WAL relay's presence lock; a mode switch may not see this relay between sessions", err, nil)
		}
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
		} else if errors.Is(err, errSwitchedAway) {
			if !switchedAway {
				s.logger.Error("Standing by: the table was switched away from the WAL relay", err, nil)
			}
		} else if err != nil {
			s.logger.Error("WAL stream ended; retrying", err, watermill.LogFields{"retry_in": s.cfg.ElectionInterval.String()})
		}
		switchedAway = errors.Is(err, errSwitchedAway)
		if switchedAway {
			// Give the presence lock back, as a default or ordered relay
			// gives its mode lock back on a table switched away; it is
			// taken again before the next session once the table is
			// switched back to the WAL relay.
			presence.leave()
		}
		if !s.waitElection(ctx) {
			return
		}
	}
}

// waitElection waits ElectionInterval; false when ctx ended first.
func (s *Subscriber) waitElection(ctx context.Context) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(s.cfg.ElectionInterval):
		return true
	}
}

// stillAway reports whether the table is still recorded in another mode
// (stillWAL; an error reading it counts as away: the next session reads it
// again, under the presence lock).
func (s *Subscriber) stillAway(ctx context.Context) bool {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	return s.stillWAL(qctx, s.pool) != nil
}

// policy is the decision about failed attempts, the same as the ordered
// and default relays' (keyed.Policy).
func (s *Subscriber) policy() keyed.Policy {
	return keyed.Policy{MaxAttempts: s.cfg.MaxAttempts, Backoff: s.cfg.Backoff, LastErrorMaxBytes: s.cfg.LastErrorMaxBytes, Permanent: subscriber.IsPermanent}
}

// presence holds, on a connection of its own (outside the pool, as the
// table relays hold their mode lock on their notifier connection), the
// lock that says a WAL relay is subscribed to the table (pgmeta.WALRelay,
// shared), so that a mode switch refuses while it runs, between sessions
// too.
type presence struct {
	pool *pgxpool.Pool
	key  int64
	conn *pgx.Conn
}

// hold takes the lock, or checks that the connection holding it is alive
// and takes it again on a new one when it is not.
func (p *presence) hold(ctx context.Context) error {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if p.conn != nil {
		if _, err := p.conn.Exec(qctx, `SELECT 1`); err == nil {
			return nil
		}
		_ = p.conn.Close(qctx) // a broken connection: its lock is gone with it
		p.conn = nil
	}
	conn, err := pgx.ConnectConfig(qctx, p.pool.Config().ConnConfig.Copy())
	if err != nil {
		return err
	}
	if _, err := conn.Exec(qctx, `SELECT pg_advisory_lock_shared($1)`, p.key); err != nil {
		_ = conn.Close(qctx)
		return err
	}
	p.conn = conn
	return nil
}

// leave releases the lock, then ends the connection. The unlock is
// explicit because a closed connection's backend releases its locks only
// when it exits, after Close has returned: a switch made right after the
// relay's Close would still see it.
func (p *presence) leave() {
	if p.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = p.conn.Exec(ctx, `SELECT pg_advisory_unlock_shared($1)`, p.key)
	_ = p.conn.Close(ctx)
	p.conn = nil
}
