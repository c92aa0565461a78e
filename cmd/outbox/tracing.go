package main

import (
	"context"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// serviceNameDefault is the service.name of the relay's spans unless
// OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES says otherwise.
const serviceNameDefault = "outbox-relay"

// startTracing returns the tracer provider of the relay spans: an OTLP/HTTP
// exporter when OTEL_EXPORTER_OTLP_ENDPOINT (or
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set and OTEL_SDK_DISABLED is not
// true, else nil (the forwarder then uses the global provider, a no-op). The
// exporter reads the standard OTEL_EXPORTER_OTLP_* variables (headers,
// timeout, TLS) and the batcher the OTEL_BSP_* ones. stop flushes the spans
// still queued.
func startTracing(ctx context.Context, env Env, logger watermill.LoggerAdapter) (tp trace.TracerProvider, stop func(), err error) {
	endpoint := env.String("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", env.String("OTEL_EXPORTER_OTLP_ENDPOINT", ""))
	disabled, err := env.Bool("OTEL_SDK_DISABLED", false)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errUsage, err)
	}
	if endpoint == "" || disabled {
		return nil, func() {}, nil
	}
	exp, err := otlptracehttp.New(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: OTEL_EXPORTER_OTLP_ENDPOINT: %w", errUsage, err)
	}
	res, err := resource.New(ctx,
		resource.WithTelemetrySDK(),
		resource.WithAttributes(semconv.ServiceName(serviceNameDefault)),
		resource.WithFromEnv(),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: OTEL_RESOURCE_ATTRIBUTES: %w", errUsage, err)
	}
	provider := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	logger.Info("Exporting relay spans over OTLP/HTTP", nil)
	return provider, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := provider.Shutdown(ctx); err != nil {
			logger.Error("Could not flush the relay spans", err, nil)
		}
	}, nil
}

// messagingSystem is the messaging.system attribute of a backend kind.
func messagingSystem(kind string) string {
	switch kind {
	case backendKafka:
		return "kafka"
	case backendAMQP:
		return "rabbitmq"
	default:
		return kind
	}
}
