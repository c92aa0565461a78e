package subscriber

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// The wake-up handshake (docs/ARCHITECTURE.md, "Wake-up").
//
// An enqueue sends NOTIFY only when it cannot take the table's idle lock in
// shared mode, that is while a relay holds it exclusively (or waits for it).
// A relay takes it when a claim finds nothing, claims once more, and only
// then sleeps until a notification or PollInterval; it gives it back when it
// wakes up. Why no commit is missed:
//   - a writer whose shared try came before the relay took the lock holds the
//     shared lock until its transaction has ended, and an exclusive lock is
//     granted only once no shared holder is left; PostgreSQL releases locks
//     after the commit is visible, so the relay's next claim, which begins
//     after the lock was granted, sees the row;
//   - a writer whose try came after fails it and notifies at commit.
// A relay that cannot take the lock because another relay holds it
// (exclusively) is covered: writers notify while that relay sleeps, and that
// relay notifies when it gives the lock back, so the covered relay sleeps
// too, checking again every coveredRecheck in case the holder died without
// a word. A relay that cannot take it because a writer's transaction is open
// (shared holders only) does not sleep: that commit may not notify, so it
// claims again after a short backoff (idleRetry). Writers never
// wait on each other: shared locks do not conflict.
//
// The locks are held on the notifier's LISTEN connection: its loss ends the
// wait for notifications at once, so a relay never sleeps on a lock whose
// session is gone (the notifier bumps the generation and wakes every
// subscription, which go through the handshake again).

const (
	// wakeCoalesce is how long a relay woken by a notification waits before
	// it claims, so that one claim takes the rows of several commits.
	wakeCoalesce = time.Millisecond
	// lingerMin and lingerMax bound the pause after a claim that found some
	// rows but not a full batch: the relay stays busy (no NOTIFY) and claims
	// again after the pause, which grows with the rate so that claims and
	// acks carry more rows under load.
	lingerMin = time.Millisecond
	lingerMax = 15 * time.Millisecond
	// lingerPerRate is the pause per event/s of the recent rate: 1,000
	// events/s give 3ms, 5,000 give the 15ms cap.
	lingerPerRate = 3 * time.Microsecond
	// idleRetryMax caps the backoff of a relay that found nothing and could
	// not take the idle lock while writers' transactions held it.
	idleRetryMax = 8 * time.Millisecond
	// idleRetryPatience is how many retries at idleRetryMax (about 130 ms
	// of writers holding the lock) come before idleRetryLong: a writer
	// whose transaction stays open that long is waited for at a slower
	// pace.
	idleRetryPatience = 20
	idleRetryLong     = 32 * time.Millisecond
	// coveredRecheck bounds the sleep of a relay covered by another relay's
	// idle lock: if that relay's session died without giving the lock back
	// (and so without notifying), the covered relay finds out this late.
	coveredRecheck = time.Second
)

// linger is the pause after a partial batch at rate events/s.
func linger(rate float64) time.Duration {
	return min(lingerMax, max(lingerMin, time.Duration(rate*float64(lingerPerRate))))
}

// idleRetry is the pause after the n-th empty claim in a row without the
// idle lock: 1, 2, 4, 8 ms, then idleRetryMax until idleRetryPatience
// retries, then idleRetryLong.
func idleRetry(n int) time.Duration {
	switch {
	case n > idleRetryPatience:
		return idleRetryLong
	case n > 4:
		return idleRetryMax
	}
	return min(idleRetryMax, time.Millisecond<<max(0, n-1))
}

// idleSignal is one Subscriber's side of the handshake for one lock: the
// lock is held through the pool's notifier, which counts the subscriptions
// of every Subscriber of the process on one lock and holds the locks of all
// tables on its LISTEN connection.
type idleSignal struct {
	s *Subscriber
	// key is the advisory key of the lock: Table.IdleLockKey for the claim
	// loop, Table.OrderedIdleLockKey for the ordered relay.
	key int64
}

// idleState is the outcome of enter.
type idleState int

const (
	idleMissed  idleState = iota // a writer's transaction holds the lock: look again soon
	idleHeld                     // taken (or counted in): look once more, then sleep
	idleCovered                  // another relay holds it: sleep, checking every coveredRecheck
)

// enter takes the lock for one subscription, or counts it in when it is
// already held.
func (i *idleSignal) enter(ctx context.Context) (uint64, idleState) {
	if i.s.notifier == nil {
		return 0, idleMissed
	}
	return i.s.notifier.enterIdle(ctx, i.key, sqlq.NotifyChannel(i.s.cfg.Table))
}

// valid reports whether a lock taken at gen is still held.
func (i *idleSignal) valid(gen uint64) bool {
	return i.s.notifier != nil && gen == i.s.notifier.idleGen.Load()
}

// leave counts one subscription out; the last one gives the lock back.
// announce asks it to notify the table's channel, so that relays covered by
// this lock go through the handshake again: needed unless the subscription
// woke up from a notification (which reached them too).
func (i *idleSignal) leave(gen uint64, announce bool) {
	if i.s.notifier == nil {
		return
	}
	i.s.notifier.leaveIdle(i.key, sqlq.NotifyChannel(i.s.cfg.Table), gen, announce)
}

// idleOp is a request to the notifier's session, which runs it on the
// LISTEN connection.
type idleOp struct {
	enter    bool
	announce bool
	key      int64
	channel  string
	gen      uint64
	reply    chan idleReply
}

type idleReply struct {
	gen   uint64
	state idleState
}

// enterIdle takes the idle lock of key on the LISTEN connection, or counts
// one more holder when it is held.
func (n *notifier) enterIdle(ctx context.Context, key int64, channel string) (uint64, idleState) {
	r, ok := n.idleRequest(ctx, idleOp{enter: true, key: key, channel: channel})
	if !ok {
		return 0, idleMissed
	}
	return r.gen, r.state
}

// leaveIdle counts one holder of key out; the last one releases the lock
// and, when announce is set, notifies channel so that relays covered by it
// go through the handshake again.
func (n *notifier) leaveIdle(key int64, channel string, gen uint64, announce bool) {
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	n.idleRequest(ctx, idleOp{key: key, channel: channel, gen: gen, announce: announce})
}

// idleRequest hands op to the session and waits for its reply; false when
// no session answers (the LISTEN connection is down, or ctx ended).
func (n *notifier) idleRequest(ctx context.Context, op idleOp) (idleReply, bool) {
	op.reply = make(chan idleReply, 1)
	n.mu.Lock()
	if !n.live {
		n.mu.Unlock()
		return idleReply{}, false
	}
	n.idleOps = append(n.idleOps, op)
	if n.interrupt != nil {
		n.interrupt()
	}
	n.mu.Unlock()
	select {
	case r := <-op.reply:
		return r, r.gen != 0 || !op.enter
	case <-ctx.Done():
		return idleReply{}, false
	}
}

// runIdleOps runs the pending idle requests on the session's connection. A
// failed statement ends the session (its locks may be in doubt).
func (n *notifier) runIdleOps(ctx context.Context, conn *pgx.Conn) error {
	n.mu.Lock()
	ops := n.idleOps
	n.idleOps = nil
	n.mu.Unlock()
	for i, op := range ops {
		gen := n.idleGen.Load()
		if op.enter {
			if n.idleHolders[op.key] > 0 {
				n.idleHolders[op.key]++
				op.reply <- idleReply{gen: gen, state: idleHeld}
				continue
			}
			var got, covered bool
			qctx, cancel := context.WithTimeout(ctx, opTimeout)
			err := conn.QueryRow(qctx, sqlq.TryIdleLockOrHolder, op.key).Scan(&got, &covered)
			cancel()
			if err != nil {
				failIdleOps(ops[i:])
				return err
			}
			switch {
			case got:
				n.idleHolders[op.key] = 1
				op.reply <- idleReply{gen: gen, state: idleHeld}
			case covered:
				op.reply <- idleReply{gen: gen, state: idleCovered}
			default:
				op.reply <- idleReply{gen: gen, state: idleMissed}
			}
			continue
		}
		if op.gen != gen || n.idleHolders[op.key] == 0 {
			op.reply <- idleReply{}
			continue
		}
		n.idleHolders[op.key]--
		if n.idleHolders[op.key] > 0 {
			op.reply <- idleReply{}
			continue
		}
		delete(n.idleHolders, op.key)
		qctx, cancel := context.WithTimeout(ctx, opTimeout)
		var err error
		if op.announce {
			_, err = conn.Exec(qctx, sqlq.IdleUnlockNotify, op.key, op.channel)
		} else {
			_, err = conn.Exec(qctx, sqlq.IdleUnlock, op.key)
		}
		cancel()
		op.reply <- idleReply{}
		if err != nil {
			// Do not keep a session that may still hold the lock: writers
			// would notify for nothing.
			failIdleOps(ops[i+1:])
			return err
		}
	}
	return nil
}

func failIdleOps(ops []idleOp) {
	for _, op := range ops {
		op.reply <- idleReply{}
	}
}

// lostIdle forgets the locks of a session that ended (they ended with it)
// and wakes every subscription, so that sleeping ones go through the
// handshake again.
func (n *notifier) lostIdle() {
	n.mu.Lock()
	ops := n.idleOps
	n.idleOps = nil
	n.live = false
	clear(n.modesUp) // the locks ended with the session
	n.mu.Unlock()
	failIdleOps(ops)
	clear(n.idleHolders)
	clear(n.heldModes) // modes stays: the next session takes them again
	n.idleGen.Add(1)
	n.notifyAll()
}
