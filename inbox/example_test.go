package inbox_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/schema"
)

// A handler behind the inbox writes through inbox.Tx; the same event
// delivered three times changes the database once.
func ExampleInbox_Middleware() {
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
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+ns+`; CREATE TABLE `+ns+`.accounts (event_id TEXT NOT NULL)`); err != nil {
		panic(err)
	}
	defer pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) //nolint:errcheck // best-effort cleanup of the example

	table := schema.MustParseTable(ns + ".billing_inbox")
	if err := inbox.Migrate(ctx, pool, table); err != nil {
		panic(err)
	}
	ib, err := inbox.New(pool, inbox.Config{Table: table, Consumer: "billing.create-account"})
	if err != nil {
		panic(err)
	}
	defer ib.Close()

	handler := func(msg *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.Tx(msg.Context())
		_, err := tx.Exec(msg.Context(), `INSERT INTO `+ns+`.accounts (event_id) VALUES ($1)`, msg.UUID)
		return nil, err
	}
	// In a router: r.AddMiddleware(middleware.Recoverer, ib.Middleware).
	h := middleware.Recoverer(ib.Middleware(handler))
	for range 3 {
		msg := message.NewMessage("0b5e3f6c-9a56-4c1e-8d7a-3f2b1c0d9e8f", []byte(`{}`))
		msg.Metadata.Set(schema.MetadataEventID, msg.UUID)
		if _, err := h(msg); err != nil {
			panic(err)
		}
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+ns+`.accounts`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("deliveries: 3, accounts created:", n)
	// Output: deliveries: 3, accounts created: 1
}
