package subscriber

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
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

	ordered *orderedRelay // keyed rows, in ordered mode

	inflight  atomic.Int64
	slotted   chan struct{} // a slot was freed
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
	defer func() {
		sub.watchers.Wait()
		s.wake.unregister(sub.wake)
		sub.cancel()
		close(sub.out)
	}()
	poll := time.NewTimer(0)
	defer poll.Stop()
	errDelay := 100 * time.Millisecond
	wait := func(d time.Duration) bool {
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d)
		select {
		case <-stop:
			return false
		case <-sub.wake:
		case <-poll.C:
		}
		return true
	}
	for {
		select {
		case <-stop:
			return
		default:
		}
		if !s.IsLeader() {
			if !wait(s.cfg.ElectionInterval) {
				return
			}
			continue
		}
		free := s.cfg.MaxInFlight - int(sub.inflight.Load())
		if free <= 0 {
			select {
			case <-stop:
				return
			case <-sub.slotted:
			}
			continue
		}
		n := min(s.cfg.BatchSize, free)
		batch, err := s.claim(sub.ctx, sub.topic, n)
		if err != nil {
			if sub.ctx.Err() != nil {
				return
			}
			sub.logger.Error("Claim failed, retrying", err, watermill.LogFields{"retry_in": errDelay.String()})
			if !wait(errDelay) {
				return
			}
			errDelay = min(2*errDelay, 5*time.Second)
			continue
		}
		errDelay = 100 * time.Millisecond
		if !sub.deliver(batch, stop) {
			return
		}
		if len(batch) == n {
			continue // there may be more due rows
		}
		if !wait(s.cfg.PollInterval) {
			return
		}
	}
}

// deliver sends the batch to the consumer, one watcher per message; it
// returns false when the subscription stopped, after giving back the leases
// of the messages not sent.
func (sub *subscription) deliver(batch []*claimed, stop <-chan struct{}) bool {
	s := sub.s
	for i, c := range batch {
		msg, err := c.row.Message(s.cfg.Table)
		if err != nil {
			// A row whose stored headers cannot be read is a permanent defect.
			c.slot = &errorSlot{err: Permanent(err)}
			c.delivered = time.Now()
			s.nack(c)
			continue
		}
		c.slot = &errorSlot{}
		// The message outlives the Subscribe context, which a router
		// cancels at Close: in-flight work finishes, or is cancelled
		// CloseTimeout after the subscription stopped (watch).
		msgCtx, cancel := context.WithCancel(withErrorSlot(context.WithoutCancel(sub.ctx), c.slot))
		msg.SetContext(msgCtx)
		c.msg = msg
		sub.inflight.Add(1)
		select {
		case sub.out <- msg:
			c.delivered = time.Now()
			sub.watchers.Add(1)
			go sub.watch(c, cancel)
		case <-stop:
			cancel()
			sub.inflight.Add(-1)
			s.release(batch[i:], 1)
			return false
		}
	}
	return true
}

// watch waits for the consumer's verdict on c and renews its lease meanwhile.
func (sub *subscription) watch(c *claimed, cancel context.CancelFunc) {
	s := sub.s
	defer func() {
		cancel()
		sub.inflight.Add(-1)
		select {
		case sub.slotted <- struct{}{}:
		default:
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
	for {
		select {
		case <-c.msg.Acked():
			s.acks <- ackReq{c: c}
			return
		case <-c.msg.Nacked():
			s.nack(c)
			return
		case <-overrun.C:
			// No more renewals: the handler loses its lease and the attempt
			// counts as failed.
			c.slot.set(s.overrunError())
			cancel()
			sub.logger.Error("Handler overran its dispatch timeout; taking its lease back and counting a failed attempt",
				s.overrunError(), watermill.LogFields{"event_id": c.row.EventID})
			s.nack(c)
			return
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
			s.release([]*claimed{c}, 0)
			return
		}
	}
}
