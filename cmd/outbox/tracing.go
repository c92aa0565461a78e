package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"
	"unicode"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/internal/redact"
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
	// The exporter logs a header or endpoint it cannot parse with its
	// value (a token, a password) and goes on without it: refuse such a
	// value first, naming the variable and not showing the value.
	if err := checkOTLPEnv(env); err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errUsage, err)
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
		// The resource's error quotes the entries it could not read, which
		// may hold a secret.
		return nil, nil, fmt.Errorf("%w: OTEL_RESOURCE_ATTRIBUTES (or OTEL_SERVICE_NAME) could not be read; the form is key1=value1,key2=value2 "+
			"with URL-encoded values (the value is not shown: it may hold a secret)", errUsage)
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

// otlpHeaderVars and otlpEndpointVars are the OTLP exporter's variables
// that may hold a secret: headers (an Authorization token) and endpoints (a
// password in the URL).
var (
	otlpHeaderVars   = []string{"OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"}
	otlpEndpointVars = []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"}
)

// checkOTLPEnv refuses an OTLP header list or endpoint that the exporter
// could not parse, by the exporter's own rules (a header entry is
// name=value, name an HTTP token, value URL-encoded; an endpoint is what
// url.Parse accepts), with errors that name the variable and the entry but
// never show a header's value or a URL's password.
func checkOTLPEnv(env Env) error {
	var errs []error
	for _, name := range otlpHeaderVars {
		if err := checkOTLPHeaders(env.raw(name)); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w; the form is name1=value1,name2=value2 with URL-encoded values, "+
				"such as Authorization=Bearer%%20<token> (the value is not shown: it may hold a secret)", name, err))
		}
	}
	for _, name := range otlpEndpointVars {
		if v := env.raw(name); v != "" {
			if _, err := url.Parse(v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%s is not a URL: %s", name, redact.URL(v), redact.URLProblem(v, err)))
			}
		}
	}
	return errors.Join(errs...)
}

// checkOTLPHeaders says which entry of an OTLP header list is malformed.
func checkOTLPHeaders(v string) error {
	if v == "" {
		return nil
	}
	entries := strings.Split(v, ",")
	for i, e := range entries {
		if strings.TrimSpace(e) == "" {
			continue
		}
		n, val, ok := strings.Cut(e, "=")
		switch {
		case !ok:
			return fmt.Errorf("entry %d of %d has no '=' (a colon for '=' is a common typo)", i+1, len(entries))
		case !validHeaderName(strings.TrimSpace(n)):
			return fmt.Errorf("the name of entry %d of %d is not a header name (letters, digits and !#$%%&'*+-.^_`|~ only; a colon for '=' is a common typo)", i+1, len(entries))
		}
		if _, err := url.PathUnescape(val); err != nil {
			return fmt.Errorf("the value of entry %d of %d has an invalid %%-escape", i+1, len(entries))
		}
	}
	return nil
}

// validHeaderName reports whether n is an HTTP token (RFC 9110), as the
// OTLP exporter requires of a header name.
func validHeaderName(n string) bool {
	if n == "" {
		return false
	}
	for _, c := range n {
		if c > unicode.MaxASCII || (!unicode.IsLetter(c) && !unicode.IsDigit(c) && !strings.ContainsRune("!#$%&'*+-.^_`|~", c)) {
			return false
		}
	}
	return true
}
