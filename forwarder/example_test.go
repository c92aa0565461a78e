package forwarder_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The relay on a router the service already runs: forwarder.New with the
// zero Config relays each row to the broker topic its topic column names,
// and AddTo adds it to the router as one more handler. Here the broker is a
// GoChannel; in production, any Watermill publisher (Kafka, AMQP, ...).
func ExampleForwarder_AddTo() {
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

	// A service writes an event in its transaction.
	eventID := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, table, publisher.Message{TenantID: uuid.New(), Topic: "org.organization.created.v1",
			EventID: eventID, Payload: []byte(`{"name":"Acme"}`)})
		return err
	}); err != nil {
		panic(err)
	}

	broker := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer broker.Close()
	received, err := broker.Subscribe(ctx, "org.organization.created.v1") // a consumer elsewhere
	if err != nil {
		panic(err)
	}

	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{}) // the router you already run
	if err != nil {
		panic(err)
	}
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: table}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	fwd, err := forwarder.New(sub, broker, forwarder.Config{}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	fwd.AddTo(r)
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	defer func() {
		_ = r.Close() // closes the subscriber too
		if err := <-done; err != nil {
			panic(err)
		}
	}()

	msg := <-received
	msg.Ack()
	fmt.Println("relayed:", msg.UUID == eventID.String(), string(msg.Payload))
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var published bool
		if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+table.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&published); err != nil {
			panic(err)
		}
		if published {
			fmt.Println("row marked published")
			break
		}
	}
	// Output:
	// relayed: true {"name": "Acme"}
	// row marked published
}
