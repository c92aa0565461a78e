package console_test

import (
	"net/url"
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

// FuzzCheckTraceURL asserts that a trace URL CheckTraceURL accepts makes,
// for any trace id, an absolute http or https link to the same non-empty
// host, without user information, with the trace id outside the host and
// port; its seed corpus holds the URLs issue 46 found accepted.
func FuzzCheckTraceURL(f *testing.F) {
	for _, s := range []string{"http://:{trace_id}", "https://tempo.example.com/trace/{trace_id}", "http://{trace_id}/trace", "http://h:{trace_id}/",
		"http://localhost:16686/trace/{trace_id}", "https://u:p@h/{trace_id}", "javascript:alert(1)//{trace_id}", "http://[::1]/{trace_id}", "http://h/{trace_id}?a={trace_id}#x"} {
		f.Add(s, "4bf92f3577b34da6a3ce929d0e0e4736")
	}
	f.Fuzz(func(t *testing.T, tmpl, traceID string) {
		if console.CheckTraceURL(tmpl) != nil {
			return
		}
		base, err := url.Parse(strings.ReplaceAll(tmpl, console.TraceIDPlaceholder, "0"))
		if err != nil {
			t.Fatalf("accepted %q, which does not parse: %v", tmpl, err)
		}
		link := strings.ReplaceAll(tmpl, console.TraceIDPlaceholder, url.QueryEscape(traceID))
		u, err := url.Parse(link)
		switch {
		case err != nil:
			t.Fatalf("accepted %q; its link for %q does not parse: %v", tmpl, traceID, err)
		case u.Scheme != "http" && u.Scheme != "https", u.Hostname() == "", u.User != nil:
			t.Fatalf("accepted %q; its link for %q is %q", tmpl, traceID, link)
		case u.Host != base.Host:
			t.Fatalf("accepted %q; the trace id %q changes the link's host to %q", tmpl, traceID, u.Host)
		}
	})
}
