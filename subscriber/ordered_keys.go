package subscriber

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/metrics"
)

// startRunnersLocked starts a runner for every key with work, while the
// subscription's MaxInFlight slots (keyed.Slots: its runners, each with at
// most one message, the unkeyed rows of its claim loop, and the copies left
// in handlers by ended terms) have room; the others wait in line. The same
// walk asks the engine to wake the relay when the earliest held row that
// waits for its time is due (keyed.Engine.At; the loop sleeps until Due).
func (r *orderedRelay) startRunnersLocked() {
	now := time.Now()
	r.keyed.Woke()
	for _, k := range r.keys {
		r.startLocked(k, now)
		if at, ok := k.retryAt(now); ok {
			r.keyed.At(at)
		}
	}
}

// startLocked starts a runner for k when k has work and the engine gives
// it a slot (keyed.Engine.Start: one runner per key; without a free slot
// the key waits in line). It reports false when k had to wait.
func (r *orderedRelay) startLocked(k *keyState, now time.Time) bool {
	if k.Out() || !r.deliverableLocked(k) || r.nextActionLocked(k) == actNone {
		return true
	}
	switch r.keyed.Start(k.name, &k.Key, now) {
	case keyed.Started:
		r.runWg.Add(1)
		go r.runKey(k)
	case keyed.Waiting:
		return false
	}
	return true
}

// retryAt is when k's held row is due again, if it waits for its time and
// no runner or statement works on it (keyed.Hold.Waits); the relay wakes
// then. The relay's mutex is held.
func (k *keyState) retryAt(now time.Time) (time.Time, bool) {
	if h := k.hold; h != nil && !h.inflight && !h.advancing && !k.Out() && h.Waits(now) {
		return h.DueAt, true
	}
	return time.Time{}, false
}

// readyLocked starts the keys that waited for a slot, oldest first, while
// slots are free.
func (r *orderedRelay) readyLocked() {
	now := time.Now()
	for {
		name, ok := r.keyed.Ready()
		if !ok {
			return
		}
		if k := r.keys[name]; k != nil && !r.startLocked(k, now) {
			return // the slot went meanwhile (the claim loop): it waits again
		}
	}
}

type action int

const (
	actNone    action = iota
	actQueue          // deliver the first queued row
	actHeld           // deliver the held row (a retry or a replay)
	actAdvance        // the held row was skipped: move the hold on
)

func (r *orderedRelay) nextActionLocked(k *keyState) action {
	if h := k.hold; h != nil && h.Open() {
		if h.inflight || h.advancing {
			return actNone
		}
		switch h.Next(time.Now()) {
		case keyed.MoveOn:
			return actAdvance
		case keyed.Deliver:
			return actHeld
		}
		return actNone
	}
	if len(k.queue) > 0 && !watchedLocked(k.p, k.queue[0].row) && !r.s.paused.set.Load().has(k.queue[0].row.Topic) {
		return actQueue
	}
	return actNone
}

// runKey delivers the rows of one key one after another until the key has
// nothing to do.
func (r *orderedRelay) runKey(k *keyState) {
	defer r.runWg.Done()
	stop := r.sub.stopped()
	for {
		r.mu.Lock()
		if !r.deliverableLocked(k) || r.keys[k.name] != k {
			r.endRunLocked(k)
			r.mu.Unlock()
			return
		}
		switch r.nextActionLocked(k) {
		case actQueue:
			e := k.queue[0]
			k.queue = k.queue[1:]
			k.flying = e.row.Sequence
			r.mu.Unlock()
			v := r.deliverRow(k, e.row, 1, stop)
			r.mu.Lock()
			k.flying = 0
			switch v {
			case verdictAck:
				delete(k.p.open, e.row.Sequence)
				k.lastDone = max(k.lastDone, e.row.Sequence)
				r.freedLocked(k.p)
			case verdictNack:
				// fail made the row the key's hold (or put it back).
			default:
				// Not delivered or no verdict: the row stays first of its
				// key, unless a hold covered it meanwhile.
				if _, open := k.p.open[e.row.Sequence]; open && r.keys[k.name] == k {
					k.queue = append([]*entry{e}, k.queue...)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			r.mu.Unlock()
		case actHeld:
			h := k.hold
			h.inflight = true
			seq, attempts := h.Seq, h.Attempts
			r.mu.Unlock()
			ctx, cancel := context.WithTimeout(r.sub.ctx, opTimeout)
			row, err := r.oq.HeldRow(ctx, r.s.pool, k.name, seq)
			gone := errors.Is(err, pgx.ErrNoRows) && r.oq.Gone(ctx, r.s.pool, k.name, seq)
			cancel()
			if gone {
				// The held row was deleted (by hand, or by a cleaner that
				// raced an operator's replay): there is nothing left to
				// deliver, and the key goes on with its next row.
				r.advance(k, h)
				r.mu.Lock()
				h.inflight = false
				if k.hold == h {
					r.refreshLaterLocked(k)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if errors.Is(err, pgx.ErrNoRows) {
				// Skipped meanwhile or resolved by another relay: the
				// holds read sorts it out.
				r.mu.Lock()
				h.inflight = false
				if k.hold == h {
					r.refreshLaterLocked(k)
				}
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if err != nil {
				r.logger.Error("Could not read a held row; retrying shortly", err, watermill.LogFields{"sequence": seq})
				r.mu.Lock()
				h.inflight = false
				h.DueAt = time.Now().Add(100 * time.Millisecond)
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			if r.s.paused.set.Load().has(row.Topic) {
				// The held row's topic is paused: the key waits, and the
				// row is looked at again at the next poll.
				r.mu.Lock()
				h.inflight = false
				h.DueAt = time.Now().Add(r.s.cfg.PollInterval)
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			v := r.deliverRow(k, row, attempts+1, stop)
			r.mu.Lock()
			h.inflight = false
			if k.hold != h {
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
			switch v {
			case verdictAck:
				h.acked = true
				r.mu.Unlock()
				r.advance(k, h)
			case verdictNack:
				r.mu.Unlock() // fail updated the hold (and a requested skip)
			default:
				r.endRunLocked(k)
				r.mu.Unlock()
				return
			}
		case actAdvance:
			h := k.hold
			r.mu.Unlock()
			r.advance(k, h)
		default:
			r.endRunLocked(k)
			r.mu.Unlock()
			return
		}
	}
}

// refreshLaterLocked makes the next holds read replace k's hold.
func (r *orderedRelay) refreshLaterLocked(k *keyState) {
	k.hold.DueAt = time.Now().Add(time.Second)
	k.holdGen = 0
	r.needHolds = true
}

// freedLocked starts a cycle when p's scan had stopped for the read-ahead
// limit and has room again.
func (r *orderedRelay) freedLocked(p *partState) {
	if p.full && len(p.open) < r.times.readAhead/2 {
		p.full = false
		r.signal()
	}
}

func (r *orderedRelay) endRunLocked(k *keyState) {
	r.keyed.Finish(&k.Key)
	if r.keys[k.name] == k {
		r.pruneKeyLocked(k.name, k)
		// A run that ends on a held row waiting for its retry (a nack, a
		// failed read) asks for a wake-up at its time: the loop may sleep
		// for PollInterval; its next walk asks again for what still waits.
		if at, ok := k.retryAt(time.Now()); ok && r.keyed.At(at) {
			r.signal()
		}
	}
	// The slot goes to the key that waited longest for one (cycles and
	// due timers start the keys whose work came later).
	r.readyLocked()
}

type verdict int

const (
	verdictAck  verdict = iota // acked
	verdictNack                // nacked and recorded (or refused)
	verdictNone                // not sent, or no verdict before the close timeout
)

// deliverRow sends one row and waits for its verdict; a nack is recorded by
// fail before it returns.
func (r *orderedRelay) deliverRow(k *keyState, row *sqlq.OrderedRow, attempts int, stop <-chan struct{}) verdict {
	s := r.s
	row.Attempts = int32(attempts) //nolint:gosec // attempts are small
	c := &claimed{row: row.ClaimedRow}
	msg, err := r.sub.message(c)
	if err != nil {
		c.slot = &errorSlot{err: Permanent(err)}
		c.delivered = time.Now()
		r.fail(k, row, c)
		return verdictNack
	}
	c.slot = &errorSlot{}
	t := k.p.term
	select {
	case <-stop:
		return verdictNone
	case <-t.Done():
		return verdictNone
	default:
	}
	// As in the default mode, the message outlives the Subscribe context
	// until CloseTimeout after the relay stopped. Its term's end cancels it
	// (a term's end cancels its messages): the handler is told that its partition lease ended.
	cp, err := t.Hand(r.sub.messageContext(c), k.name, msg)
	if err != nil {
		if errors.Is(err, term.ErrKeyOut) {
			// Not expected: the key's runner is the only one, and a
			// partition is taken again only once its ended terms have
			// quiesced.
			r.logger.Error("A copy of the key is still in a handler; not delivering it again", err, watermill.LogFields{"sequence": row.Sequence})
		}
		return verdictNone
	}
	c.msg = msg
	select {
	case r.sub.out <- msg:
		c.delivered = time.Now()
		cp.Delivered()
	case <-stop:
		cp.End(term.Withdrawn)
		return verdictNone
	case <-t.Done():
		cp.End(term.Withdrawn)
		return verdictNone
	}
	var grace <-chan time.Time
	for {
		select {
		case <-cp.Overdue():
			// As in the default mode: the attempt counts as failed and holds
			// the key like any failure; ending the copy cancels the
			// message's context.
			c.slot.set(s.overrunError())
			if !cp.End(term.Overran) {
				return verdictNone // the term ended first: nothing is written (a verdict of an ended term is not progress)
			}
			r.logger.Error("Handler overran its dispatch timeout; counting a failed attempt", s.overrunError(),
				watermill.LogFields{"event_id": row.EventID})
			r.fail(k, row, c)
			return verdictNack
		case <-msg.Acked():
			if c.refusedAck() {
				// Never published: it holds its key dead, as a nack does.
				if !cp.End(term.Nacked) {
					return verdictNone
				}
				r.fail(k, row, c)
				return verdictNack
			}
			if !cp.End(term.Acked) {
				return verdictNone // a verdict of an ended term is not progress
			}
			observeDelivered(s, c)
			s.observeDispatch(c, metrics.ResultSuccess)
			if m := s.cfg.Metrics; m != nil {
				m.DeliveryLag.WithLabelValues(s.label).Observe(time.Since(row.CreatedAt).Seconds())
			}
			return verdictAck
		case <-msg.Nacked():
			if !cp.End(term.Nacked) {
				return verdictNone // a verdict of an ended term is not progress
			}
			r.fail(k, row, c)
			return verdictNack
		case <-t.Done():
			// The term ended with the message in the handler: its context
			// is cancelled (a term's end cancels its messages), and the ledger follows the copy until its
			// verdict (recorded nowhere, a verdict of an ended term is not progress), its overrun or the relay's
			// stop; the partition is not taken again before (one copy per key).
			return verdictNone
		case <-stop:
			stop = nil
			grace = time.After(s.cfg.CloseTimeout)
		case <-grace:
			// The copy stays out (a handler has it) until its term ends
			// with the relay's shutdown.
			r.logger.Info("Message neither acked nor nacked before the close timeout; the next owner delivers it again",
				watermill.LogFields{"event_id": row.EventID})
			return verdictNone
		}
	}
}

// fail records a failed attempt of row as its key's hold. The rows of the
// key queued behind it are covered once the hold is written.
func (r *orderedRelay) fail(k *keyState, row *sqlq.OrderedRow, c *claimed) {
	s := r.s
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	attempts := int(row.Attempts)
	f := s.cfg.policy().Judge(c.slot.get(), attempts, row.Payload)
	summary := f.Summary
	// The statement decides dead with the same rule, on the hold's count.
	backoff := f.RetryIn
	var (
		dead, skip bool
		n          int
	)
	// The write is work under the term (a verdict of an ended term is not progress): it is not made once the
	// term has ended, and the partition is not taken again while it runs;
	// the statement is fenced on owner and epoch besides.
	leave, live := k.p.term.Enter()
	defer leave()
	qerr := pgx.ErrNoRows
	if live {
		qerr = r.oq.Fail(sqlq.FailArgs{Relay: r.id, Partition: row.Partition, Key: k.name, Sequence: row.Sequence, LastError: summary,
			MaxAttempts: s.cfg.MaxAttempts, Permanent: f.Permanent, Backoff: backoff.Seconds(), Epoch: k.p.term.Epoch()}).
			QueryRow(ctx, s.pool).Scan(&dead, &n, &skip)
	}
	s.observeDispatch(c, metrics.ResultFailure)
	if qerr != nil && !errors.Is(qerr, pgx.ErrNoRows) {
		time.Sleep(100 * time.Millisecond) // the database is failing; do not spin
	}
	fields := watermill.LogFields{"event_id": row.EventID, "sequence": row.Sequence, "attempts": attempts, "error": summary}
	r.mu.Lock()
	defer r.mu.Unlock()
	if k.flying == row.Sequence {
		k.flying = 0 // from here on the row is covered by the hold, or queued again
	}
	if r.keys[k.name] != k {
		return // the partition was dropped meanwhile; its next owner delivers the row again
	}
	r.gen++
	k.holdGen = r.gen
	h := k.hold
	switch {
	case errors.Is(qerr, pgx.ErrNoRows), qerr != nil:
		// Not recorded: lease lost, another hold of the key this relay has
		// not read yet, or a database error. The row stays first of its
		// key (open, so the floor stays below it); the holds read tells.
		if qerr != nil && !errors.Is(qerr, pgx.ErrNoRows) {
			r.logger.Error("Could not record nack; delivering the row again", qerr, fields)
		} else {
			s.fenceRejected("nack")
			r.logger.Info("Nack not recorded: the partition passed to another relay, or the key has another hold; reading the holds again", fields)
			k.holdGen = 0
			r.needHolds = true
		}
		if h != nil && h.Seq == row.Sequence {
			h.DueAt = time.Now().Add(backoff)
			return
		}
		if _, open := k.p.open[row.Sequence]; open {
			k.queue = append([]*entry{{row: row}}, k.queue...)
		}
		return
	}
	// The hold is written: the row and the key's queued rows are covered
	// (the hold reaches them), also when a holds read applied it first.
	delete(k.p.open, row.Sequence)
	if h == nil || h.Seq != row.Sequence || !h.Open() {
		k.setHold(&holdState{Hold: keyed.Hold{Seq: row.Sequence, State: keyed.Retrying}})
		h = k.hold
	}
	r.freedLocked(k.p)
	h.Attempts, h.State = n, keyed.StateOf(dead, skip, h.replay, false)
	h.DueAt = time.Now().Add(backoff)
	if dead {
		delete(fields, "error")
		r.logger.Error("Outbox message is dead and holds its ordering key; replay or skip it once the cause is fixed", errors.New(summary), fields)
		if m := s.cfg.Metrics; m != nil {
			m.DeadTotal.WithLabelValues(s.label, row.Topic).Inc()
		}
		return
	}
	fields["retry_in"] = backoff.String()
	r.logger.Info("Outbox message nacked; its ordering key waits for the retry", fields)
}

// advance moves the key's hold h on: its row succeeded or was skipped. It
// goes to the key's next row at or below seen (every such row is covered),
// or is resolved; a replay hold is deleted.
func (r *orderedRelay) advance(k *keyState, h *holdState) {
	r.mu.Lock()
	if k.hold != h || r.keys[k.name] != k {
		r.mu.Unlock()
		return
	}
	// Work under the term (a verdict of an ended term is not progress): the key is still owned, so the term
	// is live (dropPartLocked ends it and forgets the key together).
	leave, live := k.p.term.Enter()
	defer leave()
	if !live {
		r.mu.Unlock()
		return
	}
	h.advancing = true
	bound := k.p.seen
	seq := h.Seq
	// A hold moved on without its row's ack is an operator's skip being
	// applied (actAdvance): the row records it (skipped_at).
	skipped := !h.acked
	r.gen++
	k.holdGen = r.gen
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), opTimeout)
	defer cancel()
	var (
		owned, resolved, deleted bool
		next                     *int64
	)
	err := r.oq.Advance(sqlq.AdvanceArgs{Relay: r.id, Partition: k.p.id, Key: k.name, Sequence: seq, Bound: bound, Epoch: k.p.term.Epoch(), Skipped: skipped}).
		QueryRow(ctx, r.s.pool).Scan(&owned, &next, &resolved, &deleted)
	r.mu.Lock()
	defer r.mu.Unlock()
	h.advancing = false
	r.gen++
	k.holdGen = r.gen
	if k.hold != h || r.keys[k.name] != k {
		return
	}
	switch {
	case err != nil:
		r.logger.Error("Could not move a hold on; retrying", err, watermill.LogFields{"sequence": seq})
		h.State = keyed.SkipRequested // retried as a skip: the row was handled
		h.DueAt = time.Now().Add(100 * time.Millisecond)
		time.AfterFunc(100*time.Millisecond, r.signal)
	case !owned:
		r.s.fenceRejected("ack")
	case next != nil:
		k.lastDone = max(k.lastDone, seq)
		k.setHold(&holdState{Hold: keyed.Hold{Seq: *next, DueAt: time.Now(), State: keyed.Retrying}})
		r.freedLocked(k.p)
	case resolved:
		k.lastDone = max(k.lastDone, seq)
		k.setHold(&holdState{Hold: keyed.Hold{Seq: seq, State: keyed.Resolved}})
	case deleted:
		k.hold = nil
	default:
		// The hold changed under us (an operator): read it again.
		r.refreshLaterLocked(k)
	}
}

// slotFreed starts the runners that waited for MaxInFlight, after a message
// of the subscription's claim loop was answered.
func (r *orderedRelay) slotFreed() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.readyLocked()
}
