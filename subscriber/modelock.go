package subscriber

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
)

// The relay-mode lock (sqlq.RelayModeLockKey): every Subscriber
// with a subscription holds its mode's lock of its table in shared mode on
// the pool's notifier connection, and checks for the other mode's lock
// (sqlq.CheckRelayMode) after taking its own. Of two relays of different
// modes that start together, at least one sees the other's lock and
// refuses, and a running relay, idle, standby or busy, keeps relays of the
// other mode out for as long as it is subscribed. The lock ends with the
// connection; the notifier takes it again on its next connection and logs
// an error if a relay of the other mode got in meanwhile. Between the two
// sessions a mode switch (schema.SwitchMode) sees no lock and may be
// accepted: so no relay claims while its lock is down (modeReady), and the
// lock taken again is checked against the table's recorded mode; a relay
// whose table was switched away meanwhile claims nothing more, and gives
// its lock back (it keeps no relay of the new mode from starting).

// modeWant is one mode lock the subscribers of the process want held.
type modeWant struct {
	table   schema.Table
	ordered bool
	ttl     time.Duration
	holders int
}

// modeOp asks the notifier's session to take (enter) or give back a mode
// lock for one Subscriber.
type modeOp struct {
	enter bool
	want  modeWant
	reply chan error // nil for a leave nobody waits for
}

// enterMode takes the mode lock of s's table for s, or fails with
// schema.ErrRelayModeMix when a relay of the other mode holds its own. It
// waits for the notifier's session up to ctx's end.
func (n *notifier) enterMode(ctx context.Context, s *Subscriber) error {
	op := modeOp{enter: true, want: modeWant{table: s.cfg.Table, ordered: s.cfg.Ordered, ttl: s.cfg.LockTTL}, reply: make(chan error, 1)}
	for {
		n.mu.Lock()
		if n.live {
			n.modeOps = append(n.modeOps, op)
			if n.interrupt != nil {
				n.interrupt()
			}
			n.mu.Unlock()
			break
		}
		n.mu.Unlock()
		select {
		case <-ctx.Done():
			return fmt.Errorf("subscriber: take the relay-mode lock of %s: no connection to PostgreSQL: %w", s.cfg.Table, ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
	select {
	case err := <-op.reply:
		return err
	case <-ctx.Done():
		// The op still runs; give back what it may take.
		go func() {
			select {
			case err := <-op.reply:
				if err == nil {
					n.leaveMode(s)
				}
			case <-n.done:
			}
		}()
		return fmt.Errorf("subscriber: take the relay-mode lock of %s: %w", s.cfg.Table, ctx.Err())
	}
}

// leaveMode gives back s's hold on its mode lock; the last holder's
// session unlocks it.
func (n *notifier) leaveMode(s *Subscriber) {
	key := sqlq.RelayModeLockKey(s.cfg.Table, s.cfg.Ordered)
	n.mu.Lock()
	defer n.mu.Unlock()
	w, ok := n.modes[key]
	if !ok {
		return
	}
	if w.holders--; w.holders > 0 {
		n.modes[key] = w
		return
	}
	delete(n.modes, key)
	delete(n.switchedAway, key) // the relays it fenced are gone
	if !n.live {
		return // the lock ended with the session
	}
	op := modeOp{want: w, reply: make(chan error, 1)}
	n.modeOps = append(n.modeOps, op)
	if n.interrupt != nil {
		n.interrupt()
	}
	n.mu.Unlock()
	// Wait, so that a relay of the other mode started after Close returns
	// does not see this lock; a session that ends meanwhile ends it too.
	select {
	case err := <-op.reply:
		if err != nil {
			n.logger.Error("Could not give back the relay-mode lock; it ends with the connection", err, nil)
		}
	case <-n.done:
	case <-time.After(opTimeout):
	}
	n.mu.Lock()
}

// runModeOps runs the pending mode requests on the session's connection,
// and takes again, on a new session, the locks of the last one. A failed
// statement ends the session.
func (n *notifier) runModeOps(ctx context.Context, conn *pgx.Conn) error {
	n.mu.Lock()
	ops := n.modeOps
	n.modeOps = nil
	var retake []modeWant
	for key, w := range n.modes {
		if !n.heldModes[key] && n.switchedAway[key] == nil {
			retake = append(retake, w)
		}
	}
	n.mu.Unlock()
	for _, w := range retake {
		key := sqlq.RelayModeLockKey(w.table, w.ordered)
		if err := n.lockMode(ctx, conn, key); err != nil {
			failModeOps(ops, err)
			return err
		}
		if err := sqlq.CheckRelayMode(ctx, conn, w.table, w.ordered, sqlq.LockKey(w.table), w.ttl, 0); err != nil {
			n.logger.Error("A relay of the other mode started while this process had lost its connection; stop one of them", err,
				watermill.LogFields{"table": w.table.String()})
		}
		away, err := switchedAway(ctx, conn, w)
		if err != nil {
			failModeOps(ops, err)
			return err
		}
		if away != nil {
			// Its relays claim nothing more: the lock is given back, so
			// that it keeps no relay of the table's mode from starting.
			n.logger.Error("The table was switched to another relay mode while this process had lost its connection: its relays of the old mode claim nothing more; close them", away,
				watermill.LogFields{"table": w.table.String()})
			qctx, cancel := context.WithTimeout(ctx, opTimeout)
			_, err := conn.Exec(qctx, `SELECT pg_advisory_unlock_shared($1)`, key)
			cancel()
			if err != nil {
				failModeOps(ops, err)
				return fmt.Errorf("give back the relay-mode lock: %w", err)
			}
			delete(n.heldModes, key)
		}
		n.mu.Lock()
		if away != nil {
			n.switchedAway[key] = away
		} else {
			n.modesUp[key] = true
		}
		n.mu.Unlock()
	}
	for i, op := range ops {
		key := sqlq.RelayModeLockKey(op.want.table, op.want.ordered)
		if !op.enter {
			err := n.unlockMode(ctx, conn, key)
			op.reply <- err
			if err != nil {
				failModeOps(ops[i+1:], err)
				return err
			}
			continue
		}
		n.mu.Lock()
		others := n.modes[sqlq.RelayModeLockKey(op.want.table, !op.want.ordered)].holders
		n.mu.Unlock()
		if err := n.lockMode(ctx, conn, key); err != nil {
			failModeOps(ops[i:], err)
			return err
		}
		cctx, cancel := context.WithTimeout(ctx, opTimeout)
		err := sqlq.CheckRelayMode(cctx, conn, op.want.table, op.want.ordered, sqlq.LockKey(op.want.table), op.want.ttl, sqlq.RelayModeOthers(others))
		cancel()
		n.mu.Lock()
		w, held := n.modes[key]
		if err == nil {
			w = op.want
			w.holders = n.modes[key].holders + 1
			n.modes[key] = w
			n.modesUp[key] = true
		}
		n.mu.Unlock()
		if err != nil && !held {
			if uerr := n.unlockMode(ctx, conn, key); uerr != nil {
				failModeOps(ops[i:], err)
				return uerr
			}
		}
		op.reply <- err
	}
	return nil
}

// errModeLockDown is modeReady's answer while the session that held the
// relay-mode lock is gone and the next one has not taken it again.
var errModeLockDown = errors.New("the relay-mode lock is down: the LISTEN connection was lost")

// modeReady tells whether s may claim: its relay-mode lock is held by the
// notifier's current session, and its table was not switched to another
// mode while the lock was down.
func (n *notifier) modeReady(s *Subscriber) error {
	key := sqlq.RelayModeLockKey(s.cfg.Table, s.cfg.Ordered)
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := n.switchedAway[key]; err != nil {
		return err
	}
	if !n.modesUp[key] {
		return errModeLockDown
	}
	return nil
}

// switchedAwayFrom reports whether s's table was found switched to another
// mode (notifier.modeReady's error other than a lock that is down): s
// claims nothing more and holds no lock of the table.
func switchedAwayFrom(s *Subscriber) bool {
	if s.modeLock == nil {
		return false
	}
	err := s.modeLock.modeReady(s)
	return err != nil && !errors.Is(err, errModeLockDown)
}

// switchedBack forgets that s's table was switched away: s has just
// recorded its mode, so the relays of that mode in this process may claim
// again.
func (n *notifier) switchedBack(s *Subscriber) {
	n.mu.Lock()
	delete(n.switchedAway, sqlq.RelayModeLockKey(s.cfg.Table, s.cfg.Ordered))
	n.mu.Unlock()
}

// switchedAway reads the recorded mode of w's table on conn: an error
// naming it when it is not w's mode (nil when it is, or none is recorded).
func switchedAway(ctx context.Context, conn *pgx.Conn, w modeWant) (away, err error) {
	own := schema.ModeDefault
	if w.ordered {
		own = schema.ModeOrdered
	}
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	rec, switched, rerr := sqlq.SwitchedAway(qctx, conn, w.table, own)
	if rerr != nil || !switched {
		return nil, rerr
	}
	return fmt.Errorf("%s is relayed in %s mode (recorded by %q at %s), not in %s mode: %w", w.table, rec.Mode, rec.RecordedBy,
		rec.RecordedAt.Format(time.RFC3339), own, schema.ErrRelayModeMix), nil
}

func (n *notifier) lockMode(ctx context.Context, conn *pgx.Conn, key int64) error {
	if n.heldModes[key] {
		return nil
	}
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	// Nobody takes a mode lock exclusively, so the shared lock is granted at once.
	if _, err := conn.Exec(qctx, `SELECT pg_advisory_lock_shared($1)`, key); err != nil {
		return fmt.Errorf("take the relay-mode lock: %w", err)
	}
	n.heldModes[key] = true
	return nil
}

func (n *notifier) unlockMode(ctx context.Context, conn *pgx.Conn, key int64) error {
	if !n.heldModes[key] {
		return nil
	}
	n.mu.Lock()
	wanted := n.modes[key].holders > 0
	n.mu.Unlock()
	if wanted {
		return nil
	}
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	if _, err := conn.Exec(qctx, `SELECT pg_advisory_unlock_shared($1)`, key); err != nil {
		return fmt.Errorf("give back the relay-mode lock: %w", err)
	}
	delete(n.heldModes, key)
	return nil
}

func failModeOps(ops []modeOp, err error) {
	for _, op := range ops {
		op.reply <- fmt.Errorf("subscriber: the relay-mode lock of %s: %w", op.want.table, err)
	}
}

// recordMode switches s's table to the mode of s (schema.SwitchMode, the
// one switch every path takes: it settles the old mode's state into the
// rows' columns, so s delivers only what was pending), once s holds its
// mode's lock: every reader of the table's state reads the record. A relay
// of another mode refuses it (schema.ErrRelayModeMix), and so does an open
// hold of any mode (schema.ErrKeysHeld: s would not read it); any other
// failure of the switch stops s too. A table without the mode table
// (migrated by an earlier version) leaves readers inferring the mode.
//
// Then s records its LockTTL beside the mode (sqlq.RecordLockTTL), by
// which every operator surface judges a row's lease; a mode table without
// the column (before migration 000014) records none, and a failure to
// record it stops s.
func (s *Subscriber) recordMode(ctx context.Context) error {
	mode, by := schema.ModeDefault, "default relay"
	if s.cfg.Ordered {
		mode, by = schema.ModeOrdered, "ordered relay"
	}
	rctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	err := schema.SwitchMode(rctx, s.pool, s.cfg.Table, mode, by)
	if err == nil {
		_, err = sqlq.RecordLockTTL(rctx, s.pool, s.cfg.Table, s.cfg.LockTTL)
	}
	var pgErr *pgconn.PgError
	switch {
	case err == nil, errors.Is(err, schema.ErrNoModeTable):
		if s.orderedAtStart {
			return checkOrderedTables(rctx, s.pool, s.cfg.Table)
		}
		return nil
	case ctx.Err() != nil:
		return fmt.Errorf("subscriber: record the relay mode of %s: %w", s.cfg.Table, ctx.Err())
	case s.orderedAtStart && errors.As(err, &pgErr) && pgErr.Code == "42501":
		// The switch could not create ordered mode's tables: the error
		// names the migration to run.
		return fmt.Errorf("subscriber: %w: %w", ErrOrderedNotMigrated, err)
	}
	return fmt.Errorf("subscriber: %w", err)
}
