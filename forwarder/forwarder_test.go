package forwarder_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestForwarderConfigValidation: a bad Config is refused like a bad
// subscriber.Config, naming the field and the fix.
func TestForwarderConfigValidation(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_cfg_outbox")
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	pub := newGoChannel(t)
	bad := []struct {
		cfg  forwarder.Config
		want string
	}{
		{forwarder.Config{Middleware: []message.HandlerMiddleware{nil}}, "forwarder: invalid config: Middleware: "},
		{forwarder.Config{RouterConfig: message.RouterConfig{CloseTimeout: -time.Second}}, "forwarder: invalid config: RouterConfig.CloseTimeout: "},
		{forwarder.Config{HandlerName: "relay org"}, "forwarder: invalid config: HandlerName: "},
		{forwarder.Config{MessagingSystem: "Kafka Cluster"}, "forwarder: invalid config: MessagingSystem: "},
	}
	for _, b := range bad {
		if _, err := forwarder.New(sub, pub, b.cfg, nil); err == nil || !strings.Contains(err.Error(), b.want) {
			t.Errorf("New(%+v): %v, want %q", b.cfg, err, b.want)
		}
	}
	if _, err := forwarder.New(nil, pub, forwarder.Config{}, nil); err == nil || !strings.Contains(err.Error(), "forwarder: ") {
		t.Errorf("nil subscriber accepted: %v", err)
	}
	if _, err := forwarder.New(sub, nil, forwarder.Config{}, nil); err == nil || !strings.Contains(err.Error(), "forwarder: ") {
		t.Errorf("nil publisher accepted: %v", err)
	}
}

// TestForwarderZeroConfig: the zero Config relays a row to the topic named
// by its topic column, key = event_id, every metadata entry carried, payload
// untouched, and the row is acked. Run twice is an error; Close is
// idempotent.
func TestForwarderZeroConfig(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_zero_outbox", schema.WithAllColumns())
	pub := newGoChannel(t)
	out, err := pub.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	id := enqueueIn(t, tbl, producerSpan(t), `{"name":"acme"}`)
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, forwarder.Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	m := receive(t, out)
	if m.UUID != id.String() || string(m.Payload) != `{"name": "acme"}` || m.Metadata.Get(router.MetadataPartitionKey) != id.String() ||
		m.Metadata.Get(schema.MetadataEventID) != id.String() || m.Metadata.Get(schema.MetadataTopic) != topic ||
		m.Metadata.Get(schema.MetadataAttempts) != "1" || m.Metadata.Get(schema.MetadataTable) != tbl.String() {
		t.Fatalf("relayed %s %s %v", m.UUID, m.Payload, m.Metadata)
	}
	waitRow(t, tbl, id.String(), func(published, dead bool, _ int) bool { return published })
	<-f.Running()
	if err := f.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "forwarder: ") {
		t.Fatalf("second Run: %v", err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// flakyPublisher fails its first publish, then publishes.
type flakyPublisher struct {
	message.Publisher
	calls atomic.Int64
}

func (p *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	if p.calls.Add(1) == 1 {
		return errors.New("broker unavailable")
	}
	return p.Publisher.Publish(topic, msgs...)
}

// TestForwarderFailures: a publish error is a nack (the row is retried and
// then acked, never acked silently); no destination topic is a permanent
// error (the row is dead at once).
func TestForwarderFailures(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "fwd_fail_outbox", schema.WithAllColumns())
	gc := newGoChannel(t)
	pub := &flakyPublisher{Publisher: gc}
	retried := enqueueIn(t, tbl, producerSpan(t), `{"n":1}`)
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10 * time.Millisecond }}, watermill.NopLogger{})

	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, forwarder.Config{DestinationTopic: func(m *message.Message) (string, error) {
		if strings.Contains(string(m.Payload), "unroutable") {
			return "", errors.New("no route")
		}
		return m.Metadata.Get(schema.MetadataTopic), nil
	}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	defer func() {
		_ = f.Close()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	waitRow(t, tbl, retried.String(), func(published, _ bool, attempts int) bool { return published && attempts == 2 })
	dead := enqueueIn(t, tbl, producerSpan(t), `{"unroutable":true}`)
	waitRow(t, tbl, dead.String(), func(_, dead bool, attempts int) bool { return dead && attempts == 1 })
}

func waitRow(t *testing.T, tbl schema.Table, eventID string, ok func(published, dead bool, attempts int) bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var published, dead bool
		var attempts int
		if err := testdb.Pool(t).QueryRow(context.Background(), `SELECT published_at IS NOT NULL, dead_at IS NOT NULL, attempts FROM `+tbl.Sanitize()+` WHERE event_id = $1`, eventID).
			Scan(&published, &dead, &attempts); err != nil {
			t.Fatal(err)
		}
		if ok(published, dead, attempts) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("row %s: published %v dead %v attempts %d", eventID, published, dead, attempts)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
