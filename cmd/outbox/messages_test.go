package main

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// TestStartupMessagesSayOneThing: each start-up mistake is reported as
// itself, once, naming the variable to fix.
func TestStartupMessagesSayOneThing(t *testing.T) {
	t.Parallel()
	base := func(kv ...string) map[string]string {
		env := map[string]string{
			"OUTBOX_DATABASE_URL": testdb.URL(),
			"OUTBOX_RELAY_TABLES": "public.org_outbox",
			"OUTBOX_BACKEND":      "amqp",
			"OUTBOX_AMQP_URL":     "amqp://guest:guest@127.0.0.1:5672/",
		}
		for i := 0; i+1 < len(kv); i += 2 {
			env[kv[i]] = kv[i+1]
		}
		return env
	}

	// A bad table name is not also "not set".
	r := rbRun(t, base("OUTBOX_RELAY_TABLES", "Bad Table"), "relay")
	r.expect(t, 2, nil, []string{"OUTBOX_RELAY_TABLES: invalid outbox table name"})
	if strings.Contains(r.stderr, "is not set") {
		t.Fatalf("a bad value is also reported as unset:\n%s", r.stderr)
	}

	// A missing table is the first and only error: no cleaner error before it.
	missing := testdb.Schema(t) + ".missing_outbox"
	r = rbRun(t, base("OUTBOX_RELAY_TABLES", missing), "relay")
	r.expect(t, 1, nil, []string{"outbox table not found: " + missing, "outbox migrate"})
	if strings.Contains(r.stderr, "level=ERROR") {
		t.Fatalf("an unrelated error was logged before the missing table:\n%s", r.stderr)
	}

	// An unparsable URL says what is wrong, and not the password.
	r = rbRun(t, base("OUTBOX_DATABASE_URL", "postgres://u:pw-s3cret@db:notaport/x"), "relay")
	r.expect(t, 2, nil, []string{"OUTBOX_DATABASE_URL is not a valid PostgreSQL URL or DSN: invalid port", "postgres://user:password@host:5432/database"})
	if strings.Contains(r.stderr, "s3cret") {
		t.Fatalf("password printed:\n%s", r.stderr)
	}

	// A broker that refuses the credentials names the variable to fix.
	r = rbRun(t, base("OUTBOX_AMQP_URL", "amqp://guest:wrong-s3cret@127.0.0.1:5672/", "OUTBOX_CLEANER_ENABLED", "false",
		"OUTBOX_RELAY_TABLES", testdb.Table(t, "org_outbox").String()), "relay")
	r.expect(t, 1, nil, []string{"OUTBOX_BACKEND=amqp", "check OUTBOX_AMQP_URL"})
	if strings.Contains(r.stderr, "s3cret") {
		t.Fatalf("password printed:\n%s", r.stderr)
	}
}

// TestDaemonRefusesGoChannel: an in-process backend in the daemon could
// only send every event dead, so it is a start-up error naming the way out.
func TestDaemonRefusesGoChannel(t *testing.T) {
	t.Parallel()
	r := rbRun(t, map[string]string{"OUTBOX_DATABASE_URL": testdb.URL(), "OUTBOX_RELAY_TABLES": "public.org_outbox", "OUTBOX_BACKEND": "gochannel"}, "relay")
	r.expect(t, 2, nil, []string{"OUTBOX_BACKEND=gochannel cannot work in the daemon", "use kafka or amqp", "router.NewInProcess()"})
}

// TestDaemonAMQPLayoutValidated: a bad AMQP layout is a start-up error
// naming the variables.
func TestDaemonAMQPLayoutValidated(t *testing.T) {
	t.Parallel()
	env := map[string]string{"OUTBOX_DATABASE_URL": testdb.URL(), "OUTBOX_RELAY_TABLES": "public.org_outbox", "OUTBOX_BACKEND": "amqp",
		"OUTBOX_AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/", "OUTBOX_AMQP_LAYOUT": "mesh"}
	rbRun(t, env, "relay").expect(t, 2, nil, []string{`OUTBOX_AMQP_LAYOUT="mesh"`, `Layout: "mesh" is not a layout`})
	env["OUTBOX_AMQP_LAYOUT"], env["OUTBOX_AMQP_EXCHANGE"] = "queue", "events"
	rbRun(t, env, "relay").expect(t, 2, nil, []string{`OUTBOX_AMQP_EXCHANGE="events"`, "only LayoutFanout"})
}
