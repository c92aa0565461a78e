package pgtest_test

import (
	"context"
	"net"
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

// TestStartOnAnotherPortWhenTaken: a port found free can be taken by
// another process before the server binds it (seen once in CI: "could not
// bind IPv4 address ... Address already in use"); Start then starts the
// server on another free port. Not parallel: it replaces the port picker.
func TestStartOnAnotherPortWhenTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	taken := ln.Addr().(*net.TCPAddr).Port
	calls := 0
	pgtest.SetFreePort(t, func(tb testing.TB, host string) int {
		calls++
		if calls == 1 {
			return taken
		}
		return pgtest.FreePort(tb, host)
	})
	c := pgtest.Start(t, pgtest.Options{})
	if c.Port == taken || calls != 2 {
		t.Fatalf("started on port %d after %d picks; want another port than the taken %d, on the second pick", c.Port, calls, taken)
	}
	conn, err := pgx.Connect(context.Background(), c.URL("", ""))
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(context.Background())
}
