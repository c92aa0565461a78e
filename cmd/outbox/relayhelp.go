package main

import (
	"fmt"
	"io"
	"text/tabwriter"
)

// relayVars lists the environment of `outbox relay` for its --help; the
// configuration table of docs/OPERATIONS.md lists the same names
// (TestRelayHelpListsTheDocumentedVariables).
var relayVars = [][3]string{
	{"OUTBOX_DATABASE_URL", "(required)", "PostgreSQL URL or DSN"},
	{"OUTBOX_RELAY_ENABLED", "true", "false runs the cleaner only"},
	{"OUTBOX_RELAY_TABLES", "(required)", "tables to relay, such as public.org_outbox,public.hrm_outbox"},
	{"OUTBOX_RELAY_SINGLE_ACTIVE", "true", "one active relay per table (advisory lock)"},
	{"OUTBOX_RELAY_BOUNDED_CLAIM", "true", "default mode: claims start at a bound, not at the oldest index entry (needs migration 000009, docs/XMIN.md)"},
	{"OUTBOX_RELAY_SOURCE", "table", "table: claim rows; wal: stream them from a logical replication slot (needs outbox migrate --wal, docs/WAL.md)"},
	{"OUTBOX_RELAY_ORDERED", "false", "ordered mode: per-key order, any number of relays (needs outbox migrate --ordered)"},
	{"OUTBOX_RELAY_POLL_INTERVAL", "1s", "safety-net polling; NOTIFY wakes the relay at commit"},
	{"OUTBOX_RELAY_BATCH_SIZE", "100", "rows per claim"},
	{"OUTBOX_RELAY_LOCK_TTL", "60s", "lease length (renewed while a message is in flight)"},
	{"OUTBOX_RELAY_LEADER_TIMEOUT", "15s", "single-active: bound on losing the table when cut off from the database"},
	{"OUTBOX_RELAY_MAX_ATTEMPTS", "25", "attempts before a row is dead"},
	{"OUTBOX_RELAY_DISPATCH_TIMEOUT", "30s", "per-message timeout"},
	{"OUTBOX_LAST_ERROR_MAX_BYTES", "2048", "last_error bound"},
	{"OUTBOX_CLEANER_ENABLED", "true", "delete old published rows"},
	{"OUTBOX_CLEANER_TABLES", "the relay tables", "tables to clean"},
	{"OUTBOX_CLEANER_INTERVAL", "1m", "time between cleaning passes"},
	{"OUTBOX_CLEANER_RETENTION", "168h", "keep published rows this long"},
	{"OUTBOX_CLEANER_DEAD_RETENTION", "0 (keep)", "also delete rows dead for longer than this"},
	{"OUTBOX_CLEANER_VACUUM", "false", "VACUUM after deleting; only for servers with autovacuum off"},
	{"OUTBOX_BACKEND", "(required)", "kafka or amqp"},
	{"OUTBOX_KAFKA_BROKERS", "", "host:port,... (OUTBOX_BACKEND=kafka)"},
	{"OUTBOX_AMQP_URL", "", "amqp://user:password@host:5672/vhost (OUTBOX_BACKEND=amqp)"},
	{"OUTBOX_AMQP_LAYOUT", "queue", "queue: per topic an exchange and one shared queue; fanout: exchanges only, each consumer binds its own queue"},
	{"OUTBOX_AMQP_EXCHANGE", "", "fanout layout: one topic exchange for every topic (routing key = topic); empty: one fanout exchange per topic"},
	{"PROMETHEUS_METRICS_ENABLED", "false", "serve metrics"},
	{"PROMETHEUS_METRICS_PATH", "/debug/prometheus", "metrics path"},
	{"PROMETHEUS_METRICS_ADDR", ":9464", "metrics listen address"},
	{"OUTBOX_HEALTH_ADDR", "(off)", "serve GET /healthz and GET /readyz on this address, such as :8081"},
	{"OUTBOX_CONSOLE_ADDR", "(off)", "serve the web console on this address, such as 127.0.0.1:8080"},
	{"OUTBOX_CONSOLE_TOKEN", "(read-only)", "the token (16+ bytes) that guards the console's pages and actions"},
	{"OUTBOX_CONSOLE_TABLES", "the relay tables", "tables the console shows"},
	{"OUTBOX_CONSOLE_READ_ONLY", "false", "no actions; a set token (either, when both are set) still guards the reads; without a token, allows a non-loopback address"},
	{"OUTBOX_CONSOLE_READ_TOKEN", "(none)", "a second token (16+ bytes) that reads every page and changes nothing"},
	{"OUTBOX_CONSOLE_PUBLIC_READ", "false", "anyone who reaches the console reads it; OUTBOX_CONSOLE_TOKEN still guards the actions"},
	{"OUTBOX_CONSOLE_ALLOWED_HOSTS", "(none)", "more Host header names the console answers to, comma-separated (e.g. the name your proxy serves)"},
	{"OUTBOX_CONSOLE_TRUST_PROXY", "false", "trust X-Forwarded-Proto and X-Forwarded-For of a proxy in front (Secure cookie, login slow-down per client)"},
	{"OUTBOX_CONSOLE_TRACE_URL", "(none)", "link the event page's trace id to your tracing UI: an http(s) URL with {trace_id}, e.g. https://tempo.example.com/trace/{trace_id}"},
	{"OTEL_EXPORTER_OTLP_ENDPOINT", "(off)", "export relay spans over OTLP/HTTP; the standard OTEL_* variables apply"},
}

// relayUsage prints the relay's help: what it does and its environment.
func relayUsage(w io.Writer) {
	fmt.Fprintln(w, "usage: outbox relay\n\nRelays OUTBOX_RELAY_TABLES to OUTBOX_BACKEND and cleans them; SIGTERM drains.\nIt takes no flags; it reads the environment:")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\n  VARIABLE\tDEFAULT\tMEANING")
	for _, v := range relayVars {
		def := v[1]
		if def == "" {
			def = "-"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\n", v[0], def, v[2])
	}
	_ = tw.Flush()
	fmt.Fprintln(w, "\nA bad value stops the relay with exit code 2 and the variable's name.")
}
