package walrelay_test

import (
	"context"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// The WAL relay streams an outbox table's committed rows from logical
// replication and hands them to a router like the table relay. It needs a
// server with wal_level = logical and a role with the REPLICATION
// attribute, so this example is compiled, not run. Setup (or `outbox
// migrate --wal`) runs once, at deploy time; rows committed before it are
// not streamed.
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	logger := watermill.NewStdLogger(false, false)
	pool, err := pgxpool.New(ctx, os.Getenv("OUTBOX_DATABASE_URL")) // e.g. postgres://relay@db:5432/app
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	table := schema.MustParseTable("public.org_outbox")
	if err := schema.Migrate(ctx, pool, table, schema.WithAllColumns()); err != nil {
		panic(err)
	}
	if _, err := walrelay.Setup(ctx, pool, table, walrelay.Names{}); err != nil { // the publication and the slot
		panic(err)
	}

	sub, err := walrelay.New(ctx, pool, walrelay.Config{Table: table}, logger)
	if err != nil {
		panic(err) // walrelay.ErrNotSetUp without Setup
	}
	defer sub.Close()
	pub, err := kafkabackend.NewPublisher(strings.Split(os.Getenv("OUTBOX_KAFKA_BROKERS"), ","), logger)
	if err != nil {
		panic(err)
	}
	defer pub.Close()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, logger)
	if err != nil {
		panic(err)
	}
	defer r.Close()
	fwd, err := forwarder.New(sub, pub, forwarder.Config{}, logger)
	if err != nil {
		panic(err)
	}
	fwd.AddTo(r)
	// Until SIGTERM: then the router drains the messages in flight, and the
	// deferred calls close the router, the relay and the pool.
	if err := r.Run(ctx); err != nil {
		panic(err)
	}
}
