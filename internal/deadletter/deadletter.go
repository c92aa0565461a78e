// Package deadletter carries, between the outbox relays and the forwarder,
// the messages a relay hands to the router only so that the router's
// dead-letter path (its poison queue) sees them: an event that died, or
// fails for good, before any handler could fail it. Such a message carries
// its cause in its context (WithCause); the forwarder refuses it with that
// cause, a Permanent error, without publishing it, and forwarder.PoisonQueue
// copies it without calling the handlers inside it.
//
// A relay hands out such messages only on a subscription whose context the
// forwarder marked (Want): a handler of the relay's own user would take
// them for events to handle.
package deadletter

import "context"

type (
	wantKey  struct{}
	causeKey struct{}
)

// Want marks the context of a Subscribe call: the subscription's consumer
// refuses every message that carries a cause (Cause), so the relay may hand
// it those.
func Want(ctx context.Context) context.Context { return context.WithValue(ctx, wantKey{}, true) }

// Wanted reports whether the context of a Subscribe call was marked by
// Want.
func Wanted(ctx context.Context) bool {
	v, _ := ctx.Value(wantKey{}).(bool)
	return v
}

// WithCause returns ctx carrying cause: the message whose context it is
// must not be published; it is handed to the router only so that its
// dead-letter path sees it, failed with cause.
func WithCause(ctx context.Context, cause error) context.Context {
	return context.WithValue(ctx, causeKey{}, cause)
}

// Cause returns the cause WithCause put in ctx, or nil.
func Cause(ctx context.Context) error {
	err, _ := ctx.Value(causeKey{}).(error)
	return err
}
