package main

// The plumbing every example has (connecting, a throw-away schema, starting
// and stopping routers), kept apart so that main.go shows the outbox. Copy it
// with the example, or replace it with your own connection and lifecycle code.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/schema"
)

// defaultDatabaseURL is used when OUTBOX_DATABASE_URL is not set.
const defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// databaseURL is OUTBOX_DATABASE_URL, or the local test database.
func databaseURL() string {
	if u := os.Getenv("OUTBOX_DATABASE_URL"); u != "" {
		return u
	}
	return defaultDatabaseURL
}

// connect opens a pool and checks the database is reachable. The relay holds
// two connections while it relays (the single-active leader's and the
// LISTEN/NOTIFY one): size the pool for them plus your own traffic.
func connect(ctx context.Context, dbURL string) (*pgxpool.Pool, error) {
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
		return nil, fmt.Errorf("PostgreSQL at %s:%d is unreachable (start it with `make up`, or set OUTBOX_DATABASE_URL): %w",
			cfg.ConnConfig.Host, cfg.ConnConfig.Port, err)
	}
	return pool, nil
}

// createSchema creates a fresh schema example_<random hex>, so that runs do
// not see each other, and returns the function that drops it.
func createSchema(ctx context.Context, pool *pgxpool.Pool) (string, func() error, error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", nil, err
	}
	ns := "example_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{ns}.Sanitize()); err != nil {
		return "", nil, fmt.Errorf("create schema %s: %w", ns, err)
	}
	drop := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, `DROP SCHEMA `+pgx.Identifier{ns}.Sanitize()+` CASCADE`); err != nil {
			return fmt.Errorf("drop schema %s: %w", ns, err)
		}
		return nil
	}
	return ns, drop, nil
}

// newLogger logs warnings and errors of the relay, routers and clients to
// stderr.
func newLogger() watermill.LoggerAdapter {
	return watermill.NewSlogLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})))
}

// startForwarder runs the relay in the background, like startRouter.
func startForwarder(ctx context.Context, f *forwarder.Forwarder) (stop func() error, err error) {
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	select {
	case <-f.Running():
	case err := <-done:
		if err == nil {
			err = errors.New("forwarder stopped while starting")
		}
		return nil, err
	}
	return sync.OnceValue(func() error { return errors.Join(f.Close(), <-done) }), nil
}

// waitAllPublished waits until every row of t is published.
func waitAllPublished(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var pending int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.Sanitize()+` WHERE published_at IS NULL`).Scan(&pending); err != nil {
			return fmt.Errorf("count pending rows: %w", err)
		}
		if pending == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d rows of %s not published in time: %w", pending, t, ctx.Err())
		case <-tick.C:
		}
	}
}

// startKafka starts a one-broker Kafka-protocol cluster inside the process
// (franz-go's kfake), topics created on first use with three partitions;
// Watermill's Kafka backend talks to it over the network as to any Kafka.
// In your service, use your brokers instead.
func startKafka() (*kfake.Cluster, error) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(3))
	if err != nil {
		return nil, fmt.Errorf("start in-process Kafka cluster: %w", err)
	}
	return c, nil
}
