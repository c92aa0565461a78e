package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/kafkatest"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// brokerSuite measures outbox-to-broker throughput: a backlog drained by
// subscriber + forwarder into Kafka (in-process kfake cluster, acks=all,
// idempotent producer) and into RabbitMQ (publisher confirms, channel pool).
func brokerSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	n := o.brokerBacklog
	cluster, err := kafkatest.Start(6, 0)
	if err != nil {
		return err
	}
	defer cluster.Close()
	backends := []struct {
		name string
		open func() (message.Publisher, error)
	}{
		{"outbox -> Kafka (kfake, acks=all, idempotent)", func() (message.Publisher, error) {
			return kafkabackend.NewPublisher(cluster.Brokers(), watermill.NopLogger{})
		}},
		{fmt.Sprintf("outbox -> RabbitMQ (confirms, pool %d)", o.amqpPool), func() (message.Publisher, error) {
			return amqpbackend.NewPublisher(amqpbackend.Config{URL: o.amqpURL, ChannelPoolSize: o.amqpPool}, watermill.NopLogger{})
		}},
	}
	var (
		names, baselines []string
		values           []float64
	)
	for i, b := range backends {
		pub, err := b.open()
		if err != nil {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		bare := "bare publisher, " + b.name[len("outbox -> "):]
		bareRate, err := publishDirect(ctx, pub, n, 200)
		if err != nil {
			_ = pub.Close()
			return fmt.Errorf("%s: %w", bare, err)
		}
		t := schema.MustParseTable(fmt.Sprintf("%s.broker_%d", schemaName, i))
		if err := fillBacklog(ctx, pool, t, n); err != nil {
			return err
		}
		rate, err := drainForwarder(ctx, pool, t, n, pub, subscriber.Config{MaxInFlight: 1000})
		_ = pub.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", b.name, err)
		}
		names, baselines, values = append(names, bare, b.name), append(baselines, "", bare), append(values, bareRate, rate)
	}
	printTable(fmt.Sprintf("Relay throughput to brokers: drain %d rows, beside the same publisher fed directly by 200 goroutines (goals: Kafka >= 10,000 msgs/s, RabbitMQ >= 5,000 msgs/s)", n),
		ratioRows(names, baselines, values, "msgs/s"))
	return nil
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
// cfg and a forwarder to pub, and returns msgs/s, counted until every row is
// published.
func drainForwarder(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int, pub message.Publisher, cfg subscriber.Config) (float64, error) {
	cfg.Table = t
	sub, err := subscriber.New(pool, cfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer sub.Close()
	f, err := forwarder.New(sub, pub, forwarder.Config{}, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	start := time.Now()
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	werr := waitPublished(ctx, pool, t, n)
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
