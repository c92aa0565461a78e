package forwarder_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

const topic = "org.organization.created.v1"

// producerSpan is the span context of the service that wrote the row: a
// sampled remote span with a tracestate.
func producerSpan(t *testing.T) trace.SpanContext {
	t.Helper()
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	ts, err := trace.ParseTraceState("vendor=abc")
	if err != nil {
		t.Fatal(err)
	}
	return trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true})
}

// enqueueIn writes one row in the trace of sc (the row's traceparent and
// tracestate columns) and returns its event_id.
func enqueueIn(t *testing.T, tbl schema.Table, sc trace.SpanContext, payload string) uuid.UUID {
	t.Helper()
	ctx := trace.ContextWithSpanContext(context.Background(), sc)
	id := uuid.New()
	err := pgx.BeginFunc(ctx, testdb.Pool(t), func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: uuid.New(), Topic: topic, EventID: id, Payload: []byte(payload)})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// startForwarder relays tbl to pub with cfg until the test ends.
func startForwarder(t *testing.T, tbl schema.Table, pub message.Publisher, cfg forwarder.Config) {
	t.Helper()
	sub, err := subscriber.New(context.Background(), testdb.Pool(t), subscriber.Config{Table: tbl, PollInterval: 50 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	f, err := forwarder.New(sub, pub, cfg, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- f.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Errorf("close forwarder: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("forwarder run: %v", err)
		}
	})
}

// receive returns the next message on topic of the Pub/Sub, acked.
func receive(t *testing.T, msgs <-chan *message.Message) *message.Message {
	t.Helper()
	select {
	case m := <-msgs:
		m.Ack()
		return m
	case <-time.After(2 * time.Minute):
		t.Fatal("no message relayed")
		return nil
	}
}

// outgoing is the span context the published message's metadata names.
func outgoing(m *message.Message) trace.SpanContext {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier{
		"traceparent": m.Metadata.Get("traceparent"), "tracestate": m.Metadata.Get("tracestate"),
	})
	return trace.SpanContextFromContext(ctx)
}

// waitSpans waits until rec holds n ended spans.
func waitSpans(t *testing.T, rec *tracetest.SpanRecorder, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for len(rec.Ended()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d spans ended, want %d", len(rec.Ended()), n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return rec.Ended()
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

func newGoChannel(t *testing.T) *gochannel.GoChannel {
	t.Helper()
	gc := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = gc.Close() })
	return gc
}

// TestRelaySpan: the relay of one row is one producer span, child of the
// row's traceparent, with the messaging attributes, and the published
// message's traceparent continues from it (tracestate kept).
func TestRelaySpan(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	parent := producerSpan(t)
	id := enqueueIn(t, tbl, parent, `{"n":1}`)

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	gc := newGoChannel(t)
	msgs, err := gc.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	startForwarder(t, tbl, gc, forwarder.Config{TracerProvider: tp, MessagingSystem: "kafka"})
	m := receive(t, msgs)

	spans := waitSpans(t, rec, 1)
	time.Sleep(100 * time.Millisecond) // a second span would have ended by now
	if n := len(rec.Ended()); n != 1 {
		t.Fatalf("%d spans for one relayed message", n)
	}
	s := spans[0]
	if s.Parent().TraceID() != parent.TraceID() || s.Parent().SpanID() != parent.SpanID() || !s.Parent().IsRemote() {
		t.Fatalf("parent %v, want the row's %v", s.Parent(), parent)
	}
	if s.SpanContext().TraceID() != parent.TraceID() {
		t.Fatalf("relay span in trace %s, want %s", s.SpanContext().TraceID(), parent.TraceID())
	}
	if s.SpanKind() != trace.SpanKindProducer || s.Name() != "publish "+topic {
		t.Fatalf("span %q kind %v", s.Name(), s.SpanKind())
	}
	want := map[attribute.Key]string{
		"messaging.system":           "kafka",
		"messaging.destination.name": topic,
		"messaging.message.id":       id.String(),
		"messaging.operation.type":   "send",
		"messaging.operation.name":   "publish",
		"outbox.table":               tbl.String(),
	}
	got := attrs(s)
	for k, v := range want {
		if got[k].String() != v {
			t.Errorf("attribute %s = %q, want %q", k, got[k].String(), v)
		}
	}
	if got["outbox.attempts"].AsInt64() != 1 {
		t.Errorf("outbox.attempts = %v", got["outbox.attempts"])
	}
	if s.Status().Code != codes.Unset {
		t.Errorf("status %v on success", s.Status())
	}
	out := outgoing(m)
	if out.TraceID() != parent.TraceID() || out.SpanID() != s.SpanContext().SpanID() {
		t.Fatalf("outgoing traceparent %q: trace %s parent span %s, want %s %s",
			m.Metadata.Get("traceparent"), out.TraceID(), out.SpanID(), parent.TraceID(), s.SpanContext().SpanID())
	}
	if out.TraceState().Get("vendor") != "abc" {
		t.Fatalf("outgoing tracestate %q", m.Metadata.Get("tracestate"))
	}
}

// TestRelaySpanError: a failed relay ends its span with error status and
// the error recorded; an error that quotes the payload is recorded without it.
func TestRelaySpanError(t *testing.T) {
	t.Parallel()
	t.Run("publish fails", func(t *testing.T) {
		t.Parallel()
		tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
		parent := producerSpan(t)
		enqueueIn(t, tbl, parent, `{"n":2}`)
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		defer func() { _ = tp.Shutdown(context.Background()) }()
		closed := gochannel.NewGoChannel(gochannel.Config{}, watermill.NopLogger{})
		_ = closed.Close() // Publish now fails: the broker is gone
		startForwarder(t, tbl, closed, forwarder.Config{TracerProvider: tp})

		s := waitSpans(t, rec, 1)[0]
		if s.Status().Code != codes.Error || !strings.Contains(s.Status().Description, "publish event") {
			t.Fatalf("status %+v", s.Status())
		}
		if s.Parent().TraceID() != parent.TraceID() || attrs(s)["messaging.system"].AsString() != forwarder.MessagingSystemDefault {
			t.Fatalf("parent %v attributes %v", s.Parent(), s.Attributes())
		}
		if len(s.Events()) == 0 || s.Events()[0].Name != "exception" {
			t.Fatalf("error not recorded: events %v", s.Events())
		}
	})
	t.Run("no route, payload redacted", func(t *testing.T) {
		t.Parallel()
		tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
		const payload = `{"card":"4111111111111111"}`
		enqueueIn(t, tbl, producerSpan(t), payload)
		rec := tracetest.NewSpanRecorder()
		tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
		defer func() { _ = tp.Shutdown(context.Background()) }()
		startForwarder(t, tbl, newGoChannel(t), forwarder.Config{TracerProvider: tp,
			DestinationTopic: func(m *message.Message) (string, error) {
				return "", fmt.Errorf("cannot route %s", m.Payload)
			}})
		s := waitSpans(t, rec, 1)[0]
		desc := s.Status().Description
		if s.Status().Code != codes.Error || !strings.Contains(desc, "cannot route") || strings.Contains(desc, "4111") {
			t.Fatalf("status %+v", s.Status())
		}
		for _, e := range s.Events() {
			for _, kv := range e.Attributes {
				if strings.Contains(kv.Value.String(), "4111") {
					t.Fatalf("event %s attribute %s holds the payload", e.Name, kv.Key)
				}
			}
		}
	})
}

// TestRelayWithoutTracerProvider: with no provider configured and none set
// globally, the published message keeps the row's traceparent, so the trace
// still reaches the consumer.
func TestRelayWithoutTracerProvider(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	parent := producerSpan(t)
	enqueueIn(t, tbl, parent, `{"n":3}`)
	gc := newGoChannel(t)
	msgs, err := gc.Subscribe(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	startForwarder(t, tbl, gc, forwarder.Config{})
	out := outgoing(receive(t, msgs))
	if out.TraceID() != parent.TraceID() || out.SpanID() != parent.SpanID() {
		t.Fatalf("outgoing %v, want the row's %v", out, parent)
	}
}

// TestOnlyTheOTelAPI: the library packages use the OpenTelemetry API only;
// the SDK and exporters are linked by the daemon alone.
func TestOnlyTheOTelAPI(t *testing.T) {
	t.Parallel()
	for _, pkg := range []string{"forwarder", "subscriber", "publisher", "router", "schema", "cleaner", "runbook", "metrics"} {
		out, err := exec.Command("go", "list", "-deps", "github.com/outboxkit/watermill-outbox/"+pkg).CombinedOutput()
		if err != nil {
			t.Fatalf("go list %s: %v\n%s", pkg, err, out)
		}
		for _, dep := range strings.Fields(string(out)) {
			if strings.HasPrefix(dep, "go.opentelemetry.io/otel/sdk") || strings.HasPrefix(dep, "go.opentelemetry.io/otel/exporters") {
				t.Errorf("package %s links %s", pkg, dep)
			}
		}
	}
}
