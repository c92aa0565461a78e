// Command inbox shows a consumer whose effects happen once per event, with
// the inbox middleware (package inbox), and the consume-transform-produce
// chain:
//
//  1. a shop enqueues shop.order.placed.v1 in its outbox (publisher.Enqueue);
//  2. the relay delivers it to a Watermill router (router.InProcess) whose
//     billing handler runs behind subscriber.CaptureError,
//     middleware.Recoverer and the inbox middleware: the handler writes an
//     invoice through inbox.Tx(msg.Context()) and enqueues the next event,
//     billing.invoice.created.v1, in the billing outbox in the SAME
//     transaction as the inbox record;
//  3. the same event delivered twice more is acked without running the
//     handler: one invoice, one next event;
//  4. an order the handler rejects (a negative amount) is nacked, and its
//     invoice, next event and inbox record are all rolled back.
//
// Run it with `go run ./examples/inbox` against the PostgreSQL of
// OUTBOX_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test). It
// works in a fresh schema example_<random hex> and drops it at the end.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// Topics follow the default rule <module>.<aggregate>.<event>.vN.
const (
	TopicOrderPlaced    = "shop.order.placed.v1"
	TopicInvoiceCreated = "billing.invoice.created.v1"
)

// shopTenant is the tenant of the example's events.
var shopTenant = uuid.MustParse("6f1c2c7e-3a52-4f7e-9f0a-2b1d9c1e5a77")

// OrderPlaced is the consumed event.
type OrderPlaced struct {
	OrderID uuid.UUID `json:"order_id"`
	Amount  int       `json:"amount_cents"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Stdout, plumbing.DatabaseURL())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "inbox:", err)
		os.Exit(1)
	}
}

// tables are the example's tables, all in one fresh schema.
type tables struct {
	shopOutbox    schema.Table // the producer's outbox
	billingInbox  schema.Table // the consumer's inbox, created by inbox.Migrate
	billingOutbox schema.Table // the consumer's own outbox, for the next event
	invoices      string       // the consumer's effect (sanitized name)
}

func run(ctx context.Context, w io.Writer, dbURL string) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := &plumbing.SyncWriter{W: w}
	logger := plumbing.NewLogger()

	pool, err := plumbing.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	ns, dropSchema, err := plumbing.CreateSchema(ctx, pool)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dropSchema()) }()
	t, err := createTables(ctx, pool, ns)
	if err != nil {
		return err
	}

	// The consumer: a billing handler behind the inbox middleware.
	ib, err := inbox.New(pool, inbox.Config{Table: t.billingInbox, Consumer: "billing.create-invoice", Logger: logger})
	if err != nil {
		return err
	}
	defer ib.Close()
	billing := &billingHandler{tables: t, out: out}
	bus := router.NewInProcess()
	defer bus.Close()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Outermost first: CaptureError hands errors to the relay, Recoverer
	// turns a panic (re-raised by the inbox after its rollback) into a nack.
	r.AddMiddleware(subscriber.CaptureError, middleware.Recoverer, ib.Middleware)
	r.AddConsumerHandler("billing.create-invoice", TopicOrderPlaced, bus, billing.Handle)
	stopRouter, err := plumbing.StartRouter(ctx, r)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	defer func() { err = errors.Join(err, stopRouter()) }()

	// 1. The shop places an order.
	order := OrderPlaced{OrderID: uuid.New(), Amount: 4200}
	eventID, err := placeOrder(ctx, pool, t, order)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "enqueued %s event_id=%s\n", TopicOrderPlaced, eventID)

	// 2. The relay delivers it.
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: t.shopOutbox}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	fwd, err := forwarder.New(sub, bus, forwarder.Config{}, logger)
	if err != nil {
		return err
	}
	stopRelay, err := plumbing.StartForwarder(ctx, fwd)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer func() { err = errors.Join(err, stopRelay()) }()
	if err := plumbing.WaitAllPublished(ctx, pool, t.shopOutbox); err != nil {
		return err
	}

	// 3. At least once: the same event arrives twice more.
	for range 2 {
		if err := bus.Publish(TopicOrderPlaced, delivery(eventID, order)); err != nil {
			return fmt.Errorf("redeliver: %w", err)
		}
	}
	fmt.Fprintf(out, "delivered event_id=%s twice more: handler runs=%d, invoices=%d, next events=%d, inbox records=%d\n",
		eventID, billing.runs.Load(), count(ctx, pool, `SELECT count(*) FROM `+t.invoices),
		count(ctx, pool, `SELECT count(*) FROM `+t.billingOutbox.Sanitize()+` WHERE topic = $1`, TopicInvoiceCreated),
		count(ctx, pool, `SELECT count(*) FROM `+t.billingInbox.Sanitize()))

	// 4. A message the handler rejects: everything it wrote rolls back.
	bad := OrderPlaced{OrderID: uuid.New(), Amount: -5}
	badID := uuid.New()
	if err := bus.Publish(TopicOrderPlaced, delivery(badID, bad)); err == nil {
		return errors.New("the rejected order was acked")
	}
	fmt.Fprintf(out, "rejected event_id=%s (amount -5): nacked; its invoices=%d, next events=%d, inbox records=%d\n", badID,
		count(ctx, pool, `SELECT count(*) FROM `+t.invoices+` WHERE order_id = $1`, bad.OrderID),
		count(ctx, pool, `SELECT count(*) FROM `+t.billingOutbox.Sanitize()+` WHERE event_id = $1`, nextEventID(badID.String())),
		count(ctx, pool, `SELECT count(*) FROM `+t.billingInbox.Sanitize()+` WHERE key = $1`, badID.String()))
	return nil
}

// billingHandler creates one invoice per order and announces it.
type billingHandler struct {
	tables tables
	out    io.Writer
	runs   atomic.Int64
}

// Handle runs inside the inbox transaction: everything it writes goes
// through inbox.Tx(msg.Context()), and commits with the inbox record.
func (h *billingHandler) Handle(msg *message.Message) error {
	h.runs.Add(1)
	ctx := msg.Context()
	tx, ok := inbox.Tx(ctx)
	if !ok {
		return errors.New("billing: no inbox transaction; add inbox.Middleware to the handler")
	}
	var evt OrderPlaced
	if err := json.Unmarshal(msg.Payload, &evt); err != nil {
		return fmt.Errorf("billing: decode %s: %w", msg.UUID, err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+h.tables.invoices+` (order_id, amount_cents) VALUES ($1, $2)`, evt.OrderID, evt.Amount); err != nil {
		return fmt.Errorf("billing: insert invoice: %w", err)
	}
	// The next event commits with the invoice and the inbox record. Its
	// event_id derives from the consumed one, so it is stable.
	payload, _ := json.Marshal(map[string]any{"order_id": evt.OrderID, "amount_cents": evt.Amount})
	if _, err := publisher.Enqueue(ctx, tx, h.tables.billingOutbox, publisher.Message{
		TenantID: shopTenant, Topic: TopicInvoiceCreated, EventID: nextEventID(msg.UUID), Payload: payload,
	}); err != nil {
		return fmt.Errorf("billing: enqueue %s: %w", TopicInvoiceCreated, err)
	}
	if evt.Amount < 0 {
		// Written, then refused: the inbox rolls all of it back.
		return fmt.Errorf("billing: order %s has a negative amount", evt.OrderID)
	}
	fmt.Fprintf(h.out, "handled event_id=%s: invoice for order %s, %s enqueued in the same transaction\n", msg.UUID, evt.OrderID, TopicInvoiceCreated)
	return nil
}

// nextEventID is the event_id of the invoice event caused by the consumed
// event consumedID (a UUID v5).
func nextEventID(consumedID string) uuid.UUID {
	return uuid.NewSHA1(uuid.NameSpaceOID, []byte("billing.invoice:"+consumedID))
}

// placeOrder enqueues the order's event in the shop's outbox.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, t tables, order OrderPlaced) (uuid.UUID, error) {
	eventID := uuid.New()
	payload, err := json.Marshal(order)
	if err != nil {
		return uuid.Nil, err
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := publisher.Enqueue(ctx, tx, t.shopOutbox, publisher.Message{TenantID: shopTenant, Topic: TopicOrderPlaced, EventID: eventID, Payload: payload})
		return err
	})
	return eventID, err
}

// delivery is a redelivery of the event as the relay sends it: the message
// UUID and the event_id metadata are the event_id.
func delivery(eventID uuid.UUID, order OrderPlaced) *message.Message {
	payload, _ := json.Marshal(order)
	m := message.NewMessage(eventID.String(), payload)
	m.Metadata.Set(schema.MetadataEventID, eventID.String())
	m.Metadata.Set(schema.MetadataTopic, TopicOrderPlaced)
	return m
}

func count(ctx context.Context, pool *pgxpool.Pool, query string, args ...any) int {
	var n int
	if err := pool.QueryRow(ctx, query, args...).Scan(&n); err != nil {
		return -1
	}
	return n
}

// createTables creates the example's tables in schema ns. In a real service
// the billing tables live in the billing service's database.
func createTables(ctx context.Context, pool *pgxpool.Pool, ns string) (tables, error) {
	t := tables{
		shopOutbox:    schema.MustParseTable(ns + ".shop_outbox"),
		billingInbox:  schema.MustParseTable(ns + ".billing_inbox"),
		billingOutbox: schema.MustParseTable(ns + ".billing_outbox"),
		invoices:      pgx.Identifier{ns, "invoices"}.Sanitize(),
	}
	// All three migrations are idempotent: run them at deploy or start-up.
	for _, o := range []schema.Table{t.shopOutbox, t.billingOutbox} {
		if err := schema.Migrate(ctx, pool, o); err != nil {
			return t, err
		}
	}
	if err := inbox.Migrate(ctx, pool, t.billingInbox); err != nil {
		return t, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+t.invoices+` (id BIGSERIAL PRIMARY KEY, order_id UUID NOT NULL, amount_cents INT NOT NULL)`); err != nil {
		return t, fmt.Errorf("create invoices: %w", err)
	}
	return t, nil
}
