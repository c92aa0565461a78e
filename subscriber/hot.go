package subscriber

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
)

// The hot path (docs/HOTPATH.md). A service that relays its own table in
// the process that writes it hands the events it committed straight to
// its subscription: no NOTIFY wake-up and no claim. The writer's enqueue
// writes each event leased to the hot path, as a claim would lease it
// (attempts 1, locked_at: sqlq.LeaseRequest, in the same INSERT, so the
// writer pays no extra statement), so no relay claims it meanwhile; after
// the commit, and only then, the events go to the subscription's channel
// and from there through the same watch, ack, nack, renewal and fencing as
// a claimed row. A crash between commit and delivery leaves leased rows,
// which the relays claim once the lease expires (LockTTL), like the rows of
// any relay that crashed.

// maxHotQueue bounds HotConfig.QueueLimit: the capacity of each
// subscription's hot channel, so that a hand-over never blocks.
const maxHotQueue = 4096

// DefaultHotQueueLimit is HotConfig.QueueLimit's default.
const DefaultHotQueueLimit = 256

// HotConfig configures a HotPath. The zero HotConfig is valid.
type HotConfig struct {
	// QueueLimit bounds the events handed to the hot path and not yet in a
	// handler (handlers are bounded by Config.MaxInFlight). An event
	// enqueued while it is full is left to the cold path at once (not
	// leased, so a relay claims it at its next wake-up) and counted in
	// outbox_hot_fallback_total{reason="queue_full"}. Defaults to
	// DefaultHotQueueLimit; at most 4096.
	QueueLimit int
	// Enqueuer is the configuration of the enqueues (topic validation,
	// payload limit, columns, metrics). Its DisableNotify is set for the
	// events the hot path takes (no relay needs waking for them) and kept
	// for the others.
	Enqueuer publisher.EnqueuerConfig
}

// HotPath hands the events a process commits to the subscription of the
// same process, without a claim. Create it with NewHotPath for a default
// or ordered relay of the table the process writes; write with BeginFunc.
// It is safe for concurrent use.
//
// Only unkeyed events are hot in ordered mode (a keyed event's order
// belongs to the ordered relay, which delivers it); the WAL relay has no
// hot path (its stream is already a push). An event is left to the cold
// path (a relay's claim, at its next wake-up) when the hot queue is full,
// when no subscription of this process takes its topic or this relay is a
// standby, and when its topic is paused.
type HotPath struct {
	s      *Subscriber
	limit  int64
	queued atomic.Int64 // events reserved: being written, or handed over and not yet in a handler
	quiet  *publisher.Enqueuer
	loud   *publisher.Enqueuer
	// crashAfterCommit, set by tests only, makes BeginFunc return after
	// the commit without handing anything over: a process killed between
	// its commit and the delivery.
	crashAfterCommit atomic.Bool
}

// NewHotPath returns the hot path of s: events enqueued through its
// BeginFunc are delivered by s's subscriptions in this process. s must be a
// relay of the table the events are written to.
func NewHotPath(s *Subscriber, cfg HotConfig) (*HotPath, error) {
	if s == nil {
		return nil, errors.New("subscriber: NewHotPath: nil Subscriber; pass the relay (subscriber.New) of the table the process writes")
	}
	switch {
	case cfg.QueueLimit == 0:
		cfg.QueueLimit = DefaultHotQueueLimit
	case cfg.QueueLimit < 0 || cfg.QueueLimit > maxHotQueue:
		return nil, fmt.Errorf("subscriber: invalid hot path config: QueueLimit is %d; use 1 to %d, or 0 for %d", cfg.QueueLimit, maxHotQueue, DefaultHotQueueLimit)
	}
	cols := s.q.Columns
	ec := cfg.Enqueuer
	if ec.Columns == nil {
		ec.Columns = &cols
	}
	loud, err := publisher.NewEnqueuer(ec)
	if err != nil {
		return nil, fmt.Errorf("subscriber: hot path: %w", err)
	}
	ec.DisableNotify = true
	quiet, err := publisher.NewEnqueuer(ec)
	if err != nil {
		return nil, fmt.Errorf("subscriber: hot path: %w", err)
	}
	return &HotPath{s: s, limit: int64(cfg.QueueLimit), quiet: quiet, loud: loud}, nil
}

// Beginner begins a transaction: a *pgxpool.Pool or a *pgx.Conn.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// BeginFunc begins a transaction on db, calls fn with it and commits it;
// after the commit, and only then, it hands the events fn enqueued through
// the HotTx to this process's subscription. When fn returns an error, or
// the commit fails, the transaction is rolled back and nothing is handed
// over. db must be a pool or a connection, not a pgx.Tx: a nested
// transaction is a savepoint, whose release commits nothing.
//
// fn must not commit or roll back the transaction itself. Events enqueued
// in fn with publisher.Enqueue (not through the HotTx) take the cold path.
func (h *HotPath) BeginFunc(ctx context.Context, db Beginner, fn func(tx *HotTx) error) (err error) {
	if _, nested := db.(pgx.Tx); nested {
		return errors.New("subscriber: HotPath.BeginFunc needs a *pgxpool.Pool or *pgx.Conn: a pgx.Tx would begin a savepoint, whose release commits nothing, and its events would be handed over before their commit")
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("subscriber: hot path: begin: %w", err)
	}
	htx := &HotTx{Tx: tx, h: h}
	committed := false
	defer func() {
		if committed {
			return
		}
		if rbErr := tx.Rollback(ctx); rbErr != nil && !errors.Is(rbErr, pgx.ErrTxClosed) {
			err = errors.Join(err, fmt.Errorf("rollback: %w", rbErr))
		}
		h.queued.Add(-int64(htx.reserved))
	}()
	if err := fn(htx); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("subscriber: hot path: commit: %w", err)
	}
	committed = true
	if h.crashAfterCommit.Load() {
		h.queued.Add(-int64(htx.reserved))
		return nil
	}
	h.handOver(htx, time.Now())
	return nil
}

// HotTx is the transaction of HotPath.BeginFunc: use it for the business
// writes (it is a pgx.Tx) and enqueue the events with its Enqueue and
// EnqueueBatch.
type HotTx struct {
	pgx.Tx
	h        *HotPath
	leased   []*claimed // the rows written leased to the hot path
	reserved int        // the queue places they take
}

// Enqueue writes msg into the relay's table in tx (publisher.Enqueue);
// after the commit the hot path delivers it, unless it is left to the cold
// path.
func (tx *HotTx) Enqueue(ctx context.Context, msg publisher.Message) (int64, error) {
	h := tx.h
	if msg.OrderingKey != "" {
		// Through the batch, which takes the key's lock as every keyed
		// enqueue does.
		seqs, err := tx.EnqueueBatch(ctx, []publisher.Message{msg})
		if err != nil {
			return 0, err
		}
		return seqs[0], nil
	}
	if reason := h.eligible(ctx, msg); reason != "" {
		h.fallback(reason, 1)
		return h.loud.Enqueue(ctx, tx.Tx, h.s.cfg.Table, msg)
	}
	tx.reserved++ // given back by BeginFunc if the transaction does not commit
	lease := &sqlq.LeaseRequest{}
	seq, err := h.quiet.Enqueue(sqlq.WithLease(ctx, lease), tx.Tx, h.s.cfg.Table, msg)
	if err != nil {
		return 0, err
	}
	tx.took(lease, 1)
	return seq, nil
}

// took keeps the rows lease holds, of the want events taken to the hot
// path, and gives back the queue places of those not written.
func (tx *HotTx) took(lease *sqlq.LeaseRequest, want int) {
	for _, row := range lease.Rows {
		tx.leased = append(tx.leased, &claimed{row: row})
	}
	if missed := want - len(lease.Rows); missed > 0 {
		// Events enqueued before (an idempotent enqueue writes nothing) or
		// repeated in a batch: not this transaction's to hand over.
		tx.reserved -= missed
		tx.h.queued.Add(-int64(missed))
		tx.h.fallback("not_written", missed)
	}
}

// EnqueueBatch writes msgs into the relay's table in tx
// (publisher.EnqueueBatch); after the commit the hot path delivers those it
// takes. The events it takes are written in one statement, leased, and
// the others in another (which wakes the relays).
func (tx *HotTx) EnqueueBatch(ctx context.Context, msgs []publisher.Message) ([]int64, error) {
	h := tx.h
	var hot, cold []int
	for i, m := range msgs {
		if reason := h.eligible(ctx, m); reason != "" {
			h.fallback(reason, 1)
			cold = append(cold, i)
			continue
		}
		hot = append(hot, i)
	}
	tx.reserved += len(hot) // given back by BeginFunc if the transaction does not commit
	seqs := make([]int64, len(msgs))
	write := func(ctx context.Context, enq *publisher.Enqueuer, idx []int) error {
		if len(idx) == 0 {
			return nil
		}
		part := make([]publisher.Message, len(idx))
		for k, i := range idx {
			part[k] = msgs[i]
		}
		got, err := enq.EnqueueBatch(ctx, tx.Tx, h.s.cfg.Table, part)
		for k, i := range idx {
			if err == nil {
				seqs[i] = got[k]
			}
		}
		return err
	}
	lease := &sqlq.LeaseRequest{}
	if err := write(sqlq.WithLease(ctx, lease), h.quiet, hot); err != nil {
		return nil, err
	}
	tx.took(lease, len(hot))
	if err := write(ctx, h.loud, cold); err != nil {
		return nil, err
	}
	return seqs, nil
}

// eligible takes a queue place for m and returns "", or the reason m is
// left to the cold path.
func (h *HotPath) eligible(ctx context.Context, m publisher.Message) string {
	s := h.s
	switch {
	case s.closed.Load():
		return "stopped"
	case s.oq != nil && m.OrderingKey != "":
		return "keyed"
	case !s.IsLeader():
		return "no_subscription"
	case s.pausedTopics(ctx).has(m.Topic):
		// The relay's own reading, read again when stale (never read
		// yet, a pause notified since, or PollInterval old), as before
		// a claim.
		return "paused"
	case !s.hotSubs.takes(m.Topic):
		return "no_subscription"
	}
	if h.queued.Add(1) > h.limit {
		h.queued.Add(-1)
		return "queue_full"
	}
	return ""
}

func (h *HotPath) fallback(reason string, n int) {
	if m := h.s.cfg.Metrics; m != nil && n > 0 {
		m.HotFallback.WithLabelValues(h.s.label, reason).Add(float64(n))
	}
}

// handOver gives the committed events of tx to the subscriptions of their
// topics; the events no subscription takes any more get their leases back
// (the attempt undone), for the cold path.
func (h *HotPath) handOver(tx *HotTx, committed time.Time) {
	if len(tx.leased) == 0 {
		return
	}
	s := h.s
	var back []*claimed
	s.hotSubs.mu.Lock()
	for _, c := range tx.leased {
		c.hot, c.hotCommitted = h, committed
		sub := s.hotSubs.pick(c.row.Topic)
		if sub == nil {
			back = append(back, c)
			continue
		}
		sub.hot <- c // never blocks: the queue places bound what is queued
	}
	s.hotSubs.mu.Unlock()
	if len(back) > 0 {
		h.queued.Add(-int64(len(back)))
		h.fallback("stopped", len(back))
		s.release(back, 1)
	}
}

// hotSubs are the subscriptions of a Subscriber that take hot events.
type hotSubs struct {
	mu   sync.Mutex
	subs []*subscription
}

func (r *hotSubs) add(sub *subscription) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.subs = append(r.subs, sub)
}

func (r *hotSubs) remove(sub *subscription) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, x := range r.subs {
		if x == sub {
			r.subs = append(r.subs[:i], r.subs[i+1:]...)
			return
		}
	}
}

// pick returns the subscription for topic (its own, else one of every
// topic), or nil. Called under mu.
func (r *hotSubs) pick(topic string) *subscription {
	var all *subscription
	for _, sub := range r.subs {
		switch sub.topic {
		case topic:
			return sub
		case AllTopics:
			all = sub
		}
	}
	return all
}

func (r *hotSubs) takes(topic string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pick(topic) != nil
}

// hotLoop delivers the events handed over to sub, each once a slot of
// MaxInFlight is free, until sub stops; then it gives back the leases of
// those not delivered (the attempt undone), for the cold path.
func (sub *subscription) hotLoop(stop <-chan struct{}) {
	s := sub.s
	var undelivered []*claimed
	defer func() {
		s.hotSubs.remove(sub) // no hand-over after this
		for drained := false; !drained; {
			select {
			case c := <-sub.hot:
				undelivered = append(undelivered, c)
			default:
				drained = true
			}
		}
		for _, c := range undelivered {
			c.hot.queued.Add(-1)
			c.hot.fallback("stopped", 1)
		}
		s.release(undelivered, 1)
	}()
	for {
		var c *claimed
		select {
		case <-stop:
			return
		case c = <-sub.hot:
		}
		for sub.slots.Reserve(1) == 0 {
			select {
			case <-stop:
				undelivered = append(undelivered, c)
				return
			case <-sub.slots.Freed():
			}
		}
		c.hot.queued.Add(-1)
		if s.paused.set.Load().has(c.row.Topic) {
			// Paused after the hand-over: the cold path delivers it once
			// the topic is resumed.
			c.hot.fallback("paused", 1)
			s.release([]*claimed{c}, 1)
			sub.slots.Unreserve(1)
			continue
		}
		if !sub.deliver([]*claimed{c}, stop) {
			return
		}
	}
}

// observeHot records the ack of a hot event: its commit-to-ack latency.
func observeHot(s *Subscriber, c *claimed) {
	if m := s.cfg.Metrics; m != nil && c.hot != nil {
		m.HotLatency.WithLabelValues(s.label).Observe(time.Since(c.hotCommitted).Seconds())
	}
}

// observeDelivered counts an acked row by the path that delivered it.
func observeDelivered(s *Subscriber, c *claimed) {
	if m := s.cfg.Metrics; m != nil {
		path := metrics.PathCold
		if c.hot != nil {
			path = metrics.PathHot
		}
		m.Delivered.WithLabelValues(s.label, path).Inc()
	}
}
