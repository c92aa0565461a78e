package console_test

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

const (
	testTraceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	testSpanID  = "00f067aa0ba902b7"
)

// tracedContext is a context whose span the publisher records in the
// row's traceparent and tracestate.
func tracedContext(t *testing.T) context.Context {
	t.Helper()
	tid, err := trace.TraceIDFromHex(testTraceID)
	if err != nil {
		t.Fatal(err)
	}
	sid, err := trace.SpanIDFromHex(testSpanID)
	if err != nil {
		t.Fatal(err)
	}
	ts, err := trace.ParseTraceState("vendor=abc")
	if err != nil {
		t.Fatal(err)
	}
	return trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: tid, SpanID: sid, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true}))
}

// enqueue commits msg on ctx (its span, if any, is recorded).
func enqueue(t *testing.T, ctx context.Context, tbl schema.Table, msg publisher.Message) uuid.UUID {
	t.Helper()
	pool := testdb.Pool(t)
	if msg.EventID == uuid.Nil {
		msg.EventID = uuid.New()
	}
	if msg.TenantID == uuid.Nil {
		msg.TenantID = uuid.New()
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, tbl, msg)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	return msg.EventID
}

// TestEventPagePayloadHeadersTrace: the event page shows the payload
// indented (and escaped), the stored headers (escaped; a key the outbox
// sets itself marked as not delivered; a column that is not an object of
// strings shown raw with a warning), the trace id and span id of the
// row's traceparent with, when Config.TraceURL is set, a link built from
// it; without trace or headers columns it says so. TraceURL is checked
// at New.
func TestEventPagePayloadHeadersTrace(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	ctx := context.Background()
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	traced := enqueue(t, tracedContext(t), tbl, publisher.Message{Topic: "org.orders.v1",
		Payload: json.RawMessage(`{"order":{"id":42,"lines":[{"sku":"<b>x</b>","qty":2}]},"note":"<script>alert(\"p\")</script>"}`),
		Headers: map[string]string{"content-type": "application/json", "x-note": `<script>alert("h")</script>`}})
	plain := enqueue(t, ctx, tbl, publisher.Message{Topic: "org.orders.v1", Payload: json.RawMessage(`[1,2]`)})
	reserved := enqueue(t, ctx, tbl, publisher.Message{Topic: "org.orders.v1", Payload: json.RawMessage(`{}`)})
	notStrings := enqueue(t, ctx, tbl, publisher.Message{Topic: "org.orders.v1", Payload: json.RawMessage(`{}`)})
	forged := enqueue(t, ctx, tbl, publisher.Message{Topic: "org.orders.v1", Payload: json.RawMessage(`{}`)})
	for id, set := range map[uuid.UUID]string{
		reserved:   `headers = '{"event_id": "forged", "x-kept": "yes"}'`,
		notStrings: `headers = '{"n": 1}'`,
		forged:     `traceparent = '00-<script>-x-01'`,
	} {
		if _, err := pool.Exec(ctx, `UPDATE `+tbl.Sanitize()+` SET `+set+` WHERE event_id = $1`, id); err != nil {
			t.Fatal(err)
		}
	}
	const token = "event-extras-token-0123456789"
	auth := map[string]string{"Authorization": "Bearer " + token}
	linked := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: token, TraceURL: "https://tempo.example.com/explore?trace={trace_id}&org=1"})
	bare := serve(t, console.Config{Tables: []schema.Table{tbl}, Token: token})
	page := func(base string, id uuid.UUID, query string) string {
		t.Helper()
		r := do(t, "GET", base+"/t/"+tbl.String()+"/event/"+id.String()+query, nil, auth)
		if r.code != 200 {
			t.Fatalf("event %s: %d\n%s", id, r.code, r.body)
		}
		return r.body
	}

	body := page(linked.URL, traced, "?payload=1")
	wantPayload := `<pre id="payload">{
  &#34;note&#34;: &#34;&lt;script&gt;alert(\&#34;p\&#34;)&lt;/script&gt;&#34;,
  &#34;order&#34;: {
    &#34;id&#34;: 42,
    &#34;lines&#34;: [
      {
        &#34;qty&#34;: 2,
        &#34;sku&#34;: &#34;&lt;b&gt;x&lt;/b&gt;&#34;
      }
    ]
  }
}</pre>`
	if !strings.Contains(body, wantPayload) {
		t.Errorf("the payload is not indented and escaped; want\n%s\nin\n%s", wantPayload, body)
	}
	for _, want := range []string{
		`<code id="trace-id">` + testTraceID + `</code>`,
		`<a href="https://tempo.example.com/explore?trace=` + testTraceID + `&amp;org=1" id="trace-link" rel="noopener noreferrer">`,
		`<code id="span-id">` + testSpanID + `</code>`,
		`<code id="tracestate">vendor=abc</code>`,
		`<tr class="header"><td><code>content-type</code></td><td><code class="header-value">application/json</code>`,
		`<code class="header-value">&lt;script&gt;alert(&#34;h&#34;)&lt;/script&gt;</code>`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("the traced event's page lacks\n%s\n%s", want, body)
		}
	}
	for _, raw := range []string{"<script>alert", "<b>x</b>"} {
		if strings.Contains(body, raw) {
			t.Errorf("the event page renders %q unescaped", raw)
		}
	}
	// Without Config.TraceURL: the ids, no link, and how to get one.
	body = page(bare.URL, traced, "")
	if !strings.Contains(body, `<code id="trace-id">`+testTraceID+`</code>`) || strings.Contains(body, `id="trace-link"`) ||
		!strings.Contains(body, "set OUTBOX_CONSOLE_TRACE_URL to link the trace") || strings.Contains(body, `id="payload"`) {
		t.Errorf("the traced event without TraceURL:\n%s", body)
	}
	body = page(linked.URL, plain, "?payload=1")
	if !strings.Contains(body, `id="no-trace"`) || !strings.Contains(body, `id="no-headers"`) || strings.Contains(body, `id="trace-link"`) ||
		!strings.Contains(body, "<pre id=\"payload\">[\n  1,\n  2\n]</pre>") {
		t.Errorf("an event without span or headers:\n%s", body)
	}
	if body = page(linked.URL, reserved, ""); !regexp.MustCompile(`<tr class="header reserved"><td><code>event_id</code></td><td><code class="header-value">forged</code> <span class="hint">\(not on the message`).MatchString(body) ||
		!strings.Contains(body, `<tr class="header"><td><code>x-kept</code>`) {
		t.Errorf("a stored header the outbox sets itself is not marked:\n%s", body)
	}
	if body = page(linked.URL, notStrings, ""); !strings.Contains(body, `id="headers-invalid"`) || !strings.Contains(body, "<pre id=\"headers-raw\">{\n  &#34;n&#34;: 1\n}</pre>") {
		t.Errorf("headers that are not strings:\n%s", body)
	}
	if body = page(linked.URL, forged, ""); !strings.Contains(body, `id="trace-invalid"`) || strings.Contains(body, `id="trace-link"`) || strings.Contains(body, "<script>") {
		t.Errorf("a traceparent that is not W3C:\n%s", body)
	}

	// A table without the optional columns says it has none.
	ptbl := testdb.Table(t, "outbox")
	id := enqueue(t, tracedContext(t), ptbl, publisher.Message{Topic: "org.orders.v1", Payload: json.RawMessage(`{}`)})
	psrv := serve(t, console.Config{Tables: []schema.Table{ptbl}, Token: token, TraceURL: "http://localhost:16686/trace/{trace_id}"})
	r := do(t, "GET", psrv.URL+"/t/"+ptbl.String()+"/event/"+id.String(), nil, auth)
	if r.code != 200 || !strings.Contains(r.body, "the table has no traceparent column") || !strings.Contains(r.body, `id="no-headers-column"`) || strings.Contains(r.body, `id="trace-link"`) {
		t.Errorf("an event of a table without trace and headers columns: %d\n%s", r.code, r.body)
	}

	// TraceURL is checked at New, and its error never repeats it.
	for _, bad := range []string{"javascript:alert(1)//{trace_id}", "ftp://tempo.example.com/{trace_id}", "https://tempo.example.com/trace/",
		"/trace/{trace_id}", "https://admin:hunter2@tempo.example.com/{trace_id}", "https://tempo.example.com/ {trace_id}", "https:///{trace_id}",
		"https://tempo.example.com/\x00{trace_id}"} {
		_, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}, TraceURL: bad})
		if err == nil || !strings.Contains(err.Error(), "OUTBOX_CONSOLE_TRACE_URL") || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("TraceURL %q: %v", bad, err)
		}
	}
	if err := console.CheckTraceURL("http://localhost:16686/trace/{trace_id}"); err != nil {
		t.Errorf("a Jaeger URL refused: %v", err)
	}
}

// TestReadableDurations: the console writes ages in their two largest
// units, "in" for the future.
func TestReadableDurations(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{
		0: "0s ago", 45 * time.Second: "45s ago", 3 * time.Minute: "3m ago", 192 * time.Second: "3m 12s ago",
		-40 * time.Second: "in 40s", 2*time.Hour + 5*time.Minute + 9*time.Second: "2h 5m ago", 26 * time.Hour: "1d 2h ago",
		72 * time.Hour: "3d ago", 1500 * time.Millisecond: "2s ago",
	} {
		if got := console.Relative(d); got != want {
			t.Errorf("Relative(%s) = %q, want %q", d, got, want)
		}
	}
	for s, want := range map[float64]string{0: "0.0s", 2.54: "2.5s", 9.96: "10s", 10.02: "10s", 45: "45s", 192: "3m 12s", 7200: "2h"} {
		if got := console.Duration(s); got != want {
			t.Errorf("Duration(%v) = %q, want %q", s, got, want)
		}
	}
}

// publisherMessage is an event of topic with an empty object payload.
func publisherMessage(topic string) publisher.Message {
	return publisher.Message{Topic: topic, Payload: json.RawMessage(`{}`)}
}
