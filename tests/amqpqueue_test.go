package tests

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestRelayToRabbitMQAfterQueueDeleted: under the queue layout, once the
// topic's queue is deleted (by an operator, or an expiry policy) while the
// relay runs, the events enqueued afterwards are not marked published on a
// confirm into nothing: their publish fails, the rows are retried, the
// retry declares the queue again, and every event is in the queue once its
// row is marked published.
func TestRelayToRabbitMQAfterQueueDeleted(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	pub, err := amqpbackend.NewPublisher(amqpbackend.Config{URL: amqpURL}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("RabbitMQ at %s is required (run `make up`): %v", amqpURL, err)
	}
	defer pub.Close()
	conn, err := amqp091.Dial(amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	topic := "e2e" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".queue.deleted.v1"
	defer func() {
		_, _ = ch.QueueDelete(topic, false, false, false)
		_ = ch.ExchangeDelete(topic, false, false)
	}()
	startRelay(t, pool, tbl, pub, subscriber.Config{Backoff: func(int) time.Duration { return 20 * time.Millisecond }})

	first := enqueueTraced(t, pool, tbl, topic, 1)
	waitAllPublished(t, pool, tbl, len(first))
	if _, err := ch.QueueDelete(topic, false, false, false); err != nil {
		t.Fatal(err)
	}
	later := enqueueTraced(t, pool, tbl, topic, 10)
	waitAllPublished(t, pool, tbl, len(first)+len(later))

	var retried int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE attempts > 1`).Scan(&retried); err != nil {
		t.Fatal(err)
	}
	if retried == 0 {
		t.Error("no row was retried after the queue was deleted")
	}
	for len(later) > 0 {
		m, ok, err := ch.Get(topic, true)
		if err != nil {
			t.Fatalf("the topic's queue, %d published events not in it: %v", len(later), err)
		}
		if !ok {
			t.Fatalf("%d events marked published are in no queue", len(later))
		}
		if _, want := later[m.MessageId]; !want {
			t.Fatalf("unexpected or repeated message %s", m.MessageId)
		}
		delete(later, m.MessageId)
	}
}
