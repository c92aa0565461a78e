package subscriber_test

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
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// exampleTable creates an outbox table in a throw-away schema for an
// example and returns it with the function that drops the schema; a
// service migrates its own table once, at deploy time.
func exampleTable(ctx context.Context, pool *pgxpool.Pool, opts ...schema.MigrateOption) (schema.Table, func()) {
	var b [6]byte
	_, _ = rand.Read(b[:])
	ns := "example_" + hex.EncodeToString(b[:])
	table := schema.MustParseTable(ns + ".org_outbox")
	if err := schema.Migrate(ctx, pool, table, append(opts, schema.WithCreateSchema())...); err != nil {
		panic(err)
	}
	return table, func() { _, _ = pool.Exec(ctx, `DROP SCHEMA `+ns+` CASCADE`) }
}

// The default mode: the subscriber leases committed rows and delivers each
// as a Watermill message whose UUID is the row's event_id; the ack marks
// the row published. In a service a router drives the subscriber
// (forwarder.New + AddTo); here the example reads the channel itself.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1:5432/test
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	table, drop := exampleTable(ctx, pool)
	defer drop()

	eventID := uuid.New()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, table, publisher.Message{TenantID: uuid.New(),
			Topic: "org.organization.created.v1", EventID: eventID, Payload: []byte(`{"name":"Acme"}`)})
		return err
	}); err != nil {
		panic(err)
	}

	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: table}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, "org.organization.created.v1") // or subscriber.AllTopics
	if err != nil {
		panic(err)
	}
	msg := <-msgs
	fmt.Println("UUID is the event_id:", msg.UUID == eventID.String())
	fmt.Println("topic:", msg.Metadata.Get(schema.MetadataTopic), "attempts:", msg.Metadata.Get(schema.MetadataAttempts))
	fmt.Println("payload:", string(msg.Payload))
	msg.Ack() // the publish succeeded: the row is marked published

	published := false
	for deadline := time.Now().Add(5 * time.Second); !published && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+table.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&published); err != nil {
			panic(err)
		}
	}
	fmt.Println("published:", published)
	// Output:
	// UUID is the event_id: true
	// topic: org.organization.created.v1 attempts: 1
	// payload: {"name": "Acme"}
	// published: true
}

// Ordered mode: the rows that share an ordering key are delivered in the
// order they were written, the next only after the previous was acked; any
// number of ordered relays share a table. The table needs the ordering
// columns (schema.WithOrderingKeyColumn, `outbox migrate --ordered`).
func ExampleNew_ordered() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://postgres@127.0.0.1:5432/test
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	table, drop := exampleTable(ctx, pool, schema.WithOrderingKeyColumn())
	defer drop()

	orderID := uuid.NewString()
	for _, event := range []string{"created", "paid", "shipped"} {
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, table, publisher.Message{TenantID: uuid.New(),
				Topic: "shop.order." + event + ".v1", EventID: uuid.New(), Payload: []byte(`{}`),
				OrderingKey: orderID}) // usually the aggregate's id
			return err
		}); err != nil {
			panic(err)
		}
	}

	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: table, Ordered: true}, watermill.NopLogger{})
	if err != nil {
		panic(err)
	}
	defer sub.Close()
	msgs, err := sub.Subscribe(ctx, subscriber.AllTopics) // ordered mode relays every topic of the table
	if err != nil {
		panic(err)
	}
	for range 3 {
		msg := <-msgs
		fmt.Println(msg.Metadata.Get(schema.MetadataTopic))
		msg.Ack() // the key's next row is delivered only after this ack
	}
	// Output:
	// shop.order.created.v1
	// shop.order.paid.v1
	// shop.order.shipped.v1
}
