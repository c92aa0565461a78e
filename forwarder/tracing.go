package forwarder

import (
	"context"
	"errors"
	"strconv"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/internal/redact"
	"github.com/outboxkit/watermill-outbox/schema"
)

// TracerName is the instrumentation scope of the relay spans.
const TracerName = "github.com/outboxkit/watermill-outbox/forwarder"

// MessagingSystemDefault is the messaging.system attribute when
// Config.MessagingSystem is empty.
const MessagingSystemDefault = "watermill"

// Attributes of the relay span beyond the OpenTelemetry messaging ones.
const (
	// AttributeTable is the outbox table the row came from.
	AttributeTable = attribute.Key("outbox.table")
	// AttributeAttempts is the row's delivery attempt (1 for the first).
	AttributeAttempts = attribute.Key("outbox.attempts")
)

// traceContext is the W3C Trace Context propagator: rows store W3C
// traceparent and tracestate, and the outgoing message carries the same
// keys, whatever global propagator the process set.
var traceContext = propagation.TraceContext{}

func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(TracerName)
}

// startSpan starts the relay span of msg: a producer span whose parent is the
// span named by the row's traceparent and tracestate metadata (a new trace
// when the row has none).
func (f *Forwarder) startSpan(msg *message.Message) (context.Context, trace.Span) {
	parent := msg.Context()
	if tp := msg.Metadata.Get(schema.MetadataTraceParent); tp != "" {
		parent = traceContext.Extract(parent, propagation.MapCarrier{
			schema.MetadataTraceParent: tp,
			schema.MetadataTraceState:  msg.Metadata.Get(schema.MetadataTraceState),
		})
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemKey.String(f.cfg.MessagingSystem),
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("publish"),
		semconv.MessagingMessageID(msg.UUID),
		AttributeTable.String(msg.Metadata.Get(schema.MetadataTable)),
	}
	if n, err := strconv.Atoi(msg.Metadata.Get(schema.MetadataAttempts)); err == nil {
		attrs = append(attrs, AttributeAttempts.Int(n))
	}
	return f.tracer.Start(parent, "publish", trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
}

// setDestination names the span after its destination, as the messaging
// conventions ask ("publish <topic>").
func setDestination(span trace.Span, dest string) {
	span.SetName("publish " + dest)
	span.SetAttributes(semconv.MessagingDestinationName(dest))
}

// injectTrace makes the outgoing message's traceparent and tracestate
// metadata continue from the relay span in ctx.
func injectTrace(ctx context.Context, md message.Metadata) {
	delete(md, schema.MetadataTraceParent)
	delete(md, schema.MetadataTraceState)
	traceContext.Inject(ctx, propagation.MapCarrier(md))
}

// endSpan ends the relay span, with error status and the error recorded (its
// summary: no payload, no secret) when the relay failed.
func endSpan(span trace.Span, err error, payload []byte) {
	if err != nil {
		summary := redact.Summary(err.Error(), payload, 0)
		span.RecordError(errors.New(summary))
		span.SetStatus(codes.Error, summary)
	}
	span.End()
}
