package router

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Metadata keys the poison copy adds.
const (
	MetadataPoisonReason = "outbox_poison_reason"
	MetadataPoisonTable  = "outbox_poison_table"
)

// MiddlewareConfig configures Middlewares.
type MiddlewareConfig struct {
	// DispatchTimeout bounds one message: its context is cancelled after it,
	// and a handler that honours the context returns an error (a nack).
	// Set it to the subscriber's Config.DispatchTimeout. Defaults to
	// subscriber.DispatchTimeoutDefault (30s).
	DispatchTimeout time.Duration
	// Retry, when set, retries a failing message in-process before it is
	// nacked, for transient broker errors; errors marked
	// subscriber.Permanent are not retried. Defaults to nil (the outbox's
	// own backoff retries).
	Retry *middleware.Retry
	// PoisonPublisher and PoisonTopic, when both set, publish a copy of a
	// message to PoisonTopic when its failure sends the row dead (at
	// MaxAttempts, or a permanent error). The row is still nacked and stays
	// dead and replayable in the table. Defaults to nil (no copy).
	PoisonPublisher message.Publisher
	PoisonTopic     string
	// MaxAttempts must match the subscriber's MaxAttempts for the poison
	// copy to know the last attempt. Defaults to
	// subscriber.MaxAttemptsDefault (25).
	MaxAttempts int
	// Logger logs poison copies that fail. Defaults to watermill.NopLogger.
	Logger watermill.LoggerAdapter
}

// Validate checks cfg as Middlewares does: negative durations or counts,
// and a poison copy with only one of PoisonPublisher and PoisonTopic, are
// refused with an error that names the field and says what to do.
func (cfg MiddlewareConfig) Validate() error {
	var errs []error
	if cfg.DispatchTimeout < 0 {
		errs = append(errs, invalidField("DispatchTimeout", "%s is negative; leave it 0 for the default (%s) or set a positive value", cfg.DispatchTimeout, subscriber.DispatchTimeoutDefault))
	}
	if cfg.MaxAttempts < 0 {
		errs = append(errs, invalidField("MaxAttempts", "%d is negative; leave it 0 for the default (%d) or set the subscriber's MaxAttempts", cfg.MaxAttempts, subscriber.MaxAttemptsDefault))
	}
	if cfg.PoisonPublisher != nil && cfg.PoisonTopic == "" {
		errs = append(errs, invalidField("PoisonTopic", "empty while PoisonPublisher is set; name the topic of the poison copies, or unset PoisonPublisher"))
	}
	if cfg.PoisonPublisher == nil && cfg.PoisonTopic != "" {
		errs = append(errs, invalidField("PoisonPublisher", "nil while PoisonTopic is %q; set the publisher of the poison copies, or unset PoisonTopic", cfg.PoisonTopic))
	}
	if len(errs) == 0 {
		return nil
	}
	for i, e := range errs {
		errs[i] = fmt.Errorf("router: invalid config: %w", e)
	}
	return errors.Join(errs...)
}

// Middlewares validates cfg and returns the relay's middleware stack,
// outermost first:
//
//  1. subscriber.CaptureError records the final error for last_error and
//     Permanent, so it must see every error the others produce;
//  2. the poison copy, when configured, publishes a copy of a message whose
//     failure makes the row dead, and passes the error on, marked so that
//     no other poison copy of this stack copies it again (with the stack
//     router-wide, an in-process consumer's failure comes back as the
//     forwarder's: the dead event is copied once, with the consumer's
//     reason);
//  3. middleware.Recoverer turns a panic into an error;
//  4. the in-process Retry, when configured, retries transient errors;
//  5. middleware.Timeout cancels the message context after DispatchTimeout,
//     per attempt.
//
// Add it with router.AddMiddleware(stack...) or handler.AddMiddleware. An
// invalid cfg returns Validate's error; MustMiddlewares panics with it
// instead, for a configuration written in the code.
func Middlewares(cfg MiddlewareConfig) ([]message.HandlerMiddleware, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return buildStack(cfg), nil
}

// MustMiddlewares is like Middlewares but panics with Validate's error on
// an invalid cfg, like regexp.MustCompile.
func MustMiddlewares(cfg MiddlewareConfig) []message.HandlerMiddleware {
	stack, err := Middlewares(cfg)
	if err != nil {
		panic(err)
	}
	return stack
}

// buildStack is Middlewares for a valid cfg.
func buildStack(cfg MiddlewareConfig) []message.HandlerMiddleware {
	if cfg.DispatchTimeout == 0 {
		cfg.DispatchTimeout = subscriber.DispatchTimeoutDefault
	}
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = subscriber.MaxAttemptsDefault
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	stack := []message.HandlerMiddleware{subscriber.CaptureError}
	if cfg.PoisonPublisher != nil && cfg.PoisonTopic != "" {
		stack = append(stack, poisonCopy(cfg))
	}
	stack = append(stack, middleware.Recoverer)
	if cfg.Retry != nil {
		r := *cfg.Retry
		// Each attempt gets a fresh per-message timeout, not the cancelled
		// context of the previous attempt.
		r.ResetContextOnRetry = true
		should := r.ShouldRetry
		r.ShouldRetry = func(p middleware.RetryParams) bool {
			if subscriber.IsPermanent(p.Err) {
				return false
			}
			return should == nil || should(p)
		}
		stack = append(stack, r.Middleware)
	}
	return append(stack, middleware.Timeout(cfg.DispatchTimeout))
}

func poisonCopy(cfg MiddlewareConfig) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			out, err := h(msg)
			if err == nil {
				return out, nil
			}
			attempts, _ := strconv.Atoi(msg.Metadata.Get(schema.MetadataAttempts))
			if !subscriber.IsPermanent(err) && attempts < cfg.MaxAttempts {
				return out, err
			}
			var copied *poisonCopiedError
			if errors.As(err, &copied) {
				// A handler further in already copied this failure: an
				// in-process consumer's, whose error is the forwarder's
				// publish error. One copy per dead event.
				return out, err
			}
			poison := msg.Copy()
			poison.Metadata.Set(MetadataPoisonReason, err.Error())
			poison.Metadata.Set(MetadataPoisonTable, msg.Metadata.Get(schema.MetadataTable))
			if perr := cfg.PoisonPublisher.Publish(cfg.PoisonTopic, poison); perr != nil {
				cfg.Logger.Error("Could not publish the poison copy; the row is dead in the table", perr,
					watermill.LogFields{"event_id": msg.UUID, "poison_topic": cfg.PoisonTopic})
				return out, fmt.Errorf("%w (and publishing the poison copy failed: %w)", err, perr)
			}
			return out, &poisonCopiedError{err: err}
		}
	}
}

// poisonCopiedError marks an error whose message was copied to the poison
// topic, so that a poison copy further out (the forwarder's, when the
// failure came back from an in-process consumer) does not copy it again.
type poisonCopiedError struct{ err error }

func (e *poisonCopiedError) Error() string { return e.err.Error() }
func (e *poisonCopiedError) Unwrap() error { return e.err }

// invalidField renders a configuration error: "router: invalid config:
// <Field>: what is wrong; what to do".
func invalidField(field, format string, args ...any) error {
	return fmt.Errorf("router: invalid config: "+field+": "+format, args...)
}
