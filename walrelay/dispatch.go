package walrelay

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/metrics"
)

// keyQueue is a key's rows in order; its keyed.Key says whether its head
// is out (one at a time) and when a failed head is due again.
type keyQueue struct {
	keyed.Key
	items   []*item
	backoff bool // the head failed and waits for its retry: the queue's streamed rows count in stream.behind
}

// dispatchAll delivers the head of every key that is free and due, with
// dispatch's rules (the retry timer armed for the earliest retry).
func (st *stream) dispatchAll(ctx context.Context) {
	if st.stopping {
		return
	}
	for key := range st.keys {
		st.dispatch(ctx, key)
	}
}

// schedule asks the engine for a wake-up at t and the retry alarm for its
// earliest one (the alarm keeps an earlier ring it has already).
func (st *stream) schedule(t time.Time) {
	st.keyed.At(t)
	if due := st.keyed.Due(); !due.IsZero() {
		st.retry.At(due)
	}
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
	if q.Out() || st.stopping || st.s.terms.Stale(key) {
		return // its verdict, or a stale copy's end (terms.Freed), dispatches again; one copy per key
	}
	switch st.keyed.Start(key, &q.Key, time.Now()) {
	case keyed.Later:
		st.schedule(q.RetryAt)
	case keyed.Started:
		st.deliver(ctx, q, q.items[0])
	}
	// Waiting: MaxInFlight messages are out, and a settle hands the key
	// back (unwait), in order.
}

// backoffReadAhead bounds the unsettled rows, those behind retrying heads
// included, at this many times MaxInFlight.
const backoffReadAhead = 4

// window counts the rows a session read and has not settled, against
// MaxInFlight: the stream is read on while they are under it, not counting
// the streamed rows queued behind heads that wait for their retry (a
// retrying key does not stop the other keys), up to backoffReadAhead x
// MaxInFlight rows in all.
type window struct {
	limit int // MaxInFlight
	// unsettled counts the streamed rows read and not settled.
	unsettled int
	// behind counts the streamed rows queued on keys whose head waits for
	// its retry.
	behind int
	// fromTable counts the rows drains read from the table (items without
	// a transaction) and not settled yet.
	fromTable int
}

// backingOff counts q's streamed rows in behind: its head waits for a retry.
func (w *window) backingOff(q *keyQueue) {
	if !q.backoff {
		q.backoff = true
		w.behind += streamed(q.items)
	}
}

// backedOff takes q's rows out of behind: its head goes out again (or the
// key is held and its rows parked).
func (w *window) backedOff(q *keyQueue) {
	if q.backoff {
		q.backoff = false
		w.behind -= streamed(q.items)
	}
}

// crowded reports whether the read-ahead bound (backoffReadAhead x
// MaxInFlight rows, those behind retrying heads included) is what stops the
// stream: spilling a retrying key's backlog lets it read on.
func (w *window) crowded() bool {
	return w.behind > 0 && w.unsettled-w.behind < w.limit && w.unsettled >= backoffReadAhead*w.limit
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
func (w *window) readable() bool {
	return w.unsettled-w.behind < w.limit && w.unsettled < backoffReadAhead*w.limit
}

// unwait dispatches the keys that waited for room, oldest first, while
// there is room.
func (st *stream) unwait(ctx context.Context) {
	for {
		key, ok := st.keyed.Ready()
		if !ok {
			return
		}
		st.dispatch(ctx, key)
	}
}

func (st *stream) deliver(ctx context.Context, q *keyQueue, it *item) {
	st.win.backedOff(q) // its slot is reserved (dispatch)
	it.attempts++
	it.row.Attempts = int32(it.attempts) //nolint:gosec // bounded by MaxAttempts
	st.inFlight.Add(1)
	// The message is built by the pump, off the loop: the row is not
	// written again until the delivery settles.
	st.hand.queue(delivery{ctx: ctx, it: it})
}

func (st *stream) onSettle(ctx context.Context, v settle) {
	it := v.it
	q := st.keys[it.key]
	if q == nil {
		return
	}
	if v.stopped {
		st.keyed.Finish(&q.Key)
		return // stopping: the row stays unsettled, the next relay delivers it
	}
	defer st.unwait(ctx)
	var f keyed.Failure // a nack's outcome: retry or dead
	if !v.ack {
		f = st.s.policy().Judge(v.err, it.attempts, it.row.Payload)
	}
	// skipped: a nack of the held row of a hold that drains after a skip
	// (an operator skipped the row while this copy was in the handler): a
	// skip is final, so the row is not tried again; it is marked skipped
	// (MarkSkipped) and holds nothing. A retry's drain delivers the held
	// row itself: its nack is an ordinary failure.
	h := st.holds.holdOf(it)
	skipped := !v.ack && h != nil && h.State == keyed.Draining && !h.retried && it.row.Sequence == h.Seq
	if skipped {
		f.Dead = true
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
			st.inFlight.Add(1) // the key keeps its slot until the settle comes back
			time.AfterFunc(visibleDelay(it.unseen), func() {
				defer st.inFlight.Done()
				st.send(v)
			})
			it.unseen++
			st.s.unseen.Add(1)
			return
		}
	}
	st.keyed.Finish(&q.Key)
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
		q.RetryAt = time.Now().Add(f.RetryIn)
		it.lastErr = f.Summary
		st.win.backingOff(q)
		st.s.logger.Debug("Nacked: key held until the retry", watermill.LogFields{"sequence": it.row.Sequence, "attempts": it.attempts})
		if (len(q.items) > st.s.cfg.MaxInFlight || st.holds.moreInTable(it)) && st.holds.spill(ctx, it.key, q) {
			return
		}
		st.dispatch(ctx, it.key)
		return
	}
	deadChanged := false
	if !v.ack {
		last := f.Summary
		var key *string
		if k := it.row.OrderingKey; k != nil && *k != "" && st.s.cols.OrderingKey && !skipped && !st.holds.ownRowOnly(it) {
			key = k
		}
		var changed, held int
		sql, args := st.s.q.MarkDeadHold, []any{it.row.ID, it.attempts, last, key}
		if skipped {
			sql, args = st.s.q.MarkSkipped, args[:3]
		}
		ok, err := st.write(ctx, "dead", sql, []any{&changed, &held}, args...)
		if err == nil && !ok {
			// Refused: this session no longer holds the slot. The row
			// stays as it is, unsettled; the session that holds the slot
			// delivers it. Nothing more goes out here: the session ends.
			st.stopping = true
			return
		}
		if err != nil {
			// Not recorded: keep the key held and try again later.
			st.s.logger.Error("Could not park a row dead; retrying", err, watermill.LogFields{"sequence": it.row.Sequence})
			q.RetryAt = time.Now().Add(st.s.cfg.Backoff(it.attempts))
			it.attempts--
			st.win.backingOff(q)
			st.dispatch(ctx, it.key)
			return
		}
		// A row already dead or skipped (a copy of a skipped row) or
		// published holds nothing: the statement changed no row.
		// An earlier row of a key that a later dead row holds goes dead
		// without moving the hold (MarkDeadHold keeps it).
		deadChanged = changed > 0 && held > 0
		if skipped {
			st.s.logger.Info("Row skipped", watermill.LogFields{"sequence": it.row.Sequence, "attempts": it.attempts})
		} else {
			st.s.logger.Info("Row dead", watermill.LogFields{"sequence": it.row.Sequence, "attempts": it.attempts})
			if m := st.s.cfg.Metrics; m != nil {
				m.DeadTotal.WithLabelValues(st.s.cfg.Table.Qualified(), it.row.Topic).Inc()
			}
		}
		if k := it.row.OrderingKey; k != nil {
			st.s.logger.Trace("Dead", watermill.LogFields{"key": *k, "sequence": it.row.Sequence, "drained": it.tx == nil, "replay": it.replay, "skipped": skipped})
		}
	}
	q.items = q.items[1:]
	q.RetryAt = time.Time{}
	if v.ack && it.tx != nil && h.replayedBy(it) {
		// The held row's replay: settled once its drain is written
		// (a replay's ack waits for its drain, hold.acked).
		st.holds.settleAcked(h)
		h.acked = it
	} else {
		st.settled(it)
	}
	if !v.ack && it.row.OrderingKey != nil && *it.row.OrderingKey != "" && st.s.cols.OrderingKey && deadChanged {
		st.holds.holdKey(*it.row.OrderingKey, it.row.Sequence, q)
	} else if v.ack {
		st.holds.afterAck(ctx, it)
	}
	st.confirmSettled()
	st.dispatch(ctx, it.key)
}

// settled accounts for a row that needs nothing more.
func (st *stream) settled(it *item) {
	if it.tx != nil {
		st.win.unsettled--
		it.tx.pending--
		return
	}
	st.win.fromTable--
	if h := st.holds.holdOf(it); h != nil && h.State == keyed.Draining {
		h.left--
	}
}
