package subscriber

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
)

// notifier is the one LISTEN connection a pool needs: every Subscriber on the
// pool registers its table's channel here, so a process with many
// subscribers holds one listening connection, not one each.
type notifier struct {
	pool   *pgxpool.Pool
	logger watermill.LoggerAdapter
	refs   int

	mu        sync.Mutex
	channels  map[string]map[*broadcaster]struct{}
	dirty     bool
	interrupt context.CancelFunc
	live      bool     // a session listens and takes idle requests
	idleOps   []idleOp // idle requests for the session (idle.go)

	cancel context.CancelFunc
	done   chan struct{}

	// The idle locks of the wake-up handshake (idle.go), all tables on the
	// LISTEN connection. idleHolders belongs to the session goroutine.
	idleHolders map[int64]int // lock key -> subscriptions counting on it
	idleGen     atomic.Uint64 // changes when a session, and its locks, ends; never 0

	// The relay-mode locks (modelock.go): modes and modeOps belong to mu,
	// heldModes to the session goroutine.
	modes     map[int64]modeWant
	modeOps   []modeOp
	heldModes map[int64]bool
	// modesUp are the mode locks the current session holds and checked
	// (belongs to mu; emptied when a session ends), and switchedAway the
	// locks taken again on a table switched to another mode meanwhile
	// (belongs to mu; for good): no relay claims without its lock up
	// (modeReady).
	modesUp      map[int64]bool
	switchedAway map[int64]error
}

var (
	notifiersMu sync.Mutex
	notifiers   = map[*pgxpool.Pool]*notifier{}
)

// acquireNotifier returns the pool's notifier, starting it on first use.
func acquireNotifier(pool *pgxpool.Pool, logger watermill.LoggerAdapter) *notifier {
	notifiersMu.Lock()
	defer notifiersMu.Unlock()
	n := notifiers[pool]
	if n == nil {
		ctx, cancel := context.WithCancel(context.Background())
		n = &notifier{pool: pool, logger: logger, channels: map[string]map[*broadcaster]struct{}{}, cancel: cancel, done: make(chan struct{}),
			idleHolders: map[int64]int{}, modes: map[int64]modeWant{}, heldModes: map[int64]bool{},
			modesUp: map[int64]bool{}, switchedAway: map[int64]error{}}
		n.idleGen.Store(1)
		notifiers[pool] = n
		go n.run(ctx)
	}
	n.refs++
	return n
}

// release drops one reference; the last one stops the notifier and waits for
// its goroutine.
func (n *notifier) release() {
	notifiersMu.Lock()
	n.refs--
	last := n.refs == 0
	if last {
		delete(notifiers, n.pool)
	}
	notifiersMu.Unlock()
	if last {
		n.cancel()
		<-n.done
	}
}

func (n *notifier) add(channel string, b *broadcaster) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.channels[channel] == nil {
		n.channels[channel] = map[*broadcaster]struct{}{}
	}
	n.channels[channel][b] = struct{}{}
	n.markDirtyLocked()
}

func (n *notifier) remove(channel string, b *broadcaster) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.channels[channel], b)
	if len(n.channels[channel]) == 0 {
		delete(n.channels, channel)
	}
	n.markDirtyLocked()
}

func (n *notifier) markDirtyLocked() {
	n.dirty = true
	if n.interrupt != nil {
		n.interrupt()
	}
}

// notify wakes the subscribers of channel; topics is set when the paused
// topics may have changed (a pause or resume notified, or notifications may
// have been missed).
func (n *notifier) notify(channel string, topics bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for b := range n.channels[channel] {
		if topics {
			b.topicsGen.Add(1)
		}
		b.broadcast()
	}
}

func (n *notifier) notifyAll() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, bs := range n.channels {
		for b := range bs {
			b.topicsGen.Add(1) // notifications may have been missed
			b.broadcast()
		}
	}
}

func (n *notifier) run(ctx context.Context) {
	defer close(n.done)
	const firstDelay = 100 * time.Millisecond
	delay := firstDelay
	for ctx.Err() == nil {
		listened, err := n.session(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			// The connection worked before it was lost: this is a new
			// failure, not the same outage going on, so the backoff starts
			// again instead of growing to seconds over a day of rare drops.
			delay = firstDelay
		}
		n.logger.Error("LISTEN connection lost; reconnecting", err, watermill.LogFields{"retry_in": delay.String()})
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// session listens on one connection until it fails; listened reports
// whether it got as far as listening on every channel.
func (n *notifier) session(ctx context.Context) (listened bool, err error) {
	conn, err := n.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		// A connection that was listening (and may hold idle locks) is not
		// handed out again; its locks end with it.
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_ = conn.Conn().Close(cctx)
		cancel()
		conn.Release()
		n.lostIdle()
	}()
	n.mu.Lock()
	n.live = true
	n.mu.Unlock()
	listening := map[string]bool{}
	// Rows committed while no one listened are found now.
	n.notifyAll()
	for {
		n.mu.Lock()
		want := make(map[string]bool, len(n.channels))
		for ch := range n.channels {
			want[ch] = true
		}
		n.dirty = false
		n.mu.Unlock()
		for ch := range want {
			if !listening[ch] {
				if _, err := conn.Exec(ctx, sqlq.ListenStatement(ch)); err != nil {
					return listened, err
				}
				listening[ch] = true
				n.notify(ch, true)
			}
		}
		for ch := range listening {
			if !want[ch] {
				if _, err := conn.Exec(ctx, sqlq.UnlistenStatement(ch)); err != nil {
					return listened, err
				}
				delete(listening, ch)
			}
		}
		listened = true
		if err := n.runIdleOps(ctx, conn.Conn()); err != nil {
			return listened, errors.Join(errors.New("idle lock"), err)
		}
		if err := n.runModeOps(ctx, conn.Conn()); err != nil {
			return listened, errors.Join(errors.New("relay-mode lock"), err)
		}
		wctx, interrupt := context.WithCancel(ctx)
		n.mu.Lock()
		dirty := n.dirty || len(n.idleOps) > 0 || len(n.modeOps) > 0
		n.interrupt = interrupt
		n.mu.Unlock()
		if dirty {
			interrupt()
		}
		msg, err := conn.Conn().WaitForNotification(wctx)
		n.mu.Lock()
		n.interrupt = nil
		n.mu.Unlock()
		interrupt()
		switch {
		case err == nil:
			n.notify(msg.Channel, msg.Payload == sqlq.PausedTopicsNotifyPayload)
		case ctx.Err() != nil:
			return listened, ctx.Err()
		case wctx.Err() != nil && !conn.Conn().IsClosed():
			// Interrupted to change the channel set.
		default:
			return listened, errors.Join(errors.New("wait for notification"), err)
		}
	}
}
