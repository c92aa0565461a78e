package router_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestInProcessDispatchContract is the in-process dispatch contract on the
// in-process backend: no subscriber is an error, a handler error or panic is
// the publisher's error, success needs every subscriber's ack.
func TestInProcessDispatchContract(t *testing.T) {
	t.Parallel()
	bus := router.NewInProcess()
	defer bus.Close()
	msg := func() *message.Message { return message.NewMessage(watermill.NewUUID(), []byte(`{}`)) }

	if err := bus.Publish("nobody.listens.v1", msg()); !errors.Is(err, router.ErrNoSubscribers) || !subscriber.IsPermanent(err) {
		t.Fatalf("publish without subscribers: %v, want a permanent ErrNoSubscribers", err)
	}

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(subscriber.CaptureError, middleware.Recoverer)
	r.AddConsumerHandler("ok", "ok.v1", bus, func(*message.Message) error { return nil })
	r.AddConsumerHandler("ok2", "ok.v1", bus, func(*message.Message) error { return nil })
	r.AddConsumerHandler("fails", "fails.v1", bus, func(*message.Message) error { return errors.New("projection store down") })
	r.AddConsumerHandler("panics", "panics.v1", bus, func(*message.Message) error { panic("nil map write") })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = r.Run(ctx) }()
	<-r.Running()
	defer r.Close()

	if err := bus.Publish("ok.v1", msg(), msg()); err != nil {
		t.Fatalf("publish to two acking subscribers: %v", err)
	}
	if err := bus.Publish("fails.v1", msg()); err == nil || !strings.Contains(err.Error(), "projection store down") {
		t.Fatalf("handler error: %v", err)
	}
	if err := bus.Publish("panics.v1", msg()); err == nil || !strings.Contains(err.Error(), "nil map write") {
		t.Fatalf("handler panic: %v", err)
	}
	slow := router.NewInProcess()
	slow.AckTimeout = 100 * time.Millisecond
	defer slow.Close()
	ch, _ := slow.Subscribe(ctx, "slow.v1")
	go func() { <-ch }() // takes the message, never answers
	if err := slow.Publish("slow.v1", msg()); err == nil || !strings.Contains(err.Error(), "did not ack") {
		t.Fatalf("unanswered message: %v", err)
	}
	_ = bus.Close()
	if err := bus.Publish("ok.v1", msg()); !errors.Is(err, router.ErrInProcessClosed) {
		t.Fatalf("publish after close: %v", err)
	}
}

// TestMiddlewaresPoisonCopyAndRetry: the poison copy is published only for
// failures that make the row dead; the in-process retry skips permanent
// errors.
func TestMiddlewaresPoisonCopyAndRetry(t *testing.T) {
	t.Parallel()
	poison := router.NewInProcess()
	defer poison.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	copies, _ := poison.Subscribe(ctx, "outbox.poison.v1")
	got := make(chan *message.Message, 10)
	go func() {
		for m := range copies {
			got <- m
			m.Ack()
		}
	}()
	calls := 0
	h := func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, errors.New("broker unavailable")
	}
	stack := router.MustMiddlewares(router.MiddlewareConfig{
		DispatchTimeout: time.Second, MaxAttempts: 3, PoisonPublisher: poison, PoisonTopic: "outbox.poison.v1",
		Retry: &middleware.Retry{MaxRetries: 2, InitialInterval: time.Millisecond},
	})
	handler := message.HandlerFunc(h)
	for i := len(stack) - 1; i >= 0; i-- {
		handler = stack[i](handler)
	}
	m := message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set("attempts", "1")
	if _, err := handler(m); err == nil || calls != 3 {
		t.Fatalf("transient error: err %v after %d calls, want 3 (1 + 2 retries)", err, calls)
	}
	select {
	case c := <-got:
		t.Fatalf("poison copy for a row that is not dead: %s", c.UUID)
	case <-time.After(100 * time.Millisecond):
	}
	m = message.NewMessage(watermill.NewUUID(), []byte(`{}`)) // each delivery is a fresh message
	m.Metadata.Set("attempts", "3")
	calls = 0
	if _, err := handler(m); err == nil {
		t.Fatal("last attempt succeeded")
	}
	select {
	case c := <-got:
		if c.UUID != m.UUID || !strings.Contains(c.Metadata.Get(router.MetadataPoisonReason), "broker unavailable") {
			t.Fatalf("poison copy %s %v", c.UUID, c.Metadata)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("no poison copy for the last attempt")
	}
	calls = 0
	perm := message.HandlerFunc(func(*message.Message) ([]*message.Message, error) {
		calls++
		return nil, subscriber.Permanent(errors.New("no route"))
	})
	for i := len(stack) - 1; i >= 0; i-- {
		perm = stack[i](perm)
	}
	m = message.NewMessage(watermill.NewUUID(), []byte(`{}`))
	m.Metadata.Set("attempts", "1")
	if _, err := perm(m); !subscriber.IsPermanent(err) || calls != 1 {
		t.Fatalf("permanent error: %v after %d calls, want 1 call", err, calls)
	}
	select {
	case <-got:
	case <-time.After(2 * time.Second):
		t.Fatal("no poison copy for a permanent error")
	}
}
