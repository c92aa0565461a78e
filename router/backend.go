package router

import (
	"errors"
	"fmt"
	"strings"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// Backend kinds (OUTBOX_BACKEND).
const (
	BackendKafka     = "kafka"
	BackendAMQP      = "amqp"
	BackendGoChannel = "gochannel"
)

// MetadataPartitionKey is the metadata entry the forwarder sets to the
// chosen partition key; the Kafka backend uses it as the record key.
const MetadataPartitionKey = "partition_key"

// AMQPChannelPoolSizeDefault is the default AMQP publisher channel pool: one
// channel per message the subscriber keeps in flight by default (2 x
// BatchSize). Without a pool, publishing with confirms is about 30x slower.
const AMQPChannelPoolSizeDefault = 200

// BackendConfig selects and configures the publisher outbox rows go to.
type BackendConfig struct {
	// Kind is kafka, amqp or gochannel. Required.
	Kind string
	// KafkaBrokers are the Kafka bootstrap addresses (kafka).
	KafkaBrokers []string
	// AMQPURL is the AMQP URI (amqp).
	AMQPURL string
	// AMQPChannelPoolSize is the AMQP publisher's channel pool. Defaults to 200.
	AMQPChannelPoolSize int
	// InProcess is the in-process pub/sub consumers subscribe to
	// (gochannel). Defaults to a new one, which only helps if the caller
	// keeps it: pass your own.
	InProcess *InProcess
}

// NewPublisher builds the publisher of cfg.Kind. Kafka waits for all
// in-sync replicas and is idempotent; AMQP uses durable queues named by
// topic, publisher confirms and a channel pool; gochannel is InProcess.
func NewPublisher(cfg BackendConfig, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	switch cfg.Kind {
	case BackendKafka:
		if len(cfg.KafkaBrokers) == 0 {
			return nil, errors.New("kafka backend: no brokers; set OUTBOX_KAFKA_BROKERS (host:port,...)")
		}
		pub, err := kafka.NewPublisher(KafkaPublisherConfig(cfg.KafkaBrokers), logger)
		if err != nil {
			return nil, fmt.Errorf("kafka backend: %w", err)
		}
		return pub, nil
	case BackendAMQP:
		if cfg.AMQPURL == "" {
			return nil, errors.New("amqp backend: no URL; set OUTBOX_AMQP_URL (amqp://user:pass@host:5672/)")
		}
		pub, err := amqp.NewPublisher(AMQPConfig(cfg.AMQPURL, cfg.AMQPChannelPoolSize), logger)
		if err != nil {
			return nil, fmt.Errorf("amqp backend: %w", err)
		}
		return pub, nil
	case BackendGoChannel:
		if cfg.InProcess == nil {
			cfg.InProcess = NewInProcess()
		}
		return cfg.InProcess, nil
	default:
		return nil, fmt.Errorf("unknown backend %q; use %s, %s or %s", cfg.Kind, BackendKafka, BackendAMQP, BackendGoChannel)
	}
}

// KafkaPublisherConfig is the watermill-kafka publisher configuration the
// relay uses: acks from all in-sync replicas, an idempotent producer, and the
// record key taken from MetadataPartitionKey (else the message UUID, which is
// the event_id). Every metadata entry becomes a Kafka header.
func KafkaPublisherConfig(brokers []string) kafka.PublisherConfig {
	sc := kafka.DefaultSaramaSyncPublisherConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = 10
	return kafka.PublisherConfig{
		Brokers:               brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(KafkaPartitionKey),
		OverwriteSaramaConfig: sc,
	}
}

// KafkaPartitionKey returns the record key of msg: its MetadataPartitionKey,
// or its UUID (the event_id).
func KafkaPartitionKey(_ string, msg *message.Message) (string, error) {
	if k := msg.Metadata.Get(MetadataPartitionKey); k != "" {
		return k, nil
	}
	return msg.UUID, nil
}

// AMQPConfig is the watermill-amqp configuration the relay (and its
// consumers) use: per topic a durable direct exchange and a durable queue of
// the same name bound to it, persistent messages, publisher confirms and a
// channel pool. The publisher declares the queue before its first publish to
// a topic, so a message confirmed by RabbitMQ is stored in a queue even when
// no consumer has subscribed yet: the outbox never marks published a message
// the broker dropped as unroutable.
func AMQPConfig(url string, poolSize int) amqp.Config {
	if poolSize == 0 {
		poolSize = AMQPChannelPoolSizeDefault
	}
	byTopic := func(topic string) string { return topic }
	c := amqp.NewDurableQueueConfig(url)
	c.Exchange = amqp.ExchangeConfig{GenerateName: byTopic, Type: "direct", Durable: true}
	c.Publish.GenerateRoutingKey = byTopic
	c.QueueBind.GenerateRoutingKey = byTopic
	c.TopologyBuilder = queueDeclaringTopology{&amqp.DefaultTopologyBuilder{}}
	c.Publish.ConfirmDelivery = true
	c.Publish.ChannelPoolSize = poolSize
	return c
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

// ParseBrokers splits a comma-separated broker list.
func ParseBrokers(s string) []string {
	var out []string
	for _, b := range strings.Split(s, ",") {
		if b = strings.TrimSpace(b); b != "" {
			out = append(out, b)
		}
	}
	return out
}
