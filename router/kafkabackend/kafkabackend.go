// Package kafkabackend is the relay's Kafka publisher: watermill-kafka
// (Sarama) configured for an outbox. It lives apart from package router so
// that programs that do not relay to Kafka do not link Sarama.
package kafkabackend

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/router"
)

// MaxMessageBytes is the relay producer's Producer.MaxMessageBytes: Kafka's
// default message.max.bytes (1,048,588), which bounds a record batch, less
// the batch's 61 bytes of framing, so that a batch Sarama fills up to it is
// one the broker takes. publisher.DefaultMaxPayloadBytes (1,000,000) leaves
// the rest for the relay's metadata headers, the key and the record framing.
const MaxMessageBytes = 1_048_588 - 61

// PublisherConfig is the watermill-kafka publisher configuration the relay
// uses: acks from all in-sync replicas, an idempotent producer with one
// request in flight (so a key's messages reach the broker in order), records
// of at most MaxMessageBytes, and the record key taken from
// router.MetadataPartitionKey (else the message UUID, which is the
// event_id). Every metadata entry becomes a Kafka header.
func PublisherConfig(brokers []string) kafka.PublisherConfig {
	sc := kafka.DefaultSaramaSyncPublisherConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = 10
	sc.Producer.MaxMessageBytes = MaxMessageBytes
	return kafka.PublisherConfig{
		Brokers:               brokers,
		Marshaler:             kafka.NewWithPartitioningMarshaler(PartitionKey),
		OverwriteSaramaConfig: sc,
	}
}

// PartitionKey returns the record key of msg: its router.MetadataPartitionKey,
// or its UUID (the event_id).
func PartitionKey(_ string, msg *message.Message) (string, error) {
	if k := msg.Metadata.Get(router.MetadataPartitionKey); k != "" {
		return k, nil
	}
	return msg.UUID, nil
}

// NewPublisher returns a Kafka publisher with PublisherConfig: a *Publisher,
// which hands every message of a Publish call to Sarama at once.
func NewPublisher(brokers []string, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kafkabackend: no brokers; set OUTBOX_KAFKA_BROKERS (host:port,...)")
	}
	_ = logger // Sarama logs through its own sarama.Logger
	cfg := PublisherConfig(brokers)
	producer, err := sarama.NewSyncProducer(cfg.Brokers, cfg.OverwriteSaramaConfig)
	if err != nil {
		return nil, fmt.Errorf("kafkabackend: cannot create Kafka producer: %w", err)
	}
	return &Publisher{producer: producer, marshaler: cfg.Marshaler}, nil
}

// Publisher publishes to Kafka like watermill-kafka's publisher (same
// Sarama configuration, marshaler and headers), except that a call with many
// messages hands them all to Sarama at once (SyncProducer.SendMessages) and
// waits for them together: Sarama packs them into as few produce requests as
// the partitions allow, where watermill-kafka waits for each message's
// acknowledgement before sending the next. Messages of one call and one
// partition key keep their order. It implements forwarder.BatchPublisher,
// reporting each message's outcome, so the forwarder acks and nacks them
// one by one.
type Publisher struct {
	producer  sarama.SyncProducer
	marshaler kafka.Marshaler
	closeOnce sync.Once
	closed    atomic.Bool
	closeErr  error
}

// Publish publishes msgs to topic and returns once Kafka acknowledged all
// of them; the error names the messages that failed (the others are
// published).
func (p *Publisher) Publish(topic string, msgs ...*message.Message) error {
	errs := p.PublishBatch(topic, msgs)
	if errs == nil {
		return nil
	}
	var failed []error
	for i, err := range errs {
		if err != nil {
			failed = append(failed, fmt.Errorf("message %s: %w", msgs[i].UUID, err))
		}
	}
	return fmt.Errorf("kafkabackend: %d of %d messages not published: %w", len(failed), len(msgs), errors.Join(failed...))
}

// PublishBatch publishes msgs to topic in one SendMessages call and returns
// nil when Kafka acknowledged every message, else one error (or nil) per
// message.
func (p *Publisher) PublishBatch(topic string, msgs []*message.Message) []error {
	if p.closed.Load() {
		return fillErr(len(msgs), errors.New("kafkabackend: publisher closed"))
	}
	var (
		errs  []error
		pms   = make([]*sarama.ProducerMessage, 0, len(msgs))
		index = make(map[*sarama.ProducerMessage]int, len(msgs))
	)
	for i, m := range msgs {
		pm, err := p.marshaler.Marshal(topic, m)
		if err != nil {
			if errs == nil {
				errs = make([]error, len(msgs))
			}
			errs[i] = fmt.Errorf("cannot marshal message %s: %w", m.UUID, err)
			continue
		}
		index[pm] = i
		pms = append(pms, pm)
	}
	if len(pms) == 0 {
		return errs
	}
	err := p.producer.SendMessages(pms)
	if err == nil {
		return errs
	}
	if errs == nil {
		errs = make([]error, len(msgs))
	}
	var perrs sarama.ProducerErrors
	if !errors.As(err, &perrs) {
		for _, i := range index {
			errs[i] = err
		}
		return errs
	}
	for _, pe := range perrs {
		if i, ok := index[pe.Msg]; ok {
			errs[i] = pe.Err
		}
	}
	return errs
}

// Close closes the producer, after the messages under way. It is idempotent.
func (p *Publisher) Close() error {
	p.closeOnce.Do(func() {
		p.closed.Store(true)
		if err := p.producer.Close(); err != nil {
			p.closeErr = fmt.Errorf("kafkabackend: cannot close Kafka producer: %w", err)
		}
	})
	return p.closeErr
}

func fillErr(n int, err error) []error {
	errs := make([]error, n)
	for i := range errs {
		errs[i] = err
	}
	return errs
}
