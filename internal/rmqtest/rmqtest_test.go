package rmqtest_test

import (
	"testing"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/watermill-outbox/internal/rmqtest"
)

// TestStopStart: a private node accepts AMQP connections, stops, starts
// again on the same port with its durable queue kept.
func TestStopStart(t *testing.T) {
	n := rmqtest.Start(t)
	declare := func(passive bool) {
		t.Helper()
		conn, err := amqp091.Dial(n.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if passive {
			_, err = ch.QueueDeclarePassive("rmqtest", true, false, false, false, nil)
		} else {
			_, err = ch.QueueDeclare("rmqtest", true, false, false, false, nil)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	declare(false)
	n.Stop()
	if _, err := amqp091.Dial(n.URL()); err == nil {
		t.Fatal("the stopped node accepts connections")
	}
	n.Start()
	declare(true)
}
