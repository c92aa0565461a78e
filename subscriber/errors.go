package subscriber

import (
	"context"
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill/message"
)

// ErrSubscriberClosed is returned by Subscribe after Close.
var ErrSubscriberClosed = errors.New("subscriber: closed")

// PermanentError marks an error that retrying cannot fix (no route for the
// topic, a payload the consumer can never accept): the row goes dead at once.
type PermanentError struct{ Err error }

func (e *PermanentError) Error() string { return "permanent: " + e.Err.Error() }

// Unwrap returns the wrapped error.
func (e *PermanentError) Unwrap() error { return e.Err }

// Permanent wraps err so that a nack sends the row dead at once. It returns
// nil for a nil err.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &PermanentError{Err: err}
}

// IsPermanent reports whether err was wrapped with Permanent.
func IsPermanent(err error) bool {
	var p *PermanentError
	return errors.As(err, &p)
}

type errorSlotKey struct{}

// errorSlot carries the handler's error from CaptureError to the nack.
type errorSlot struct {
	mu  sync.Mutex
	err error
}

func (s *errorSlot) set(err error) {
	s.mu.Lock()
	s.err = err
	s.mu.Unlock()
}

func (s *errorSlot) get() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// RecordError records err as the reason msg is about to be nacked, for
// last_error and for Permanent. It is a no-op for messages that did not come
// from an outbox Subscriber. CaptureError calls it for router handlers.
func RecordError(msg *message.Message, err error) {
	if slot, ok := msg.Context().Value(errorSlotKey{}).(*errorSlot); ok && err != nil {
		slot.set(err)
	}
}

// CaptureError is a Watermill router middleware that records a handler's
// error on the message (RecordError), so that the nack stores it as
// last_error and honours Permanent. Put it outermost, before the recoverer
// and timeout, so that it sees their errors too.
func CaptureError(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		msgs, err := h(msg)
		if err != nil {
			RecordError(msg, err)
		}
		return msgs, err
	}
}

func withErrorSlot(ctx context.Context, slot *errorSlot) context.Context {
	return context.WithValue(ctx, errorSlotKey{}, slot)
}

// ContextWithErrorRecorder returns a context on which RecordError (and so
// CaptureError) records a handler's error, and a function that returns the
// last error recorded. In-process backends use it to turn a consumer's nack
// into the publisher's error.
func ContextWithErrorRecorder(ctx context.Context) (context.Context, func() error) {
	slot := &errorSlot{}
	return withErrorSlot(ctx, slot), slot.get
}
