package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

var benchPayload = json.RawMessage(`{"organization_id":"6f1c2c7e-3a52-4f7e-9f0a-2b1d9c1e5a77","name":"Acme Corporation","status":"active","changed_by":"user-42","version":7}`)

// enqueueSuite compares Enqueue/EnqueueBatch with a bare INSERT of the same
// row into an equivalent table (same columns and indexes), one event per
// transaction and 100 per transaction.
func enqueueSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	outboxT := schema.MustParseTable(schemaName + ".enq_outbox")
	bareT := schema.MustParseTable(schemaName + ".bare_outbox")
	for _, t := range []schema.Table{outboxT, bareT} {
		if err := schema.Migrate(ctx, pool, t); err != nil {
			return err
		}
	}
	withNotify, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		return err
	}
	noNotify, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		return err
	}
	tenant := uuid.New()
	msg := func() publisher.Message {
		return publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(), Payload: benchPayload}
	}
	bareInsert := `INSERT INTO ` + bareT.Sanitize() + ` (tenant_id, topic, payload, event_id) VALUES ($1, $2, $3, $4)`
	bareBatch := `INSERT INTO ` + bareT.Sanitize() + ` (tenant_id, topic, payload, event_id)
SELECT u.t::uuid, u.tp, u.p::jsonb, u.e::uuid FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS u(t, tp, p, e)`

	single := func(fn func(tx pgx.Tx) error) func() (int, error) {
		return func() (int, error) { return 1, pgx.BeginFunc(ctx, pool, fn) }
	}
	batch := func(fn func(tx pgx.Tx, msgs []publisher.Message) error) func() (int, error) {
		return func() (int, error) {
			msgs := make([]publisher.Message, 100)
			for i := range msgs {
				msgs[i] = msg()
			}
			return len(msgs), pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return fn(tx, msgs) })
		}
	}
	cases := []struct {
		name, baseline string
		op             func() (int, error)
	}{
		{"bare INSERT, 1/tx", "", single(func(tx pgx.Tx) error {
			m := msg()
			_, err := tx.Exec(ctx, bareInsert, m.TenantID.String(), m.Topic, string(m.Payload), m.EventID.String())
			return err
		})},
		{"Enqueue, 1/tx, no NOTIFY", "bare INSERT, 1/tx", single(func(tx pgx.Tx) error {
			_, err := noNotify.Enqueue(ctx, tx, outboxT, msg())
			return err
		})},
		{"Enqueue, 1/tx (default, NOTIFY)", "bare INSERT, 1/tx", single(func(tx pgx.Tx) error {
			_, err := withNotify.Enqueue(ctx, tx, outboxT, msg())
			return err
		})},
		{"bare INSERT, 100/tx", "", batch(func(tx pgx.Tx, msgs []publisher.Message) error {
			tenants, topics, payloads, ids := make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs)), make([]string, len(msgs))
			for i, m := range msgs {
				tenants[i], topics[i], payloads[i], ids[i] = m.TenantID.String(), m.Topic, string(m.Payload), m.EventID.String()
			}
			_, err := tx.Exec(ctx, bareBatch, tenants, topics, payloads, ids)
			return err
		})},
		{"EnqueueBatch, 100/tx, no NOTIFY", "bare INSERT, 100/tx", batch(func(tx pgx.Tx, msgs []publisher.Message) error {
			_, err := noNotify.EnqueueBatch(ctx, tx, outboxT, msgs)
			return err
		})},
		{"EnqueueBatch, 100/tx (default, NOTIFY)", "bare INSERT, 100/tx", batch(func(tx pgx.Tx, msgs []publisher.Message) error {
			_, err := withNotify.EnqueueBatch(ctx, tx, outboxT, msgs)
			return err
		})},
	}
	best := make([]float64, len(cases))
	for round := 0; round < o.rounds; round++ {
		for i, c := range cases {
			if ctx.Err() != nil {
				break
			}
			rate, err := measure(ctx, o, c.op)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			best[i] = max(best[i], rate)
			// Keep the tables the same size for every case.
			if _, err := pool.Exec(ctx, `TRUNCATE `+outboxT.Sanitize()+`, `+bareT.Sanitize()); err != nil {
				return err
			}
		}
	}
	names, baselines := make([]string, len(cases)), make([]string, len(cases))
	for i, c := range cases {
		names[i], baselines[i] = c.name, c.baseline
	}
	printTable(fmt.Sprintf("Enqueue throughput (%d producers; goal: outbox >= 0.80x of bare INSERT)", o.workers), ratioRows(names, baselines, best, "events/s"))
	return nil
}

// measure runs op from o.workers goroutines for o.duration and returns
// events per second.
func measure(ctx context.Context, o options, op func() (int, error)) (float64, error) {
	ctx, cancel := context.WithTimeout(ctx, o.duration)
	defer cancel()
	var (
		events  atomic.Int64
		wg      sync.WaitGroup
		errOnce sync.Once
		failure error
	)
	start := time.Now()
	for range o.workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				n, err := op()
				if err != nil {
					if ctx.Err() == nil {
						errOnce.Do(func() { failure = err })
					}
					return
				}
				events.Add(int64(n))
			}
		}()
	}
	wg.Wait()
	if failure != nil {
		return 0, failure
	}
	return float64(events.Load()) / time.Since(start).Seconds(), nil
}
