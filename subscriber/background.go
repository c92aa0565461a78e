package subscriber

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// opTimeout bounds one ack, nack, renewal or release statement, and one
// claim: each attempt of a write gets its own.
const opTimeout = 10 * time.Second

// ackTries is how many times a grouped ack is written before its rows are
// left to come back after LockTTL.
const ackTries = 3

// ackReq is one acked message waiting to be written.
type ackReq struct{ c *claimed }

// maxAckGroup bounds the rows of one ack statement.
const maxAckGroup = 1000

// ackLinger is how long the acker gathers acks after the first one before it
// writes them: it delays published_at by as much, never a delivery.
const ackLinger = 2 * time.Millisecond

// runAcker writes acks in groups: it takes what has accumulated while the
// previous statement ran, so under load one statement acks many rows. After
// ackStop it writes what is left and returns.
func (s *Subscriber) runAcker() {
	defer s.ackerWg.Done()
	group := make([]*claimed, 0, maxAckGroup)
	stopping := false
	for {
		var first ackReq
		if stopping {
			select {
			case first = <-s.acks:
			default:
				return
			}
		} else {
			select {
			case first = <-s.acks:
			case <-s.ackStop:
				stopping = true
				continue
			}
		}
		group = append(group[:0], first.c)
		// Gather the acks that come within ackLinger, so that under load
		// one statement acks a claim's worth of rows.
		linger := time.NewTimer(ackLinger)
	more:
		for len(group) < maxAckGroup {
			select {
			case r := <-s.acks:
				group = append(group, r.c)
			case <-linger.C:
				break more
			case <-s.ackStop:
				stopping = true
				break more
			}
		}
		linger.Stop()
	rest:
		for len(group) < maxAckGroup {
			select {
			case r := <-s.acks:
				group = append(group, r.c)
			default:
				break rest
			}
		}
		s.writeAcks(group)
	}
}

func (s *Subscriber) writeAcks(group []*claimed) {
	ids, attempts, locked := make([]string, len(group)), make([]int32, len(group)), make([]time.Time, len(group))
	for i, c := range group {
		ids[i], attempts[i], locked[i] = c.fence()
	}
	var (
		acked map[string]float64
		err   error
	)
	// Each attempt has a timeout of its own: one write stuck behind a lock
	// must not eat the time of the retries.
	for try := 0; try < ackTries; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), s.writeTimeout)
		acked, err = s.ackRows(ctx, ids, attempts, locked)
		cancel()
		if err == nil {
			break
		}
		time.Sleep(time.Duration(try+1) * 50 * time.Millisecond)
	}
	if err != nil {
		// The leases stay; the rows are delivered again after LockTTL.
		s.logger.Error("Could not write acks; the rows are delivered again after the lock TTL", err, watermill.LogFields{"rows": len(group)})
		return
	}
	m := s.cfg.Metrics
	for _, c := range group {
		lag, ok := acked[c.row.ID]
		if !ok {
			s.fenceRejected("ack")
			s.logger.Info("Ack ignored: the lease passed to another holder", watermill.LogFields{"event_id": c.row.EventID})
			continue
		}
		if m != nil {
			observeDelivered(s, c)
			s.observeDispatch(c, "success")
			m.DeliveryLag.WithLabelValues(s.label).Observe(lag)
		}
	}
}

// ackPlanSettings, sent in one batch before the grouped ack (one implicit
// transaction: set_config(..., true) lasts until its end), make the ack
// look its rows up by primary key. Without them the planner, which
// estimates few pending rows, joins a group of a hundred acks or more by a
// bitmap scan of the whole pending index (the ack's fence, published_at IS
// NULL, is that index's predicate): under a pinned horizon every ack then
// read every dead entry since the pin (about 40,000 entries per ack in a
// 20,000-row drain, issue 43).
const ackPlanSettings = `SELECT set_config('enable_bitmapscan', 'off', true), set_config('enable_hashjoin', 'off', true),
  set_config('enable_mergejoin', 'off', true)`

func (s *Subscriber) ackRows(ctx context.Context, ids []string, attempts []int32, locked []time.Time) (acked map[string]float64, err error) {
	b := &pgx.Batch{}
	b.Queue(ackPlanSettings)
	b.Queue(s.q.Ack, ids, attempts, locked)
	br := s.pool.SendBatch(ctx, b)
	defer func() {
		if cerr := br.Close(); err == nil && cerr != nil {
			acked, err = nil, cerr
		}
	}()
	if _, err := br.Exec(); err != nil {
		return nil, err
	}
	rows, err := br.Query()
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	acked = make(map[string]float64, len(ids))
	for rows.Next() {
		var (
			id  string
			lag float64
		)
		if err := rows.Scan(&id, &lag); err != nil {
			return nil, err
		}
		acked[id] = lag
	}
	return acked, rows.Err()
}

// elector holds the table's session-level advisory lock on a dedicated
// connection while this subscriber is the leader.
type elector struct {
	s        *Subscriber
	mu       sync.Mutex
	conn     *pgxpool.Conn
	isLeader atomic.Bool
	// dropped is when this relay lost its leader session: it lets the
	// standbys try first (each tries within one ElectionInterval) and tries
	// again itself only after two.
	dropped time.Time
	// standing is set while this relay stands by: it logs that once, and
	// its next election is a takeover.
	standing bool
	// named is set when the leader session took the relay's default name
	// (session.go), to be reset when the connection goes back to the pool.
	named bool
}

func (e *elector) run(ctx context.Context) {
	defer e.s.bgWg.Done()
	t := time.NewTicker(e.s.cfg.ElectionInterval)
	defer t.Stop()
	for {
		e.tick(ctx)
		select {
		case <-ctx.Done():
			e.resign()
			return
		case <-t.C:
		}
	}
}

// stepTimeout bounds each statement on the leader's connection (ping,
// election, claim): LeaderTimeout/3.
func (e *elector) stepTimeout() time.Duration { return e.s.cfg.LeaderTimeout / 3 }

func (e *elector) tick(ctx context.Context) {
	if switchedAwayFrom(e.s) {
		// The table was switched to another mode while this relay's
		// mode lock was down: it claims nothing more, and gives the
		// single-active lock back (an ordered relay refuses to start while
		// a session holds it).
		e.resign()
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if ctx.Err() != nil {
		return // stopping: resign ends the term
	}
	s := e.s
	// The relay's stop does not cut a statement on the leader's connection
	// short: pgx closes a connection whose statement is cancelled, and its
	// session, with the leader lock, would end only after Close returned (a
	// relay of the other mode started then was refused). resign unlocks
	// once the statement is done.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.stepTimeout())
	defer cancel()
	if e.conn != nil {
		// A ping that does not answer in time means this relay cannot reach
		// the database: step down, so it claims nothing more; the server
		// ends the silent session within LeaderTimeout (keepalive).
		if err := e.conn.Ping(sctx); err != nil && ctx.Err() == nil {
			s.logger.Error("Leader cannot reach the database; stepping down", err, watermill.LogFields{"timeout": e.stepTimeout().String()})
			e.dropLocked()
		}
		return
	}
	if !e.dropped.IsZero() && time.Since(e.dropped) < 2*s.cfg.ElectionInterval {
		return
	}
	conn, err := s.pool.Acquire(sctx)
	if err != nil {
		if ctx.Err() == nil {
			s.logger.Error("Cannot acquire a connection for the leader election", err, nil)
		}
		return
	}
	idle, interval, count, userTimeout := leaderKeepalive(s.cfg.LeaderTimeout)
	var got bool
	err = conn.QueryRow(sctx, sqlq.TryLeaderLock, sqlq.LockKey(s.cfg.Table), idle, interval, count, userTimeout).Scan(&got, nil, nil, nil, nil)
	if err != nil {
		if ctx.Err() == nil {
			s.logger.Error("Leader election query failed", err, nil)
		}
		// A session-level lock survives a failed statement: end the session
		// rather than hand it back to the pool holding a lock.
		closeConn(conn)
		return
	}
	if !got {
		conn.Release()
		if !e.standing {
			e.standing = true
			s.logger.Info("Standing by: another relay is active for the table; taking over when its session ends", nil)
		}
		return
	}
	// Before any claim of this term: every lease in the table is the
	// previous holder's, whose session is gone (see sqlq.Queries.TakeBack).
	taken, err := e.takeBack(sctx, conn)
	if err != nil {
		if ctx.Err() == nil {
			s.logger.Error("Could not take the previous relay's leases back; its rows return after the lock TTL", err, nil)
		}
		// As above: a session-level lock survives a failed statement.
		closeConn(conn)
		return
	}
	e.conn = conn
	e.named = nameSession(sctx, conn)
	s.setLeaderGauge(1) // the gauge first: whoever sees IsLeader sees the gauge agree
	e.isLeader.Store(true)
	fields := watermill.LogFields{"leases_taken_back": taken}
	if e.standing {
		s.logger.Info("Took over as the active relay for the table: the previous relay's session is gone; its leased rows are due again at once", fields)
	} else {
		s.logger.Info("Became the active relay for the table", fields)
	}
	e.standing = false
	s.wake.broadcast()
	s.notices.broadcast() // death notices the previous leader left, and those of the rows taken back
}

// takeBack makes the leases left by the previous leader due at once, on the
// connection that has just taken the lock, and returns how many.
func (e *elector) takeBack(ctx context.Context, conn *pgxpool.Conn) (int, error) {
	s := e.s
	rows, err := conn.Query(ctx, s.q.TakeBack, s.cfg.MaxAttempts)
	if err != nil {
		return 0, fmt.Errorf("take leases back: %w", err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var (
			id, topic string
			dead      bool
		)
		if err := rows.Scan(&id, &topic, &dead); err != nil {
			return n, fmt.Errorf("take leases back: %w", err)
		}
		n++
		if dead {
			s.wentDead(topic)
			s.logger.Error("Outbox message is dead: the relay holding its last allowed attempt lost its session; replay it once the cause is fixed",
				errors.New("lease taken back on the last attempt"), watermill.LogFields{"row_id": id})
		}
	}
	if err := rows.Err(); err != nil {
		return n, fmt.Errorf("take leases back: %w", err)
	}
	return n, nil
}

// leaderKeepalive derives the leader session's TCP settings from the leader
// timeout L: keepalive idle L/3, interval L/6 and count (L - idle)/interval,
// in whole seconds, and TCP_USER_TIMEOUT L in milliseconds. With
// TCP_USER_TIMEOUT set, Linux ends the connection at the first keepalive
// probe (or retransmission) at least L after the peer's last packet: at
// most L + L/6.
func leaderKeepalive(l time.Duration) (idle, interval, count, userTimeout string) {
	secs := max(1, int(l/time.Second))
	i := max(1, secs/3)
	iv := max(1, secs/6)
	c := max(1, (secs-i)/iv)
	return strconv.Itoa(i), strconv.Itoa(iv), strconv.Itoa(c), strconv.FormatInt(l.Milliseconds(), 10)
}

// withConn runs fn on the leader's connection, bounded by LeaderTimeout/3;
// it fails when this subscriber is not the leader, and steps down when the
// connection broke or did not answer in time.
func (e *elector) withConn(ctx context.Context, fn func(context.Context, *pgx.Conn) error) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.conn == nil {
		return errNotLeader
	}
	ctx, cancel := context.WithTimeout(ctx, e.stepTimeout())
	defer cancel()
	err := fn(ctx, e.conn.Conn())
	if err != nil && e.conn.Conn().IsClosed() {
		e.s.logger.Error("Leader connection lost during a claim; stepping down", err, nil)
		e.dropLocked()
	}
	return err
}

var errNotLeader = errors.New("not the active relay for the table")

// dropLocked forgets a broken leader connection; closing it ends the session
// and so releases the lock if the server still holds it.
func (e *elector) dropLocked() {
	// Not the leader any more before the (possibly slow) close of a silent
	// connection; the gauge first, so that whoever sees IsLeader false sees
	// the gauge agree.
	e.s.setLeaderGauge(0)
	e.isLeader.Store(false)
	closeConn(e.conn)
	e.conn = nil
	e.dropped = time.Now()
}

// closeConn ends conn's session and gives the slot back to the pool, which
// discards the closed connection.
func closeConn(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = conn.Conn().Close(ctx)
	cancel()
	conn.Release()
}

func (e *elector) resign() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.conn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if _, err := e.conn.Exec(ctx, sqlq.LeaderUnlock, sqlq.LockKey(e.s.cfg.Table)); err != nil {
		e.dropLocked()
		return
	}
	e.s.setLeaderGauge(0)
	e.isLeader.Store(false)
	if e.named {
		unnameSession(ctx, e.conn)
	}
	e.conn.Release()
	e.conn = nil
}

func (s *Subscriber) setLeaderGauge(v float64) {
	if m := s.cfg.Metrics; m != nil {
		m.RelayLeader.WithLabelValues(s.label).Set(v)
	}
}

// runStats refreshes the table gauges.
func (s *Subscriber) runStats(ctx context.Context) {
	defer s.bgWg.Done()
	t := time.NewTicker(s.cfg.StatsInterval)
	defer t.Stop()
	for {
		if s.IsLeader() {
			s.refreshStats(ctx)
		} else {
			// A standby must not keep exporting what it saw as leader.
			m := s.cfg.Metrics
			m.Pending.DeleteLabelValues(s.label)
			m.Dead.DeleteLabelValues(s.label)
			m.Locked.DeleteLabelValues(s.label)
			m.OldestPendingAge.DeleteLabelValues(s.label)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Subscriber) refreshStats(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	var (
		pending, locked, dead int64
		oldest                float64
	)
	// The state reader of the relay's own mode (the mode it recorded),
	// as the runbook reads it, so that the gauges and `outbox stats` agree.
	stats := sqlq.NewStateQueries(s.cfg.Table, schema.ModeDefault, s.q.Columns).Gauges()
	if s.oq != nil {
		stats = sqlq.NewStateQueries(s.cfg.Table, schema.ModeOrdered, s.oq.Columns).Gauges()
		s.refreshHeldKeys(qctx)
	}
	if err := s.pool.QueryRow(qctx, stats).Scan(&pending, &locked, &dead, &oldest); err != nil {
		if ctx.Err() == nil {
			s.logger.Error("Could not read table stats", err, nil)
		}
		return
	}
	m := s.cfg.Metrics
	m.Pending.WithLabelValues(s.label).Set(float64(pending))
	m.Dead.WithLabelValues(s.label).Set(float64(dead))
	m.Locked.WithLabelValues(s.label).Set(float64(locked))
	m.OldestPendingAge.WithLabelValues(s.label).Set(oldest)
}
