package main

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TestDeadReplayJudgesLeasesByTheRelaysLockTTL: the table's relays run
// with LockTTL 5m and record it at start; `outbox dead replay` without
// OUTBOX_RELAY_LOCK_TTL, or with a shorter one, refuses a row leased 90 s
// ago and leaves a dead one out of a bulk replay, saying it judged by 5m:
// OUTBOX_RELAY_LOCK_TTL is only a lower bound.
func TestDeadReplayJudgesLeasesByTheRelaysLockTTL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "cli_lockttl_outbox")
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, LockTTL: 5 * time.Minute}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Subscribe(ctx, subscriber.AllTopics); err != nil {
		t.Fatal(err)
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA)
	rbExec(t, pool, tbl, `UPDATE %s SET attempts = 2, last_error = 'timeout', available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, ids[0])
	rbExec(t, pool, tbl, `UPDATE %s SET attempts = 25, last_error = 'timeout', dead_at = now(), available_at = now() - interval '95 seconds',
  locked_at = now() - interval '90 seconds' WHERE event_id = $1`, ids[1])
	for _, env := range []map[string]string{rbEnv(), rbEnv("OUTBOX_RELAY_LOCK_TTL", "30s")} {
		for _, id := range ids {
			r := rbRun(t, env, "dead", "replay", "--table="+tbl.String(), "--event-id="+id.String(), "--confirm")
			r.expect(t, 1, nil, []string{"leased it", "lock TTL 5m0s", "nothing changed"})
		}
		r := rbRun(t, env, "dead", "replay", "--table="+tbl.String(), "--topic="+rbTopicA, "--dry-run")
		r.expect(t, 0, []string{"skipping rows leased in the last 5m0s", "Nothing to replay"}, nil)
	}
}
