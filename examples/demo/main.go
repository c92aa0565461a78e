// Command demo is what `make demo` runs: the relay end to end, from the local
// PostgreSQL to an in-process Kafka cluster, printing what arrived on Kafka.
//
// It starts a one-broker Kafka-protocol cluster inside the process
// (franz-go's kfake, plumbing.StartKafka; Watermill's Kafka backend talks to
// it over the network as to any Kafka), creates an outbox table in a fresh
// schema, commits five events for two tenants in two transactions, relays
// them with forwarder.New(sub, kafkaPublisher, forwarder.Config{}, logger),
// reads them back from Kafka and prints each one's topic, record key,
// partition, event_id, tenant_id, headers and payload. It finishes by itself
// in a few seconds and leaves nothing behind.
//
// The database is OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test; `make demo` defaults to the local
// server's postgres database). It needs nothing else on the machine.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/IBM/sarama"
	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill-kafka/v3/pkg/kafka"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The demo's topics (<module>.<aggregate>.<event>.vN).
const (
	TopicOrganizationCreated = "org.organization.created.v1"
	TopicMemberInvited       = "org.member.invited.v1"
)

// The demo's two tenants: fixed IDs make the output easy to read.
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
		fmt.Fprintln(os.Stderr, "demo:", err)
		os.Exit(1)
	}
}

// run is the whole demo; it writes what happens to w.
func run(ctx context.Context, w io.Writer, dbURL string) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	logger := plumbing.NewLogger()

	// Kafka: an in-process cluster, 3 partitions per topic.
	cluster, err := plumbing.StartKafka()
	if err != nil {
		return err
	}
	defer cluster.Close()

	// PostgreSQL: an outbox table (with the optional trace and headers
	// columns) in a fresh schema.
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
	table, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		return err
	}
	if err := schema.Migrate(ctx, pool, table, schema.WithAllColumns()); err != nil {
		return err
	}

	// Five events for two tenants, each tenant's in one transaction.
	var msgs []publisher.Message
	for _, batch := range [][]publisher.Message{
		{
			event(tenantAcme, TopicOrganizationCreated, "signup-acme", map[string]any{"name": "Acme"}),
			event(tenantAcme, TopicMemberInvited, "signup-acme", map[string]any{"email": "alice@acme.example", "role": "admin"}),
			event(tenantAcme, TopicMemberInvited, "signup-acme", map[string]any{"email": "bob@acme.example", "role": "member"}),
		},
		{
			event(tenantGlobex, TopicOrganizationCreated, "signup-globex", map[string]any{"name": "Globex"}),
			event(tenantGlobex, TopicMemberInvited, "signup-globex", map[string]any{"email": "carol@globex.example", "role": "admin"}),
		},
	} {
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			// Your business writes go here, in the same transaction.
			_, err := publisher.EnqueueBatch(ctx, tx, table, batch)
			return err
		}); err != nil {
			return fmt.Errorf("enqueue: %w", err)
		}
		msgs = append(msgs, batch...)
	}
	fmt.Fprintf(w, "enqueued %d events for 2 tenants into %s\n", len(msgs), table)

	// The relay: outbox subscriber -> forwarder -> Kafka publisher. The zero
	// forwarder.Config sends each row to the Kafka topic named by its topic
	// column, keyed by event_id, with every metadata entry as a header.
	kafkaPublisher, err := kafkabackend.NewPublisher(cluster.ListenAddrs(), logger)
	if err != nil {
		return err
	}
	defer kafkaPublisher.Close()
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: table}, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	fwd, err := forwarder.New(sub, kafkaPublisher, forwarder.Config{}, logger)
	if err != nil {
		return err
	}
	stopRelay, err := plumbing.StartForwarder(ctx, fwd)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer func() { err = errors.Join(err, stopRelay()) }()
	if err := plumbing.WaitAllPublished(ctx, pool, table); err != nil {
		return err
	}
	if err := stopRelay(); err != nil {
		return fmt.Errorf("stop relay: %w", err)
	}
	fmt.Fprintf(w, "relayed to Kafka at %s\n\n", strings.Join(cluster.ListenAddrs(), ","))

	// Read them back, as a consumer would.
	got, err := readBack(ctx, cluster, logger, len(msgs), TopicOrganizationCreated, TopicMemberInvited)
	if err != nil {
		return err
	}
	for i, r := range got {
		if err := printRecord(w, i+1, len(got), r); err != nil {
			return err
		}
	}

	var unpublished int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+table.Sanitize()+` WHERE published_at IS NULL`).Scan(&unpublished); err != nil {
		return err
	}
	if unpublished != 0 {
		return fmt.Errorf("%d rows of %s are not published", unpublished, table)
	}
	fmt.Fprintf(w, "forwarded %d events from %s to Kafka; all rows published\n", len(got), table)
	return nil
}

// event builds one outbox message with a fresh event_id and a custom header.
func event(tenant uuid.UUID, topic, correlationID string, payload map[string]any) publisher.Message {
	b, err := json.Marshal(payload)
	if err != nil {
		panic(err) // maps of strings always marshal
	}
	return publisher.Message{
		TenantID: tenant,
		Topic:    topic,
		EventID:  uuid.New(),
		Payload:  b,
		Headers:  map[string]string{"correlation_id": correlationID},
	}
}

// record is one message read back from Kafka.
type record struct {
	topic     string
	partition int32
	key       string
	msg       *message.Message
}

// readBack reads n messages from the topics, from the oldest offset, and
// returns them in outbox sequence order.
func readBack(ctx context.Context, cluster *kfake.Cluster, logger watermill.LoggerAdapter, n int, topics ...string) ([]record, error) {
	// No consumer group: read every partition from the oldest offset.
	kafkaSubscriber, err := newKafkaSubscriber(cluster.ListenAddrs(), logger)
	if err != nil {
		return nil, err
	}
	defer kafkaSubscriber.Close()
	ctx, cancel := context.WithCancel(ctx)
	records := make(chan record)
	var wg sync.WaitGroup
	defer wg.Wait() // after cancel: the readers have returned before Close
	defer cancel()
	for _, topic := range topics {
		ch, err := kafkaSubscriber.Subscribe(ctx, topic)
		if err != nil {
			return nil, fmt.Errorf("subscribe to %s: %w", topic, err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case msg, ok := <-ch:
					if !ok {
						return
					}
					key, _ := kafka.MessageKeyFromCtx(msg.Context())
					partition, _ := kafka.MessagePartitionFromCtx(msg.Context())
					msg.Ack()
					select {
					case records <- record{topic: topic, partition: partition, key: string(key), msg: msg}:
					case <-ctx.Done():
						return
					}
				case <-ctx.Done():
					return
				}
			}
		}()
	}
	var out []record
	for len(out) < n {
		select {
		case r := <-records:
			out = append(out, r)
		case <-ctx.Done():
			return nil, fmt.Errorf("read %d of %d events back from Kafka: %w", len(out), n, ctx.Err())
		}
	}
	sequence := func(r record) int64 {
		s, _ := strconv.ParseInt(r.msg.Metadata.Get(schema.MetadataSequence), 10, 64)
		return s
	}
	sort.Slice(out, func(i, j int) bool { return sequence(out[i]) < sequence(out[j]) })
	return out, nil
}

// printRecord prints one Kafka record.
func printRecord(w io.Writer, i, n int, r record) error {
	md := r.msg.Metadata
	if r.key == "" {
		return fmt.Errorf("record %s on %s has no key", r.msg.UUID, r.topic)
	}
	keyNote := "the event_id, the default partition key"
	if r.key != r.msg.UUID {
		keyNote = "NOT the event_id"
	}
	tenant := md.Get(schema.MetadataTenantID)
	fmt.Fprintf(w, "event %d of %d\n", i, n)
	fmt.Fprintf(w, "  topic:     %s\n", r.topic)
	fmt.Fprintf(w, "  key:       %s (%s)\n", r.key, keyNote)
	fmt.Fprintf(w, "  partition: %d\n", r.partition)
	fmt.Fprintf(w, "  event_id:  %s\n", r.msg.UUID)
	fmt.Fprintf(w, "  tenant_id: %s (%s)\n", tenant, tenantNames[tenant])
	fmt.Fprintf(w, "  headers:\n")
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(w, "    %s: %s\n", k, md[k])
	}
	fmt.Fprintf(w, "  payload:   %s\n\n", r.msg.Payload)
	return nil
}

// newKafkaSubscriber returns a subscriber without a consumer group: it reads
// every partition from the oldest offset.
func newKafkaSubscriber(brokers []string, logger watermill.LoggerAdapter) (*kafka.Subscriber, error) {
	sc := kafka.DefaultSaramaSubscriberConfig()
	sc.Version = sarama.V2_8_0_0
	sc.Consumer.Offsets.Initial = sarama.OffsetOldest
	return kafka.NewSubscriber(kafka.SubscriberConfig{
		Brokers:               brokers,
		Unmarshaler:           kafka.DefaultMarshaler{},
		OverwriteSaramaConfig: sc,
	}, logger)
}
