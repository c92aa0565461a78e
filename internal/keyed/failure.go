package keyed

import (
	"time"

	"github.com/outboxkit/watermill-outbox/internal/redact"
)

// NoErrorText is the last_error of a message nacked without an error.
const NoErrorText = "handler nacked the message without an error (add the subscriber.CaptureError middleware to record it)"

// Policy is what a relay's configuration says about failed attempts.
type Policy struct {
	// MaxAttempts is the number of attempts after which a row is dead.
	MaxAttempts int
	// Backoff is the delay before the attempt after attempts failed ones.
	Backoff func(attempts int) time.Duration
	// LastErrorMaxBytes bounds the summary (redact.Summary).
	LastErrorMaxBytes int
	// Permanent reports whether err asks for no retry
	// (subscriber.IsPermanent).
	Permanent func(err error) bool
}

// Failure is what one failed attempt leads to.
type Failure struct {
	// Summary is the text to record as last_error: the error's text,
	// redacted and bounded, without the payload's text.
	Summary string
	// Permanent: the error asked for no retry.
	Permanent bool
	// Dead: no attempt follows (permanent, or MaxAttempts reached). Where
	// the attempts are counted in the database, its statement decides with
	// the same rule and this is the relay's own count's answer.
	Dead bool
	// RetryIn is the backoff before the next attempt. It is set when dead
	// too: the statements that decide in the database take it.
	RetryIn time.Duration
}

// Judge decides about the attempts-th attempt of a message with payload,
// failed with err (nil: nacked without an error).
func (p Policy) Judge(err error, attempts int, payload []byte) Failure {
	text := NoErrorText
	if err != nil {
		text = err.Error()
	}
	f := Failure{
		Summary:   redact.Summary(text, payload, p.LastErrorMaxBytes),
		Permanent: err != nil && p.Permanent != nil && p.Permanent(err),
	}
	f.Dead = f.Permanent || attempts >= p.MaxAttempts
	f.RetryIn = p.Backoff(attempts) // once per attempt, dead or not
	return f
}
