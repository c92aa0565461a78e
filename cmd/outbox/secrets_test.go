package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// daemonEnv, set in a child process of this test binary, makes TestMain run
// the real main (`outbox <daemonEnv's value>`) instead of the tests, so that
// a test reads what the daemon writes to its own stderr: its logger's lines,
// its exit message and what libraries log through their global loggers
// (OpenTelemetry's).
const daemonEnv = "OUTBOX_TEST_RUN_DAEMON"

func TestMain(m *testing.M) {
	if args := os.Getenv(daemonEnv); args != "" {
		os.Args = append([]string{"outbox"}, strings.Fields(args)...)
		main()
		return
	}
	os.Exit(m.Run())
}

// daemonRun is what one run of the daemon process did.
type daemonRun struct {
	code           int
	stdout, stderr string
}

// runDaemon runs `outbox relay` as a process of its own with exactly env
// (and PATH), until it exits or a minute has passed (then it is killed).
func runDaemon(t *testing.T, env map[string]string) daemonRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0])
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), daemonEnv + "=relay"}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		code = exit.ExitCode()
	case err != nil:
		t.Fatalf("run the daemon: %v", err)
	}
	return daemonRun{code: code, stdout: stdout.String(), stderr: stderr.String()}
}

// TestNoSecretInStartupFailures: each variable of the daemon that can
// carry a secret (a password in a URL or DSN, a token, an OTLP header) is
// given a secret and a typo, and the daemon is started as a process of its
// own: the secret is in no line it writes, on stderr or stdout, whatever
// fails; a bad value exits 2 naming the variable. The rest of the
// configuration is valid and names a table that does not exist, so that a
// daemon that accepts the value stops at once (exit 1).
func TestNoSecretInStartupFailures(t *testing.T) {
	t.Parallel()
	var b [6]byte
	_, _ = rand.Read(b[:])
	secret := "S3cr3t" + hex.EncodeToString(b[:])
	base := map[string]string{
		"OUTBOX_DATABASE_URL":  testdb.URL(),
		"OUTBOX_RELAY_TABLES":  "public.no_such_outbox_" + hex.EncodeToString(b[:]),
		"OUTBOX_BACKEND":       "kafka",
		"OUTBOX_KAFKA_BROKERS": "127.0.0.1:1",
	}
	amqp := map[string]string{"OUTBOX_BACKEND": "amqp"}
	otlp := map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
	cases := []struct {
		name  string
		env   map[string]string
		extra map[string]string // other variables the case needs
		code  int               // the exit code, 0: any
		names string            // the variable the message names, "": any
	}{
		{"database URL, bad port", map[string]string{"OUTBOX_DATABASE_URL": "postgres://postgres:" + secret + "@127.0.0.1:notaport/test"}, nil, 2, "OUTBOX_DATABASE_URL"},
		{"database URL, bad escape", map[string]string{"OUTBOX_DATABASE_URL": "postgres://postgres:" + secret + "@127.0.0.1:5432/te%zzst"}, nil, 2, "OUTBOX_DATABASE_URL"},
		{"database DSN, bad port", map[string]string{"OUTBOX_DATABASE_URL": "host=127.0.0.1 port=notaport user=postgres password=" + secret + " dbname=test"}, nil, 2, "OUTBOX_DATABASE_URL"},
		{"AMQP URL, bad port", map[string]string{"OUTBOX_AMQP_URL": "amqp://guest:" + secret + "@127.0.0.1:notaport/"}, amqp, 2, "OUTBOX_AMQP_URL"},
		{"AMQP URL, bad escape in the vhost", map[string]string{"OUTBOX_AMQP_URL": "amqp://guest:" + secret + "@127.0.0.1:5672/%zz"}, amqp, 2, "OUTBOX_AMQP_URL"},
		{"AMQP URL, unclosed [", map[string]string{"OUTBOX_AMQP_URL": "amqp://guest:" + secret + "@[127.0.0.1:5672/"}, amqp, 2, "OUTBOX_AMQP_URL"},
		{"AMQP URL, bad scheme", map[string]string{"OUTBOX_AMQP_URL": "amqq://guest:" + secret + "@127.0.0.1:5672/"}, amqp, 2, "OUTBOX_AMQP_URL"},
		{"AMQP URL, bad escape in the password", map[string]string{"OUTBOX_AMQP_URL": "amqp://guest:" + secret + "%zz" + secret + "@127.0.0.1:5672/"}, amqp, 2, "OUTBOX_AMQP_URL"},
		{"AMQP layout typo", map[string]string{"OUTBOX_AMQP_URL": "amqp://guest:" + secret + "@127.0.0.1:5672/", "OUTBOX_AMQP_LAYOUT": "fanuot"}, amqp, 2, "OUTBOX_AMQP_LAYOUT"},
		{"console token too short", map[string]string{"OUTBOX_CONSOLE_TOKEN": secret[:12], "OUTBOX_CONSOLE_ADDR": "127.0.0.1:0"}, nil, 2, "OUTBOX_CONSOLE_TOKEN"},
		{"console read token too short", map[string]string{"OUTBOX_CONSOLE_READ_TOKEN": secret[:12], "OUTBOX_CONSOLE_ADDR": "127.0.0.1:0"}, nil, 2, "OUTBOX_CONSOLE_READ_TOKEN"},
		{"console token, address typo", map[string]string{"OUTBOX_CONSOLE_TOKEN": secret + secret, "OUTBOX_CONSOLE_ADDR": "127.0.0.1:notaport"}, nil, 0, "OUTBOX_CONSOLE_ADDR"},
		{"console trace URL, bad port", map[string]string{"OUTBOX_CONSOLE_TRACE_URL": "https://u:" + secret + "@tempo:notaport/trace/{trace_id}", "OUTBOX_CONSOLE_ADDR": "127.0.0.1:0"}, nil, 2, "OUTBOX_CONSOLE_TRACE_URL"},
		{"OTLP headers, colon for =", map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization: Bearer " + secret}, otlp, 2, "OTEL_EXPORTER_OTLP_HEADERS"},
		{"OTLP trace headers, colon for =", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-api-key:" + secret}, otlp, 2, "OTEL_EXPORTER_OTLP_TRACES_HEADERS"},
		{"OTLP headers, padded token after a colon", map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization: Basic " + secret + "=="}, otlp, 2, "OTEL_EXPORTER_OTLP_HEADERS"},
		{"OTLP headers, bad escape", map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20" + secret + "%zz"}, otlp, 2, "OTEL_EXPORTER_OTLP_HEADERS"},
		{"OTLP endpoint, bad port", map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://u:" + secret + "@127.0.0.1:notaport"}, nil, 2, "OTEL_EXPORTER_OTLP_ENDPOINT"},
		{"OTLP traces endpoint, bad port", map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://u:" + secret + "@127.0.0.1:notaport/v1/traces"}, nil, 2, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"},
		{"OTLP resource attributes, missing =", map[string]string{"OTEL_RESOURCE_ATTRIBUTES": "service.name=relay,token:" + secret}, otlp, 2, "OTEL_RESOURCE_ATTRIBUTES"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			env := map[string]string{}
			for _, m := range []map[string]string{base, c.extra, c.env} {
				for k, v := range m {
					env[k] = v
				}
			}
			r := runDaemon(t, env)
			for _, out := range []struct{ name, text string }{{"stderr", r.stderr}, {"stdout", r.stdout}} {
				if strings.Contains(out.text, secret) || strings.Contains(out.text, secret[:12]) {
					t.Errorf("the daemon's %s shows the secret:\n%s", out.name, out.text)
				}
			}
			if c.code != 0 && r.code != c.code {
				t.Errorf("exit code %d, want %d; stderr:\n%s", r.code, c.code, r.stderr)
			}
			if r.code == 0 {
				t.Errorf("the daemon exited 0; stderr:\n%s", r.stderr)
			}
			if c.names != "" && !strings.Contains(r.stderr, c.names) {
				t.Errorf("stderr does not name %s:\n%s", c.names, r.stderr)
			}
		})
	}
}
