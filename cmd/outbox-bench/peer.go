package main

import (
	"context"
	"database/sql"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	wforwarder "github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver for the watermill-sql peer
)

// countingSink is an in-memory publisher that accepts every message at once.
type countingSink struct{ n atomic.Int64 }

func (c *countingSink) Publish(_ string, msgs ...*message.Message) error {
	c.n.Add(int64(len(msgs)))
	return nil
}

func (c *countingSink) Close() error { return nil }

// peerSQL is Watermill's own outbox path: watermill-sql v3 with
// DefaultPostgreSQLSchema, and components/forwarder reading the
// forwarder topic and publishing to the destination.
type peerSQL struct {
	db      *sql.DB
	schema  wsql.DefaultPostgreSQLSchema
	offsets wsql.DefaultPostgreSQLOffsetsAdapter
}

func newPeerSQL(dbURL, schemaName, suffix string) (*peerSQL, error) {
	db, err := sql.Open("pgx", dbURL)
	if err != nil {
		return nil, err
	}
	return &peerSQL{
		db: db,
		schema: wsql.DefaultPostgreSQLSchema{GenerateMessagesTableName: func(topic string) string {
			return pgx.Identifier{schemaName, "watermill_" + topic + suffix}.Sanitize()
		}},
		offsets: wsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string {
			return pgx.Identifier{schemaName, "watermill_offsets_" + topic + suffix}.Sanitize()
		}},
	}, nil
}

const peerForwarderTopic = "outbox_forwarder"

// publisher returns the enveloping publisher business code would use.
func (p *peerSQL) publisher() (message.Publisher, error) {
	pub, err := wsql.NewPublisher(p.db, wsql.PublisherConfig{SchemaAdapter: p.schema, AutoInitializeSchema: true}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	return wforwarder.NewPublisher(pub, wforwarder.PublisherConfig{ForwarderTopic: peerForwarderTopic}), nil
}

// fill writes n enveloped messages (1,000 per INSERT).
func (p *peerSQL) fill(n int) error {
	pub, err := p.publisher()
	if err != nil {
		return err
	}
	for n > 0 {
		k := min(n, 1000)
		msgs := make([]*message.Message, k)
		for i := range msgs {
			msgs[i] = message.NewMessage(watermill.NewUUID(), message.Payload(benchPayload))
		}
		if err := pub.Publish("org.organization.updated.v1", msgs...); err != nil {
			return err
		}
		n -= k
	}
	return nil
}

// run starts the peer's forwarder to out; stop it with the returned func.
func (p *peerSQL) run(ctx context.Context, out message.Publisher) (func(), error) {
	sub, err := wsql.NewSubscriber(p.db, wsql.SubscriberConfig{
		SchemaAdapter: p.schema, OffsetsAdapter: p.offsets, InitializeSchema: true, ConsumerGroup: "bench",
	}, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	f, err := wforwarder.NewForwarder(sub, out, watermill.NopLogger{}, wforwarder.Config{ForwarderTopic: peerForwarderTopic})
	if err != nil {
		return nil, err
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Run(ctx) }()
	<-f.Running()
	return func() { _ = f.Close(); <-done; _ = sub.Close() }, nil
}

// peerDrain measures the watermill-sql + forwarder peer draining n rows into
// an in-memory sink.
func peerDrain(ctx context.Context, o options, schemaName string, n, round int) (float64, error) {
	p, err := newPeerSQL(o.dbURL, schemaName, fmt.Sprintf("_drain%d", round))
	if err != nil {
		return 0, err
	}
	defer p.db.Close()
	if err := p.fill(n); err != nil {
		return 0, fmt.Errorf("fill: %w", err)
	}
	sink := &countingSink{}
	start := time.Now()
	stop, err := p.run(ctx, sink)
	if err != nil {
		return 0, err
	}
	defer stop()
	for sink.n.Load() < int64(n) {
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		time.Sleep(2 * time.Millisecond)
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// measurePeerLatency offers rate events/s to the watermill-sql peer, one per
// database/sql transaction, and returns commit-to-delivery latencies.
func measurePeerLatency(ctx context.Context, o options, schemaName string, rate int, d time.Duration) ([]time.Duration, error) {
	p, err := newPeerSQL(o.dbURL, schemaName, fmt.Sprintf("_lat%d", rate))
	if err != nil {
		return nil, err
	}
	defer p.db.Close()
	if err := p.fill(1); err != nil { // creates the tables
		return nil, err
	}
	sink := newArrivals()
	stop, err := p.run(ctx, sink)
	if err != nil {
		return nil, err
	}
	defer stop()
	committed := offerSteady(ctx, rate, d, func() (string, time.Time, error) {
		tx, err := p.db.BeginTx(ctx, nil)
		if err != nil {
			return "", time.Time{}, err
		}
		pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{SchemaAdapter: p.schema}, watermill.NopLogger{})
		if err != nil {
			_ = tx.Rollback()
			return "", time.Time{}, err
		}
		m := message.NewMessage(watermill.NewUUID(), message.Payload(benchPayload))
		if err := wforwarder.NewPublisher(pub, wforwarder.PublisherConfig{ForwarderTopic: peerForwarderTopic}).Publish("org.organization.updated.v1", m); err != nil {
			_ = tx.Rollback()
			return "", time.Time{}, err
		}
		before := time.Now()
		return m.UUID, before, tx.Commit()
	})
	return sink.latencies(committed, func(string) bool { return false }, 10*time.Second)
}
