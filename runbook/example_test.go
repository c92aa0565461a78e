package runbook_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The runbook of one table: build it once, then call its operations.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	rb := runbook.New(pool, schema.MustParseTable("public.org_outbox"))
	stats, err := rb.Stats(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Printf("%s (%s mode): %d pending, %d dead\n", stats.Table, stats.Mode, stats.Pending, stats.Dead)
}

// An event goes dead (its only allowed attempt failed); the operator finds
// it with Dead, replays it with ReplayEvent (`outbox dead replay
// --event-id=...`), and Stats shows it pending again, due for the relay.
func ExampleRunbook_ReplayEvent() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1:5432/test
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	// A throw-away schema for the example; a service uses its own tables.
	var b [6]byte
	_, _ = rand.Read(b[:])
	ns := "example_" + hex.EncodeToString(b[:])
	table := schema.MustParseTable(ns + ".org_outbox")
	if err := schema.Migrate(ctx, pool, table, schema.WithCreateSchema()); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) //nolint:errcheck // best-effort cleanup of the example

	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, table, publisher.Message{TenantID: uuid.New(),
			Topic: "org.organization.created.v1", EventID: uuid.New(), Payload: []byte(`{"name":"Acme"}`)})
		return err
	}); err != nil {
		panic(err)
	}

	// A relay allowed one attempt, whose publish fails.
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: table, MaxAttempts: 1}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	msgs, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		panic(err)
	}
	(<-msgs).Nack()

	rb := runbook.New(pool, table)
	var stats runbook.TableStats
	for deadline := time.Now().Add(5 * time.Second); stats.Dead == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if stats, err = rb.Stats(ctx); err != nil {
			panic(err)
		}
	}
	if err := sub.Close(); err != nil {
		panic(err)
	}
	fmt.Printf("pending %d, dead %d\n", stats.Pending, stats.Dead)

	dead, err := rb.Dead(ctx, runbook.DeadFilter{Topic: "org.organization.created.v1", Limit: 10})
	if err != nil {
		panic(err)
	}
	for _, row := range dead {
		fmt.Printf("dead: %s after %d attempt(s)\n", row.Topic, row.Attempts)
	}

	res, err := rb.ReplayEvent(ctx, dead[0].EventID, runbook.ReplayOptions{})
	if err != nil {
		panic(err)
	}
	fmt.Println("replayed rows:", res.Changed)
	if stats, err = rb.Stats(ctx); err != nil {
		panic(err)
	}
	fmt.Printf("pending %d, dead %d\n", stats.Pending, stats.Dead)
	// Output:
	// pending 0, dead 1
	// dead: org.organization.created.v1 after 1 attempt(s)
	// replayed rows: 1
	// pending 1, dead 0
}
