package kafkabackend_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// Sarama's metrics library starts one process-wide meter ticker on
		// first use and never stops it; it is not a per-client goroutine.
		goleak.IgnoreTopFunction("github.com/rcrowley/go-metrics.(*meterArbiter).tick"),
	)
}

// TestPublishBatchPerMessage: one PublishBatch call reports each message's
// outcome: a message Sarama refuses (larger than Producer.MaxMessageBytes)
// fails alone, the others of the call reach the broker, in order, with
// their partition key as record key; Publish of the same messages names
// the one that failed.
func TestPublishBatchPerMessage(t *testing.T) {
	cluster, err := kafkatest.Start(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	mp, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	pub, ok := mp.(*kafkabackend.Publisher)
	if !ok {
		t.Fatalf("NewPublisher returned %T, want *kafkabackend.Publisher", mp)
	}
	const topic = "org.batch.v1"
	msg := func(id, payload string) *message.Message {
		m := message.NewMessage(id, []byte(payload))
		m.Metadata.Set(router.MetadataPartitionKey, "org-1")
		return m
	}
	huge := `"` + strings.Repeat("x", 2_000_000) + `"`
	msgs := []*message.Message{msg("a", `{"n":1}`), msg("too-big", huge), msg("b", `{"n":2}`)}
	errs := pub.PublishBatch(topic, msgs)
	if len(errs) != 3 || errs[0] != nil || errs[1] == nil || errs[2] != nil {
		t.Fatalf("PublishBatch: %v, want only the second message failed", errs)
	}
	if errs := pub.PublishBatch(topic, []*message.Message{msg("c", `{"n":3}`)}); errs != nil {
		t.Fatalf("PublishBatch of one good message: %v", errs)
	}
	err = pub.Publish(topic, msg("d", `{"n":4}`), msg("too-big-2", huge))
	if err == nil || !strings.Contains(err.Error(), "1 of 2 messages") || !strings.Contains(err.Error(), "too-big-2") {
		t.Fatalf("Publish with one oversized message: %v", err)
	}

	sub, err := cluster.NewSubscriber("batch", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for len(got) < 4 {
		select {
		case m := <-ch:
			got = append(got, m.UUID)
			m.Ack()
		case <-ctx.Done():
			t.Fatalf("received %v, want a, b, c, d", got)
		}
	}
	if strings.Join(got, ",") != "a,b,c,d" {
		t.Fatalf("received %v, want a, b, c, d in order", got)
	}
	select {
	case m := <-ch:
		t.Fatalf("unexpected message %s", m.UUID)
	case <-time.After(300 * time.Millisecond):
	}
	if err := pub.Close(); err != nil {
		t.Fatal(err)
	}
	if errs := pub.PublishBatch(topic, msgs[:1]); len(errs) != 1 || errs[0] == nil {
		t.Fatalf("PublishBatch after Close: %v", errs)
	}
}
