package main

import (
	"strings"
	"testing"

	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
)

// kafkaBrokers starts an in-process Kafka cluster for a daemon under test
// and returns its bootstrap address.
func kafkaBrokers(t *testing.T) string {
	t.Helper()
	c, err := kafkatest.Start(1, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return strings.Join(c.Brokers(), ",")
}

// TestLockTTLTooShortIsAUsageError: OUTBOX_RELAY_LOCK_TTL below
// subscriber.LockTTLMin stops the daemon at start with exit code 2 naming
// the variable, before any connection, instead of a minute of start-up
// retries of the relay's refusal.
func TestLockTTLTooShortIsAUsageError(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "cli_lockttl_outbox")
	r := rbRun(t, rbEnv("OUTBOX_RELAY_TABLES", tbl.String(), "OUTBOX_BACKEND", "kafka", "OUTBOX_KAFKA_BROKERS", kafkaBrokers(t),
		"OUTBOX_RELAY_LOCK_TTL", "50ms"), "relay")
	r.expect(t, 2, nil, []string{"OUTBOX_RELAY_LOCK_TTL=50ms is below 100ms"})
	if strings.Contains(r.stderr, "retrying") {
		t.Errorf("the daemon retried a bad value:\n%s", r.stderr)
	}
}

// TestWALLevelReplicaIsAUsageError: OUTBOX_RELAY_SOURCE=wal on a server
// whose wal_level is replica (which only a server restart changes) stops
// the daemon with exit code 2 naming the variable and wal_level, at once,
// instead of a minute of start-up retries.
func TestWALLevelReplicaIsAUsageError(t *testing.T) {
	t.Parallel()
	cluster := pgtest.Start(t, pgtest.Options{Settings: map[string]string{"wal_level": "replica"}})
	env := map[string]string{"OUTBOX_DATABASE_URL": cluster.URL("", "")}
	const tbl = "public.cli_wallevel_outbox"
	rbRun(t, env, "migrate", "--table="+tbl).expect(t, 0, []string{"migrated " + tbl}, nil)
	env["OUTBOX_RELAY_TABLES"], env["OUTBOX_BACKEND"], env["OUTBOX_KAFKA_BROKERS"], env["OUTBOX_RELAY_SOURCE"] = tbl, "kafka", kafkaBrokers(t), "wal"
	r := rbRun(t, env, "relay")
	r.expect(t, 2, nil, []string{"OUTBOX_RELAY_SOURCE=wal", `wal_level is not logical: it is "replica"`})
	if strings.Contains(r.stderr, "retrying") {
		t.Errorf("the daemon retried a wal_level that only a restart changes:\n%s", r.stderr)
	}
}
