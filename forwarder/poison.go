package forwarder

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/subscriber"
)

// PoisonQueue returns a router middleware that publishes to topic on pub a
// copy of each dead outbox event, once, whatever handler or middleware
// inside it failed, and also of the events that die without a failure
// reaching it:
//
//   - a forwarded message's failure is copied when it is Permanent or
//     happens on the row's last allowed attempt (earlier failures are
//     retried by the outbox itself). The error is not swallowed: the router
//     nacks the message, so the row goes dead with that error as
//     last_error, and nothing is logged as an ack without a publish;
//   - a row whose lease expired on its last allowed attempt (its relay was
//     killed, hung or cut off during that attempt, or stopped before the
//     handler answered) is parked dead by the next claim, take-over or
//     release, which records a death notice with it in the same statement;
//     the relay then hands the dead row to the router once more, and
//     PoisonQueue copies it with the cause (the row's last_error) as the
//     reason;
//   - a row whose stored headers are not a JSON object is handed to the
//     router without them, and copied with the decoding error as the
//     reason; its nack sends it dead with that error.
//
// The last two are refused whatever the router does: the forwarder never
// publishes them, and PoisonQueue copies them without calling the handlers
// and middleware inside it. Either way the row stays (or goes) dead, never
// marked published, and `outbox dead replay` delivers it again once the
// cause is fixed. This holds for the default relay and ordered mode (the
// death notices need migration 000015, <table>_dead_notices); the WAL relay
// parks a row whose headers are not a JSON object dead without a copy
// (docs/WAL.md, "Limits").
//
// One copy per dead event, except where a relay dies between the copy and
// the write that records the row's fate: then the copy is made again, as
// the outbox delivers any message again after a crash (the copies share
// the message UUID, the event_id). A death notice whose delivery gets no
// answer is handed out again, at most three times in all, so a notice that
// kills its relay does not make it loop.
//
// Messages of the router's other handlers are handled as Watermill's
// middleware.PoisonQueue handles them: every failure is copied and the
// message acked.
//
// Watermill's own middleware.PoisonQueue works with the forwarder too, and
// makes one copy per dead event, the ones that die outside the handler
// included (the forwarder refuses those with a Permanent error, which the
// stock poison queue copies): it acks what it copied, which the forwarder
// takes as the router's dead-letter path, so the row goes dead at once
// (see Forwarder.AddTo). PoisonQueue is for what that does not do: the
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
	// poisoned publishes msg's copy with err as the reason and returns the
	// error the router gets: err marked as copied.
	poisoned := func(msg *message.Message, err error) error {
		poison := msg.Copy()
		poison.Metadata.Set(middleware.ReasonForPoisonedKey, err.Error())
		poison.Metadata.Set(middleware.PoisonedTopicKey, message.SubscribeTopicFromCtx(msg.Context()))
		poison.Metadata.Set(middleware.PoisonedHandlerKey, message.HandlerNameFromCtx(msg.Context()))
		poison.Metadata.Set(middleware.PoisonedSubscriberKey, message.SubscriberNameFromCtx(msg.Context()))
		if perr := pub.Publish(topic, poison); perr != nil {
			return fmt.Errorf("%w (and publishing the poison copy failed: %w)", err, perr)
		}
		return &poisonCopiedError{err: err}
	}
	return func(h message.HandlerFunc) message.HandlerFunc {
		others := other(h)
		return func(msg *message.Message) ([]*message.Message, error) {
			o, ok := msg.Context().Value(outcomeKey{}).(*outcome)
			if !ok {
				return others(msg)
			}
			if err := refusal(msg); err != nil {
				// Dead, or failing for good, before any handler could
				// fail it: copied without running the handlers inside.
				recordOutcome(msg, err)
				subscriber.RecordError(msg, err)
				return nil, poisoned(msg, err)
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
			return out, poisoned(msg, err)
		}
	}, nil
}

// poisonCopiedError marks an error whose message PoisonQueue has copied, so
// that a second PoisonQueue further out does not copy it again.
type poisonCopiedError struct{ err error }

func (e *poisonCopiedError) Error() string { return e.err.Error() }
func (e *poisonCopiedError) Unwrap() error { return e.err }
