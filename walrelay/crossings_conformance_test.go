package walrelay_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
	"github.com/outboxkit/watermill-outbox/internal/relaytest"
)

// crossingKnownBroken names the crossings (internal/relaytest/crossings.go)
// that fail for the WAL relay today, by case, with why.
var crossingKnownBroken = map[string]string{}

// TestCrossing runs the crossing cases of the conformance suite against the
// WAL relay, on a private wal_level=logical cluster that the cases share.
func TestCrossing(t *testing.T) {
	t.Parallel()
	clusterSlots <- struct{}{}
	t.Cleanup(func() { <-clusterSlots })
	pg := pgtest.Start(t, pgtest.Options{Settings: map[string]string{
		"wal_level": "logical", "max_replication_slots": "100", "max_wal_senders": "100", "wal_sender_timeout": "10s",
		"max_connections": "300",
	}})
	cfg, err := pgxpool.ParseConfig(pg.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 100
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	r := conformanceRelay(pool)
	for _, c := range relaytest.Crossings {
		t.Run(c.Name, func(t *testing.T) {
			t.Parallel()
			if why, ok := crossingKnownBroken[c.Name]; ok {
				t.Skip("known broken: " + why)
			}
			c.Fn(t, r)
		})
	}
}
