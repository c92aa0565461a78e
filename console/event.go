package console

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"sort"
	"strings"

	"github.com/google/uuid"

	"github.com/outboxkit/watermill-outbox/schema"
)

// eventExtras is what the event page shows beyond runbook.Row: the
// payload (when asked for), the stored headers and the trace context.
type eventExtras struct {
	// PayloadAsked: the page was opened with ?payload=1.
	PayloadAsked bool
	// Payload is the payload, indented when it is JSON.
	Payload string
	// HeadersColumn: the table has the headers column.
	HeadersColumn bool
	// Headers are the stored headers, sorted by key.
	Headers []header
	// HeadersRaw is the headers column when it is not a JSON object of
	// strings (the relay cannot deliver the row then), indented.
	HeadersRaw string
	// TraceColumns: the table has the traceparent and tracestate columns.
	TraceColumns bool
	// TraceParent and TraceState are the row's, "" when not recorded.
	TraceParent, TraceState string
	// TraceID and SpanID are the traceparent's, "" when it is not a
	// valid W3C traceparent.
	TraceID, SpanID string
	// TraceLink is Config.TraceURL with the trace id, "" without either.
	TraceLink string
}

// header is one stored header.
type header struct {
	Key, Value string
	// Reserved: the outbox sets this metadata key itself, so the relay
	// does not deliver the stored value (schema.ReservedMetadata).
	Reserved bool
}

// eventExtras reads the payload (withPayload), headers and trace context
// of the row id, as far as the table has the columns.
func (h *handler) eventExtras(ctx context.Context, t schema.Table, id uuid.UUID, withPayload bool) (eventExtras, error) {
	x := eventExtras{PayloadAsked: withPayload}
	cols, err := schema.DetectColumns(ctx, h.pool, t)
	if err != nil {
		return x, fmt.Errorf("read the columns of %s: %w", t, err)
	}
	x.HeadersColumn, x.TraceColumns = cols.Headers, cols.TraceContext
	sel := []string{"NULL::text", "NULL::text", "NULL::text", "NULL::text"}
	if withPayload {
		sel[0] = "payload::text"
	}
	if cols.Headers {
		sel[1] = "headers::text"
	}
	if cols.TraceContext {
		sel[2], sel[3] = "traceparent", "tracestate"
	}
	var payload, headers, parent, state *string
	if err := h.pool.QueryRow(ctx, `SELECT `+strings.Join(sel, ", ")+` FROM `+t.Sanitize()+` WHERE event_id = $1`, id).
		Scan(&payload, &headers, &parent, &state); err != nil {
		return x, fmt.Errorf("read the payload, headers and trace context of an event of %s: %w", t, err)
	}
	if payload != nil {
		x.Payload = indentJSON(*payload)
	}
	if headers != nil && *headers != "null" {
		var m map[string]string
		if err := json.Unmarshal([]byte(*headers), &m); err != nil {
			x.HeadersRaw, m = indentJSON(*headers), nil
		}
		for k, v := range m {
			x.Headers = append(x.Headers, header{Key: k, Value: v, Reserved: schema.ReservedMetadata(k)})
		}
		sort.Slice(x.Headers, func(i, j int) bool { return x.Headers[i].Key < x.Headers[j].Key })
	}
	if parent != nil {
		x.TraceParent = *parent
	}
	if state != nil {
		x.TraceState = *state
	}
	x.TraceID, x.SpanID = parseTraceParent(x.TraceParent)
	if x.TraceID != "" && h.cfg.TraceURL != "" {
		x.TraceLink = traceLink(h.cfg.TraceURL, x.TraceID)
	}
	return x, nil
}

// indentJSON indents a JSON text by two spaces; any other text is
// returned as it is.
func indentJSON(s string) string {
	var b bytes.Buffer
	if err := json.Indent(&b, []byte(s), "", "  "); err != nil {
		return s
	}
	return b.String()
}

// traceParentRE is a W3C traceparent: version, trace id, parent (span)
// id, flags, in lowercase hex.
var traceParentRE = regexp.MustCompile(`^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$`)

// parseTraceParent returns the trace id and span id of a W3C traceparent,
// "" for both when s is not a valid one (version ff, an all-zero id, or
// more fields in version 00).
func parseTraceParent(s string) (traceID, spanID string) {
	m := traceParentRE.FindStringSubmatch(s)
	if m == nil || m[1] == "ff" || (m[1] == "00" && m[5] != "") ||
		m[2] == strings.Repeat("0", 32) || m[3] == strings.Repeat("0", 16) {
		return "", ""
	}
	return m[2], m[3]
}

// traceLink puts the trace id, escaped, where Config.TraceURL says.
func traceLink(tmpl, traceID string) string {
	return strings.ReplaceAll(tmpl, TraceIDPlaceholder, url.QueryEscape(traceID))
}
