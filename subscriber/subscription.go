package subscriber

import (
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/keyed"
)

// subscription is one Subscribe call: a claim loop and one watcher per
// message in flight.
type subscription struct {
	s      *Subscriber
	topic  string
	out    chan *message.Message
	ctx    context.Context
	cancel context.CancelFunc
	logger watermill.LoggerAdapter
	wake   chan struct{}
	// retry rings when each row this subscription nacked is due again: the
	// claim loop claims it then, not at its next poll.
	retry *keyed.Alarm

	ordered *orderedRelay // keyed rows, in ordered mode

	// deadLetters is set when the consumer refuses the messages meant for
	// the router's dead-letter path (package deadletter): the forwarder,
	// through Forwarder.AddTo. The subscription then hands it a row that
	// cannot become a message (its headers are not a JSON object), refused,
	// instead of parking it dead unseen, and the death notices of the
	// table (notices.go).
	deadLetters bool

	// slots counts the rows this subscription holds against MaxInFlight
	// (keyed.Slots): reserved for a claim under way, claimed and not yet
	// handed over (the batch in hand, the pre-claimed batch, the sweep's),
	// delivered and not yet acked or nacked, the ordered relay's keyed
	// runners, and the copies ended terms left in handlers.
	slots     *keyed.Slots
	hot       chan *claimed // events a HotPath handed over (hot.go)
	watchers  sync.WaitGroup
	stopOnce  sync.Once
	stoppedCh chan struct{}
}

// stopped is closed when the subscription must end: its context is done or
// the subscriber is closing.
func (sub *subscription) stopped() <-chan struct{} {
	sub.stopOnce.Do(func() {
		sub.stoppedCh = make(chan struct{})
		go func() {
			select {
			case <-sub.ctx.Done():
			case <-sub.s.closing:
			}
			close(sub.stoppedCh)
		}()
	})
	return sub.stoppedCh
}

func (sub *subscription) run() {
	s := sub.s
	stop := sub.stopped()
	if sub.ordered != nil {
		sub.watchers.Add(1)
		go func() {
			defer sub.watchers.Done()
			sub.ordered.run(stop)
		}()
	}
	sub.watchers.Add(1)
	go func() {
		defer sub.watchers.Done()
		sub.hotLoop(stop)
	}()
	if sub.s.bounded != nil && sub.topic == AllTopics && s.oq == nil {
		sub.watchers.Add(1)
		go func() {
			defer sub.watchers.Done()
			sub.sweep(stop)
		}()
	}
	if sub.deadLetters {
		sub.watchers.Add(1)
		go func() {
			defer sub.watchers.Done()
			sub.noticeLoop(stop)
		}()
	}
	defer func() {
		sub.watchers.Wait()
		sub.retry.Stop()
		s.wake.unregister(sub.wake)
		sub.cancel()
		close(sub.out)
	}()
	poll := time.NewTimer(0)
	defer poll.Stop()
	errDelay := 100 * time.Millisecond
	// wait sleeps up to d or until a wake-up; it reports whether the
	// subscription goes on and whether a wake-up ended the sleep.
	wait := func(d time.Duration, wakeable bool) (goOn, woken bool) {
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d)
		wake, retry := sub.wake, sub.retry.C()
		if !wakeable {
			wake, retry = nil, nil
		}
		select {
		case <-stop:
			return false, false
		case <-wake:
			return true, true
		case <-retry:
			return true, false // a nacked row is due: claim it (not a notification)
		case <-poll.C:
			return true, false
		}
	}
	var (
		holding  bool   // this subscription counts on the idle lock
		idleGen  uint64 // the lock's generation when taken
		notified bool   // woken by a notification while holding it
		misses   int    // empty claims in a row without the idle lock
		rate     rateMeter
	)
	// A default relay sleeps on the ordered relays' idle lock too: writers
	// of keyed rows try that one (so that an ordered table's idle claim
	// loop, which claims unkeyed rows only, does not make every keyed
	// commit notify), and this relay claims keyed rows as well. It does so
	// also on a table without the ordering_key column: the columns are read
	// once, at New, and schema.Migrate may add the column while the relay
	// runs; until then no writer tries that lock, so holding it costs one
	// more lock statement per sleep and changes nothing else.
	keyedToo := s.oq == nil
	release := func() {
		if holding {
			if keyedToo {
				s.oidle.leave(idleGen, false)
			}
			s.idle.leave(idleGen, !notified)
			holding = false
		}
	}
	defer release()
	// A claim that filled its batch starts the next claim at once, before
	// the batch is delivered, so that claiming overlaps delivery (as the
	// bare claim+ack ceiling overlaps two workers). pre is that claim.
	type claimResult struct {
		batch []*claimed
		err   error
		n     int
	}
	var pre chan claimResult
	dropPre := func() {
		if pre != nil {
			r := <-pre
			pre = nil
			s.release(r.batch, 1) // not delivered: the attempt does not count
			sub.slots.Unreserve(len(r.batch))
		}
	}
	defer dropPre()
	for {
		select {
		case <-stop:
			return
		default:
		}
		if !s.IsLeader() || s.modeLock.modeReady(s) != nil {
			// A standby, or a relay whose mode lock is down (a switch of
			// mode could be accepted meanwhile: modelock.go) or whose table
			// was switched away: it claims nothing.
			dropPre()
			release()
			if goOn, _ := wait(s.cfg.ElectionInterval, true); !goOn {
				return
			}
			continue
		}
		var (
			batch []*claimed
			err   error
			n     int
		)
		if pre != nil {
			r := <-pre
			pre = nil
			batch, err, n = r.batch, r.err, r.n
		} else {
			// The slots of the batch are taken before the claim, so that
			// the sweep's claims and this loop's (with the batch in hand
			// and the pre-claimed one) never exceed MaxInFlight together.
			if n = sub.slots.Reserve(s.cfg.BatchSize); n == 0 {
				select {
				case <-stop:
					return
				case <-sub.slots.Freed():
				}
				continue
			}
			batch, err = s.claim(sub.ctx, sub.topic, n)
			sub.slots.Unreserve(n - len(batch))
		}
		if err != nil {
			if sub.ctx.Err() != nil {
				return
			}
			sub.logger.Error("Claim failed, retrying", err, watermill.LogFields{"retry_in": errDelay.String()})
			if goOn, _ := wait(errDelay, true); !goOn {
				return
			}
			errDelay = min(2*errDelay, 5*time.Second)
			continue
		}
		errDelay = 100 * time.Millisecond
		rate.add(len(batch))
		if len(batch) == n {
			if n2 := sub.slots.Reserve(s.cfg.BatchSize); n2 > 0 {
				pre = make(chan claimResult, 1)
				go func(ch chan claimResult) {
					b, err := s.claim(sub.ctx, sub.topic, n2)
					sub.slots.Unreserve(n2 - len(b))
					ch <- claimResult{b, err, n2}
				}(pre)
			}
		}
		if !sub.deliver(batch, stop) {
			return
		}
		switch {
		case len(batch) == n:
			release()
			misses = 0
			continue // there may be more due rows
		case len(batch) > 0:
			// Busy: stay off the idle lock (writers send no NOTIFY) and
			// claim again after a pause that grows with the rate.
			release()
			misses = 0
			if goOn, _ := wait(linger(rate.perSecond()), false); !goOn {
				return
			}
			continue
		}
		if s.cfg.DisableNotify {
			if goOn, _ := wait(s.cfg.PollInterval, true); !goOn {
				return
			}
			continue
		}
		if holding && !s.idle.valid(idleGen) {
			holding = false // lost with its connection
		}
		if holding {
			// The lock was held before this claim began: every later commit
			// sends NOTIFY, so sleep until one does (or the poll).
			goOn, woken := wait(s.cfg.PollInterval, true)
			if !goOn {
				return
			}
			if woken {
				notified = true
				// Let a few more commits land. The lock stays held through
				// the claim (it still covers commits after it); the claim
				// gives it back when it finds rows.
				if goOn, _ := wait(wakeCoalesce, false); !goOn {
					return
				}
			}
			continue
		}
		if s.hooks.beforeIdle != nil {
			s.hooks.beforeIdle()
		}
		gen, st := s.idle.enter(sub.ctx)
		if st == idleHeld && keyedToo {
			// Both locks or neither: a lock held alone would leave one
			// kind of writer silent.
			kgen, kst := s.oidle.enter(sub.ctx)
			if kst != idleHeld || kgen != gen {
				if kst == idleHeld {
					s.oidle.leave(kgen, false)
				}
				s.idle.leave(gen, true)
				st = kst
				if kst == idleHeld {
					st = idleMissed // the session changed between the two
				}
			}
		}
		switch st {
		case idleHeld:
			// Claim once more: rows committed before the lock was granted
			// are visible now; later ones notify.
			holding, idleGen, misses, notified = true, gen, 0, false
			continue
		case idleCovered:
			// Another relay sleeps on the lock: writers notify, and it
			// notifies when it gives the lock back.
			misses = 0
			goOn, woken := wait(min(s.cfg.PollInterval, coveredRecheck), true)
			if !goOn {
				return
			}
			if woken {
				if goOn, _ := wait(wakeCoalesce, false); !goOn {
					return
				}
			}
			continue
		}
		// A writer's transaction is open: its commit may not notify, so
		// claim again soon.
		misses++
		if goOn, _ := wait(idleRetry(misses), true); !goOn {
			return
		}
	}
}

// rateMeter estimates the recent claim rate in rows per second, decaying
// with a time constant of rateWindow.
type rateMeter struct {
	last time.Time
	v    float64
}

const rateWindow = 200 * time.Millisecond

func (m *rateMeter) add(rows int) {
	now := time.Now()
	if !m.last.IsZero() {
		m.v *= math.Exp(-float64(now.Sub(m.last)) / float64(rateWindow))
	}
	m.last = now
	m.v += float64(rows)
}

func (m *rateMeter) perSecond() float64 { return m.v / rateWindow.Seconds() }

// deliver sends the batch to the consumer, one watcher per message; it
// returns false when the subscription stopped, after giving back the leases
// of the messages not sent. The batch's rows are counted in inflight
// already (reserve); each keeps its slot until its verdict.
func (sub *subscription) deliver(batch []*claimed, stop <-chan struct{}) bool {
	s := sub.s
	for i, c := range batch {
		msg, err := sub.message(c)
		if err != nil {
			// A row whose stored headers cannot be read is a permanent defect.
			c.slot = &errorSlot{err: Permanent(err)}
			c.delivered = time.Now()
			sub.nack(c)
			sub.slots.Unreserve(1)
			continue
		}
		c.slot = &errorSlot{}
		// The message outlives the Subscribe context, which a router
		// cancels at Close: in-flight work finishes, or is cancelled
		// CloseTimeout after the subscription stopped (watch).
		msgCtx, cancel := context.WithCancel(sub.messageContext(c))
		msg.SetContext(msgCtx)
		c.msg = msg
		select {
		case sub.out <- msg:
			c.delivered = time.Now()
			sub.watchers.Add(1)
			go sub.watch(c, cancel)
		case <-stop:
			cancel()
			s.release(batch[i:], 1)
			sub.slots.Unreserve(len(batch) - i)
			return false
		}
	}
	return true
}

// message builds c's message. A row whose stored headers cannot be read
// fails, unless the subscription takes dead letters (deadLetters): then its
// message has no stored headers and c.refusal says why, so that the
// forwarder refuses it and the router's poison queue sees the failure; the
// verdict that follows sends the row dead (or holds its key dead).
func (sub *subscription) message(c *claimed) (*message.Message, error) {
	t := sub.s.cfg.Table
	msg, err := c.row.Message(t)
	if err == nil || !sub.deadLetters {
		return msg, err
	}
	c.refusal = fmt.Errorf("cannot be relayed: %w", err)
	return c.row.MessageWithoutHeaders(t), nil
}

// messageContext is the context c's message starts from: detached from the
// Subscribe context, carrying c's error slot (set first) and, for a refused
// row, its cause (package deadletter).
func (sub *subscription) messageContext(c *claimed) context.Context {
	ctx := withErrorSlot(context.WithoutCancel(sub.ctx), c.slot)
	if c.refusal != nil {
		ctx = deadletter.WithCause(ctx, c.refusal)
	}
	return ctx
}

// refusedAck reports whether an ack of c counts as its failure: c was
// refused (message), so it is never published; the refusal is then its
// failure, unless the handler recorded another.
func (c *claimed) refusedAck() bool {
	if c.refusal == nil {
		return false
	}
	if c.slot.get() == nil {
		c.slot.set(Permanent(c.refusal))
	}
	return true
}

// nack records a failed attempt of c and, when it is retried, asks the
// claim loop's alarm for its due time.
func (sub *subscription) nack(c *claimed) {
	if at, ok := sub.s.nack(c); ok {
		sub.retry.At(at)
	}
}

// watch waits for the consumer's verdict on c and renews its lease meanwhile.
// c keeps its slot until its handler returns (its verdict), also after an
// overrun: MaxInFlight counts every message from its delivery until its
// handler returns, or until CloseTimeout after the subscription stopped.
func (sub *subscription) watch(c *claimed, cancel context.CancelFunc) {
	s := sub.s
	defer func() {
		cancel()
		sub.slots.Unreserve(1)
		if sub.ordered != nil {
			sub.ordered.slotFreed()
		}
		sub.watchers.Done()
	}()
	var renew <-chan time.Time
	if !s.cfg.DisableLeaseExtension {
		t := time.NewTicker(s.cfg.LockTTL / 2)
		defer t.Stop()
		renew = t.C
	}
	stop := sub.stopped()
	var grace <-chan time.Time
	overrun := time.NewTimer(s.overrunAfter())
	defer overrun.Stop()
	overran := false // the attempt was counted as failed: a verdict now writes nothing
	for {
		select {
		case <-c.msg.Acked():
			if overran {
				return
			}
			if c.refusedAck() {
				sub.nack(c) // never published: it goes dead
				return
			}
			observeHot(s, c)
			s.acks <- ackReq{c: c}
			return
		case <-c.msg.Nacked():
			if !overran {
				sub.nack(c)
			}
			return
		case <-overrun.C:
			// No more renewals: the handler loses its lease and the attempt
			// counts as failed. The message keeps its slot until the handler
			// returns: one that ignores its context still runs.
			c.slot.set(s.overrunError())
			cancel()
			sub.logger.Error("Handler overran its dispatch timeout; taking its lease back and counting a failed attempt",
				s.overrunError(), watermill.LogFields{"event_id": c.row.EventID})
			sub.nack(c)
			overran, renew = true, nil
		case <-renew:
			if !s.IsLeader() {
				// A relay that stepped down (it could not reach the
				// database) renews no lease: its rows return to the new
				// leader after LockTTL. Its ack is still tried: fenced,
				// it lands only while the lease is still this relay's.
				continue
			}
			if !s.extend(c) {
				renew = nil
			}
		case <-stop:
			stop = nil
			grace = time.After(s.cfg.CloseTimeout)
		case <-grace:
			sub.logger.Info("Message neither acked nor nacked before the close timeout; cancelling it and giving its lease back",
				watermill.LogFields{"event_id": c.row.EventID})
			cancel()
			if !overran {
				s.release([]*claimed{c}, 0)
			}
			return
		}
	}
}
