package schema_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/schema"
)

// Migrate creates the outbox table, its indexes and the optional columns
// asked for; run again, it changes nothing.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1:5432/test
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	// A throw-away schema for the example; a service uses its own.
	var b [6]byte
	_, _ = rand.Read(b[:])
	ns := "example_" + hex.EncodeToString(b[:])
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+ns); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) //nolint:errcheck // best-effort cleanup of the example

	table, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		panic(err)
	}
	for range 2 { // idempotent: the second run finds everything in place
		if err := schema.Migrate(ctx, pool, table, schema.WithHeadersColumn()); err != nil {
			panic(err)
		}
	}
	cols, err := schema.DetectColumns(ctx, pool, table)
	if err != nil {
		panic(err)
	}
	fmt.Println("table:", table.Name(), "headers column:", cols.Headers)
	// Output: table: org_outbox headers column: true
}
