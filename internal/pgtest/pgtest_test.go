package pgtest_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxkit/watermill-outbox/internal/pgtest"
)

// TestStartRestart: a private cluster starts, restarts and accepts connections.
func TestStartRestart(t *testing.T) {
	st := time.Now()
	c := pgtest.Start(t, pgtest.Options{})
	t.Logf("started in %s: %s", time.Since(st), c.URL("", ""))
	st = time.Now()
	c.Restart()
	t.Logf("restart %s", time.Since(st))
	conn, err := pgx.Connect(context.Background(), c.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	conn.Close(context.Background())
}
