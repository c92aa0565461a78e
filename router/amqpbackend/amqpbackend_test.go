package amqpbackend_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
)

func amqpURL() string {
	if u := os.Getenv("TEST_AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

func unique(prefix string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return prefix + "." + hex.EncodeToString(b[:]) + ".v1"
}

// channel opens a raw amqp091 channel, as a non-Go consumer would use the
// broker, and deletes what the test declared when it ends.
func channel(t *testing.T, exchanges, queues *[]string) *amqp091.Channel {
	t.Helper()
	conn, err := amqp091.Dial(amqpURL())
	if err != nil {
		t.Fatalf("RabbitMQ at %s is required: %v", amqpURL(), err)
	}
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range *queues {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
		for _, e := range *exchanges {
			_ = ch.ExchangeDelete(e, false, false)
		}
		_ = conn.Close()
	})
	return ch
}

func bindQueue(t *testing.T, ch *amqp091.Channel, queue, exchange, key string) <-chan amqp091.Delivery {
	t.Helper()
	if _, err := ch.QueueDeclare(queue, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := ch.QueueBind(queue, key, exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	d, err := ch.Consume(queue, "", true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func receive(t *testing.T, d <-chan amqp091.Delivery, who string) amqp091.Delivery {
	t.Helper()
	select {
	case m := <-d:
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("%s got nothing", who)
	}
	return amqp091.Delivery{}
}

func publish(t *testing.T, cfg amqpbackend.Config, topic string) *message.Message {
	t.Helper()
	pub, err := amqpbackend.NewPublisher(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	msg := message.NewMessage("6f1c7a57-1d5b-4a35-9b0b-2d9c1f2b8e01", []byte(`{"id":1}`))
	msg.Metadata.Set("event_id", msg.UUID)
	msg.Metadata.Set("tenant_id", "11111111-1111-1111-1111-111111111111")
	msg.Metadata.Set("topic", topic)
	if err := pub.Publish(topic, msg); err != nil {
		t.Fatal(err)
	}
	return msg
}

// TestFanoutEveryConsumerGetsACopy: with the fanout layout, two services
// that bind their own queues to the topic's exchange each get every event,
// and the relay declares no queue.
func TestFanoutEveryConsumerGetsACopy(t *testing.T) {
	t.Parallel()
	topic := unique("org.fanout")
	exchanges, queues := []string{topic}, []string{topic + ".billing", topic + ".search"}
	ch := channel(t, &exchanges, &queues)
	// Consumers come first: RabbitMQ drops what no queue is bound for.
	if err := ch.ExchangeDeclare(topic, "fanout", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	billing := bindQueue(t, ch, topic+".billing", topic, "")
	search := bindQueue(t, ch, topic+".search", topic, "")

	msg := publish(t, amqpbackend.Config{URL: amqpURL(), Layout: amqpbackend.LayoutFanout}, topic)
	for who, d := range map[string]<-chan amqp091.Delivery{"billing": billing, "search": search} {
		m := receive(t, d, who)
		if string(m.Body) != `{"id":1}` || m.MessageId != msg.UUID || m.ContentType != "application/json" ||
			m.Headers["event_id"] != msg.UUID || m.Headers["tenant_id"] != "11111111-1111-1111-1111-111111111111" ||
			m.Headers["topic"] != topic || m.DeliveryMode != amqp091.Persistent {
			t.Fatalf("%s got body %q, message id %q, content type %q, headers %v, delivery mode %d", who, m.Body, m.MessageId, m.ContentType, m.Headers, m.DeliveryMode)
		}
	}
	// No queue named after the topic was declared by the relay.
	if _, err := ch.QueueDeclarePassive(topic, true, false, false, false, nil); err == nil || !strings.Contains(err.Error(), "NOT_FOUND") {
		queues = append(queues, topic)
		t.Fatalf("the fanout layout declared queue %q (%v)", topic, err)
	}
}

// TestSharedTopicExchange: with Exchange set, every topic goes to one topic
// exchange with the topic as routing key; consumers bind by pattern.
func TestSharedTopicExchange(t *testing.T) {
	t.Parallel()
	topic := unique("org.shared")
	exchange := "outbox-test-" + strings.ReplaceAll(topic, ".", "-")
	exchanges, queues := []string{exchange}, []string{topic + ".all"}
	ch := channel(t, &exchanges, &queues)
	if err := ch.ExchangeDeclare(exchange, "topic", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	all := bindQueue(t, ch, topic+".all", exchange, "org.#")
	msg := publish(t, amqpbackend.Config{URL: amqpURL(), Layout: amqpbackend.LayoutFanout, Exchange: exchange}, topic)
	if m := receive(t, all, "pattern consumer"); m.RoutingKey != topic || m.MessageId != msg.UUID {
		t.Fatalf("routing key %q, message id %q", m.RoutingKey, m.MessageId)
	}
}

// TestQueueLayoutStoresBeforeAnyConsumer: the default layout declares the
// topic's queue before publishing, so an event confirmed before any consumer
// exists waits in it.
func TestQueueLayoutStoresBeforeAnyConsumer(t *testing.T) {
	t.Parallel()
	topic := unique("org.queue")
	exchanges, queues := []string{topic}, []string{topic}
	ch := channel(t, &exchanges, &queues)
	msg := publish(t, amqpbackend.Config{URL: amqpURL()}, topic)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for ctx.Err() == nil {
		m, ok, err := ch.Get(topic, true)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			if m.MessageId != msg.UUID || m.Headers["event_id"] != msg.UUID {
				t.Fatalf("stored message: id %q headers %v", m.MessageId, m.Headers)
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatal("the queue layout did not store the event")
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		cfg  amqpbackend.Config
		want string
	}{
		{amqpbackend.Config{}, "URL: empty; set OUTBOX_AMQP_URL"},
		{amqpbackend.Config{URL: "amqp://x", Layout: "mesh"}, `Layout: "mesh" is not a layout`},
		{amqpbackend.Config{URL: "amqp://x", Exchange: "events"}, "only LayoutFanout"},
		{amqpbackend.Config{URL: "amqp://x", ChannelPoolSize: -1}, "ChannelPoolSize: negative"},
	} {
		err := c.cfg.Validate()
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), "amqpbackend: invalid config: ") {
			t.Errorf("%+v: %v, want %q", c.cfg, err, c.want)
		}
	}
}

// TestBadURLShowsNoPassword: a URL that does not parse (a bad port, a bad
// escape in the vhost or the password, an unclosed [, a wrong scheme) is
// refused by Validate and NewPublisher, before any connection, with the
// field named and the password nowhere in the error.
func TestBadURLShowsNoPassword(t *testing.T) {
	t.Parallel()
	const pw = "Pa55-w0rd-secret"
	for _, raw := range []string{
		"amqp://guest:" + pw + "@127.0.0.1:notaport/",
		"amqp://guest:" + pw + "@127.0.0.1:5672/%zz",
		"amqp://guest:" + pw + "%zz@127.0.0.1:5672/",
		"amqp://guest:" + pw + "@[127.0.0.1:5672/",
		"amqq://guest:" + pw + "@127.0.0.1:5672/",
		"amqp://guest:" + pw + "/x@127.0.0.1:notaport/",
	} {
		for _, err := range []error{amqpbackend.Config{URL: raw}.Validate(), amqpbackend.CheckURL(raw), func() error {
			_, err := amqpbackend.NewPublisher(amqpbackend.Config{URL: raw}, nil)
			return err
		}()} {
			if err == nil || strings.Contains(err.Error(), pw) || strings.Contains(err.Error(), "w0rd") {
				t.Errorf("%s: %v, want an error without the password", strings.ReplaceAll(raw, pw, "***"), err)
			}
		}
		if err := (amqpbackend.Config{URL: raw}).Validate(); err != nil && !strings.Contains(err.Error(), "invalid config: URL: ") {
			t.Errorf("Validate does not name the URL field: %v", err)
		}
	}
}

// TestPublishBatch: a batch goes out on one channel and is confirmed as a
// whole: every message stored in the topic's queue, in order, with its
// event_id as MessageId. A batch RabbitMQ refuses (the topic's exchange
// exists with another type) fails every message with the reason, and the
// next batch, on a fresh channel, goes through.
func TestPublishBatch(t *testing.T) {
	t.Parallel()
	good, bad := unique("org.batch"), unique("org.batch.bad")
	exchanges, queues := []string{good, bad}, []string{good}
	ch := channel(t, &exchanges, &queues)
	if err := ch.ExchangeDeclare(bad, "fanout", true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	p, err := amqpbackend.NewPublisher(amqpbackend.Config{URL: amqpURL()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := p.(*amqpbackend.Publisher)
	defer func() {
		if err := pub.Close(); err != nil {
			t.Error(err)
		}
		if err := pub.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
	}()
	batch := func(n int) []*message.Message {
		msgs := make([]*message.Message, n)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), []byte(`{"n":`+strconv.Itoa(i)+`}`))
			msgs[i].Metadata.Set("event_id", msgs[i].UUID)
		}
		return msgs
	}

	refused := batch(5)
	errs := pub.PublishBatch(bad, refused)
	if len(errs) != len(refused) {
		t.Fatalf("a refused batch returned %d results for %d messages: %v", len(errs), len(refused), errs)
	}
	for i, err := range errs {
		if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), "PRECONDITION_FAILED") {
			t.Fatalf("message %d of a refused batch: %v (want the topic and RabbitMQ's reason)", i, err)
		}
	}

	const n = 300
	msgs := batch(n)
	if errs := pub.PublishBatch(good, msgs); errs != nil {
		t.Fatalf("PublishBatch: %v", errors.Join(errs...))
	}
	for i := 0; i < n; i++ {
		m, ok, err := ch.Get(good, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Fatalf("the queue holds %d of %d confirmed messages", i, n)
		}
		if m.MessageId != msgs[i].UUID || string(m.Body) != string(msgs[i].Payload) || m.DeliveryMode != amqp091.Persistent {
			t.Fatalf("message %d: id %q body %q delivery mode %d, want id %q body %q, persistent", i, m.MessageId, m.Body, m.DeliveryMode, msgs[i].UUID, msgs[i].Payload)
		}
	}
	if errs := pub.PublishBatch(good, nil); errs != nil {
		t.Fatalf("an empty batch: %v", errs)
	}
}

// TestQueueLayoutDeletedQueue: once the topic's queue is deleted (by an
// operator, or an expiry policy), a publish that no queue receives fails,
// by PublishBatch and by Publish, instead of being confirmed into nothing;
// the next publish declares the queue again and lands in it, so the row the
// relay retries is delivered.
func TestQueueLayoutDeletedQueue(t *testing.T) {
	t.Parallel()
	topic := unique("org.deleted")
	exchanges, queues := []string{topic}, []string{topic}
	ch := channel(t, &exchanges, &queues)
	p, err := amqpbackend.NewPublisher(amqpbackend.Config{URL: amqpURL()}, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub := p.(*amqpbackend.Publisher)
	defer pub.Close()
	newMsg := func() *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
		m.Metadata.Set("event_id", m.UUID)
		return m
	}
	get := func(want *message.Message) {
		t.Helper()
		m, ok, err := ch.Get(topic, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok || m.MessageId != want.UUID {
			t.Fatalf("the queue holds %q (ok %v), want %s", m.MessageId, ok, want.UUID)
		}
	}
	first := newMsg()
	if errs := pub.PublishBatch(topic, []*message.Message{first}); errs != nil {
		t.Fatal(errors.Join(errs...))
	}
	get(first)

	publishers := map[string]func(*message.Message) error{
		"PublishBatch": func(m *message.Message) error {
			if errs := pub.PublishBatch(topic, []*message.Message{m, newMsg()}); errs != nil {
				return errs[0]
			}
			return nil
		},
		"Publish": func(m *message.Message) error { return pub.Publish(topic, m) },
	}
	for _, name := range []string{"PublishBatch", "Publish"} {
		if _, err := ch.QueueDelete(topic, false, false, false); err != nil {
			t.Fatal(err)
		}
		lost := newMsg()
		err := publishers[name](lost)
		if err == nil || !strings.Contains(err.Error(), "no queue") {
			t.Fatalf("%s after the queue was deleted: %v, want an error saying no queue received the message", name, err)
		}
		if err := publishers[name](lost); err != nil {
			t.Fatalf("%s again (the relay's retry): %v", name, err)
		}
		get(lost)
		if _, err := ch.QueuePurge(topic, false); err != nil {
			t.Fatal(err)
		}
	}
}
