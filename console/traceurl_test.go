package console_test

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/console"
)

// TestCheckTraceURLNeedsAHost: a trace URL without a host name, or with
// the trace id where the host or the port goes, makes every trace link
// broken; CheckTraceURL refuses it, naming the setting, never repeating it
// (issue 46).
func TestCheckTraceURLNeedsAHost(t *testing.T) {
	t.Parallel()
	for _, bad := range []string{"http://:{trace_id}", "https://:16686/trace/{trace_id}", "http://{trace_id}/trace", "http://tempo.example.com:{trace_id}/x",
		"https://{trace_id}.example.com/", "http://[]:80/{trace_id}", "http://@tempo.example.com/{trace_id}"} {
		err := console.CheckTraceURL(bad)
		if err == nil || !strings.Contains(err.Error(), "OUTBOX_CONSOLE_TRACE_URL") || strings.Contains(err.Error(), bad) {
			t.Errorf("CheckTraceURL(%q) = %v, want a refusal that names the setting", bad, err)
		}
	}
	for _, good := range []string{"http://localhost:16686/trace/{trace_id}", "https://tempo.example.com/trace/{trace_id}", "https://grafana.example.com/explore?trace={trace_id}#{trace_id}",
		"http://[::1]:16686/trace/{trace_id}", "http://127.0.0.1/{trace_id}"} {
		if err := console.CheckTraceURL(good); err != nil {
			t.Errorf("CheckTraceURL(%q): %v", good, err)
		}
	}
}
