package publisher

import (
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/schema"
)

// ErrInvalidMessage is matched (errors.Is) by every validation error. A
// validation error is returned before any SQL runs, so the caller's
// transaction stays usable.
var ErrInvalidMessage = errors.New("invalid outbox message")

// ValidationError says which field of which message was wrong and why.
type ValidationError struct {
	// Index is the position of the message in an EnqueueBatch or Publish
	// call; 0 for Enqueue, whose error names no position.
	Index int
	// Field is the Message field at fault: TenantID, Topic, EventID,
	// Payload or Headers.
	Field string
	// Reason says what was wrong and what to do.
	Reason string
	// single: the error of Enqueue, one message, so the text names no
	// position.
	single bool
}

// invalidMessage returns the ValidationError of message i.
func invalidMessage(i int, field, reason string) *ValidationError {
	return &ValidationError{Index: i, Field: field, Reason: reason}
}

// alone marks err, if it is a *ValidationError, as the error of a single
// message (Enqueue): its text names no position.
func alone(err error) error {
	var ve *ValidationError
	if errors.As(err, &ve) {
		ve.single = true
	}
	return err
}

func (e *ValidationError) Error() string {
	if e.single {
		return fmt.Sprintf("invalid outbox message: %s: %s", e.Field, e.Reason)
	}
	return fmt.Sprintf("invalid outbox message #%d: %s: %s", e.Index, e.Field, e.Reason)
}

// Is makes errors.Is(err, ErrInvalidMessage) true.
func (e *ValidationError) Is(target error) bool { return target == ErrInvalidMessage }

// MaxTopicBytes is the exclusive upper bound on a topic's length in bytes.
const MaxTopicBytes = 128

// DefaultMaxPayloadBytes is the default limit of EnqueuerConfig.MaxPayloadBytes:
// 1,000,000 bytes of payload (as the relay reads it from JSONB) and headers
// together. It leaves 48,527 bytes of Kafka's default message.max.bytes
// (1,048,588, of which the relay's producer may use
// kafkabackend.MaxMessageBytes, 1,048,527) for what the relay adds: its
// metadata headers (event_id, tenant_id, topic, sequence, attempts, table,
// partition_key, trace context, Watermill's message UUID), the record key
// and the record's framing.
const DefaultMaxPayloadBytes = 1_000_000

// HeaderFramingBytes is what each header costs, beyond its name and value,
// in the size MaxPayloadBytes bounds: the two length prefixes a Kafka
// record header may take (Sarama counts as much).
const HeaderFramingBytes = 10

var defaultTopicPattern = regexp.MustCompile(`^[a-z0-9-]+(\.[a-z0-9-]+)*\.v[0-9]+$`)

// ValidateTopic is the default topic rule (the project's topic convention):
// one or more dot-separated segments of [a-z0-9-], then a version segment vN,
// shorter than 128 bytes, such as org.organization.created.v1 (the usual
// <module>.<aggregate>.<event>.vN) or billing.v2.
func ValidateTopic(topic string) error {
	if err := validateTopicBasics(topic); err != nil {
		return err
	}
	if !defaultTopicPattern.MatchString(topic) {
		return fmt.Errorf("%q does not follow the topic convention: one or more dot-separated segments of [a-z0-9-], then a version segment vN (for example org.organization.created.v1 or billing.v2); set EnqueuerConfig.ValidateTopic to ValidateTopicRelaxed or your own rule for another convention", topic)
	}
	return nil
}

var relaxedTopicPattern = regexp.MustCompile(`^[A-Za-z0-9._:-]+$`)

// ValidateTopicRelaxed accepts any topic of letters, digits and . _ : -
// shorter than 128 bytes. It fits the topic names of Watermill's own tests
// and of most brokers.
func ValidateTopicRelaxed(topic string) error {
	if err := validateTopicBasics(topic); err != nil {
		return err
	}
	if !relaxedTopicPattern.MatchString(topic) {
		return fmt.Errorf("%q may only contain letters, digits and . _ : -", topic)
	}
	return nil
}

func validateTopicBasics(topic string) error {
	if topic == "" {
		return errors.New("empty; set a topic such as org.organization.created.v1")
	}
	if len(topic) >= MaxTopicBytes {
		return fmt.Errorf("%d bytes; a topic must be shorter than %d bytes", len(topic), MaxTopicBytes)
	}
	return nil
}

type validator struct {
	topic      func(string) error
	maxPayload int
}

func (v validator) message(i int, m *Message, cols schema.Columns) error {
	if m.TenantID == uuid.Nil {
		return invalidMessage(i, "TenantID", "nil UUID; set the tenant the event belongs to")
	}
	if m.EventID == uuid.Nil {
		return invalidMessage(i, "EventID", "nil UUID; generate one per event (uuid.New()) and keep it when retrying, it is the idempotency key")
	}
	if err := v.topic(m.Topic); err != nil {
		return invalidMessage(i, "Topic", err.Error())
	}
	if err := v.payload(m.Payload); err != nil {
		return invalidMessage(i, "Payload", err.Error())
	}
	if m.OrderingKey != "" {
		if err := validOrderingKey(m.OrderingKey); err != nil {
			return invalidMessage(i, "OrderingKey", err.Error())
		}
		if !cols.OrderingKey {
			return invalidMessage(i, "OrderingKey", "the table has no ordering_key column; add it with schema.Migrate(ctx, db, table, schema.WithOrderingKeyColumn()) or `outbox migrate`")
		}
	}
	if size := messageBytes(m); size > v.maxPayload {
		return invalidMessage(i, "Payload", fmt.Sprintf("%d bytes with the headers, as the broker would receive them (the payload as JSONB writes it: %d bytes), exceeds the limit of %d bytes; store large data elsewhere and reference it, or raise EnqueuerConfig.MaxPayloadBytes together with the broker's limit", size, jsonbTextBytes(m.Payload), v.maxPayload))
	}
	if len(m.Headers) > 0 {
		if !cols.Headers {
			return invalidMessage(i, "Headers", "the table has no headers column; add it with schema.Migrate(ctx, db, table, schema.WithHeadersColumn())")
		}
		for k, val := range m.Headers {
			if schema.ReservedMetadata(k) {
				return invalidMessage(i, "Headers", fmt.Sprintf("key %q is reserved: the outbox sets it from its own columns", k))
			}
			if strings.HasPrefix(k, WatermillMetadataPrefix) {
				return invalidMessage(i, "Headers", fmt.Sprintf("key %q is reserved by Watermill (its metadata keys start with %q: the message UUID, delays, redelivery); rename it", k, WatermillMetadataPrefix))
			}
			if len(k) > MaxHeaderNameBytes {
				return invalidMessage(i, "Headers", fmt.Sprintf("key %q... is %d bytes; a header name may have at most %d bytes (AMQP carries it as a short string and would cut it)",
					truncateUTF8(k, 32), len(k), MaxHeaderNameBytes))
			}
			if k == "" || strings.IndexByte(k, 0) >= 0 || strings.IndexByte(val, 0) >= 0 || !utf8.ValidString(k) || !utf8.ValidString(val) {
				return invalidMessage(i, "Headers", fmt.Sprintf("key %q: keys must be non-empty and keys and values valid UTF-8 without NUL bytes", k))
			}
		}
	}
	return nil
}

// messageBytes bounds from above what a broker receives of m beyond the
// relay's own metadata: its payload as PostgreSQL's JSONB text output writes
// it (what the relay reads) and each header's name and value with
// HeaderFramingBytes. m's payload has passed v.payload.
func messageBytes(m *Message) int {
	n := jsonbTextBytes(m.Payload)
	for k, val := range m.Headers {
		n += len(k) + len(val) + HeaderFramingBytes
	}
	return n
}

// MaxHeaderNameBytes is the longest header name (a key of Message.Headers)
// that Enqueue accepts: AMQP carries a header name as a short string of at
// most 255 bytes, and RabbitMQ would receive a longer one cut.
const MaxHeaderNameBytes = 255

// WatermillMetadataPrefix starts every metadata key that Watermill and its
// backends set or read for themselves (_watermill_message_uuid, which the
// Kafka marshaler refuses in metadata, _watermill_amqp_redelivered,
// _watermill_delayed_until, ...): Enqueue refuses a header name with it.
const WatermillMetadataPrefix = "_watermill_"

// truncateUTF8 returns the first n bytes of s at most, cut on a UTF-8
// boundary, for an error that quotes a long value.
func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// validOrderingKey checks an ordering key: at most 256 bytes of valid UTF-8
// without NUL (PostgreSQL text cannot hold NUL).
func validOrderingKey(k string) error {
	if len(k) > schema.MaxOrderingKeyBytes {
		return fmt.Errorf("%d bytes; an ordering key may have at most %d bytes (use the aggregate id, or a hash of a longer key)", len(k), schema.MaxOrderingKeyBytes)
	}
	if strings.IndexByte(k, 0) >= 0 {
		return errors.New("contains a NUL byte, which PostgreSQL text cannot store; remove it")
	}
	if !utf8.ValidString(k) {
		return errors.New("not valid UTF-8; use a UTF-8 string such as the aggregate id")
	}
	return nil
}

func (v validator) payload(p json.RawMessage) error {
	if len(p) == 0 {
		return errors.New("empty; the payload must be a JSON value such as {} (the column is JSONB)")
	}
	if len(p) > v.maxPayload {
		return fmt.Errorf("%d bytes exceeds the limit of %d bytes; store large data elsewhere and reference it, or raise EnqueuerConfig.MaxPayloadBytes", len(p), v.maxPayload)
	}
	if !json.Valid(p) {
		return errors.New("not valid JSON; the column is JSONB (marshal the event with encoding/json)")
	}
	return jsonbStorable(p)
}
