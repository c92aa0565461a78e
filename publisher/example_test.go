package publisher_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

// Enqueue writes the event in the transaction that writes the business row:
// both commit, or neither does. Enqueueing the same event_id again returns
// the first row's sequence and writes nothing.
func ExampleEnqueue() {
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
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+ns+`; CREATE TABLE `+ns+`.organizations (id UUID PRIMARY KEY, name TEXT NOT NULL)`); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) //nolint:errcheck // best-effort cleanup of the example
	table := schema.MustParseTable(ns + ".org_outbox")
	if err := schema.Migrate(ctx, pool, table); err != nil {
		panic(err)
	}

	orgID, eventID := uuid.New(), uuid.New()
	var first, again int64
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO `+ns+`.organizations (id, name) VALUES ($1, $2)`, orgID, "Acme"); err != nil {
			return err
		}
		msg := publisher.Message{
			TenantID: uuid.New(),
			Topic:    "org.organization.created.v1",
			EventID:  eventID,
			Payload:  []byte(`{"organization_id":"` + orgID.String() + `","name":"Acme"}`),
		}
		if first, err = publisher.Enqueue(ctx, tx, table, msg); err != nil {
			return err
		}
		again, err = publisher.Enqueue(ctx, tx, table, msg) // a retried request: idempotent
		return err
	})
	if err != nil {
		panic(err)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table.Sanitize()+` WHERE published_at IS NULL`).Scan(&rows); err != nil {
		panic(err)
	}
	fmt.Println("same sequence:", first == again, "pending rows:", rows)
	// Output: same sequence: true pending rows: 1
}
