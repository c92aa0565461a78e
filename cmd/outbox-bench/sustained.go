package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

type tableSize struct {
	at                 time.Duration
	rows, dead         int64
	table, index, live int64
}

func measureSize(ctx context.Context, pool *pgxpool.Pool, t schema.Table, since time.Time) (tableSize, error) {
	s := tableSize{at: time.Since(since).Round(time.Second)}
	err := pool.QueryRow(ctx, `SELECT pg_table_size($1::regclass), pg_indexes_size($1::regclass),
		COALESCE((SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0),
		COALESCE((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = $1::regclass), 0),
		(SELECT count(*) FROM `+t.Sanitize()+`)`, t.Sanitize()).Scan(&s.table, &s.index, &s.live, &s.dead, &s.rows)
	return s, err
}

// sustainedSuite runs a steady rate through the subscriber with the cleaner
// on and reports table and index size and dead tuples over time.
func sustainedSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	t := schema.MustParseTable(schemaName + ".sustained_outbox")
	if err := schema.Migrate(ctx, pool, t); err != nil {
		return err
	}
	s, err := subscriber.New(ctx, pool, subscriber.Config{Table: t}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer s.Close()
	var autovacuum string
	if err := pool.QueryRow(ctx, `SHOW autovacuum`).Scan(&autovacuum); err != nil {
		return err
	}
	c, err := cleaner.New(pool, cleaner.Config{Table: t, Interval: 10 * time.Second, Retention: 30 * time.Second, Vacuum: o.cleanerVacuum}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = c.Run(runCtx) }()
	ch, err := s.Subscribe(runCtx, subscriber.AllTopics)
	if err != nil {
		return err
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for m := range ch {
			m.Ack()
		}
	}()
	start := time.Now()
	var samples []tableSize
	sample := func() error {
		sz, err := measureSize(ctx, pool, t, start)
		samples = append(samples, sz)
		return err
	}
	if err := sample(); err != nil {
		return err
	}
	tenant := uuid.New()
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		return err
	}
	interval := time.Second / time.Duration(o.sustainedRate/10) // 10 events per transaction
	next := time.Now()
	lastSample := time.Now()
	sent := 0
	for time.Since(start) < o.sustainedDuration && ctx.Err() == nil {
		time.Sleep(time.Until(next))
		next = next.Add(interval)
		if err := enqueueBenchBatch(ctx, pool, enq, t, tenant, 10); err != nil {
			return err
		}
		sent += 10
		if time.Since(lastSample) >= o.sustainedDuration/5 {
			lastSample = time.Now()
			if err := sample(); err != nil {
				return err
			}
		}
	}
	if err := sample(); err != nil {
		return err
	}
	stop()
	wg.Wait()
	fmt.Printf("Sustained run: %d events/s for %s (%d events), subscriber with immediate ack, cleaner every 10s with 30s retention, cleaner VACUUM %v, server autovacuum %s (goal: table size bounded)\n",
		o.sustainedRate, o.sustainedDuration, sent, o.cleanerVacuum, autovacuum)
	fmt.Printf("  %8s %10s %12s %12s %12s %12s\n", "at", "rows", "table bytes", "index bytes", "live tuples", "dead tuples")
	for _, sz := range samples {
		fmt.Printf("  %8s %10d %12d %12d %12d %12d\n", sz.at, sz.rows, sz.table, sz.index, sz.live, sz.dead)
	}
	fmt.Println()
	return nil
}
