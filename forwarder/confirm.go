package forwarder

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// ErrNotPublished is the reason stored as last_error when the router acked
// an outbox message that the forwarder did not publish: the router's own
// dead-letter path took it (Watermill's middleware.PoisonQueue and
// PoisonQueueWithFilter copy a failed message and ack it), or a middleware
// acked it without calling the handler. The row is never marked published:
// it goes dead at once, Permanent, with ErrNotPublished and the failure as
// last_error, so the outbox does not deliver it again and a poison queue
// copies it once. Replay it (outbox dead replay) once the cause is fixed.
var ErrNotPublished = errors.New("acked by the router but not published")

// outcomeKey carries a *outcome in the context of the message the router
// handles.
type outcomeKey struct{}

// outcome is what the forwarder's handler did with one outbox message: a
// publish that succeeded, else the last error.
type outcome struct {
	published atomic.Bool
	// final is set when a failure of this delivery sends the row dead: it is
	// the row's last allowed attempt.
	final bool
	mu    sync.Mutex
	err   error
}

func (o *outcome) failure() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.err
}

// recordOutcome records on msg what its publish did: err nil confirms it.
// It is a no-op for a message that did not come through AddTo's confirming
// subscriber.
func recordOutcome(msg *message.Message, err error) {
	o, ok := msg.Context().Value(outcomeKey{}).(*outcome)
	if !ok {
		return
	}
	if err == nil {
		o.published.Store(true)
		return
	}
	o.mu.Lock()
	o.err = err
	o.mu.Unlock()
}

// confirmingSubscriber stands between the outbox subscriber and the router:
// the router handles a copy of each outbox message, and the outbox message
// is acked only when the router acked the copy and the forwarder's handler
// published it; an ack without a confirmed publish becomes a Permanent
// nack (the row goes dead at once). So what the user's router middleware
// does with the handler's error cannot mark a row published that was not,
// and a router whose dead-letter path acks (Watermill's poison queue) makes
// one copy per dead event, not one per attempt.
type confirmingSubscriber struct {
	sub         message.Subscriber
	logger      watermill.LoggerAdapter
	refused     *atomic.Int64
	maxAttempts int

	closing   chan struct{}
	closeOnce sync.Once
	closeErr  error
	wg        sync.WaitGroup // pumps and watchers
}

func newConfirmingSubscriber(sub message.Subscriber, logger watermill.LoggerAdapter, refused *atomic.Int64, maxAttempts int) *confirmingSubscriber {
	return &confirmingSubscriber{sub: sub, logger: logger, refused: refused, maxAttempts: maxAttempts, closing: make(chan struct{})}
}

// String is the name a router gives the handler's subscriber (in logs and
// in the subscriber_poisoned metadata of Watermill's poison queue): the
// outbox subscriber's, not this wrapper's.
func (c *confirmingSubscriber) String() string {
	if s, ok := c.sub.(fmt.Stringer); ok {
		return s.String()
	}
	return strings.TrimLeft(fmt.Sprintf("%T", c.sub), "*")
}

// Subscribe subscribes to the outbox subscriber and returns the channel of
// the copies the router handles.
func (c *confirmingSubscriber) Subscribe(ctx context.Context, topic string) (<-chan *message.Message, error) {
	select {
	case <-c.closing:
		return nil, errors.New("forwarder: subscriber closed")
	default:
	}
	// The forwarder refuses what a relay hands the router only for its
	// dead-letter path (Handle, PoisonQueue), so it asks for those too.
	in, err := c.sub.Subscribe(deadletter.Want(ctx), topic)
	if err != nil {
		return nil, err
	}
	out := make(chan *message.Message)
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer close(out)
		for orig := range in {
			attempts, _ := strconv.Atoi(orig.Metadata.Get(schema.MetadataAttempts))
			o := &outcome{final: attempts >= c.maxAttempts}
			cp := message.NewMessage(orig.UUID, orig.Payload)
			for k, v := range orig.Metadata {
				cp.Metadata[k] = v
			}
			cp.SetContext(context.WithValue(orig.Context(), outcomeKey{}, o))
			c.wg.Add(1)
			go c.watch(orig, cp, o)
			select {
			case out <- cp:
			case <-ctx.Done():
				// Not handed to the router: neither acked nor nacked, the
				// outbox subscriber gives its lease back at its close.
			case <-c.closing:
			}
		}
	}()
	return out, nil
}

// watch passes the router's verdict on cp to orig. An ack without a
// confirmed publish means the router took the message off the delivery path
// itself (its poison queue copied it, or a middleware skipped the handler):
// orig is nacked Permanent, so its row goes dead at once with the failure
// as last_error instead of being delivered, and copied, again.
func (c *confirmingSubscriber) watch(orig, cp *message.Message, o *outcome) {
	defer c.wg.Done()
	select {
	case <-cp.Acked():
		if o.published.Load() {
			orig.Ack()
			return
		}
		c.refused.Add(1)
		reason := ErrNotPublished
		poisoned := cp.Metadata.Get(middleware.ReasonForPoisonedKey)
		if err := o.failure(); err != nil {
			// Wrapped, so that a Permanent failure still sends the row dead.
			reason = fmt.Errorf("%w: %w", ErrNotPublished, err)
		} else if poisoned != "" {
			// A middleware failed before the forwarder's handler ran (or
			// without its error reaching it), and Watermill's poison queue
			// kept only its text.
			reason = fmt.Errorf("%w: %s", ErrNotPublished, poisoned)
		}
		fields := watermill.LogFields{"event_id": orig.UUID}
		if poisoned != "" {
			// Expected with Watermill's poison queue: it acks what it copied.
			c.logger.Info("Outbox message copied to the router's poison queue, which acked it; the row goes dead with the failure instead of being marked published",
				fields.Add(watermill.LogFields{"reason": redact.Summary(reason.Error(), orig.Payload, 0)}))
		} else {
			c.logger.Error("Outbox message acked without a confirmed publish; the row goes dead instead of being marked published. "+
				"A router middleware swallowed the forwarder's error or skipped its handler; "+
				"see the README's router section", errors.New(redact.Summary(reason.Error(), orig.Payload, 0)), fields)
		}
		// Permanent: the router's own dead-letter path took the message, so
		// the row goes dead now; another attempt would be copied again.
		subscriber.RecordError(orig, subscriber.Permanent(reason))
		orig.Nack()
	case <-cp.Nacked():
		orig.Nack()
	case <-orig.Context().Done():
		// The outbox subscriber gave up on orig (its close timeout).
	case <-c.closing:
		// The outbox subscriber is closed: a late verdict has nowhere to go.
	}
}

// Close closes the outbox subscriber (which waits, up to its close timeout,
// for the verdicts of the messages in flight), then ends the watchers. It
// is idempotent.
func (c *confirmingSubscriber) Close() error {
	c.closeOnce.Do(func() {
		if err := c.sub.Close(); err != nil {
			c.closeErr = fmt.Errorf("forwarder: close the outbox subscriber: %w", err)
		}
		close(c.closing)
		c.wg.Wait()
	})
	return c.closeErr
}

// handlerError is an error of the forwarder's handler, marked with whether
// the outbox retries the row after it.
type handlerError struct {
	err   error
	final bool // a Permanent error, or the row's last allowed attempt
}

func (e *handlerError) Error() string { return e.err.Error() }
func (e *handlerError) Unwrap() error { return e.err }

// PoisonFilter reports whether a handler's error should be copied to a
// poison topic. For an error of the forwarder's handler it is true only
// when the error sends the row dead (a Permanent error, or a failure on the
// row's last allowed attempt): earlier failures pass through as errors, and
// the outbox retries the row with its backoff. Any other error reports
// true: a filter sees the error, not the message. With Watermill's
//
//	pq, err := middleware.PoisonQueueWithFilter(pub, "poison", forwarder.PoisonFilter)
//
// the forwarder's own failures are retried by the outbox and copied once,
// on the row's last attempt; another middleware's failure is copied at its
// first attempt and, acked by the poison queue, sends the row dead at once
// (see AddTo). PoisonQueue gives every failure the outbox's retries and
// copies once, on the last.
func PoisonFilter(err error) bool {
	var he *handlerError
	if errors.As(err, &he) {
		return he.final
	}
	return true
}
