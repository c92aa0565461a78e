// Package kafkabackend is the relay's Kafka publisher: watermill-kafka
// (Sarama) configured for an outbox. It lives apart from package router so
// that programs that do not relay to Kafka do not link Sarama.
package kafkabackend

import (
	"errors"
	"fmt"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/router"
)

// PublisherConfig is the watermill-kafka publisher configuration the relay
// uses: acks from all in-sync replicas, an idempotent producer with one
// request in flight (so a key's messages reach the broker in order), and the
// record key taken from router.MetadataPartitionKey (else the message UUID,
// which is the event_id). Every metadata entry becomes a Kafka header.
func PublisherConfig(brokers []string) kafka.PublisherConfig {
	sc := kafka.DefaultSaramaSyncPublisherConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Producer.RequiredAcks = sarama.WaitForAll
	sc.Producer.Idempotent = true
	sc.Net.MaxOpenRequests = 1
	sc.Producer.Retry.Max = 10
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

// NewPublisher returns a Kafka publisher with PublisherConfig.
func NewPublisher(brokers []string, logger watermill.LoggerAdapter) (message.Publisher, error) {
	if len(brokers) == 0 {
		return nil, errors.New("kafkabackend: no brokers; set OUTBOX_KAFKA_BROKERS (host:port,...)")
	}
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	pub, err := kafka.NewPublisher(PublisherConfig(brokers), logger)
	if err != nil {
		return nil, fmt.Errorf("kafkabackend: %w", err)
	}
	return pub, nil
}
