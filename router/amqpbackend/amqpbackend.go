// Package amqpbackend is the relay's AMQP (RabbitMQ) publisher:
// watermill-amqp configured for an outbox, with two layouts. It lives apart
// from package router so that programs that do not relay to AMQP do not link
// the AMQP client.
//
// LayoutQueue (the default) declares, per topic, a durable direct exchange
// and a durable queue, both named after the topic, bound with the topic as
// routing key, before the first publish: a message RabbitMQ confirms is stored
// even when no consumer runs yet. Consumers of one topic share that queue and
// compete for its messages: it suits one consuming service per topic.
//
// LayoutFanout declares only exchanges and never a queue: per topic a
// durable fanout exchange named after the topic or, with Config.Exchange set,
// one durable topic exchange to which every message goes with its topic as
// routing key. Each consuming service declares and binds its own queue and
// gets its own copy. RabbitMQ drops a message that no queue is bound for and
// still confirms it, so bind the queues before the events flow.
package amqpbackend

import (
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
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

// invalidField renders a configuration error: "amqpbackend: invalid config:
// <field>: <what is wrong; what to do>".
func invalidField(field, format string, args ...any) error {
	return fmt.Errorf("amqpbackend: invalid config: "+field+": "+format, args...)
}

// WatermillConfig is the watermill-amqp configuration of c: persistent
// messages with MessageId = event_id and ContentType application/json,
// publisher confirms, a channel pool, and the exchanges (and, with
// LayoutQueue, queues) of c's layout. With LayoutQueue a watermill-amqp
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

// NewPublisher validates c and returns its publisher.
func NewPublisher(c Config, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	pub, err := amqp.NewPublisher(WatermillConfig(c), logger)
	if err != nil {
		return nil, fmt.Errorf("amqpbackend: %w", err)
	}
	return pub, nil
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
