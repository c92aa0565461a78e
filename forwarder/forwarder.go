// Package forwarder moves outbox messages to any Watermill publisher: Kafka,
// AMQP, the in-process backend, or anything else that implements
// message.Publisher.
//
// The zero Config relays every row of the subscriber's table to the
// destination topic named by the row's topic column, with the row's ordering
// key (else the event_id) as partition key, every metadata entry (event_id, tenant_id, topic, sequence,
// attempts, table, traceparent, tracestate and stored headers) carried as a
// broker header, and the business JSON as the payload. A publish error is a
// nack: the row is retried with backoff and never acked silently.
//
// Each relayed message gets an OpenTelemetry producer span in the trace of
// the row's traceparent, with the messaging attributes (messaging.system,
// messaging.destination.name, messaging.message.id = event_id,
// messaging.operation.type = send), error status when the relay fails, and
// the published message's traceparent pointing at it. Only the OTel API is
// used: spans go to Config.TracerProvider or the global provider.
//
// The forwarder does not end a publish when its message's context ends:
// Watermill's message.Publisher.Publish takes no context, so a publish
// under way when an ordered relay's partition lease or a WAL relay's
// session ends goes on until the broker answers or the publisher's own
// timeout (Sarama's Net.WriteTimeout, the AMQP channel's confirm) fires, and
// its handler returns only then. The relays' promise of one copy of a key
// across relays (docs/ORDERING.md, docs/WAL.md) rests on handlers that
// return when their context ends; behind the forwarder, a copy of the next
// owner can reach the broker while the old owner's publish still runs, for
// at most that publish timeout. Consumers that need one copy per key at all
// times deduplicate by event_id (the message UUID and a broker header).
package forwarder

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unicode"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/internal/deadletter"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Config configures a Forwarder. The zero Config works.
type Config struct {
	// SubscribeTopic is the topic subscribed to on the outbox subscriber.
	// Defaults to subscriber.AllTopics (every row of the table).
	SubscribeTopic string
	// DestinationTopic maps a message to the broker topic. Defaults to the
	// row's topic column (metadata "topic"). An error from it is permanent:
	// the row goes dead at once (there is no route for it).
	DestinationTopic func(msg *message.Message) (string, error)
	// PartitionKey chooses the partition key, stored in metadata
	// router.MetadataPartitionKey. It becomes the Kafka record key only
	// with a publisher whose marshaler reads that entry: kafkabackend's, or
	// watermill-kafka's with kafka.NewWithPartitioningMarshaler(
	// kafkabackend.PartitionKey); watermill-kafka's DefaultMarshaler
	// writes no key. Defaults to
	// PartitionByOrderingKey: the row's ordering key when it has one, so a
	// key stays in one Kafka partition, else its event_id.
	PartitionKey func(msg *message.Message) (string, error)
	// HandlerName names the router handler. Defaults to
	// "outbox_forwarder_" + the table in the message metadata, or
	// "outbox_forwarder".
	HandlerName string
	// Middleware is the handler's middleware stack. Defaults to the stack
	// of router.Middlewares with the zero MiddlewareConfig. Set it to an empty,
	// non-nil slice to use only the router's own middleware.
	Middleware []message.HandlerMiddleware
	// RouterConfig configures the router Run creates. Defaults to Watermill's
	// defaults.
	RouterConfig message.RouterConfig
	// TracerProvider provides the tracer of the relay spans: one producer
	// span per relayed message, child of the span in the row's traceparent,
	// and the published message's traceparent continues from it. Defaults to
	// otel.GetTracerProvider() (a no-op until the process sets one).
	TracerProvider trace.TracerProvider
	// MessagingSystem is the span's messaging.system attribute, the broker
	// kind ("kafka", "rabbitmq"). Defaults to MessagingSystemDefault.
	MessagingSystem string
	// BatchSize is the most messages one publish call carries. With
	// BatchSize above 1, the messages the subscriber has in flight at once
	// (subscriber.Config.MaxInFlight) queue up while up to MaxPublishes
	// publish calls are under way, and the next free call publishes them,
	// oldest first, one call per destination topic; there is no timer, so
	// a message that arrives alone is published at once. Every message is
	// still acked or nacked on its own, by its own result: a BatchPublisher
	// reports one per message; a plain publisher's Publish(topic, msgs...)
	// fails or succeeds as a whole, so a failed call nacks every message in
	// it (nothing is lost: they are retried). Per-key order holds in
	// ordered mode because the subscriber never has two messages of one key
	// in flight. Defaults to PublishBatchSizeDefault (100) when the publisher
	// implements BatchPublisher (kafkabackend's and amqpbackend's do), else to 1 (one
	// Publish per message, calls running concurrently): watermill-amqp's and
	// watermill-kafka's own publishers send a multi-message call one message
	// at a time, each waiting for the broker, which is slower than
	// concurrent single calls.
	BatchSize int
	// MaxPublishes bounds the publish calls under way at once when
	// BatchSize is above 1. Defaults to MaxPublishesDefault (4).
	MaxPublishes int
}

// validate checks cfg after its defaults are set; each problem names the
// field and what to do, like subscriber.Config.
func (cfg Config) validate() error {
	var errs []error
	for i, m := range cfg.Middleware {
		if m == nil {
			errs = append(errs, invalidField("Middleware", "entry %d is nil; remove it (an empty, non-nil slice means no middleware of the forwarder's own)", i))
		}
	}
	if cfg.RouterConfig.CloseTimeout < 0 {
		errs = append(errs, invalidField("RouterConfig.CloseTimeout", "%s is negative; leave it 0 for Watermill's default or set how long Close waits for handlers", cfg.RouterConfig.CloseTimeout))
	}
	if strings.ContainsFunc(cfg.HandlerName, unicode.IsSpace) {
		errs = append(errs, invalidField("HandlerName", "%q contains white space; it names the handler in logs and metric labels, use something like outbox_forwarder_org", cfg.HandlerName))
	}
	if cfg.BatchSize < 0 {
		errs = append(errs, invalidField("BatchSize", "%d is negative; leave it 0 for the default or set the most messages one publish call carries", cfg.BatchSize))
	}
	if cfg.MaxPublishes < 0 {
		errs = append(errs, invalidField("MaxPublishes", "%d is negative; leave it 0 for the default (%d)", cfg.MaxPublishes, MaxPublishesDefault))
	}
	if !validMessagingSystem(cfg.MessagingSystem) {
		errs = append(errs, invalidField("MessagingSystem", "%q is not an OpenTelemetry messaging.system value; use lowercase letters, digits, '_' or '-', such as kafka or rabbitmq", cfg.MessagingSystem))
	}
	if len(errs) == 0 {
		return nil
	}
	for i, e := range errs {
		errs[i] = fmt.Errorf("forwarder: invalid config: %w", e)
	}
	return errors.Join(errs...)
}

func validMessagingSystem(s string) bool {
	for _, r := range s {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') && r != '_' && r != '-' {
			return false
		}
	}
	return s != ""
}

// PartitionByEventID keys records by event_id (the default): the same event
// lands on the same partition every time it is relayed.
func PartitionByEventID(msg *message.Message) (string, error) { return msg.UUID, nil }

// PartitionByOrderingKey keys records by the row's ordering key (metadata
// schema.MetadataOrderingKey) when it has one, so that a key's events share
// a partition and keep the order an ordered subscriber relays them in;
// rows without a key are keyed by event_id.
func PartitionByOrderingKey(msg *message.Message) (string, error) {
	if k := msg.Metadata.Get(schema.MetadataOrderingKey); k != "" {
		return k, nil
	}
	return msg.UUID, nil
}

// PartitionByTenantID keys records by tenant_id, so one tenant's events share
// a partition (still no order guarantee: retries reorder).
func PartitionByTenantID(msg *message.Message) (string, error) {
	if t := msg.Metadata.Get(schema.MetadataTenantID); t != "" {
		return t, nil
	}
	return "", errors.New("message has no tenant_id metadata")
}

// PartitionByMetadata keys records by the metadata entry key (a header stored
// with the event), falling back to event_id when it is absent.
func PartitionByMetadata(key string) func(*message.Message) (string, error) {
	return func(msg *message.Message) (string, error) {
		if v := msg.Metadata.Get(key); v != "" {
			return v, nil
		}
		return msg.UUID, nil
	}
}

// Forwarder relays an outbox subscriber to a publisher.
type Forwarder struct {
	sub    message.Subscriber
	pub    message.Publisher
	cfg    Config
	logger watermill.LoggerAdapter

	router  *message.Router
	tracer  trace.Tracer
	batcher *batcher // nil: one Publish per message
	started atomic.Bool
	refused atomic.Int64 // acks refused without a confirmed publish
	// maxAttempts is the subscriber's MaxAttempts (for PoisonFilter).
	maxAttempts int
	closeOnce   sync.Once
	closeErr    error
}

// New returns a Forwarder from sub (usually a *subscriber.Subscriber) to pub.
// The configuration comes before the logger, as in this module's other
// constructors (subscriber.New) and Watermill's message.NewRouter; Watermill's
// own forwarder.NewForwarder(sub, pub, logger, config) takes them the other
// way round, and either order mistyped is a compile error. A nil logger is
// watermill.NopLogger{}.
func New(sub message.Subscriber, pub message.Publisher, cfg Config, logger watermill.LoggerAdapter) (*Forwarder, error) {
	if sub == nil || pub == nil {
		return nil, errors.New("forwarder: nil subscriber or publisher")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	if cfg.SubscribeTopic == "" {
		cfg.SubscribeTopic = subscriber.AllTopics
	}
	if cfg.DestinationTopic == nil {
		cfg.DestinationTopic = func(msg *message.Message) (string, error) {
			if t := msg.Metadata.Get(schema.MetadataTopic); t != "" {
				return t, nil
			}
			return "", errors.New("message has no topic metadata")
		}
	}
	if cfg.PartitionKey == nil {
		cfg.PartitionKey = PartitionByOrderingKey
	}
	if cfg.HandlerName == "" {
		cfg.HandlerName = "outbox_forwarder"
		if s, ok := sub.(interface{ Table() schema.Table }); ok {
			cfg.HandlerName += "_" + s.Table().Qualified()
		}
	}
	if cfg.Middleware == nil {
		cfg.Middleware = router.MustMiddlewares(router.MiddlewareConfig{Logger: logger})
	}
	if cfg.MessagingSystem == "" {
		cfg.MessagingSystem = MessagingSystemDefault
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = 1
		if _, ok := pub.(BatchPublisher); ok {
			cfg.BatchSize = PublishBatchSizeDefault
		}
	}
	if cfg.MaxPublishes == 0 {
		cfg.MaxPublishes = MaxPublishesDefault
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	r, err := message.NewRouter(cfg.RouterConfig, logger)
	if err != nil {
		return nil, fmt.Errorf("forwarder: %w", err)
	}
	f := &Forwarder{sub: sub, pub: pub, cfg: cfg, logger: logger, router: r, tracer: tracerOf(cfg.TracerProvider), maxAttempts: sqlq.MaxAttemptsDefault}
	if s, ok := sub.(interface{ MaxAttempts() int }); ok {
		f.maxAttempts = s.MaxAttempts()
	}
	if cfg.BatchSize > 1 {
		f.batcher = newBatcher(pub, cfg.BatchSize, cfg.MaxPublishes)
	}
	return f, nil
}

// Handle is the forwarder's handler function: it publishes one outbox
// message to its destination, in a span of its own (see
// Config.TracerProvider), alone or in a batch with the messages handled at
// the same time (Config.BatchSize), and returns once the broker has it. A
// publish error nacks the message. Add it with AddTo (or Run): a handler
// registered by hand on the outbox subscriber lacks AddTo's guarantee that
// an ack without a successful publish is refused, and is not handed the
// dead events that PoisonQueue copies.
//
// Through AddTo, the relay also hands the router the events that die
// without a handler's failure, for its poison queue: a row whose lease
// expired on its last allowed attempt (its relay was killed during it) and
// a row whose stored headers are not a JSON object. Handle publishes none
// of them: it returns a Permanent error with the cause, which the router's
// poison queue copies (see PoisonQueue); the row is, or goes, dead.
func (f *Forwarder) Handle(msg *message.Message) (err error) {
	ctx, span := f.startSpan(msg)
	defer func() {
		endSpan(span, err, msg.Payload)
		recordOutcome(msg, err)
		if err != nil {
			// Recorded here too, for last_error, when no CaptureError runs.
			subscriber.RecordError(msg, err)
			attempts, _ := strconv.Atoi(msg.Metadata.Get(schema.MetadataAttempts))
			err = &handlerError{err: err, final: subscriber.IsPermanent(err) || attempts >= f.maxAttempts}
		}
	}()
	if err := refusal(msg); err != nil {
		return err
	}
	dest, err := f.cfg.DestinationTopic(msg)
	if err == nil && dest == "" {
		err = errors.New("the destination topic is empty")
	}
	if err != nil {
		return subscriber.Permanent(fmt.Errorf("no destination topic for event %s: %w", msg.UUID, err))
	}
	setDestination(span, dest)
	key, err := f.cfg.PartitionKey(msg)
	if err != nil {
		return subscriber.Permanent(fmt.Errorf("partition key for event %s: %w", msg.UUID, err))
	}
	out := message.NewMessage(msg.UUID, msg.Payload)
	for k, v := range msg.Metadata {
		out.Metadata[k] = v
	}
	out.Metadata[router.MetadataPartitionKey] = key
	injectTrace(ctx, out.Metadata)
	out.SetContext(ctx)
	if f.batcher != nil {
		if err := f.batcher.submit(ctx, dest, out); err != nil {
			return fmt.Errorf("publish event %s to %q: %w", msg.UUID, dest, err)
		}
		return nil
	}
	if err := f.pub.Publish(dest, out); err != nil {
		return fmt.Errorf("publish event %s to %q: %w", msg.UUID, dest, err)
	}
	return nil
}

// refusal is the error the forwarder refuses msg with when the relay
// handed it to the router only for its dead-letter path (package
// deadletter), else nil: Permanent, naming the event and the cause.
func refusal(msg *message.Message) error {
	cause := deadletter.Cause(msg.Context())
	if cause == nil {
		return nil
	}
	return subscriber.Permanent(fmt.Errorf("event %s %w", msg.UUID, cause))
}

// AddTo adds the forwarder's handler, with its middleware, to a router the
// caller already runs, and returns the handler.
//
// Whatever middleware the router runs, a row is marked published only when
// its publish succeeded: the router handles a copy of each outbox message,
// and an ack of the copy acks the outbox message only if Handle published
// it. An ack without a confirmed publish means the router's own
// dead-letter path took the message (Watermill's middleware.PoisonQueue or
// PoisonQueueWithFilter copied it and acked, after the router's Retry
// middleware, if any, gave up), or a middleware acked it without calling
// the handler: it is logged, counted (RefusedAcks), and the row goes dead
// at once with ErrNotPublished and the failure as last_error. So a router
// with Watermill's stock Retry and PoisonQueue makes one poison copy per
// dead event, and the outbox does not retry what the router gave up on.
func (f *Forwarder) AddTo(r *message.Router) *message.Handler {
	h := r.AddConsumerHandler(f.cfg.HandlerName, f.cfg.SubscribeTopic, newConfirmingSubscriber(f.sub, f.logger, &f.refused, f.maxAttempts), f.Handle)
	for _, m := range f.cfg.Middleware {
		h.AddMiddleware(m)
	}
	return h
}

// RefusedAcks is how many outbox messages the router acked although their
// publish had not succeeded, each sent dead instead of marked published
// (see AddTo). Above zero, the router's poison queue took messages, or a
// middleware of the router swallows the forwarder's errors.
func (f *Forwarder) RefusedAcks() int64 { return f.refused.Load() }

// Router is the router Run runs; add middleware or metrics to it before Run.
func (f *Forwarder) Router() *message.Router { return f.router }

// Run relays until ctx is done or Close is called, on a router of its own.
func (f *Forwarder) Run(ctx context.Context) error {
	if f.started.Swap(true) {
		return errors.New("forwarder: Run called twice")
	}
	f.AddTo(f.router)
	if err := f.router.Run(ctx); err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	return nil
}

// Running is closed once Run's router runs.
func (f *Forwarder) Running() <-chan struct{} { return f.router.Running() }

// Close stops Run: the router drains in-flight messages (up to its
// CloseTimeout) and closes the subscriber. It is idempotent.
func (f *Forwarder) Close() error {
	f.closeOnce.Do(func() { f.closeErr = f.router.Close() })
	return f.closeErr
}

// invalidField renders a configuration error: "forwarder: invalid config:
// <Field>: what is wrong; what to do".
func invalidField(field, format string, args ...any) error {
	return fmt.Errorf("forwarder: invalid config: "+field+": "+format, args...)
}
