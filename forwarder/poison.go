package forwarder

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/subscriber"
)

// PoisonQueue returns a router middleware that publishes to topic on pub a
// copy of each outbox event whose failure inside it sends its row dead, once
// per dead event, whatever handler or middleware inside it failed: a
// forwarded message's failure is copied only when it is Permanent or happens
// on the row's last allowed attempt (earlier failures are retried by the
// outbox itself). The error is not swallowed: the router nacks the message,
// so the row goes dead with that error as last_error, and nothing is logged
// as an ack without a publish. The copy carries the metadata of Watermill's
// middleware.PoisonQueue (middleware.ReasonForPoisonedKey and the others).
//
// An event that dies without a failure reaching it gets no copy: a row
// whose lease expired on its last allowed attempt (its relay was killed,
// hung or cut off during that attempt; the next claim or the next leader
// parks it dead), and a row whose stored headers are not a JSON object
// (dead before the router sees it). Each is counted in outbox_dead_total,
// logged at error and listed by `outbox dead list` with a last_error that
// says why; replay it once the cause is fixed. Copying them would make two
// copies of an event whose relay was killed after PoisonQueue published its
// copy and before the nack that sent the row dead.
//
// Messages of the router's other handlers are handled as Watermill's
// middleware.PoisonQueue handles them: every failure is copied and the
// message acked.
//
// Watermill's own middleware.PoisonQueue works with the forwarder too, and
// makes one copy per dead event: it acks what it copied, which the
// forwarder takes as the router's dead-letter path, so the row goes dead at
// once (see Forwarder.AddTo). PoisonQueue is for what that does not do: the
// outbox's own retries with backoff (which survive a restart and a
// handover) before the single copy, and the row's last_error set from the
// failure by the nack rather than by a refused ack.
//
// Add it router-wide before the middleware whose failures it should copy
// (a middleware sees the errors of those added after it):
//
//	pq, err := forwarder.PoisonQueue(pub, "poison")
//	r.AddMiddleware(pq, fraudCheck)
func PoisonQueue(pub message.Publisher, topic string) (message.HandlerMiddleware, error) {
	if pub == nil {
		return nil, errors.New("forwarder: PoisonQueue: nil publisher; pass the publisher of the poison topic")
	}
	other, err := middleware.PoisonQueue(pub, topic)
	if err != nil {
		return nil, fmt.Errorf("forwarder: PoisonQueue: %w", err)
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		others := other(h)
		return func(msg *message.Message) ([]*message.Message, error) {
			o, ok := msg.Context().Value(outcomeKey{}).(*outcome)
			if !ok {
				return others(msg)
			}
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			// For last_error and Permanent, also when no CaptureError runs.
			subscriber.RecordError(msg, err)
			var copied *poisonCopiedError
			if errors.As(err, &copied) || (!o.final && !subscriber.IsPermanent(err)) {
				return out, err
			}
			poison := msg.Copy()
			poison.Metadata.Set(middleware.ReasonForPoisonedKey, err.Error())
			poison.Metadata.Set(middleware.PoisonedTopicKey, message.SubscribeTopicFromCtx(msg.Context()))
			poison.Metadata.Set(middleware.PoisonedHandlerKey, message.HandlerNameFromCtx(msg.Context()))
			poison.Metadata.Set(middleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(msg.Context()))
			if perr := pub.Publish(topic, poison); perr != nil {
				return out, fmt.Errorf("%w (and publishing the poison copy failed: %w)", err, perr)
			}
			return out, &poisonCopiedError{err: err}
		}
	}, nil
}

// poisonCopiedError marks an error whose message PoisonQueue has copied, so
// that a second PoisonQueue further out does not copy it again.
type poisonCopiedError struct{ err error }

func (e *poisonCopiedError) Error() string { return e.err.Error() }
func (e *poisonCopiedError) Unwrap() error { return e.err }
