package main

import (
	"context"
	"flag"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// orderedOptions are the flags of the ordered suite.
type orderedOptions struct {
	backlog, keys, hotBacklog, rate int
	duration, hold                  time.Duration
}

func (o *orderedOptions) register() {
	flag.IntVar(&o.backlog, "ordered-backlog", 40000, "ordered suite: rows drained in the drain and relays cases")
	flag.IntVar(&o.keys, "ordered-keys", 1000, "ordered suite: ordering keys of the drain and latency cases")
	flag.IntVar(&o.hotBacklog, "ordered-hot", 10000, "ordered suite: rows of the one hot key")
	flag.IntVar(&o.rate, "ordered-rate", 1000, "ordered suite: offered events/s of the latency cases")
	flag.DurationVar(&o.duration, "ordered-duration", 10*time.Second, "ordered suite: length of the plain latency case")
	flag.DurationVar(&o.hold, "ordered-hold", 60*time.Second, "ordered suite: how long the unrelated transaction stays open in the long-transaction case")
}

// orderedSuite compares ordered mode with the default mode: drain rate and
// row writes per event, one hot key, 1/2/4 relays, and commit-to-delivery
// latency with and without an unrelated long transaction.
func orderedSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	oo := o.ordered
	newTable := func(name string) (schema.Table, error) {
		t := schema.MustParseTable(schemaName + "." + name)
		return t, schema.Migrate(ctx, pool, t, schema.WithOrderingKeyColumn())
	}
	fill := func(t schema.Table, n, keys int) error {
		enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
		if err != nil {
			return err
		}
		tenant := uuid.New()
		for i := 0; i < n; {
			k := min(n-i, 1000)
			msgs := make([]publisher.Message, k)
			for j := range msgs {
				msgs[j] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(),
					Payload: benchPayload, OrderingKey: "org-" + strconv.Itoa((i+j)%keys)}
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

	// 1. Drain, default vs ordered, with row writes per event.
	var names, bases []string
	var rates []float64
	var writes []float64
	for _, ordered := range []bool{false, true} {
		name := map[bool]string{false: "drain default", true: "drain ordered"}[ordered]
		t, err := newTable(map[bool]string{false: "drain_default", true: "drain_ordered"}[ordered])
		if err != nil {
			return err
		}
		if ordered {
			// Ordered mode's tables (and their 64 partition rows) come with
			// the switch: made before the count, as by a migration.
			if err := schema.SwitchMode(ctx, pool, t, schema.ModeOrdered, "outbox-bench"); err != nil {
				return err
			}
		}
		if err := fill(t, oo.backlog, oo.keys); err != nil {
			return err
		}
		before, err := rowWrites(ctx, pool, t)
		if err != nil {
			return err
		}
		rate, err := drainOrdered(ctx, pool, []schema.Table{t}, oo.backlog, ordered, 1)
		if err != nil {
			return err
		}
		after, err := rowWrites(ctx, pool, t)
		if err != nil {
			return err
		}
		names, rates = append(names, name), append(rates, rate)
		bases = append(bases, map[bool]string{false: "", true: "drain default"}[ordered])
		writes = append(writes, float64(after-before)/float64(oo.backlog))
	}
	printTable(fmt.Sprintf("ordered: drain %d rows over %d keys", oo.backlog, oo.keys), ratioRows(names, bases, rates, "msgs/s"))
	fmt.Printf("row writes per event (n_tup_ins+upd+del of the outbox and companion tables, after the fill): default %.3f, ordered %.3f\n", writes[0], writes[1])
	fmt.Printf("(ordered relays here tick every 100 ms: a drain ends when every floor is written)\n\n")

	// 2. One hot key.
	hot, err := newTable("hot")
	if err != nil {
		return err
	}
	if err := fill(hot, oo.hotBacklog, 1); err != nil {
		return err
	}
	hotRate, err := drainOrdered(ctx, pool, []schema.Table{hot}, oo.hotBacklog, true, 1)
	if err != nil {
		return err
	}
	// 3. 1, 2, 4 relays on one table.
	names, bases, rates = []string{"one hot key"}, []string{""}, []float64{hotRate}
	for _, n := range []int{1, 2, 4} {
		t, err := newTable("relays_" + strconv.Itoa(n))
		if err != nil {
			return err
		}
		if err := fill(t, oo.backlog/2, oo.keys); err != nil {
			return err
		}
		r, err := drainOrdered(ctx, pool, []schema.Table{t}, oo.backlog/2, true, n)
		if err != nil {
			return err
		}
		names, rates = append(names, fmt.Sprintf("%d relays", n)), append(rates, r)
		bases = append(bases, map[bool]string{true: "", false: "1 relays"}[n == 1])
	}
	printTable(fmt.Sprintf("ordered: one hot key (%d rows); %d rows over %d keys by 1, 2, 4 relays (2 cores bound this machine)", oo.hotBacklog, oo.backlog/2, oo.keys),
		ratioRows(names, bases, rates, "msgs/s"))

	// 4. Latency at a paced rate, then with an unrelated transaction open.
	lt, err := newTable("latency")
	if err != nil {
		return err
	}
	p50, p99, err := orderedLatency(ctx, pool, lt, oo, oo.duration, nil)
	if err != nil {
		return err
	}
	other := schemaName + ".unrelated"
	if _, err := pool.Exec(ctx, `CREATE TABLE `+other+` (id int)`); err != nil {
		return err
	}
	lt2, err := newTable("latency_long_tx")
	if err != nil {
		return err
	}
	q50, q99, err := orderedLatency(ctx, pool, lt2, oo, oo.hold, func(ctx context.Context) (func(), error) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return nil, err
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+other+` VALUES (1)`); err != nil {
			_ = tx.Rollback(ctx)
			return nil, err
		}
		return func() { _ = tx.Rollback(context.Background()) }, nil
	})
	if err != nil {
		return err
	}
	fmt.Printf("ordered: commit-to-delivery latency at %d ev/s over %d keys\n", oo.rate, oo.keys)
	fmt.Printf("  plain (%s):                                p50 %.2f ms  p99 %.2f ms\n", oo.duration, p50, p99)
	fmt.Printf("  an unrelated transaction open for %s:   p50 %.2f ms  p99 %.2f ms\n\n", oo.hold, q50, q99)
	return nil
}

// rowWrites sums inserts, updates and deletes of t and its companion tables
// (after waiting for the statistics to be flushed).
func rowWrites(ctx context.Context, pool *pgxpool.Pool, t schema.Table) (int64, error) {
	time.Sleep(2500 * time.Millisecond) // idle backends flush their statistics about once a second
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		return 0, err
	}
	var n int64
	err = conn.QueryRow(ctx, `SELECT COALESCE(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint FROM pg_stat_user_tables
WHERE relid IN (to_regclass($1), to_regclass($2), to_regclass($3), to_regclass($4))`,
		t.Sanitize(), t.PartitionsTable(), t.RelaysTable(), t.HoldsTable()).Scan(&n)
	return n, err
}

// drainOrdered drains n rows of t with relays subscribers (ordered or the
// default mode) acking at once, and returns msgs/s until the progress is
// durable (acks written, or floors past every row).
func drainOrdered(ctx context.Context, pool *pgxpool.Pool, tables []schema.Table, n int, ordered bool, relays int) (float64, error) {
	_, durable, err := drainTimes(ctx, pool, tables, n, ordered, relays)
	if err != nil {
		return 0, err
	}
	return float64(n) / durable.Seconds(), nil
}

// drainTimes is drainOrdered's measurement: how long until every row was
// delivered, and until the progress was durable.
func drainTimes(ctx context.Context, pool *pgxpool.Pool, tables []schema.Table, n int, ordered bool, relays int) (delivered, durable time.Duration, err error) {
	t := tables[0]
	// Count distinct events: a relay handover repeats some.
	var (
		mu       sync.Mutex
		distinct = make(map[string]struct{}, n)
		all      = make(chan struct{})
	)
	var subs []*subscriber.Subscriber
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
	}()
	start := time.Now()
	for i := 0; i < relays; i++ {
		cfg := subscriber.Config{Table: t, Ordered: ordered, BatchSize: 500, DisableNotify: true}
		if ordered {
			// Floors are written once per tick: a 100 ms tick makes the end of
			// the drain durable soon after the last ack, as the default mode's
			// acks are.
			cfg.ElectionInterval = 100 * time.Millisecond
		}
		s, err := subscriber.New(ctx, pool, cfg, watermill.NopLogger{})
		if err != nil {
			return 0, 0, err
		}
		subs = append(subs, s)
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			return 0, 0, err
		}
		go func() {
			for m := range ch {
				m.Ack()
				mu.Lock()
				before := len(distinct)
				distinct[m.UUID] = struct{}{}
				if before < n && len(distinct) == n {
					close(all)
				}
				mu.Unlock()
			}
		}()
	}
	select {
	case <-all:
	case <-ctx.Done():
		return 0, 0, ctx.Err()
	}
	delivered = time.Since(start)
	if !ordered {
		if err := waitPublished(ctx, pool, t, n); err != nil {
			return 0, 0, err
		}
		return delivered, time.Since(start), nil
	}
	if err := waitFloors(ctx, pool, t); err != nil {
		return 0, 0, err
	}
	return delivered, time.Since(start), nil
}

// orderedLatency runs a paced producer (rate events/s, batches of 10 every
// 10 ms, keys spread over o.keys) into t for d while one ordered relay
// delivers, and returns the p50 and p99 commit-to-delivery latency in ms.
// before, when set, starts something that stays open for the run.
func orderedLatency(ctx context.Context, pool *pgxpool.Pool, t schema.Table, o orderedOptions, d time.Duration,
	before func(context.Context) (func(), error)) (float64, float64, error) {
	s, err := subscriber.New(ctx, pool, subscriber.Config{Table: t, Ordered: true}, watermill.NopLogger{})
	if err != nil {
		return 0, 0, err
	}
	defer s.Close()
	var committed sync.Map // event_id -> time
	var mu sync.Mutex
	var lat []float64
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		return 0, 0, err
	}
	go func() {
		for m := range ch {
			now := time.Now()
			m.Ack()
			if v, ok := committed.Load(m.UUID); ok {
				mu.Lock()
				lat = append(lat, float64(now.Sub(v.(time.Time)).Microseconds())/1000)
				mu.Unlock()
			}
		}
	}()
	time.Sleep(500 * time.Millisecond) // partitions taken
	if before != nil {
		done, err := before(ctx)
		if err != nil {
			return 0, 0, err
		}
		defer done()
	}
	per := 10
	tick := time.NewTicker(time.Second * time.Duration(per) / time.Duration(o.rate))
	defer tick.Stop()
	end := time.Now().Add(d)
	tenant := uuid.New()
	i := 0
	for time.Now().Before(end) {
		<-tick.C
		msgs := make([]publisher.Message, per)
		for j := range msgs {
			msgs[j] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(),
				Payload: benchPayload, OrderingKey: "org-" + strconv.Itoa((i*per+j)%o.keys)}
		}
		i++
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.EnqueueBatch(ctx, tx, t, msgs)
			return err
		}); err != nil {
			return 0, 0, err
		}
		now := time.Now()
		for _, m := range msgs {
			committed.Store(m.EventID.String(), now)
		}
	}
	time.Sleep(500 * time.Millisecond)
	mu.Lock()
	defer mu.Unlock()
	if len(lat) == 0 {
		return 0, 0, fmt.Errorf("no event delivered")
	}
	sort.Float64s(lat)
	return lat[len(lat)/2], lat[len(lat)*99/100], nil
}
