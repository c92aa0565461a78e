// Package plumbing is the scaffolding the examples share: connecting to
// PostgreSQL from OUTBOX_DATABASE_URL, a throw-away schema per run, a logger,
// starting and stopping routers and the relay in the background, waiting for
// the relay to catch up, and an in-process Kafka cluster.
//
// It is example scaffolding, not part of the library: it exists so that each
// example's main.go shows the outbox and nothing else. A service replaces it
// with its own connection and lifecycle code (its configuration, its
// migrations, its way of running and shutting down components); copy what you
// need from here, or import it only while you try the examples out.
package plumbing

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/schema"
)

// DefaultDatabaseURL is used when OUTBOX_DATABASE_URL is not set.
const DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// DatabaseURL is OUTBOX_DATABASE_URL, or DefaultDatabaseURL (the local test
// database) when it is not set.
func DatabaseURL() string {
	if u := os.Getenv("OUTBOX_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultDatabaseURL
}

// Connect opens a pool and checks the database is reachable; an unreachable
// database is an error that names its address. The relay holds two
// connections while it relays (the single-active leader's and the
// LISTEN/NOTIFY one): size the pool for them plus your own traffic.
func Connect(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	cfg.MaxConns = 10
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		return nil, fmt.Errorf("PostgreSQL at %s:%d is unreachable (start it, or set OUTBOX_DATABASE_URL to a database you can use, such as postgres://user:password@host:5432/db): %w",
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	return pool, nil
}

// CreateSchema creates a fresh schema example_<random hex>, so that runs do
// not see each other, and returns its name and the function that drops it
// with everything in it.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool) (name string, drop func() error, err error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", nil, err
	}
	ns := "example_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{ns}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create schema %s: %w", ns, err)
	}
	drop = func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{ns}.Sanitize()+` CASCADE`); err != nil {
			return fmt.Errorf("drop schema %s: %w", ns, err)
		}
		return nil
	}
	return ns, drop, nil
}

// NewLogger logs warnings and errors of the relay, routers and clients to
// stderr.
func NewLogger() watermill.LoggerAdapter {
	return watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
}

// StartRouter runs r in the background until its handlers are subscribed,
// and returns the function that stops it and reports how Run ended (safe to
// call more than once).
func StartRouter(ctx context.Context, r *message.Router) (stop func() error, err error) {
	return start(ctx, "router", r.Run, r.Running(), r.Close)
}

// StartForwarder runs the relay in the background until it is running, and
// returns the function that stops it and reports how Run ended (safe to call
// more than once), like StartRouter.
func StartForwarder(ctx context.Context, f *forwarder.Forwarder) (stop func() error, err error) {
	return start(ctx, "forwarder", f.Run, f.Running(), f.Close)
}

// start calls run in the background and waits until running is closed, or
// run returns first (an error). The returned stop calls closeFn and waits for
// run to return.
func start(ctx context.Context, what string, run func(context.Context) error, running <-chan struct{}, closeFn func() error) (stop func() error, err error) {
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	select {
	case <-running:
	case err := <-done:
		if err == nil {
			err = fmt.Errorf("%s stopped while starting", what)
		}
		return nil, err
	}
	return sync.OnceValue(func() error { return errors.Join(closeFn(), <-done) }), nil
}

// WaitAllPublished waits until every row of the outbox t is published, or
// ctx ends.
func WaitAllPublished(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	return waitNoRows(ctx, pool, t, `published_at IS NULL`, "not published")
}

// WaitSettled waits until every row of the outbox t is published or dead, or
// ctx ends: for a run where some events are meant to go dead.
func WaitSettled(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	return waitNoRows(ctx, pool, t, `published_at IS NULL AND dead_at IS NULL`, "neither published nor dead")
}

// waitNoRows polls t until no row matches the condition where; state says
// what the rows left over are (for the error when ctx ends first).
func waitNoRows(ctx context.Context, pool *pgxpool.Pool, t schema.Table, where, state string) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var pending int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.Sanitize()+` WHERE `+where).Scan(&pending); err != nil {
			return fmt.Errorf("count pending rows: %w", err)
		}
		if pending == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d rows of %s %s in time: %w", pending, t, state, ctx.Err())
		case <-tick.C:
		}
	}
}

// SyncWriter serialises writes to W: handlers print from their own
// goroutines.
type SyncWriter struct {
	mu sync.Mutex
	W  io.Writer // where the writes go
}

// Write writes p to W, one call at a time.
func (s *SyncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.W.Write(p)
}

// StartKafka starts a one-broker Kafka-protocol cluster inside the process
// (franz-go's kfake), topics created on first use with three partitions;
// Watermill's Kafka backend talks to it over the network (at the cluster's
// ListenAddrs) as to any Kafka. Close the cluster when done. In your service,
// use your brokers instead.
func StartKafka() (*kfake.Cluster, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(3))
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka cluster: %w", err)
	}
	return c, nil
}
