package tests

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestKafkaRecordKeyWithStockPublisher: the README's rule for the Kafka
// record key, with watermill-kafka's own publisher. With
// kafka.NewWithPartitioningMarshaler(kafkabackend.PartitionKey) the
// forwarder's rows arrive keyed by event_id; with the DefaultMarshaler
// they arrive without a key (the event_id is still the UUID and a header).
func TestKafkaRecordKeyWithStockPublisher(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		marshaler kafka.MarshalerUnmarshaler
		keyed     bool
	}{
		{"PartitioningMarshaler", kafka.NewWithPartitioningMarshaler(kafkabackend.PartitionKey), true},
		{"DefaultMarshaler", kafka.DefaultMarshaler{}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t)
			tbl := testdb.Table(t, "key_outbox", schema.WithAllColumns())
			cluster, err := kafkatest.Start(3, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer cluster.Close()
			pub, err := kafka.NewPublisher(kafka.PublisherConfig{Brokers: cluster.Brokers(), Marshaler: tc.marshaler}, watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			defer pub.Close()
			const topic = "org.organization.keyed.v1"
			want := enqueueTraced(t, pool, tbl, topic, 5)
			startRelay(t, pool, tbl, pub, subscriber.Config{})
			waitAllPublished(t, pool, tbl, len(want))
			sub, err := cluster.NewSubscriber("", watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Close()
			receiveAll(t, sub, topic, tbl, want, func(got *message.Message) {
				key, _ := kafka.MessageKeyFromCtx(got.Context())
				if tc.keyed && string(key) != got.UUID {
					t.Errorf("record key %q, want the event_id %s", key, got.UUID)
				}
				if !tc.keyed && len(key) != 0 {
					t.Errorf("record key %q, want none from the DefaultMarshaler", key)
				}
				if got.Metadata.Get(schema.MetadataEventID) != got.UUID {
					t.Errorf("event_id header %q, want %s", got.Metadata.Get(schema.MetadataEventID), got.UUID)
				}
			})
		})
	}
}
