package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// brokerSuite measures outbox-to-broker throughput: a backlog drained by
// subscriber + forwarder into Kafka (in-process kfake cluster, acks=all,
// idempotent producer), in the default mode and in ordered mode, and into
// RabbitMQ (publisher confirms, channel pool), each beside the same
// publisher fed directly by 200 goroutines in the same run. The Kafka cases
// run the batching forwarder (its default with kafkabackend's publisher) and,
// for comparison, one Publish per message (BatchSize 1); the default mode's
// own ceiling, the subscriber's claim and ack statements with no delivery,
// is printed beside them.
func brokerSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	n := o.brokerBacklog
	cluster, err := kafkatest.Start(6, 0)
	if err != nil {
		return err
	}
	defer cluster.Close()
	const keys = 1000
	subCfg := subscriber.Config{BatchSize: o.brokerBatch, MaxInFlight: o.brokerInFlight}
	ordCfg := subscriber.Config{BatchSize: o.brokerBatch, MaxInFlight: o.brokerInFlight, Ordered: true, ElectionInterval: 100 * time.Millisecond}
	batching := forwarder.Config{MaxPublishes: o.brokerPublishes}
	type relayCase struct {
		name    string
		ordered bool
		sub     subscriber.Config
		fwd     forwarder.Config
	}
	backends := []struct {
		name  string
		open  func() (message.Publisher, error)
		reset func() error // empties what earlier cases left in the broker
		cases []relayCase
		// noBare: no bare-publisher baseline (the no-op sink has nothing to
		// compare with).
		noBare bool
	}{
		{"Kafka (kfake, acks=all, idempotent)", func() (message.Publisher, error) {
			return kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
		}, func() error { return nil }, []relayCase{
			{"outbox -> Kafka, default mode, batching forwarder", false, subCfg, batching},
			{"outbox -> Kafka, default mode, one Publish per message", false, subCfg, forwarder.Config{BatchSize: 1}},
			{fmt.Sprintf("outbox -> Kafka, ordered mode (%d keys), batching forwarder", keys), true, ordCfg, batching},
			{fmt.Sprintf("outbox -> Kafka, ordered mode (%d keys), one Publish per message", keys), true, ordCfg, forwarder.Config{BatchSize: 1}},
		}, false},
		{"no broker (a no-op BatchPublisher: the outbox side alone)", func() (message.Publisher, error) {
			return nopPublisher{}, nil
		}, func() error { return nil }, []relayCase{
			{fmt.Sprintf("outbox -> no broker, ordered mode (%d keys), batching forwarder", keys), true, ordCfg, batching},
		}, true},
		{fmt.Sprintf("RabbitMQ (confirms, pool %d)", o.amqpPool), func() (message.Publisher, error) {
			return amqpbackend.NewPublisher(amqpbackend.Config{URL: o.amqpURL, ChannelPoolSize: o.amqpPool}, watermill.NopLogger{})
		}, func() error { return purgeQueues(o.amqpURL, "bench.direct.v1", "org.organization.updated.v1") }, []relayCase{
			{"outbox -> RabbitMQ, default mode, batching forwarder", false, subCfg, batching},
			{"outbox -> RabbitMQ, default mode, one Publish per message", false, subCfg, forwarder.Config{BatchSize: 1}},
		}, false},
	}
	const ceilingName = "default mode's SQL ceiling: claim+ack loop, no delivery"
	aloneName := fmt.Sprintf("ordered subscriber alone (%d keys), acking at once: no router, forwarder or broker", keys)
	var (
		names, baselines []string
		best             []float64
		cpu              = map[string]cpuUse{} // of the last round
	)
	for round := 0; round < o.rounds; round++ {
		var values []float64
		for bi, b := range backends {
			pub, err := b.open()
			if err != nil {
				return fmt.Errorf("%s: %w", b.name, err)
			}
			bare := "bare publisher, " + b.name
			if err := b.reset(); err != nil {
				_ = pub.Close()
				return err
			}
			if !b.noBare {
				var bareRate float64
				use, err := measureCPU(func() (err error) {
					bareRate, err = publishDirect(ctx, pub, n, 200)
					return err
				})
				cpu[bare] = use
				if err != nil {
					_ = pub.Close()
					return fmt.Errorf("%s: %w", bare, err)
				}
				if round == 0 {
					names, baselines = append(names, bare), append(baselines, "")
				}
				values = append(values, bareRate)
			}
			for ci, c := range b.cases {
				if !strings.Contains(c.name, o.brokerCases) {
					continue
				}
				t := schema.MustParseTable(fmt.Sprintf("%s.broker_%d_%d_%d", schemaName, round, bi, ci))
				k := 0
				if c.ordered {
					k = keys
				}
				if err := fillKeyed(ctx, pool, t, n, k); err != nil {
					_ = pub.Close()
					return err
				}
				if err := b.reset(); err != nil {
					_ = pub.Close()
					return err
				}
				var rate float64
				use, err := measureCPU(func() (err error) {
					rate, err = drainForwarderWith(ctx, pool, t, n, pub, c.sub, c.fwd)
					return err
				})
				cpu[c.name] = use
				if err != nil {
					_ = pub.Close()
					return fmt.Errorf("%s: %w", c.name, err)
				}
				if _, err := pool.Exec(ctx, `DROP TABLE `+t.Sanitize()+` CASCADE`); err != nil {
					_ = pub.Close()
					return err
				}
				if round == 0 {
					base := bare
					if b.noBare {
						base = ""
					}
					names, baselines = append(names, c.name), append(baselines, base)
				}
				values = append(values, rate)
			}
			_ = pub.Close()
			if err := b.reset(); err != nil {
				return err
			}
		}
		// The ordered subscriber alone, acking at once: no router, no
		// forwarder, no broker.
		if strings.Contains(aloneName, o.brokerCases) {
			t := schema.MustParseTable(fmt.Sprintf("%s.broker_alone_%d", schemaName, round))
			if err := fillKeyed(ctx, pool, t, n, keys); err != nil {
				return err
			}
			var durable time.Duration
			use, err := measureCPU(func() (err error) {
				_, durable, err = drainTimes(ctx, pool, []schema.Table{t}, n, true, 1)
				return err
			})
			cpu[aloneName] = use
			if err != nil {
				return fmt.Errorf("%s: %w", aloneName, err)
			}
			if _, err := pool.Exec(ctx, `DROP TABLE `+t.Sanitize()+` CASCADE`); err != nil {
				return err
			}
			if round == 0 {
				names, baselines = append(names, aloneName), append(baselines, "")
			}
			values = append(values, float64(n)/durable.Seconds())
		}
		// The default mode's ceiling on this machine: its claim and ack
		// statements alone.
		t := schema.MustParseTable(fmt.Sprintf("%s.broker_ceiling_%d", schemaName, round))
		if err := fillBacklog(ctx, pool, t, n); err != nil {
			return err
		}
		var ceiling float64
		use, err := measureCPU(func() (err error) {
			ceiling, err = drainBareSQL(ctx, pool, t, n, 2, o.brokerBatch)
			return err
		})
		cpu[ceilingName] = use
		if err != nil {
			return err
		}
		if _, err := pool.Exec(ctx, `DROP TABLE `+t.Sanitize()); err != nil {
			return err
		}
		values = append(values, ceiling)
		if round == 0 {
			names, baselines = append(names, ceilingName), append(baselines, "")
			best = make([]float64, len(values))
		}
		for i, v := range values {
			best[i] = max(best[i], v)
		}
	}
	printTable(fmt.Sprintf("Relay throughput to brokers: drain %d rows (subscriber BatchSize %d, MaxInFlight %d), best of %d, beside the same publisher fed directly by 200 goroutines (goals: Kafka >= 0.3x default mode, >= 0.5x ordered mode; RabbitMQ >= 0.8x)", n, o.brokerBatch, o.brokerInFlight, o.rounds),
		ratioRows(names, baselines, best, "msgs/s"))
	fmt.Println("CPU per 100,000 messages, last round: the bench process (relay, router, forwarder, broker client; for Kafka also the in-process kfake broker) and the local PostgreSQL's processes")
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "case\tprocess\tpostgres\t")
	for _, name := range names {
		if use, ok := cpu[name]; ok {
			per := func(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()*100000/float64(n)) }
			fmt.Fprintf(w, "%s\t%s\t%s\t\n", name, per(use.self), per(use.postgres))
		}
	}
	_ = w.Flush()
	fmt.Println()
	return nil
}

// nopPublisher accepts every message and sends nothing: the outbox side of
// a drain alone.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error       { return nil }
func (nopPublisher) PublishBatch(string, []*message.Message) []error { return nil }
func (nopPublisher) Close() error                                    { return nil }

// fillKeyed creates t with every column (ordered mode's too) and commits n
// pending rows, spread round-robin over keys ordering keys (none when keys is
// 0).
func fillKeyed(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n, keys int) error {
	if err := schema.Migrate(ctx, pool, t, schema.WithOrderingKeyColumn()); err != nil {
		return err
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		return err
	}
	tenant := uuid.New()
	for i := 0; i < n; {
		k := min(n-i, 1000)
		msgs := make([]publisher.Message, k)
		for j := range msgs {
			msgs[j] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(), Payload: benchPayload}
			if keys > 0 {
				msgs[j].OrderingKey = "org-" + strconv.Itoa((i+j)%keys)
			}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := enq.EnqueueBatch(ctx, tx, t, msgs)
			return err
		}); err != nil {
			return err
		}
		i += k
	}
	_, err = pool.Exec(ctx, `VACUUM ANALYZE `+t.Sanitize())
	return err
}

// publishDirect is the broker's own ceiling for the same publisher: n
// messages of the same payload and headers published from workers
// goroutines, with no outbox.
func publishDirect(ctx context.Context, pub message.Publisher, n, workers int) (float64, error) {
	var (
		next  atomic.Int64
		wg    sync.WaitGroup
		first atomic.Value
	)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n) && ctx.Err() == nil {
				m := message.NewMessage(watermill.NewUUID(), message.Payload(benchPayload))
				for _, k := range []string{"event_id", "tenant_id", "topic", "sequence", "attempts", "table", "partition_key"} {
					m.Metadata.Set(k, "0123456789abcdef0123456789abcdef")
				}
				if err := pub.Publish("bench.direct.v1", m); err != nil {
					first.CompareAndSwap(nil, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	if err, _ := first.Load().(error); err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// drainForwarder relays the backlog of t through a subscriber configured by
// cfg and a forwarder with the zero Config to pub, and returns msgs/s,
// counted until every row is published.
func drainForwarder(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int, pub message.Publisher, cfg subscriber.Config) (float64, error) {
	return drainForwarderWith(ctx, pool, t, n, pub, cfg, forwarder.Config{})
}

// drainForwarderWith relays the backlog of t through a subscriber configured
// by cfg and a forwarder configured by fcfg to pub, and returns msgs/s,
// counted until the progress is durable: every ack written (default mode)
// or every partition floor past every row (ordered mode).
func drainForwarderWith(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int, pub message.Publisher, cfg subscriber.Config, fcfg forwarder.Config) (float64, error) {
	cfg.Table = t
	sub, err := subscriber.New(ctx, pool, cfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	f, err := forwarder.New(sub, pub, fcfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	var werr error
	if cfg.Ordered {
		werr = waitFloors(ctx, pool, t)
	} else {
		werr = waitPublished(ctx, pool, t, n)
	}
	elapsed := time.Since(start)
	_ = f.Close()
	if err := <-done; err != nil {
		return 0, err
	}
	if werr != nil {
		return 0, werr
	}
	return float64(n) / elapsed.Seconds(), nil
}

// waitFloors waits until every row of the ordered table t is below its
// partition's floor (acked and the progress written).
func waitFloors(ctx context.Context, pool *pgxpool.Pool, t schema.Table) error {
	// Per partition, the last keyed row (one index probe each) against the
	// floor: a count of the rows above the floors scanned the table and,
	// polled every 5 ms during a drain, took PostgreSQL CPU from the relay
	// it measures.
	q := `SELECT count(*) FROM generate_series(0, ` + strconv.Itoa(schema.OrderingPartitions-1) + `) AS g(part)
LEFT JOIN ` + t.PartitionsTable() + ` AS p ON p.partition = g.part
WHERE (SELECT max(o.sequence) FROM ` + t.Sanitize() + ` AS o WHERE o.ordering_partition = g.part AND o.ordering_key IS NOT NULL)
  > COALESCE(p.floor_sequence, 0)`
	for {
		var left int
		if err := pool.QueryRow(ctx, q).Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// purgeQueues empties the named queues that exist, so that every case
// publishes into empty queues (RabbitMQ slows as unconsumed messages pile
// up) and the suite leaves nothing behind.
func purgeQueues(url string, queues ...string) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return fmt.Errorf("purge RabbitMQ queues: %w", err)
	}
	defer conn.Close()
	for _, q := range queues {
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("purge RabbitMQ queues: %w", err)
		}
		if _, err := ch.QueuePurge(q, false); err != nil {
			var aerr *amqp091.Error
			if !errors.As(err, &aerr) || aerr.Code != amqp091.NotFound {
				return fmt.Errorf("purge queue %s: %w", q, err)
			}
			continue // a closed channel: the queue does not exist yet
		}
		_ = ch.Close()
	}
	return nil
}
