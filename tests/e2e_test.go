package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

const amqpURL = "amqp://guest:guest@127.0.0.1:5672/"

// traced returns a context carrying a sampled span with a trace state.
func traced(t *testing.T) (context.Context, string) {
	t.Helper()
	tid := trace.TraceID(uuid.New())
	var sid trace.SpanID
	copy(sid[:], uuid.New().NodeID())
	sid[7] = 1
	ts, err := trace.ParseTraceState("vendor=outbox-test")
	if err != nil {
		t.Fatal(err)
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts})
	return trace.ContextWithSpanContext(context.Background(), sc), fmt.Sprintf("00-%s-%s-01", tid, sid)
}

type sent struct {
	msg    publisher.Message
	parent string
}

// enqueueTraced commits n events, each in its own transaction under its own
// trace, with a custom header.
func enqueueTraced(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic string, n int) map[string]sent {
	t.Helper()
	out := map[string]sent{}
	for i := range n {
		ctx, parent := traced(t)
		m := publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(),
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d,"name":"acme"}`, i)), Headers: map[string]string{"correlation_id": fmt.Sprintf("c-%d", i)}}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, tbl, m)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		out[m.EventID.String()] = sent{m, parent}
	}
	return out
}

// enqueueTracedInOneTx is enqueueTraced with the n messages committed in one
// transaction, each with its own trace.
func enqueueTracedInOneTx(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, topic string, n int) map[string]sent {
	t.Helper()
	out := map[string]sent{}
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	for i := range n {
		ctx, parent := traced(t)
		m := publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: uuid.New(),
			Payload: json.RawMessage(fmt.Sprintf(`{"n":%d,"name":"acme"}`, i)), Headers: map[string]string{"correlation_id": fmt.Sprintf("c-%d", i)}}
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
		out[m.EventID.String()] = sent{m, parent}
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	return out
}

// startRelay runs subscriber + forwarder (zero Config) from tbl to pub.
func startRelay(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, pub message.Publisher, cfg subscriber.Config) *forwarder.Forwarder {
	t.Helper()
	cfg.Table = tbl
	if cfg.PollInterval == 0 {
		cfg.PollInterval = 50 * time.Millisecond
	}
	sub, err := subscriber.New(context.Background(), pool, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, forwarder.Config{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	<-f.Running()
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("forwarder close: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("forwarder run: %v", err)
		}
		_ = sub.Close()
	})
	return f
}

// checkMessage compares a message received from a broker with what was sent.
func checkMessage(t *testing.T, tbl schema.Table, want sent, got *message.Message, attempts string) {
	t.Helper()
	md := got.Metadata
	checks := map[string]string{
		schema.MetadataEventID:     want.msg.EventID.String(),
		schema.MetadataTenantID:    want.msg.TenantID.String(),
		schema.MetadataTopic:       want.msg.Topic,
		schema.MetadataAttempts:    attempts,
		schema.MetadataTable:       tbl.String(),
		schema.MetadataTraceParent: want.parent,
		schema.MetadataTraceState:  "vendor=outbox-test",
		"correlation_id":           want.msg.Headers["correlation_id"],
	}
	for k, v := range checks {
		if md.Get(k) != v {
			t.Errorf("event %s: header %s = %q, want %q", want.msg.EventID, k, md.Get(k), v)
		}
	}
	if md.Get(schema.MetadataSequence) == "" {
		t.Errorf("event %s: no sequence header", want.msg.EventID)
	}
	var gotPayload, wantPayload any
	if err := json.Unmarshal(got.Payload, &gotPayload); err != nil {
		t.Fatalf("payload is not JSON: %v", err)
	}
	_ = json.Unmarshal(want.msg.Payload, &wantPayload)
	if fmt.Sprint(gotPayload) != fmt.Sprint(wantPayload) {
		t.Errorf("payload %s, want %s", got.Payload, want.msg.Payload)
	}
}

// receiveAll subscribes sub to topic and reads until every event of want
// arrived once, checking each with checkMessage (attempts "1") and extra; it
// fails on a repeated or unknown message and after 30s.
func receiveAll(t *testing.T, sub message.Subscriber, topic string, tbl schema.Table, want map[string]sent, extra func(*message.Message)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	for len(want) > 0 {
		select {
		case got := <-ch:
			w, ok := want[got.UUID]
			if !ok {
				t.Fatalf("unexpected or repeated message %s", got.UUID)
			}
			if extra != nil {
				extra(got)
			}
			checkMessage(t, tbl, w, got, "1")
			delete(want, got.UUID)
			got.Ack()
		case <-ctx.Done():
			t.Fatalf("%d messages not received from the broker", len(want))
		}
	}
}

func waitAllPublished(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, n int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		var published, locked int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE published_at IS NOT NULL), count(*) FILTER (WHERE locked_at IS NOT NULL) FROM `+tbl.Sanitize()).Scan(&published, &locked); err != nil {
			t.Fatal(err)
		}
		if published == n && locked == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("published %d of %d, %d locked", published, n, locked)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRelayToKafka: outbox rows arrive on Kafka (kfake) with key = event_id,
// every metadata entry as a header (trace context included) and the business
// JSON as payload.
func TestRelayToKafka(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	cluster, err := kafkatest.Start(3, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	pub, err := kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	const topic = "org.organization.created.v1"
	want := enqueueTraced(t, pool, tbl, topic, 20)
	startRelay(t, pool, tbl, pub, subscriber.Config{})
	waitAllPublished(t, pool, tbl, len(want))

	sub, err := cluster.NewSubscriber("e2e", watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	receiveAll(t, sub, topic, tbl, want, func(got *message.Message) {
		if key, _ := kafka.MessageKeyFromCtx(got.Context()); string(key) != got.UUID {
			t.Errorf("record key %q, want the event_id %s", key, got.UUID)
		}
	})
}

// TestRelayToRabbitMQ: the same through a real RabbitMQ with confirms.
func TestRelayToRabbitMQ(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	pub, err := amqpbackend.NewPublisher(amqpbackend.Config{URL: amqpURL}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("RabbitMQ at %s is required (run `make up`): %v", amqpURL, err)
	}
	defer pub.Close()
	topic := "e2e" + strings.ReplaceAll(uuid.NewString()[:8], "-", "") + ".organization.created.v1"
	want := enqueueTraced(t, pool, tbl, topic, 20)
	startRelay(t, pool, tbl, pub, subscriber.Config{})
	waitAllPublished(t, pool, tbl, len(want))

	sub, err := amqp.NewSubscriber(amqpbackend.WatermillConfig(amqpbackend.Config{URL: amqpURL}), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	receiveAll(t, sub, topic, tbl, want, nil)
}

// TestRelayInProcess: with no subscriber the in-process backend refuses the
// message, so the row is retried, never acked; a handler error is a nack too;
// once a healthy consumer subscribes, everything is delivered.
func TestRelayInProcess(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	bus := router.NewInProcess()
	defer bus.Close()
	const topic = "org.organization.created.v1"
	want := enqueueTraced(t, pool, tbl, topic, 5)
	startRelay(t, pool, tbl, bus, subscriber.Config{Backoff: func(int) time.Duration { return 100 * time.Millisecond }})

	lastErrors := func() []string {
		rows, err := pool.Query(context.Background(), `SELECT COALESCE(last_error, '') || CASE WHEN dead_at IS NOT NULL AND attempts = 1 THEN ' [dead at attempt 1]' ELSE '' END
FROM `+tbl.Sanitize()+` WHERE published_at IS NULL`)
		if err != nil {
			t.Fatal(err)
		}
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		errs := lastErrors()
		if len(errs) == 5 && strings.Contains(errs[0], "no subscribers") && strings.HasSuffix(errs[0], "[dead at attempt 1]") &&
			strings.HasSuffix(errs[4], "[dead at attempt 1]") {
			break // no route for the topic is permanent: dead at once, not 25 attempts into the void
		}
		if time.Now().After(deadline) {
			t.Fatalf("rows without subscriber: %q", errs)
		}
		time.Sleep(20 * time.Millisecond)
	}

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(subscriber.CaptureError, middleware.Recoverer)
	var (
		mu       sync.Mutex
		got      = map[string]*message.Message{}
		failOnce = map[string]bool{}
	)
	r.AddConsumerHandler("consumer", topic, bus, func(msg *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if !failOnce[msg.UUID] {
			failOnce[msg.UUID] = true
			return errors.New("consumer database unavailable")
		}
		got[msg.UUID] = msg
		return nil
	})
	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	defer r.Close()
	// Now that a consumer listens, the operator replays the dead rows.
	if res, err := runbook.New(pool, tbl).ReplayDead(context.Background(), runbook.DeadFilter{AllTopics: true}, false); err != nil || res.Rows != 5 {
		t.Fatalf("replay: %+v, %v", res, err)
	}

	deadline = time.Now().Add(2 * time.Minute)
	sawConsumerError := false
	for {
		for _, e := range lastErrors() {
			sawConsumerError = sawConsumerError || strings.Contains(e, "consumer database unavailable")
		}
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n == len(want) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("in-process consumer got %d of %d", n, len(want))
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !sawConsumerError {
		t.Error("the consumer's error never reached last_error")
	}
	waitAllPublished(t, pool, tbl, len(want))
	mu.Lock()
	defer mu.Unlock()
	for id, w := range want {
		// Attempts after the replay (which resets them): the consumer's failure, then success.
		if a, _ := strconv.Atoi(got[id].Metadata.Get(schema.MetadataAttempts)); a != 2 {
			t.Errorf("event %s delivered at attempt %d, want 2", id, a)
		}
		checkMessage(t, tbl, w, got[id], got[id].Metadata.Get(schema.MetadataAttempts))
	}
}
