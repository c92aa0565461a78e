// Package testdb is the test harness shared by the project's tests: a
// connection to the real PostgreSQL named by TEST_DATABASE_URL and a fresh
// schema per test, so tests run in parallel without seeing each other.
//
// A missing database fails the test loudly; it is never skipped.
package testdb

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/schema"
)

// DefaultURL is used when TEST_DATABASE_URL is not set.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

// URL returns the test database URL.
func URL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

var (
	sharedOnce sync.Once
	shared     *pgxpool.Pool
	sharedErr  error
)

// Pool returns a pool shared by the tests of the package. It fails the test
// when the database cannot be reached.
func Pool(tb testing.TB) *pgxpool.Pool {
	tb.Helper()
	sharedOnce.Do(func() {
		cfg, err := pgxpool.ParseConfig(URL())
		if err != nil {
			sharedErr = err
			return
		}
		cfg.MaxConns = 40
		shared, sharedErr = connect(cfg)
	})
	if sharedErr != nil {
		tb.Fatalf("PostgreSQL at %s is required and unreachable (run `make up`): %v", URL(), sharedErr)
	}
	return shared
}

// ClosePool closes the shared pool, so that a leak check run after the tests
// sees none of its connections' goroutines.
func ClosePool() {
	if shared != nil {
		shared.Close()
	}
}

// NewPool returns a pool of its own, closed when the test ends, configured by
// mutate when it is not nil.
func NewPool(tb testing.TB, mutate func(*pgxpool.Config)) *pgxpool.Pool {
	tb.Helper()
	cfg, err := pgxpool.ParseConfig(URL())
	if err != nil {
		tb.Fatalf("parse TEST_DATABASE_URL: %v", err)
	}
	if mutate != nil {
		mutate(cfg)
	}
	pool, err := connect(cfg)
	if err != nil {
		tb.Fatalf("PostgreSQL at %s is required and unreachable (run `make up`): %v", URL(), err)
	}
	tb.Cleanup(pool.Close)
	return pool
}

func connect(cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// Schema creates a fresh schema, dropped when the test ends, and returns its
// name.
func Schema(tb testing.TB) string {
	tb.Helper()
	pool := Pool(tb)
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{name}.Sanitize()); err != nil {
		tb.Fatalf("create test schema: %v", err)
	}
	tb.Cleanup(func() {
		if _, err := pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{name}.Sanitize()+` CASCADE`); err != nil {
			tb.Errorf("drop test schema %s: %v", name, err)
		}
	})
	return name
}

// Table creates an outbox table named <fresh schema>.<name> with the optional
// columns opts ask for, and returns it.
func Table(tb testing.TB, name string, opts ...schema.MigrateOption) schema.Table {
	tb.Helper()
	t := schema.MustParseTable(Schema(tb) + "." + name)
	if err := schema.Migrate(context.Background(), Pool(tb), t, opts...); err != nil {
		tb.Fatalf("migrate %s: %v", t, err)
	}
	return t
}

// MigrationSQL returns the SQL of tbl's migration step (its number, as
// "000008") in direction dir ("up" or "down"), as schema.MigrationFiles
// renders it: tests use it to put a table back to an older version.
func MigrationSQL(tb testing.TB, tbl schema.Table, step, dir string) string {
	tb.Helper()
	for path, body := range schema.MigrationFiles(tbl) {
		if strings.HasPrefix(path, "migrations/"+step+"_") && strings.HasSuffix(path, "."+dir+".sql") {
			return body
		}
	}
	tb.Fatalf("no migration %s (%s) for %s", step, dir, tbl)
	return ""
}
