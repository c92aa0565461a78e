package subscriber

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Subscriber is a message.Subscriber over one outbox table. Create it with
// New; it is safe for concurrent use.
type Subscriber struct {
	pool   *pgxpool.Pool
	cfg    Config
	q      *sqlq.Queries
	oq     *sqlq.OrderedQueries // ordered mode only
	pq     sqlq.PausedTopicsQueries
	paused pausedState // the topics an operator paused (paused.go)
	logger watermill.LoggerAdapter
	label  string // table label for metrics

	// orderedAtStart: New found the table without ordered mode's
	// companion tables, which the start's switch to ordered mode creates
	// (recordMode checks them after it).
	orderedAtStart bool

	// The background (acker, elector, listener, stats) runs while at least
	// one subscription does (or is being set up): start and stopBackground,
	// under closeMu.
	active   int  // subscriptions running or being set up
	running  bool // the background runs
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bgWg     sync.WaitGroup // elector, stats
	leader   *elector
	wake     broadcaster
	// notices wakes the subscriptions that deliver death notices
	// (notices.go) when this subscriber parked a row dead outside the
	// router, or became the leader.
	notices  broadcaster
	notifier *notifier // nil with DisableNotify
	// modeLock holds the relay-mode lock of the table (modelock.go) on the
	// pool's notifier connection while the background runs; modeHeld says
	// it was taken (under modeMu).
	modeLock *notifier
	modeMu   sync.Mutex
	modeHeld bool
	idle     idleSignal // the claim loop's (unkeyed rows)
	oidle    idleSignal // the ordered relay's (keyed rows)

	acks      chan ackReq
	ackStop   chan struct{}
	ackerWg   sync.WaitGroup
	closing   chan struct{}
	closed    atomic.Bool
	closeMu   sync.Mutex
	subsWg    sync.WaitGroup
	closeErr  error
	closeDone chan struct{} // closed when Close has finished

	ordered      []*orderedRelay // the ordered relays of its subscriptions (guarded by closeMu)
	writeTimeout time.Duration   // bounds each ack, nack, renewal or release write
	bounded      *boundedClaims  // the bounded claim (boundedclaim.go), nil when claims take no bound

	hotSubs hotSubs // the subscriptions a HotPath hands events to (hot.go)

	hooks testHooks // zero in production; set by tests only (export_test.go)
}

// testHooks are the seams the tests set through export_test.go; a
// Subscriber made by New leaves them zero, which changes nothing.
type testHooks struct {
	abandon         atomic.Bool // ordered relays stop like a killed process, giving nothing back
	beforeIdle      func()      // runs before a subscription tries the idle lock
	afterClaimQuery func()      // runs between a claim's query and its rows
}

var _ message.Subscriber = (*Subscriber)(nil)

// New returns a Subscriber for cfg.Table on pool. It checks that the table
// exists and detects its optional columns. While a subscription runs, a
// single-active subscriber holds one connection of the pool (the leader's),
// and all subscribers on a pool share one listening connection: size the
// pool for them. When the context of every subscription has ended, the
// subscriber holds no connection (a deferred pool.Close returns) until it
// is subscribed again; Close is still needed to end it. ctx bounds the
// checks New makes (30 s at most); the subscriber does not keep it. New has
// the shape of walrelay.New.
func New(ctx context.Context, pool *pgxpool.Pool, cfg Config, logger watermill.LoggerAdapter) (*Subscriber, error) {
	if pool == nil {
		return nil, errors.New("subscriber: nil pool; pass a *pgxpool.Pool")
	}
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, fmt.Errorf("subscriber: invalid config: %w", err)
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cols, err := schema.DetectColumns(ctx, pool, cfg.Table)
	if err != nil {
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	if err := schema.CheckDeadAt(ctx, pool, cfg.Table); err != nil {
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	if cols.OrderingKey {
		if err := sqlq.CheckRelayMode(ctx, pool, cfg.Table, cfg.Ordered, sqlq.LockKey(cfg.Table), cfg.LockTTL, 0); err != nil {
			return nil, fmt.Errorf("subscriber: %w", err)
		}
	}
	var (
		oq      *sqlq.OrderedQueries
		atStart bool
	)
	if cfg.Ordered {
		if oq, atStart, err = checkOrdered(ctx, pool, cfg.Table, cols); err != nil {
			return nil, err
		}
	}
	s := &Subscriber{
		oq:             oq,
		orderedAtStart: atStart,
		pool:           pool,
		cfg:            cfg,
		q:              sqlq.NewQueries(cfg.Table, cols),
		pq:             sqlq.NewPausedTopicsQueries(cfg.Table),
		logger:         logger.With(watermill.LogFields{"table": cfg.Table.String()}),
		label:          cfg.Table.Qualified(),
		acks:           make(chan ackReq, 4*cfg.BatchSize),
		closing:        make(chan struct{}),
		writeTimeout:   opTimeout,
		closeDone:      make(chan struct{}),
	}
	s.idle.s, s.idle.key = s, sqlq.IdleLockKey(cfg.Table)
	s.oidle.s, s.oidle.key = s, sqlq.OrderedIdleLockKey(cfg.Table)
	if s.bounded, err = newBoundedClaims(ctx, s); err != nil {
		return nil, fmt.Errorf("subscriber: %w", err)
	}
	return s, nil
}

// start starts the background a subscription needs, unless it runs; the
// caller holds closeMu.
func (s *Subscriber) start() {
	if s.running {
		return
	}
	s.running = true
	s.bgCtx, s.bgCancel = context.WithCancel(context.Background())
	s.ackStop = make(chan struct{})
	s.ackerWg.Add(1)
	go s.runAcker()
	if !s.cfg.DisableSingleActive && !s.cfg.Ordered {
		if s.leader == nil {
			s.leader = &elector{s: s}
		}
		s.bgWg.Add(1)
		go s.leader.run(s.bgCtx)
	}
	s.modeLock = acquireNotifier(s.pool, s.logger)
	if !s.cfg.DisableNotify {
		s.notifier = s.modeLock
		s.notifier.add(sqlq.NotifyChannel(s.cfg.Table), &s.wake)
	}
	if s.cfg.Metrics != nil {
		s.bgWg.Add(1)
		go s.runStats(s.bgCtx)
	}
}

// stopBackground stops what start started, once no subscription runs: the
// pending acks are written, the leader resigns (a standby stops trying), the
// relay-mode lock and the listening connection are given back, so the
// subscriber holds no connection of the pool and a deferred pool.Close
// returns even when no one closes the subscriber (a Watermill router closes
// its subscribers only in Router.Close, not when Run's context ends). The
// next Subscribe starts it again. The caller holds closeMu.
func (s *Subscriber) stopBackground() {
	if !s.running {
		return
	}
	s.running = false
	close(s.ackStop)
	s.ackerWg.Wait()
	s.bgCancel()
	s.bgWg.Wait()
	if s.notifier != nil {
		s.notifier.remove(sqlq.NotifyChannel(s.cfg.Table), &s.wake)
		s.notifier = nil
	}
	s.modeMu.Lock()
	if s.modeHeld {
		s.modeLock.leaveMode(s)
		s.modeHeld = false
	}
	s.modeMu.Unlock()
	s.modeLock.release()
	s.modeLock = nil
}

// IsLeader reports whether this subscriber holds the table's single-active
// lock. It is always true with DisableSingleActive.
func (s *Subscriber) IsLeader() bool {
	return s.leader == nil || s.leader.isLeader.Load()
}

// Subscribe delivers the rows whose topic column equals topic, or every row
// for AllTopics, until ctx is done or the subscriber is closed; then the
// channel is closed. Ack marks the row published; Nack schedules a retry or
// marks it dead (see package doc).
func (s *Subscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	if topic == "" {
		return nil, errors.New("subscriber: empty topic; pass a topic or subscriber.AllTopics")
	}
	if s.cfg.Ordered && topic != AllTopics {
		return nil, errors.New("subscriber: ordered mode relays every topic of the table in key order; subscribe with subscriber.AllTopics")
	}
	s.closeMu.Lock()
	if s.closed.Load() {
		s.closeMu.Unlock()
		return nil, ErrSubscriberClosed
	}
	s.start()
	s.active++ // the background stays up while the mode lock is taken
	s.closeMu.Unlock()

	err := s.holdMode(ctx)

	s.closeMu.Lock()
	defer s.closeMu.Unlock()
	if err != nil || s.closed.Load() {
		if s.active--; s.active == 0 {
			s.stopBackground()
		}
		switch {
		case s.closed.Load():
			return nil, ErrSubscriberClosed
		case ctx.Err() != nil:
			// Ended by its context before it began: a closed channel,
			// as for a subscription whose context ends later.
			out := make(chan *message.Message)
			close(out)
			return out, nil
		}
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	sub := &subscription{
		s:      s,
		topic:  topic,
		out:    make(chan *message.Message),
		ctx:    ctx,
		cancel: cancel,
		wake:   s.wake.register(),
		retry:  keyed.NewAlarm(),
		logger: s.logger.With(watermill.LogFields{"topic": topic}),
		hot:    make(chan *claimed, maxHotQueue),
		// Only the forwarder (Forwarder.AddTo) asks for the messages meant
		// for the router's dead-letter path: it refuses them.
		deadLetters: deadletter.Wanted(ctx),
	}
	var stale func() int
	if s.cfg.Ordered {
		sub.ordered = newOrderedRelay(sub)
		s.ordered = append(s.ordered, sub.ordered)
		stale = sub.ordered.terms.Lingering
	}
	sub.slots = keyed.NewSlots(s.cfg.MaxInFlight, stale)
	if sub.ordered != nil {
		sub.ordered.keyed = keyed.NewEngine(sub.slots)
	}
	s.hotSubs.add(sub)
	s.subsWg.Add(1)
	go func() {
		defer s.subsWg.Done()
		sub.run()
		s.closeMu.Lock()
		defer s.closeMu.Unlock()
		if s.active--; s.active == 0 {
			s.stopBackground()
		}
	}()
	return sub.out, nil
}

// holdMode takes the relay-mode lock of the table for s, unless it holds
// it (modelock.go): so no relay of the other mode starts on the table while
// this one may deliver (sqlq.CheckRelayMode). It waits for the notifier's
// connection until ctx ends or s is closed.
func (s *Subscriber) holdMode(ctx context.Context) error {
	s.modeMu.Lock()
	defer s.modeMu.Unlock()
	if s.modeHeld {
		return nil
	}
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-s.closing:
			cancel()
		case <-mctx.Done():
		}
	}()
	if err := s.modeLock.enterMode(mctx, s); err != nil {
		return err
	}
	if err := s.recordMode(mctx); err != nil {
		s.modeLock.leaveMode(s)
		return err
	}
	s.modeLock.switchedBack(s)
	s.modeHeld = true
	return nil
}

// Close stops every subscription: claims stop, messages in flight get up to
// CloseTimeout to be acked or nacked, the remaining leases are given back,
// pending acks are written, and the connections are returned. Close is
// idempotent and safe to call while subscriptions are blocked; a second call
// (a router closes its subscribers too) waits until the first has finished.
func (s *Subscriber) Close() error {
	s.closeMu.Lock()
	if s.closed.Swap(true) {
		s.closeMu.Unlock()
		<-s.closeDone
		return s.closeErr
	}
	defer close(s.closeDone)
	close(s.closing)
	s.closeMu.Unlock()

	s.subsWg.Wait()
	s.closeMu.Lock()
	s.stopBackground()
	s.closeMu.Unlock()
	return s.closeErr
}

// claim leases up to n rows for topic, on the leader's connection when
// single-active, else on the pool.
func (s *Subscriber) claim(ctx context.Context, topic string, n int) ([]*claimed, error) {
	paused := s.pausedTopics(ctx)
	query, args := s.q.ClaimAll, []any{s.cfg.MaxAttempts, s.cfg.LockTTL.Seconds(), n}
	switch {
	case topic != AllTopics && paused.has(topic):
		return nil, nil // resumed at the next wake-up or poll
	case topic != AllTopics:
		query, args = s.q.ClaimTopic, append(args, topic)
		if s.oq != nil {
			query = s.q.ClaimTopicUnkeyed
		}
	case paused != nil:
		query, args = s.q.ClaimAllExcept, append(args, paused.topics)
		if s.oq != nil {
			query = s.q.ClaimAllUnkeyedExcept // keyed rows go through the ordered relay
		}
	case s.oq != nil:
		query = s.q.ClaimAllUnkeyed // keyed rows go through the ordered relay
	}
	if s.bounded != nil && topic == AllTopics && s.oq == nil && paused == nil {
		return s.bounded.claim(ctx, s, n) // boundedclaim.go
	}
	out, _, err := s.claimQuery(ctx, query, args, claimOpts{}, nil)
	if err != nil {
		return nil, err
	}
	return s.unpaused(out), nil
}

// claimOpts says where a claim runs and what it returns besides the
// claimed columns.
type claimOpts struct {
	// onPool runs the claim on the pool even when single-active (the
	// bounded claim's sweep), else it runs on the leader's connection.
	onPool bool
	// dueAt reads one more column after parked, the row's available_at
	// before the claim, into claimed.dueAt (the bounded claim's).
	dueAt bool
}

// claimPrelude is a statement sent with a claim in one round trip, before
// it (the bounded claim's cut): scan reads its one row.
type claimPrelude struct {
	sql  string
	args []any
	scan func(pgx.Row) error
}

// claimQuery runs one claim statement (query with args) and returns the rows
// it leased, sorted by sequence, after counting and logging the rows it
// parked dead, and how many it parked (see claimOpts). pre, when set, is
// sent in the same batch before the claim. The caller gives back the rows
// of the topics paused meanwhile (unpaused), after it has judged from all
// of them whether the statement was full: a claim whose rows a pause
// filters still took its batch in index order.
func (s *Subscriber) claimQuery(ctx context.Context, query string, args []any, opts claimOpts, pre *claimPrelude) ([]*claimed, int, error) {
	// No claim while the relay-mode lock is down or the table was switched
	// away (modelock.go); the loops that claim wait before they ask.
	if err := s.modeLock.modeReady(s); err != nil {
		return nil, 0, fmt.Errorf("subscriber: claim on %s: %w", s.cfg.Table, err)
	}
	// The claim commits its leases as it runs: cancelled between its UPDATE
	// and the reading of its rows, it would orphan the batch until LockTTL.
	// So it runs on a context of its own, detached from ctx's cancellation
	// and bounded by opTimeout; the caller gives back what it cannot deliver.
	qctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), opTimeout)
	defer cancel()
	var out, parked []*claimed
	run := func(ctx context.Context, conn interface {
		Query(context.Context, string, ...any) (pgx.Rows, error)
		SendBatch(context.Context, *pgx.Batch) pgx.BatchResults
	}) (err error) {
		var rows pgx.Rows
		if pre == nil {
			rows, err = conn.Query(ctx, query, args...)
		} else {
			b := &pgx.Batch{}
			b.Queue(pre.sql, pre.args...)
			b.Queue(query, args...)
			br := conn.SendBatch(ctx, b)
			defer func() {
				if cerr := br.Close(); err == nil {
					err = cerr
				}
			}()
			if err := pre.scan(br.QueryRow()); err != nil {
				return err
			}
			rows, err = br.Query()
		}
		if err != nil {
			return err
		}
		defer rows.Close()
		if s.hooks.afterClaimQuery != nil {
			s.hooks.afterClaimQuery()
		}
		for rows.Next() {
			c := &claimed{}
			var extra []any
			if opts.dueAt {
				extra = []any{&c.dueAt}
			}
			if err := c.row.ScanClaim(rows, s.q.Columns, extra...); err != nil {
				return err
			}
			if c.row.Parked {
				parked = append(parked, c)
				continue
			}
			out = append(out, c)
		}
		return rows.Err()
	}
	var err error
	if s.leader != nil && !opts.onPool {
		err = s.leader.withConn(qctx, func(ctx context.Context, conn *pgx.Conn) error { return run(ctx, conn) })
	} else {
		err = run(qctx, s.pool)
	}
	if err != nil {
		return nil, 0, fmt.Errorf("claim from %s: %w", s.cfg.Table, err)
	}
	for _, c := range parked {
		s.wentDead(c.row.Topic)
		s.logger.Error("Outbox message is dead: the lease of its last allowed attempt expired; replay it once the cause is fixed",
			errors.New("lease expired on the last attempt"),
			watermill.LogFields{"event_id": c.row.EventID, "tenant_id": c.row.TenantID, "sequence": c.row.Sequence, "attempts": c.row.Attempts})
	}
	if len(parked) > 0 {
		s.notices.broadcast() // their death notices are due
	}
	sort.Slice(out, func(i, j int) bool { return out[i].row.Sequence < out[j].row.Sequence })
	return out, len(parked), nil
}

// unpaused gives back, untouched (the claim's attempt undone), the rows of
// out whose topic is paused now: a claim that chose its statement before
// the relay read a pause may still have leased them. Once the relay has
// logged a pause (pausedTopics stores the set first), no claim hands out
// a row of the topic.
func (s *Subscriber) unpaused(out []*claimed) []*claimed {
	set := s.paused.set.Load()
	if set == nil {
		return out
	}
	var back []*claimed
	kept := out[:0]
	for _, c := range out {
		if set.has(c.row.Topic) {
			back = append(back, c)
			continue
		}
		kept = append(kept, c)
	}
	s.release(back, 1)
	return kept
}

// claimed is one leased row and its delivery state.
type claimed struct {
	row       sqlq.ClaimedRow
	msg       *message.Message
	slot      *errorSlot
	delivered time.Time
	dueAt     time.Time // available_at before the claim (bounded claims only)
	// hot is the hot path that handed the row over (nil: claimed), at
	// hotCommitted, the writer's commit.
	hot          *HotPath
	hotCommitted time.Time
	// refusal, when set, is why the row cannot be relayed: it was handed
	// to the forwarder only for the router's dead-letter path
	// (subscription.deadLetters), and its verdict sends it dead.
	refusal error
}

func (c *claimed) fence() (string, int32, time.Time) { return c.row.ID, c.row.Attempts, c.row.LockedAt }

// nack records a failed attempt of c. It reports when the row is due
// again, false when it is not retried (dead, or the nack not recorded).
func (s *Subscriber) nack(c *claimed) (time.Time, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	f := s.cfg.policy().Judge(c.slot.get(), int(c.row.Attempts), c.row.Payload)
	summary := f.Summary
	// The statement decides dead with the same rule, on the row's count.
	backoff := f.RetryIn
	id, attempts, lockedAt := c.fence()
	var dead bool
	qerr := s.q.Nack(sqlq.NackArgs{ID: id, Attempts: attempts, LockedAt: lockedAt, LastError: summary,
		MaxAttempts: s.cfg.MaxAttempts, Permanent: f.Permanent, Backoff: backoff.Seconds()}).QueryRow(ctx, s.pool).Scan(&dead)
	s.observeDispatch(c, metrics.ResultFailure)
	fields := watermill.LogFields{"event_id": c.row.EventID, "tenant_id": c.row.TenantID, "sequence": c.row.Sequence,
		"attempts": c.row.Attempts, "error": summary}
	switch {
	case errors.Is(qerr, pgx.ErrNoRows):
		s.fenceRejected("nack")
		s.logger.Info("Nack ignored: the lease passed to another holder", fields)
	case qerr != nil:
		// The lease stays; the row comes back after LockTTL.
		s.logger.Error("Could not record nack; the row returns after the lock TTL", qerr, fields)
	case dead:
		delete(fields, "error") // passed as the error itself
		s.logger.Error("Outbox message is dead; replay it once the cause is fixed", errors.New(summary), fields)
		s.wentDead(c.row.Topic)
	default:
		fields["retry_in"] = backoff.String()
		s.logger.Info("Outbox message nacked, retrying later", fields)
		return time.Now().Add(backoff), true
	}
	return time.Time{}, false
}

// extend renews the lease of c. The fence token (id, attempts, locked_at)
// does not change, so a renewal whose reply is lost breaks nothing.
func (s *Subscriber) extend(c *claimed) bool {
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	id, attempts, lockedAt := c.fence()
	tag, err := s.pool.Exec(ctx, s.q.Extend, id, attempts, lockedAt)
	if err == nil && tag.RowsAffected() == 0 {
		err = pgx.ErrNoRows
	}
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		s.fenceRejected("extend")
		s.logger.Info("Lease renewal refused: the lease passed to another holder", watermill.LogFields{"event_id": c.row.EventID})
		return false
	case err != nil:
		s.logger.Error("Could not renew lease", err, watermill.LogFields{"event_id": c.row.EventID})
		return true
	}
	if m := s.cfg.Metrics; m != nil {
		m.LeaseExtended.WithLabelValues(s.label).Inc()
	}
	return true
}

// release gives leases back; undo is 1 for rows never delivered.
func (s *Subscriber) release(cs []*claimed, undo int) {
	if len(cs) == 0 {
		return
	}
	ids, attempts, locked := make([]string, len(cs)), make([]int32, len(cs)), make([]time.Time, len(cs))
	for i, c := range cs {
		ids[i], attempts[i], locked[i] = c.fence()
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
	defer cancel()
	rows, err := s.pool.Query(ctx, s.q.Release, ids, attempts, locked, undo, s.cfg.MaxAttempts)
	if err == nil {
		defer rows.Close()
		for rows.Next() {
			var (
				id, topic string
				dead      bool
			)
			if err = rows.Scan(&id, &topic, &dead); err != nil {
				break
			}
			if dead {
				s.wentDead(topic)
				s.notices.broadcast() // another subscription of s may deliver its death notice
				s.logger.Error("Outbox message is dead: its last allowed attempt got no verdict before the relay stopped; replay it once the cause is fixed",
					errors.New("no verdict on the last attempt"), watermill.LogFields{"row_id": id})
			}
		}
		if err == nil {
			err = rows.Err()
		}
	}
	if err != nil {
		s.logger.Error("Could not give leases back; the rows return after the lock TTL", err, watermill.LogFields{"rows": len(cs)})
	}
}

// overrunAfter is how long after delivery a message loses its lease:
// DispatchTimeout plus one renewal period (LockTTL/2) of margin.
func (s *Subscriber) overrunAfter() time.Duration { return s.cfg.DispatchTimeout + s.cfg.LockTTL/2 }

// overrunError is the failure recorded for a handler that overran.
func (s *Subscriber) overrunError() error {
	return fmt.Errorf("handler overran: no ack or nack %s after delivery (DispatchTimeout %s plus a margin of LockTTL/2); its lease was taken back",
		s.overrunAfter(), s.cfg.DispatchTimeout)
}

// wentDead counts a row's first entry into the dead state.
func (s *Subscriber) wentDead(topic string) {
	if m := s.cfg.Metrics; m != nil {
		m.DeadTotal.WithLabelValues(s.label, topic).Inc()
	}
}

func (s *Subscriber) observeDispatch(c *claimed, result string) {
	m := s.cfg.Metrics
	if m == nil {
		return
	}
	m.DispatchTotal.WithLabelValues(s.label, c.row.Topic, result).Inc()
	m.DispatchLatency.WithLabelValues(s.label, c.row.Topic, result).Observe(time.Since(c.delivered).Seconds())
}

func (s *Subscriber) fenceRejected(op string) {
	if m := s.cfg.Metrics; m != nil {
		m.FenceRejected.WithLabelValues(s.label, op).Inc()
	}
}

// broadcaster wakes every registered subscription (LISTEN/NOTIFY, leadership).
type broadcaster struct {
	mu   sync.Mutex
	subs map[chan struct{}]struct{}
	// topicsGen counts the notifications that may change the paused
	// topics; bumped before the wake-ups are sent.
	topicsGen atomic.Uint64
}

func (b *broadcaster) register() chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.subs == nil {
		b.subs = map[chan struct{}]struct{}{}
	}
	ch := make(chan struct{}, 1)
	b.subs[ch] = struct{}{}
	return ch
}

func (b *broadcaster) unregister(ch chan struct{}) {
	b.mu.Lock()
	delete(b.subs, ch)
	b.mu.Unlock()
}

func (b *broadcaster) broadcast() {
	b.mu.Lock()
	defer b.mu.Unlock()
	for ch := range b.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// Table returns the subscriber's outbox table.
func (s *Subscriber) Table() schema.Table { return s.cfg.Table }

// MaxAttempts returns after how many failed attempts a row is dead
// (Config.MaxAttempts after its default).
func (s *Subscriber) MaxAttempts() int { return s.cfg.MaxAttempts }
