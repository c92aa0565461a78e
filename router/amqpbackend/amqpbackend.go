// Package amqpbackend is the relay's AMQP (RabbitMQ) publisher:
// watermill-amqp configured for an outbox, with two layouts. It lives apart
// from package router so that programs that do not relay to AMQP do not link
// the AMQP client.
//
// LayoutQueue (the default) declares, per topic, a durable direct exchange
// and a durable queue, both named after the topic, bound with the topic as
// routing key, before the first publish: a message RabbitMQ confirms is stored
// even when no consumer runs yet. Its messages are published mandatory: once
// the queue is gone (deleted by an operator, or by an expiry policy),
// RabbitMQ returns a message no queue received and its publish fails, so
// the outbox retries the row (never marks it published), and the next
// publish to the topic declares the queue again. Consumers of one topic share
// that queue and compete for its messages: it suits one consuming service per
// topic.
//
// LayoutFanout declares only exchanges and never a queue: per topic a
// durable fanout exchange named after the topic or, with Config.Exchange set,
// one durable topic exchange to which every message goes with its topic as
// routing key. Each consuming service declares and binds its own queue and
// gets its own copy. RabbitMQ drops a message that no queue is bound for and
// still confirms it, so bind the queues before the events flow.
package amqpbackend

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/watermill-outbox/internal/redact"
)

// ChannelPoolSizeDefault is the default publisher channel pool: one channel
// per message the subscriber keeps in flight by default (2 x BatchSize).
// Without a pool, publishing with confirms is about 30x slower.
const ChannelPoolSizeDefault = 200

// Layouts (OUTBOX_AMQP_LAYOUT).
const (
	LayoutQueue  = "queue"
	LayoutFanout = "fanout"
)

// Config configures the AMQP publisher.
type Config struct {
	// URL is the AMQP URI. Required.
	URL string
	// Layout is LayoutQueue (default) or LayoutFanout; see the package doc.
	Layout string
	// Exchange, with LayoutFanout, is the one topic exchange every message
	// goes to, with its topic as routing key. Empty: one fanout exchange per
	// topic, named after the topic. Must be empty with LayoutQueue.
	Exchange string
	// ChannelPoolSize is the publisher's channel pool. Defaults to 200.
	ChannelPoolSize int
}

// Validate reports what is wrong with c, naming the field.
func (c Config) Validate() error {
	var errs []error
	if c.URL == "" {
		errs = append(errs, invalidField("URL", "empty; set OUTBOX_AMQP_URL (amqp://user:password@host:5672/vhost)"))
	} else if err := CheckURL(c.URL); err != nil {
		errs = append(errs, invalidField("URL", "%w", err))
	}
	switch c.Layout {
	case "", LayoutQueue:
		if c.Exchange != "" {
			errs = append(errs, invalidField("Exchange", "%q is set, but only LayoutFanout (OUTBOX_AMQP_LAYOUT=fanout) publishes to one shared exchange", c.Exchange))
		}
	case LayoutFanout:
	default:
		errs = append(errs, invalidField("Layout", "%q is not a layout; use %q or %q", c.Layout, LayoutQueue, LayoutFanout))
	}
	if c.ChannelPoolSize < 0 {
		errs = append(errs, invalidField("ChannelPoolSize", "negative; leave it 0 for the default"))
	}
	return errors.Join(errs...)
}

// CheckURL reports why raw is not an AMQP URI that the client can dial,
// with the URI's password replaced by *** and no part of its userinfo
// quoted (the parser's own message quotes the whole URI), so that the error
// can be logged.
func CheckURL(raw string) error {
	if _, err := amqp091.ParseURI(raw); err != nil {
		return fmt.Errorf("%s is not an AMQP URI: %s; the form is amqp://user:password@host:5672/vhost", redact.URL(raw), redact.URLProblem(raw, err))
	}
	return nil
}

// invalidField renders a configuration error: "amqpbackend: invalid config:
// <field>: <what is wrong; what to do>".
func invalidField(field, format string, args ...any) error {
	return fmt.Errorf("amqpbackend: invalid config: "+field+": "+format, args...)
}

// WatermillConfig is the watermill-amqp configuration of c: persistent
// messages with MessageId = event_id and ContentType application/json,
// publisher confirms, a channel pool, and the exchanges (and, with
// LayoutQueue, queues and mandatory publishing) of c's layout. With LayoutQueue a watermill-amqp
// subscriber on the same configuration consumes the topic's queue.
func WatermillConfig(c Config) amqp.Config {
	if c.ChannelPoolSize == 0 {
		c.ChannelPoolSize = ChannelPoolSizeDefault
	}
	byTopic := func(topic string) string { return topic }
	wc := amqp.NewDurableQueueConfig(c.URL)
	wc.Publish.GenerateRoutingKey = byTopic
	wc.QueueBind.GenerateRoutingKey = byTopic
	switch {
	case c.Layout == LayoutFanout && c.Exchange != "":
		wc.Exchange = amqp.ExchangeConfig{GenerateName: func(string) string { return c.Exchange }, Type: "topic", Durable: true}
		wc.TopologyBuilder = exchangeOnlyTopology{}
	case c.Layout == LayoutFanout:
		wc.Exchange = amqp.ExchangeConfig{GenerateName: byTopic, Type: "fanout", Durable: true}
		wc.TopologyBuilder = exchangeOnlyTopology{}
	default:
		wc.Exchange = amqp.ExchangeConfig{GenerateName: byTopic, Type: "direct", Durable: true}
		wc.TopologyBuilder = queueDeclaringTopology{&amqp.DefaultTopologyBuilder{}}
		// A message no queue receives comes back (basic.return) and its
		// publish fails (Publisher.PublishBatch).
		wc.Publish.Mandatory = true
	}
	wc.Marshaler = amqp.DefaultMarshaler{PostprocessPublishing: func(p amqp091.Publishing) amqp091.Publishing {
		if id, ok := p.Headers[amqp.DefaultMessageUUIDHeaderKey].(string); ok {
			p.MessageId = id
		}
		p.ContentType = "application/json"
		return p
	}}
	wc.Publish.ConfirmDelivery = true
	wc.Publish.ChannelPoolSize = c.ChannelPoolSize
	return wc
}

// NewPublisher validates c and returns its publisher, a *Publisher whose
// Publish and PublishBatch (forwarder.BatchPublisher) publish on channels of
// its own in confirm mode.
func NewPublisher(c Config, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	wc := WatermillConfig(c)
	pub, err := amqp.NewPublisher(wc, logger)
	if err != nil {
		return nil, fmt.Errorf("amqpbackend: %w", redactURL(err, c.URL))
	}
	return &Publisher{Publisher: pub, cfg: wc, url: c.URL, declared: map[string]bool{}}, nil
}

// Publisher publishes to RabbitMQ with publisher confirms. PublishBatch
// publishes a batch on one channel and then awaits its confirms together, so
// a batch costs about one broker round trip instead of one per message; a
// Forwarder uses it by default (forwarder.BatchPublisher). Publish is
// PublishBatch of its messages. Both report a message RabbitMQ returned
// (LayoutQueue: no queue received it) as failed, although RabbitMQ confirms
// it. The embedded watermill-amqp publisher holds the connection checked at
// NewPublisher; Close closes it.
type Publisher struct {
	*amqp.Publisher
	cfg amqp.Config
	url string

	mu       sync.Mutex
	conn     *amqp091.Connection
	idle     []confirmChannel // confirm-mode channels between batches
	declared map[string]bool  // topics whose topology is declared
	closed   bool
}

// confirmChannel is a channel in confirm mode with its listener of returned
// messages (basic.return). PublishBatch reads returns while it waits for
// confirms; amqp091 sends them from the connection's reader, so a returned
// message's return is read before its confirm resolves, and a channel that
// is dropped with confirms outstanding gets a reader of returns until it is
// closed (drainReturns).
type confirmChannel struct {
	*amqp091.Channel
	returns chan amqp091.Return
}

// drainReturns reads cc's returns until the channel is closed, so that the
// connection's reader never blocks on a channel no batch waits on.
func (cc confirmChannel) drainReturns() {
	go func() {
		for range cc.returns { // discard the returns of an abandoned batch
		}
	}()
}

// Publish publishes msgs to topic with PublishBatch and returns the errors
// of the messages that failed, joined; nil when RabbitMQ has every message.
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	return errors.Join(p.PublishBatch(topic, msgs)...)
}

// idleChannelsMax is how many confirm-mode channels PublishBatch keeps open
// between batches (the forwarder runs forwarder.MaxPublishesDefault batches
// at once).
const idleChannelsMax = 16

// confirmTimeout bounds the wait for a batch's confirms: a broker that
// neither confirms nor closes the channel fails the batch (the outbox
// delivers it again).
const confirmTimeout = 30 * time.Second

// PublishBatch publishes msgs to topic on one channel, in order, and then
// waits for their confirms. It returns nil when RabbitMQ confirmed every
// message, else one entry per message: nil for a confirmed one, the reason
// for the others (nacked, returned because no queue received it under
// LayoutQueue, not published because the channel closed, or not confirmed
// within 30 s). A returned message makes the next publish to topic declare
// its topology again.
func (p *Publisher) PublishBatch(topic string, msgs []*message.Message) []error {
	if len(msgs) == 0 {
		return nil
	}
	errs := make([]error, len(msgs))
	failed := false
	failRest := func(from int, err error) {
		for i := from; i < len(msgs); i++ {
			if errs[i] == nil {
				errs[i] = err
			}
		}
		failed = true
	}
	ch, err := p.channel()
	if err != nil {
		failRest(0, err)
		return errs
	}
	healthy := true
	defer func() { p.putChannel(ch, healthy) }()
	exchange := p.cfg.Exchange.GenerateName(topic)
	if err := p.declare(ch, topic, exchange); err != nil {
		healthy = false
		failRest(0, err)
		return errs
	}
	key := p.cfg.Publish.GenerateRoutingKey(topic)
	confirms := make([]*amqp091.DeferredConfirmation, len(msgs))
	for i, msg := range msgs {
		out, err := p.cfg.Marshaler.Marshal(msg)
		if err != nil {
			errs[i], failed = fmt.Errorf("amqpbackend: marshal message %s: %w", msg.UUID, err), true
			continue
		}
		confirms[i], err = ch.PublishWithDeferredConfirmWithContext(msg.Context(), exchange, key,
			p.cfg.Publish.Mandatory, p.cfg.Publish.Immediate, out)
		if err != nil {
			healthy = false
			failRest(i, fmt.Errorf("amqpbackend: publish to %q: %w", exchange, err))
			break
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), confirmTimeout)
	defer cancel()
	// RabbitMQ sends a message's basic.return before its basic.ack, and
	// amqp091's reader hands it to ch.returns (unbuffered) before it reads
	// the ack: a message returned is in returned once its confirm resolves.
	returned := map[string]string{} // message id -> RabbitMQ's reason
	returns := ch.returns
	wait := func(dc *amqp091.DeferredConfirmation) (bool, error) {
		for {
			select {
			case r, open := <-returns:
				if !open {
					returns = nil // the channel closed: its confirms resolve as nacks
					continue
				}
				returned[r.MessageId] = fmt.Sprintf("%d %s", r.ReplyCode, r.ReplyText)
			case <-dc.Done():
				return dc.Acked(), nil
			case <-ctx.Done():
				return false, ctx.Err()
			}
		}
	}
	for i, dc := range confirms {
		if dc == nil {
			continue
		}
		ok, err := wait(dc)
		switch {
		case err != nil:
			healthy = false
			errs[i], failed = fmt.Errorf("amqpbackend: message %s not confirmed by RabbitMQ within %s: %w", msgs[i].UUID, confirmTimeout, err), true
		case !ok:
			errs[i], failed = fmt.Errorf("amqpbackend: RabbitMQ nacked message %s (or closed the channel before confirming it)", msgs[i].UUID), true
		}
	}
	if len(returned) > 0 {
		for i, msg := range msgs {
			if reason, ok := returned[msg.UUID]; ok && errs[i] == nil {
				errs[i], failed = fmt.Errorf("amqpbackend: RabbitMQ returned message %s: no queue received it from exchange %q with routing key %q (%s); the topic's topology is declared again before the next publish", msg.UUID, exchange, key, reason), true
			}
		}
		p.mu.Lock()
		delete(p.declared, topic)
		p.mu.Unlock()
	}
	if ch.IsClosed() {
		healthy = false
	}
	if !failed {
		return nil
	}
	return errs
}

// channel returns an idle confirm-mode channel or opens one, dialing when
// the connection is missing or closed.
func (p *Publisher) channel() (confirmChannel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return confirmChannel{}, errors.New("amqpbackend: publisher closed")
	}
	for len(p.idle) > 0 {
		ch := p.idle[len(p.idle)-1]
		p.idle = p.idle[:len(p.idle)-1]
		if !ch.IsClosed() {
			return ch, nil
		}
	}
	if p.conn == nil || p.conn.IsClosed() {
		conn, err := amqp091.DialConfig(p.url, amqp091.Config{Properties: amqp091.Table{"connection_name": "watermill-outbox batch publisher"}})
		if err != nil {
			return confirmChannel{}, fmt.Errorf("amqpbackend: connect: %w", redactURL(err, p.url))
		}
		p.conn = conn
		p.declared = map[string]bool{} // a new node may lack what the old one had
	}
	ch, err := p.conn.Channel()
	if err != nil {
		return confirmChannel{}, fmt.Errorf("amqpbackend: open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return confirmChannel{}, fmt.Errorf("amqpbackend: enable publisher confirms: %w", err)
	}
	return confirmChannel{Channel: ch, returns: ch.NotifyReturn(make(chan amqp091.Return))}, nil
}

// putChannel keeps a healthy channel for the next batch and closes the rest.
// A healthy channel has every confirm, and so every return, read.
func (p *Publisher) putChannel(ch confirmChannel, healthy bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if healthy && !p.closed && !ch.IsClosed() && len(p.idle) < idleChannelsMax {
		p.idle = append(p.idle, ch)
		return
	}
	if !healthy {
		ch.drainReturns()
	}
	_ = ch.Close()
}

// declare declares topic's topology once per connection, as watermill-amqp's
// Publish does before its first message to a topic.
func (p *Publisher) declare(ch confirmChannel, topic, exchange string) error {
	p.mu.Lock()
	done := p.declared[topic]
	p.mu.Unlock()
	if done || exchange == "" {
		return nil
	}
	if err := p.cfg.TopologyBuilder.ExchangeDeclare(ch.Channel, exchange, p.cfg); err != nil {
		return fmt.Errorf("amqpbackend: topic %q: %w", topic, err)
	}
	p.mu.Lock()
	p.declared[topic] = true
	p.mu.Unlock()
	return nil
}

// Close closes the batch channels and connection and watermill-amqp's
// publisher. It is idempotent.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	for _, ch := range p.idle {
		_ = ch.Close()
	}
	p.idle = nil
	conn := p.conn
	p.mu.Unlock()
	var err error
	if conn != nil && !conn.IsClosed() {
		err = conn.Close()
	}
	return errors.Join(err, p.Publisher.Close())
}

// redactURL replaces the URL's password in err's text, which amqp091 and
// url.Parse may include (no secrets in logs), also when the URL does not
// parse (redact.WithoutURLPassword finds the password by hand).
func redactURL(err error, raw string) error {
	msg := err.Error()
	if red := redact.WithoutURLPassword(msg, raw); red != msg {
		return errors.New(red)
	}
	return err
}

// queueDeclaringTopology declares, with each exchange, the queue of the same
// name and its binding; the default builder declares queues only when a
// consumer subscribes.
type queueDeclaringTopology struct{ *amqp.DefaultTopologyBuilder }

func (b queueDeclaringTopology) ExchangeDeclare(ch *amqp091.Channel, exchange string, c amqp.Config) error {
	if err := b.DefaultTopologyBuilder.ExchangeDeclare(ch, exchange, c); err != nil {
		return fmt.Errorf("declare exchange %q: %w", exchange, err)
	}
	queue := c.Queue.GenerateName(exchange)
	if _, err := ch.QueueDeclare(queue, c.Queue.Durable, c.Queue.AutoDelete, c.Queue.Exclusive, c.Queue.NoWait, c.Queue.Arguments); err != nil {
		return fmt.Errorf("declare queue %q: %w", queue, err)
	}
	if err := ch.QueueBind(queue, c.QueueBind.GenerateRoutingKey(exchange), exchange, c.QueueBind.NoWait, c.QueueBind.Arguments); err != nil {
		return fmt.Errorf("bind queue %q: %w", queue, err)
	}
	return nil
}

// exchangeOnlyTopology declares the exchange and nothing else: consumers
// bind their own queues.
type exchangeOnlyTopology struct{}

func (exchangeOnlyTopology) ExchangeDeclare(ch *amqp091.Channel, exchange string, c amqp.Config) error {
	if err := ch.ExchangeDeclare(exchange, c.Exchange.Type, c.Exchange.Durable, c.Exchange.AutoDeleted,
		c.Exchange.Internal, c.Exchange.NoWait, c.Exchange.Arguments); err != nil {
		return fmt.Errorf("declare exchange %q: %w", exchange, err)
	}
	return nil
}

func (exchangeOnlyTopology) BuildTopology(*amqp091.Channel, amqp.BuildTopologyParams, amqp.Config, watermill.LoggerAdapter) error {
	return errors.New("amqpbackend: the fanout layout publishes only; consumers declare and bind their own queues")
}
