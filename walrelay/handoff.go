package walrelay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/term"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// handoff hands a session's deliveries to the subscriber's channel, in the
// order the session loop queued them, each under the session's term (one
// copy per key; the message's context ends with the term, the copy or
// DispatchTimeout), and sends each verdict back to the loop. The loop
// queues; one pump goroutine and a few waiter goroutines do the rest.
type handoff struct {
	s        *Subscriber
	term     *term.Term
	out      chan *message.Message
	send     func(settle)    // a verdict to the session loop (stream.send)
	inFlight *sync.WaitGroup // the session's deliveries under way
	gone     <-chan struct{} // closed when the session loop ends

	mu    sync.Mutex
	ready []delivery    // queued by the loop for the pump, oldest first
	wake  chan struct{} // capacity 1: the pump has deliveries
	waits chan waiting  // to an idle waiter
}

func newHandoff(st *stream) *handoff {
	return &handoff{s: st.s, term: st.term, out: st.out, send: st.send, inFlight: &st.inFlight, gone: st.gone,
		wake: make(chan struct{}, 1), waits: make(chan waiting)}
}

// queue queues d for the pump.
func (h *handoff) queue(d delivery) {
	h.mu.Lock()
	h.ready = append(h.ready, d)
	h.mu.Unlock()
	select {
	case h.wake <- struct{}{}:
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
	// refusal, when set, is why the row cannot be relayed (handOver): an
	// ack of its message is its failure for good, never a delivery.
	refusal error
}

// refused is the error a refused message's ack or nack settles with (its
// refusal, for good, or the error the handler recorded, for good too): it
// is never a delivery.
func (w waiting) refused() error {
	if err := w.recorded(); err != nil {
		return subscriber.Permanent(err)
	}
	return subscriber.Permanent(w.refusal)
}

// waiterIdle is how long a waiter goroutine stays for the next message
// before it ends.
const waiterIdle = time.Second

// pump hands the queued deliveries to the subscriber's channel one by one,
// in the order the loop queued them, and each handed message to a waiter.
// One goroutine blocks on the channel, where a goroutine per delivery had a
// goroutine per key in flight parked on it (a fifth of the relay's CPU in a
// drain went to waking them). It ends with the stream.
func (h *handoff) pump() {
	var batch []delivery
	for {
		select {
		case <-h.wake:
		case <-h.gone:
			return
		}
		h.mu.Lock()
		batch, h.ready = h.ready, batch[:0]
		h.mu.Unlock()
		for i, d := range batch {
			h.handOver(d)
			batch[i] = delivery{}
		}
	}
}

// handOver builds d's message, hands it to the subscriber's channel and then
// to a waiter, or settles d when it cannot.
func (h *handoff) handOver(d delivery) {
	if d.ctx.Err() != nil {
		// Stopped: not handed over (a select with out ready too would
		// pick at random).
		h.send(settle{it: d.it, stopped: true})
		h.inFlight.Done()
		return
	}
	msg, err := d.it.row.Message(h.s.cfg.Table)
	var refusal error
	if err != nil {
		if !h.s.deadLetters.Load() {
			// A row that cannot become a message (bad headers) is dead at once.
			h.send(settle{it: d.it, err: subscriber.Permanent(err)})
			h.inFlight.Done()
			return
		}
		// The consumer refuses a message that carries a cause (package
		// deadletter): handed over without its headers, refused, it is
		// never published, the router's poison queue copies it, and its
		// verdict sends the row dead, as the table relays do.
		refusal = fmt.Errorf("cannot be relayed: %w", err)
		msg = d.it.row.MessageWithoutHeaders(h.s.cfg.Table)
	}
	// The message's context carries the session's values; the term sets
	// it, cancelled when the session ends or the copy does (a term's end cancels its messages).
	// It also ends at DispatchTimeout (cancelled with the copy, below).
	base := context.WithoutCancel(d.ctx)
	if refusal != nil {
		base = deadletter.WithCause(base, refusal)
	}
	mctx, recorded := subscriber.ContextWithErrorRecorder(base)
	mctx, cancel := context.WithTimeout(mctx, h.s.cfg.DispatchTimeout)
	cp, err := h.term.Hand(mctx, d.it.key, msg)
	if err != nil {
		cancel()
		if errors.Is(err, term.ErrKeyOut) {
			// Not expected: dispatch asked the ledger, and a key has one
			// delivery at a time in a session.
			h.s.logger.Error("A copy of the key is still in a handler; not delivering it again", err, watermill.LogFields{"sequence": d.it.row.Sequence})
		}
		h.send(settle{it: d.it, stopped: true})
		h.inFlight.Done()
		return
	}
	select {
	case h.out <- msg:
		cp.Delivered()
	case <-d.ctx.Done():
		cp.End(term.Withdrawn)
		cancel()
		h.send(settle{it: d.it, stopped: true})
		h.inFlight.Done()
		return
	}
	w := waiting{delivery: d, msg: msg, recorded: recorded, cp: cp, cancel: cancel, refusal: refusal}
	select {
	case h.waits <- w: // an idle waiter took it
	default:
		go h.waiter(w)
	}
}

// waiter waits for w's verdict, sends it to the loop, then waits for the
// messages handed to it while it is idle, up to waiterIdle: a goroutine
// grows its stack once, not once per message. It ends with the stream.
func (h *handoff) waiter(w waiting) {
	idle := time.NewTimer(waiterIdle)
	defer idle.Stop()
	for {
		select {
		case <-w.msg.Acked():
			switch {
			case !w.cp.End(term.Acked):
				h.send(settle{it: w.it, stopped: true}) // the session ended first: not recorded (a verdict of an ended term is not progress)
			case w.refusal != nil:
				h.send(settle{it: w.it, err: w.refused()}) // acked by the poison queue: dead, never delivered
			default:
				h.send(settle{it: w.it, ack: true})
			}
		case <-w.msg.Nacked():
			if !w.cp.End(term.Nacked) {
				h.send(settle{it: w.it, stopped: true}) // a verdict of an ended term is not progress
				break
			}
			err := w.recorded() // nil: nacked without an error (keyed.NoErrorText)
			if w.refusal != nil {
				err = w.refused()
			}
			h.send(settle{it: w.it, err: err})
		case <-w.cp.Overdue():
			// The handler kept the message past its overrun: the relay
			// gives up on it (its context is cancelled) and counts a
			// failed attempt; the key is delivered again after Backoff (its
			// copies may overlap by the overrun, as in ordered mode).
			if !w.cp.End(term.Overran) {
				h.send(settle{it: w.it, stopped: true}) // the session ended first
				break
			}
			err := h.s.overrunError()
			h.s.logger.Error("Handler overran its dispatch timeout; counting a failed attempt", err, watermill.LogFields{"sequence": w.it.row.Sequence})
			h.send(settle{it: w.it, err: err})
		case <-w.ctx.Done():
			// The session ended with the message in a handler: its
			// context is cancelled (a term's end cancels its messages), and the ledger follows the
			// copy; no later session delivers its key until the copy ends
			// (its verdict, recorded nowhere, CloseTimeout, or the relay's
			// stop: one copy per key, a verdict of an ended term is not progress, nothing waits forever).
			h.send(settle{it: w.it, stopped: true})
		}
		w.cancel()
		h.inFlight.Done()
		idle.Reset(waiterIdle)
		select {
		case w = <-h.waits:
		case <-idle.C:
			return
		case <-h.gone:
			return
		}
	}
}
