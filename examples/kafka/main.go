// Command kafka is the template to copy for relaying an outbox to a real
// Kafka cluster and consuming it safely:
//
//   - the producer side writes a business row (an invitation) and its event
//     in one transaction;
//   - the relay (subscriber.New + forwarder.New + kafkabackend.NewPublisher)
//     keys each record by tenant (forwarder.PartitionByTenantID), so
//     one tenant's events share a partition (retries still reorder: no order
//     is guaranteed);
//   - the consumer is a Watermill router over a Kafka consumer group that
//     dedups on event_id in the same transaction as its side effect (a seat
//     counter, which a duplicate would otherwise inflate), shown by
//     delivering one event twice.
//
// Brokers come from OUTBOX_KAFKA_BROKERS (host:port,...). When it is unset
// the example starts an in-process Kafka-protocol cluster
// (plumbing.StartKafka); in your service, delete that fallback. The database
// is OUTBOX_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test).
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/outboxkit/watermill-outbox/router/kafkabackend"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
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

// TopicMemberInvited is the event's topic in the outbox.
const TopicMemberInvited = "org.member.invited.v1"

// MemberInvited is the event's payload.
type MemberInvited struct {
	InvitationID uuid.UUID `json:"invitation_id"`
	Email        string    `json:"email"`
}

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
		fmt.Fprintln(os.Stderr, "kafka:", err)
		os.Exit(1)
	}
}

// tables are the example's tables, all in one fresh schema.
type tables struct {
	outbox      schema.Table
	invitations string // the producer's business table (sanitized name)
	seats       string // the consumer's side effect (sanitized name)
	processed   string // the consumer's dedup table (sanitized name)
}

// run is the whole example; it writes what happens to w.
func run(ctx context.Context, w io.Writer, dbURL string) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := &plumbing.SyncWriter{W: w}
	logger := plumbing.NewLogger()

	brokers, topicPrefix, stopKafka, err := kafkaBrokers(out)
	if err != nil {
		return err
	}
	defer stopKafka()
	topic := topicPrefix + TopicMemberInvited // the Kafka topic

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

	// Producer: each invitation and its event in one transaction.
	invites := []struct {
		tenant uuid.UUID
		email  string
	}{
		{tenantAcme, "alice@acme.example"}, {tenantGlobex, "carol@globex.example"}, {tenantAcme, "bob@acme.example"},
		{tenantGlobex, "erin@globex.example"}, {tenantAcme, "dave@acme.example"},
	}
	for _, inv := range invites {
		var eventID uuid.UUID
		var seq int64
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			eventID, seq, err = inviteMember(ctx, tx, t, inv.tenant, inv.email)
			return err
		}); err != nil {
			return fmt.Errorf("invite %s: %w", inv.email, err)
		}
		fmt.Fprintf(out, "enqueued %s tenant=%s event_id=%s sequence=%d\n", TopicMemberInvited, tenantNames[inv.tenant.String()], eventID, seq)
	}

	// Consumer: a Watermill router reading the topic in a consumer group.
	kafkaSubscriber, err := newKafkaSubscriber(brokers, "seat-billing", logger)
	if err != nil {
		return err
	}
	defer kafkaSubscriber.Close()
	consumer, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Retry transient failures a few times in-process, turning panics into
	// errors; a message that still fails is nacked and redelivered by Kafka.
	consumer.AddMiddleware(
		middleware.Retry{MaxRetries: 3, InitialInterval: 100 * time.Millisecond, Logger: logger}.Middleware,
		middleware.Recoverer,
	)
	billing := &seatBilling{pool: pool, tables: t, out: out, handled: make(chan handled, 2*len(invites))}
	consumer.AddConsumerHandler("seat_billing", topic, kafkaSubscriber, billing.Handle)
	stopConsumer, err := plumbing.StartRouter(ctx, consumer)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	defer func() { err = errors.Join(err, stopConsumer()) }()

	// Relay: the outbox to Kafka, keyed by tenant.
	kafkaPublisher, err := kafkabackend.NewPublisher(brokers, logger)
	if err != nil {
		return err
	}
	defer kafkaPublisher.Close()
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: t.outbox}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	fwd, err := forwarder.New(sub, kafkaPublisher, forwarder.Config{
		PartitionKey: forwarder.PartitionByTenantID,
		DestinationTopic: func(msg *message.Message) (string, error) {
			return topicPrefix + msg.Metadata.Get(schema.MetadataTopic), nil
		},
	}, logger)
	if err != nil {
		return err
	}
	stopRelay, err := plumbing.StartForwarder(ctx, fwd)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer func() { err = errors.Join(err, stopRelay()) }()

	var first *message.Message
	for range invites {
		h, err := billing.next(ctx)
		if err != nil {
			return err
		}
		if first == nil {
			first = h.msg
		}
	}

	// At least once: a relay that crashes after Kafka acknowledged a record
	// and before the outbox row was marked published sends it again. Do
	// that by hand with the very record the consumer received.
	fmt.Fprintf(out, "redelivering event_id=%s (as after a relay crash between Kafka's ack and the outbox's)\n", first.UUID)
	if err := kafkaPublisher.Publish(topic, first); err != nil {
		return fmt.Errorf("redeliver: %w", err)
	}
	if h, err := billing.next(ctx); err != nil {
		return err
	} else if !h.duplicate {
		return fmt.Errorf("the redelivered event %s was not recognised as a duplicate", first.UUID)
	}

	var acme, globex int
	if err := pool.QueryRow(ctx, `SELECT COALESCE((SELECT seats FROM `+t.seats+` WHERE tenant_id = $1), 0),
	       COALESCE((SELECT seats FROM `+t.seats+` WHERE tenant_id = $2), 0)`, tenantAcme, tenantGlobex).Scan(&acme, &globex); err != nil {
		return err
	}
	fmt.Fprintf(out, "seats: Acme=%d Globex=%d (%d invitations, %d deliveries)\n", acme, globex, len(invites), len(invites)+1)
	if err := plumbing.WaitAllPublished(ctx, pool, t.outbox); err != nil {
		return err
	}
	fmt.Fprintf(out, "all %d outbox rows published\n", len(invites))
	return nil
}

// kafkaBrokers returns the brokers of OUTBOX_KAFKA_BROKERS, or starts an
// in-process cluster when it is unset (delete that branch in your service).
// On a shared cluster the topics of a run get a prefix of their own, so that
// runs of this example do not read each other's events.
func kafkaBrokers(w io.Writer) (brokers []string, topicPrefix string, stop func(), err error) {
	if s := os.Getenv("OUTBOX_KAFKA_BROKERS"); s != "" {
		for _, b := range strings.Split(s, ",") {
			if b = strings.TrimSpace(b); b != "" {
				brokers = append(brokers, b)
			}
		}
		if len(brokers) == 0 {
			return nil, "", nil, fmt.Errorf("OUTBOX_KAFKA_BROKERS=%q names no broker; use host:port,host:port", s)
		}
		var b [4]byte
		if _, err := rand.Read(b[:]); err != nil {
			return nil, "", nil, err
		}
		topicPrefix = "example-" + hex.EncodeToString(b[:]) + "."
		fmt.Fprintf(w, "kafka: %s (topics prefixed %q)\n", strings.Join(brokers, ","), topicPrefix)
		return brokers, topicPrefix, func() {}, nil
	}
	cluster, err := plumbing.StartKafka()
	if err != nil {
		return nil, "", nil, err
	}
	fmt.Fprintln(w, "kafka: in-process cluster (set OUTBOX_KAFKA_BROKERS=host:port,... to use yours)")
	return cluster.ListenAddrs(), "", cluster.Close, nil
}

// newKafkaSubscriber returns a consumer-group subscriber. A group seen for
// the first time starts at the oldest offset, so events relayed before the
// consumer first joined are not skipped.
func newKafkaSubscriber(brokers []string, group string, logger watermill.LoggerAdapter) (*kafka.Subscriber, error) {
	sc := kafka.DefaultSaramaSubscriberConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	s, err := kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: sc,
		ConsumerGroup:         group,
	}, logger)
	if err != nil {
		return nil, fmt.Errorf("kafka subscriber: %w", err)
	}
	return s, nil
}

// inviteMember inserts an invitation and enqueues its MemberInvited event
// inside tx.
func inviteMember(ctx context.Context, tx pgx.Tx, t tables, tenant uuid.UUID, email string) (eventID uuid.UUID, seq int64, err error) {
	invitationID := uuid.New()
	if _, err := tx.Exec(ctx, `INSERT INTO `+t.invitations+` (id, tenant_id, email) VALUES ($1, $2, $3)`, invitationID, tenant, email); err != nil {
		return uuid.Nil, 0, err
	}
	payload, err := json.Marshal(MemberInvited{InvitationID: invitationID, Email: email})
	if err != nil {
		return uuid.Nil, 0, err
	}
	eventID = uuid.New()
	seq, err = publisher.Enqueue(ctx, tx, t.outbox, publisher.Message{TenantID: tenant, Topic: TopicMemberInvited, EventID: eventID, Payload: payload})
	return eventID, seq, err
}

// handled is one message the consumer finished.
type handled struct {
	msg       *message.Message // a copy, with its metadata
	duplicate bool
}

// seatBilling consumes MemberInvited: each invitation adds a paid seat to
// its tenant, exactly once per event_id.
type seatBilling struct {
	pool    *pgxpool.Pool
	tables  tables
	out     io.Writer
	handled chan handled
}

// consumerName scopes the dedup records, so that several consumers can share
// one processed_events table.
const consumerName = "seat_billing"

// Handle is the router handler; an error nacks the record.
func (b *seatBilling) Handle(msg *message.Message) error {
	ctx := msg.Context()
	var evt MemberInvited
	if err := json.Unmarshal(msg.Payload, &evt); err != nil {
		return fmt.Errorf("decode %s: %w", msg.UUID, err)
	}
	tenant, err := uuid.Parse(msg.Metadata.Get(schema.MetadataTenantID))
	if err != nil {
		return fmt.Errorf("event %s: tenant_id header: %w", msg.UUID, err)
	}
	duplicate := false
	var seats int
	err = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		// The dedup record and the side effect commit together.
		tag, err := tx.Exec(ctx, `INSERT INTO `+b.tables.processed+` (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`, consumerName, msg.UUID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			duplicate = true
			return nil
		}
		return tx.QueryRow(ctx, `INSERT INTO `+b.tables.seats+` AS s (tenant_id, seats) VALUES ($1, 1)
ON CONFLICT (tenant_id) DO UPDATE SET seats = s.seats + 1 RETURNING seats`, tenant).Scan(&seats)
	})
	if err != nil {
		return fmt.Errorf("bill seat for event %s: %w", msg.UUID, err)
	}
	if duplicate {
		fmt.Fprintf(b.out, "duplicate ignored event_id=%s\n", msg.UUID)
	} else {
		key, _ := kafka.MessageKeyFromCtx(ctx)
		partition, _ := kafka.MessagePartitionFromCtx(ctx)
		name := tenantNames[tenant.String()]
		fmt.Fprintf(b.out, "consumed event_id=%s tenant=%s partition=%d key=%s: %s now pays for %d seat(s)\n",
			msg.UUID, name, partition, key, name, seats)
	}
	select {
	case b.handled <- handled{msg: msg.Copy(), duplicate: duplicate}:
	case <-ctx.Done():
	}
	return nil
}

// next waits for the consumer to finish one more message.
func (b *seatBilling) next(ctx context.Context) (handled, error) {
	select {
	case h := <-b.handled:
		return h, nil
	case <-ctx.Done():
		return handled{}, fmt.Errorf("waiting for the consumer: %w", ctx.Err())
	}
}

// createTables creates the outbox, the producer's table and the consumer's
// tables in schema ns. In a real system the consumer's tables live in the
// consumer's own database.
func createTables(ctx context.Context, pool *pgxpool.Pool, ns string) (tables, error) {
	outbox, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		return tables{}, err
	}
	if err := schema.Migrate(ctx, pool, outbox); err != nil {
		return tables{}, err
	}
	q := func(name string) string { return pgx.Identifier{ns, name}.Sanitize() }
	t := tables{outbox: outbox, invitations: q("invitations"), seats: q("seats"), processed: q("processed_events")}
	ddl := `
CREATE TABLE ` + t.invitations + ` (id UUID PRIMARY KEY, tenant_id UUID NOT NULL, email TEXT NOT NULL);
CREATE TABLE ` + t.seats + ` (tenant_id UUID PRIMARY KEY, seats INT NOT NULL);
CREATE TABLE ` + t.processed + ` (
  consumer     TEXT        NOT NULL,
  event_id     UUID        NOT NULL,
  processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, event_id)
);`
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return tables{}, fmt.Errorf("create example tables: %w", err)
	}
	return t, nil
}
