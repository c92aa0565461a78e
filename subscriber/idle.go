package subscriber

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/schema"
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
// A relay that cannot take the lock (a writer's transaction is open, or
// another relay holds it) does not sleep: it claims again after a short
// backoff (idleRetryMax at most). Writers never wait on each other: shared
// locks do not conflict.

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
	// not take the idle lock.
	idleRetryMax = 8 * time.Millisecond
)

// linger is the pause after a partial batch at rate events/s.
func linger(rate float64) time.Duration {
	return min(lingerMax, max(lingerMin, time.Duration(rate*float64(lingerPerRate))))
}

// idleRetry is the pause after the n-th empty claim in a row without the
// idle lock: 1ms, 2ms, 4ms ... idleRetryMax.
func idleRetry(n int) time.Duration {
	if n > 4 {
		return idleRetryMax
	}
	return min(idleRetryMax, time.Millisecond<<max(0, n-1))
}

// idleSignal is one Subscriber's side of the handshake. In the default mode
// the lock is held through the pool's notifier, which counts the
// subscriptions of every Subscriber of the process on one table and holds
// the locks of all tables on one connection; in ordered mode a goroutine
// holds it for the subscriber's life.
type idleSignal struct {
	s *Subscriber
	// key is the advisory key of the lock: Table.IdleLockKey for the claim
	// loop, Table.OrderedIdleLockKey for the ordered relay.
	key int64

	// ordered mode: a background goroutine holds the lock for the
	// subscriber's life; granted says it has it.
	permanent bool
	granted   atomic.Bool
	gen       atomic.Uint64
}

// enter takes the lock for one subscription, or counts it in when it is
// already held. It reports false when the lock could not be taken; the
// caller must then not sleep longer than idleRetryMax.
func (i *idleSignal) enter(ctx context.Context) (uint64, bool) {
	if i.permanent {
		return i.gen.Load(), i.granted.Load()
	}
	if i.s.notifier == nil {
		return 0, false
	}
	return i.s.notifier.enterIdle(ctx, i.key)
}

// valid reports whether a lock taken at gen is still held.
func (i *idleSignal) valid(gen uint64) bool {
	if i.permanent {
		return i.granted.Load() && gen == i.gen.Load()
	}
	return i.s.notifier != nil && gen == i.s.notifier.idleGen.Load()
}

// leave counts one subscription out; the last one gives the lock back.
func (i *idleSignal) leave(gen uint64) {
	if i.permanent || i.s.notifier == nil {
		return
	}
	i.s.notifier.leaveIdle(i.key, gen)
}

// lost records that the lock is gone and wakes the subscriptions, so that
// sleeping ones go through the handshake again.
func (i *idleSignal) lost() {
	i.gen.Add(1)
	i.s.wake.broadcast()
}

// enterIdle takes the idle lock of key on the notifier's lock connection, or
// counts one more holder when it is held.
func (n *notifier) enterIdle(ctx context.Context, key int64) (uint64, bool) {
	n.idleMu.Lock()
	defer n.idleMu.Unlock()
	gen := n.idleGen.Load()
	if n.idleHolders[key] > 0 {
		n.idleHolders[key]++
		return gen, true
	}
	qctx, cancel := context.WithTimeout(ctx, opTimeout)
	defer cancel()
	var got bool
	err := n.withIdleConn(qctx, func(c *pgx.Conn) error {
		return c.QueryRow(qctx, schema.TryIdleLock, key).Scan(&got)
	})
	if err != nil || !got {
		return 0, false
	}
	n.idleHolders[key] = 1
	return n.idleGen.Load(), true
}

// leaveIdle counts one holder of key out; the last one releases the lock.
func (n *notifier) leaveIdle(key int64, gen uint64) {
	n.idleMu.Lock()
	defer n.idleMu.Unlock()
	if gen != n.idleGen.Load() || n.idleHolders[key] == 0 {
		return
	}
	n.idleHolders[key]--
	if n.idleHolders[key] > 0 {
		return
	}
	delete(n.idleHolders, key)
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var was bool
	err := n.withIdleConn(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, schema.IdleUnlock, key).Scan(&was)
	})
	if err != nil && n.idleConn != nil {
		// Do not keep a connection that may still hold the lock: writers
		// would notify for nothing.
		n.dropIdleConnLocked()
	}
}

// withIdleConn runs fn on the connection that holds the idle locks,
// acquiring it on first use. Called with idleMu held.
func (n *notifier) withIdleConn(ctx context.Context, fn func(*pgx.Conn) error) error {
	if n.idleConn == nil {
		conn, err := n.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		n.idleConn = conn
	}
	err := fn(n.idleConn.Conn())
	if err != nil && n.idleConn.Conn().IsClosed() {
		n.dropIdleConnLocked()
	}
	return err
}

// dropIdleConnLocked closes the lock connection (which ends its session and
// so its locks) instead of handing a locked connection back to the pool,
// forgets the holders, and wakes every subscription so that sleeping ones go
// through the handshake again.
func (n *notifier) dropIdleConnLocked() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_ = n.idleConn.Conn().Close(ctx)
	cancel()
	n.idleConn.Release()
	n.idleConn = nil
	clear(n.idleHolders)
	n.idleGen.Add(1)
	n.notifyAll()
}

// closeIdleConn gives the lock connection back to the pool, unlocked.
func (n *notifier) closeIdleConn() {
	n.idleMu.Lock()
	defer n.idleMu.Unlock()
	if n.idleConn == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	if _, err := n.idleConn.Exec(ctx, schema.UnlockAll); err != nil {
		_ = n.idleConn.Conn().Close(ctx)
	}
	n.idleConn.Release()
	n.idleConn = nil
	clear(n.idleHolders)
	n.idleGen.Add(1)
}

// holdPermanently is the ordered mode's side of the handshake: ordered
// relays keep the idle lock, or wait for it, for their whole life, so every
// enqueue notifies while one runs. It waits for the lock on a connection of
// its own; once the lock is granted, a claim sees every row committed before,
// and later ones notify.
func (i *idleSignal) holdPermanently(ctx context.Context) {
	defer i.s.bgWg.Done()
	delay := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := i.holdOnce(ctx)
		i.granted.Store(false)
		i.lost()
		if ctx.Err() != nil {
			return
		}
		i.s.logger.Error("Wake-up lock connection lost; reconnecting", err, watermill.LogFields{"retry_in": delay.String()})
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

func (i *idleSignal) holdOnce(ctx context.Context) error {
	conn, err := i.s.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer func() {
		// A connection that held or waited for the lock is not reused.
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Conn().Close(cctx)
		cancel()
		conn.Release()
	}()
	if _, err := conn.Exec(ctx, schema.IdleLock, i.key); err != nil {
		return err
	}
	i.granted.Store(true)
	i.s.wake.broadcast()
	t := time.NewTicker(i.s.cfg.ElectionInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		pctx, cancel := context.WithTimeout(ctx, opTimeout)
		err := conn.Ping(pctx)
		cancel()
		if err != nil {
			return err
		}
	}
}
