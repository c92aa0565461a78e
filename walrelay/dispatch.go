package walrelay

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

type keyQueue struct {
	items    []*item
	inFlight bool
	retryAt  time.Time
	backoff  bool // the head failed and waits for its retry: the queue's streamed rows count in stream.behind
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
		return // a stale copy's end dispatches again (terms.Freed); one copy per key
	}
	if q.retryAt.After(time.Now()) {
		st.schedule(q.retryAt)
		return
	}
	if st.slots.Reserve(1) == 0 {
		// MaxInFlight messages are out: the key waits for a settle
		// (unwait), in order.
		st.waiters.Add(key)
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

// unwait dispatches the keys that waited for room, oldest first, while
// there is room.
func (st *stream) unwait(ctx context.Context) {
	for !st.slots.Full() {
		key, ok := st.waiters.Pop()
		if !ok {
			return
		}
		st.dispatch(ctx, key)
	}
}

func (st *stream) deliver(ctx context.Context, q *keyQueue, it *item) {
	q.inFlight = true // its slot is reserved (dispatch)
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
	// it, cancelled when the session ends or the copy does (a term's end cancels its messages).
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
				st.send(settle{it: w.it, stopped: true}) // the session ended first: not recorded (a verdict of an ended term is not progress)
			}
		case <-w.msg.Nacked():
			if !w.cp.End(term.Nacked) {
				st.send(settle{it: w.it, stopped: true}) // a verdict of an ended term is not progress
				break
			}
			st.send(settle{it: w.it, err: w.recorded()}) // nil: nacked without an error (keyed.NoErrorText)
		case <-w.ctx.Done():
			// The session ended with the message in a handler: its
			// context is cancelled (a term's end cancels its messages), and the ledger follows the
			// copy; no later session delivers its key until the copy ends
			// (its verdict, recorded nowhere, CloseTimeout, or the relay's
			// stop: one copy per key, a verdict of an ended term is not progress, nothing waits forever).
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
	if v.stopped {
		st.slots.Unreserve(1)
		return // stopping: the row stays unsettled, the next relay delivers it
	}
	defer st.unwait(ctx)
	var f keyed.Failure // a nack's outcome: retry or dead
	if !v.ack {
		f = st.s.policy().Judge(v.err, it.attempts, it.row.Payload)
	}
	if !v.ack && f.Dead && it.tx != nil {
		// The dead write must find the row (a dead write waits for its row to be visible): it waits for the
		// row's transaction to be visible, the verdict kept, the row not
		// delivered again.
		ok, err := st.vis.visible(ctx, it.tx.xid)
		if err != nil {
			st.s.logger.Error("Could not tell whether a rejected row is visible; trying again", err, watermill.LogFields{"sequence": it.row.Sequence})
		}
		if err != nil || !ok {
			q.inFlight = true // it keeps its slot until the settle comes back
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
	st.slots.Unreserve(1)
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
	if !v.ack && !f.Dead {
		q.retryAt = time.Now().Add(f.RetryIn)
		it.lastErr = f.Summary
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
		last := f.Summary
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
		// (a replay's ack waits for its drain, hold.acked).
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
	if h := st.holdOf(it); h != nil && h.State == keyed.Draining {
		h.left--
	}
}
