package subscriber_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// leaderSessionName is the application_name of the session holding t's
// single-active lock, as the console and the runbook read it.
func leaderSessionName(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (string, bool) {
	t.Helper()
	var name string
	err := pool.QueryRow(context.Background(), `SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted AND ((l.classid::bigint << 32) | l.objid::bigint) = $1::bigint`, sqlq.LockKey(tbl)).Scan(&name)
	return name, err == nil
}

// TestLeaderSessionNamed: a relay embedded in an application, on a pool
// whose connections have no application_name, names its leader session
// "outbox-relay <host> <pid>" (the console showed "unnamed session"), and
// gives the connection back to the pool unnamed; a pool's own name is kept.
func TestLeaderSessionNamed(t *testing.T) {
	t.Parallel()
	host, _ := os.Hostname()
	for _, tc := range []struct{ poolName, want string }{
		{"", sqlq.RelayApplicationPrefix + host + " " + strconv.Itoa(os.Getpid())},
		{"billing-api", "billing-api"},
	} {
		t.Run("pool name "+strconv.Quote(tc.poolName), func(t *testing.T) {
			t.Parallel()
			pool := testdb.NewPool(t, func(c *pgxpool.Config) {
				delete(c.ConnConfig.RuntimeParams, "application_name")
				if tc.poolName != "" {
					c.ConnConfig.RuntimeParams["application_name"] = tc.poolName
				}
			})
			tbl := testdb.Table(t, "named_outbox")
			s := newSub(t, pool, subscriber.Config{Table: tbl, ElectionInterval: 100 * time.Millisecond})
			ctx, cancel := context.WithCancel(context.Background())
			ch, err := s.Subscribe(ctx, subscriber.AllTopics)
			if err != nil {
				t.Fatal(err)
			}
			waitFor(t, "leadership", 2*time.Minute, s.IsLeader)
			name, ok := leaderSessionName(t, pool, tbl)
			if !ok || name != tc.want[:min(len(tc.want), 63)] {
				t.Fatalf("the leader session is named %q (found %v), want %q", name, ok, tc.want)
			}
			cancel()
			for range ch {
			}
			waitFor(t, "the leader connection back in the pool", 2*time.Minute, func() bool { return pool.Stat().AcquiredConns() == 0 })
			for _, c := range pool.AcquireAllIdle(context.Background()) {
				var got string
				err := c.QueryRow(context.Background(), `SELECT current_setting('application_name')`).Scan(&got)
				c.Release()
				if err != nil || got != tc.poolName {
					t.Fatalf("a pool connection is named %q (%v) after the relay resigned, want %q", got, err, tc.poolName)
				}
			}
		})
	}
}
