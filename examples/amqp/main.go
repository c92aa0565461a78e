// Command amqp relays an outbox to RabbitMQ and consumes it back:
//
//   - events for two tenants are committed with their business rows, with a
//     custom header (correlation_id) stored in the outbox's headers column;
//   - the relay (subscriber.New + forwarder.New) publishes them through
//     amqpbackend.NewPublisher in the fanout layout: per topic a durable
//     fanout exchange, persistent messages, publisher confirms and a
//     channel pool; the relay declares no queue;
//   - a Watermill router consumes them as the consumer group
//     "header_printer": a watermill-amqp subscriber on the same exchanges
//     (amqpbackend.WatermillConfig) declares and binds the group's own
//     durable queue per topic, <topic>_header_printer, never a queue named
//     after the topic, which on a shared broker may be another
//     application's (docs/CONSUMERS.md, "RabbitMQ layout"); it dedups on
//     event_id and prints every message's headers: the outbox metadata
//     (event_id, tenant_id, topic, sequence, attempts, table, partition_key)
//     and the custom ones.
//
// RabbitMQ is OUTBOX_AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/),
// the database OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test). The topics carry a random
// segment so that runs sharing a broker do not mix (a real service uses fixed
// names such as org.organization.created.v1); their queues and exchanges are
// deleted at the end.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/outboxkit/watermill-outbox/router/amqpbackend"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// defaultAMQPURL is used when OUTBOX_AMQP_URL is not set.
const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// consumerGroup names the consuming service: its queues (<topic>_<group>)
// and its rows in processed_events.
const consumerGroup = "header_printer"

// The example's tenants: fixed IDs make the output easy to read.
var (
	tenantAcme   = uuid.MustParse("a0000000-0000-4000-8000-000000000001")
	tenantGlobex = uuid.MustParse("b0000000-0000-4000-8000-000000000002")
	tenantNames  = map[string]string{tenantAcme.String(): "Acme", tenantGlobex.String(): "Globex"}
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Stdout, plumbing.DatabaseURL())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "amqp:", err)
		os.Exit(1)
	}
}

// amqpURL is OUTBOX_AMQP_URL, or the local RabbitMQ.
func amqpURL() string {
	if u := os.Getenv("OUTBOX_AMQP_URL"); u != "" {
		return u
	}
	return defaultAMQPURL
}

// topics are this run's topics: <module>.<aggregate>.<event>.vN with a
// random module segment.
type topics struct {
	organizationCreated, memberInvited string
}

func newTopics() (topics, error) {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		return topics{}, err
	}
	module := "ex" + hex.EncodeToString(b[:])
	return topics{organizationCreated: module + ".organization.created.v1", memberInvited: module + ".member.invited.v1"}, nil
}

func (t topics) all() []string { return []string{t.organizationCreated, t.memberInvited} }

// run is the whole example; it writes what happens to w.
func run(ctx context.Context, w io.Writer, dbURL string) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := &plumbing.SyncWriter{W: w}
	logger := plumbing.NewLogger()
	brokerURL := amqpURL()
	tp, err := newTopics()
	if err != nil {
		return err
	}

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
	outbox, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		return err
	}
	// The headers column stores the custom headers of publisher.Message.
	if err := schema.Migrate(ctx, pool, outbox, schema.WithHeadersColumn()); err != nil {
		return err
	}
	processed := pgx.Identifier{ns, "processed_events"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+processed+` (consumer TEXT NOT NULL, event_id UUID NOT NULL, PRIMARY KEY (consumer, event_id))`); err != nil {
		return err
	}

	// The consumer group's subscriber: the relay's exchanges (the same
	// configuration, so both sides agree on them), and a queue of the
	// group's own per topic, <topic>_<group>, which it declares and binds
	// when it subscribes: before the relay publishes, so that it misses
	// nothing. Every group gets its own copy of each event; the consumers of
	// one group (replicas of one service) share its queue and compete.
	relayAMQP := amqpbackend.Config{URL: brokerURL, Layout: amqpbackend.LayoutFanout}
	consumerAMQP := amqpbackend.WatermillConfig(relayAMQP)
	consumerAMQP.Queue.GenerateName = amqp.GenerateQueueNameTopicNameWithSuffix(consumerGroup)
	consumerAMQP.TopologyBuilder = &amqp.DefaultTopologyBuilder{} // declares the exchange, the group's queue and the binding
	amqpSubscriber, err := amqp.NewSubscriber(consumerAMQP, logger)
	if err != nil {
		return fmt.Errorf("RabbitMQ at %s is unreachable (start it with `make up`, or set OUTBOX_AMQP_URL): %w", redactURL(brokerURL), err)
	}
	defer amqpSubscriber.Close()
	defer func() {
		err = errors.Join(err, deleteTopology(brokerURL, tp.all(), consumerAMQP.Queue.GenerateName, logger))
	}()
	consumer, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	consumer.AddMiddleware(middleware.Recoverer)
	printer := &headerPrinter{pool: pool, processed: processed, out: out, handled: make(chan struct{}, 16)}
	for _, topic := range tp.all() {
		consumer.AddConsumerHandler("print_"+topic, topic, amqpSubscriber, printer.Handle)
		fmt.Fprintf(out, "consumer group %s reads %s from queue %s\n", consumerGroup, topic, consumerAMQP.Queue.GenerateName(topic))
	}
	stopConsumer, err := plumbing.StartRouter(ctx, consumer)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	defer func() { err = errors.Join(err, stopConsumer()) }()

	// The producer: each tenant's events in one transaction.
	events := []struct {
		tenant  uuid.UUID
		topic   string
		payload string
	}{
		{tenantAcme, tp.organizationCreated, `{"name":"Acme"}`},
		{tenantAcme, tp.memberInvited, `{"email":"alice@acme.example"}`},
		{tenantGlobex, tp.organizationCreated, `{"name":"Globex"}`},
		{tenantGlobex, tp.memberInvited, `{"email":"carol@globex.example"}`},
	}
	for _, tenant := range []uuid.UUID{tenantAcme, tenantGlobex} {
		var batch []publisher.Message
		for _, e := range events {
			if e.tenant == tenant {
				batch = append(batch, publisher.Message{
					TenantID: e.tenant, Topic: e.topic, EventID: uuid.New(), Payload: json.RawMessage(e.payload),
					Headers: map[string]string{"correlation_id": "signup-" + strings.ToLower(tenantNames[tenant.String()])},
				})
			}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// Your business writes go here, in the same transaction.
			_, err := publisher.EnqueueBatch(ctx, tx, outbox, batch)
			return err
		}); err != nil {
			return fmt.Errorf("enqueue: %w", err)
		}
		for _, m := range batch {
			fmt.Fprintf(out, "enqueued %s tenant=%s event_id=%s\n", m.Topic, tenantNames[tenant.String()], m.EventID)
		}
	}

	// The relay: outbox -> RabbitMQ.
	amqpPublisher, err := amqpbackend.NewPublisher(relayAMQP, logger)
	if err != nil {
		return fmt.Errorf("RabbitMQ at %s: %w", redactURL(brokerURL), err)
	}
	defer amqpPublisher.Close()
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: outbox}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	fwd, err := forwarder.New(sub, amqpPublisher, forwarder.Config{}, logger)
	if err != nil {
		return err
	}
	stopRelay, err := plumbing.StartForwarder(ctx, fwd)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer func() { err = errors.Join(err, stopRelay()) }()

	for range events {
		select {
		case <-printer.handled:
		case <-ctx.Done():
			return fmt.Errorf("waiting for RabbitMQ deliveries: %w", ctx.Err())
		}
	}
	if err := plumbing.WaitAllPublished(ctx, pool, outbox); err != nil {
		return err
	}
	fmt.Fprintf(out, "received %d events from RabbitMQ; all %d outbox rows published\n", len(events), len(events))
	return nil
}

// headerPrinter consumes every topic: it prints each new event with its
// headers, and ignores an event_id it has seen before.
type headerPrinter struct {
	pool      *pgxpool.Pool
	processed string
	out       io.Writer
	handled   chan struct{}
}

// Handle is the router handler; an error nacks the delivery (RabbitMQ
// delivers it again).
func (p *headerPrinter) Handle(msg *message.Message) error {
	ctx := msg.Context()
	tag, err := p.pool.Exec(ctx, `INSERT INTO `+p.processed+` (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, consumerGroup, msg.UUID)
	if err != nil {
		return fmt.Errorf("record event %s: %w", msg.UUID, err)
	}
	if tag.RowsAffected() == 0 {
		fmt.Fprintf(p.out, "duplicate ignored event_id=%s\n", msg.UUID)
		return nil
	}
	// One Write per message, so that concurrent handlers do not interleave.
	var b strings.Builder
	fmt.Fprintf(&b, "received %s event_id=%s\n  headers:\n", message.SubscribeTopicFromCtx(ctx), msg.UUID)
	keys := make([]string, 0, len(msg.Metadata))
	for k := range msg.Metadata {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "    %s: %s\n", k, msg.Metadata[k])
	}
	fmt.Fprintf(&b, "  payload: %s\n", msg.Payload)
	fmt.Fprint(p.out, b.String())
	select {
	case p.handled <- struct{}{}:
	case <-ctx.Done():
	}
	return nil
}

// deleteTopology deletes the exchanges of this run's topics and the
// consumer group's queues. A real service keeps them: they are durable on
// purpose.
func deleteTopology(brokerURL string, topics []string, queueName amqp.QueueNameGenerator, logger watermill.LoggerAdapter) error {
	conn, err := amqp.NewConnection(amqp.ConnectionConfig{AmqpURI: brokerURL}, logger)
	if err != nil {
		return fmt.Errorf("delete queues: %w", err)
	}
	defer conn.Close()
	ch, err := conn.Connection().Channel()
	if err != nil {
		return fmt.Errorf("delete queues: %w", err)
	}
	defer ch.Close()
	var errs []error
	for _, topic := range topics {
		if _, err := ch.QueueDelete(queueName(topic), false, false, false); err != nil {
			errs = append(errs, fmt.Errorf("delete queue %s: %w", queueName(topic), err))
		}
		if err := ch.ExchangeDelete(topic, false, false); err != nil {
			errs = append(errs, fmt.Errorf("delete exchange %s: %w", topic, err))
		}
	}
	return errors.Join(errs...)
}

// redactURL hides the password of an AMQP URL.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable OUTBOX_AMQP_URL)"
	}
	return u.Redacted()
}
