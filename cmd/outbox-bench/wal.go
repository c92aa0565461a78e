package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// walSuite measures the WAL relay on a server with wal_level = logical
// (scripts/bench-wal.sh starts a private one): the writer's cost against a
// bare INSERT while the relay streams, the drain of a backlog against the
// ordered mode's drain of the same backlog, commit-to-delivery latency at
// o.ordered.rate events/s, and the relay's statements per event.
func walSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	var level string
	if err := pool.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		return err
	}
	if level != "logical" {
		return fmt.Errorf("the wal suite needs wal_level = logical (it is %s): run scripts/bench-wal.sh, which starts a private server", level)
	}
	oo := o.ordered
	counter := newStatementCounter()
	relayPool, err := newPool(ctx, o, 4, counter)
	if err != nil {
		return err
	}
	defer relayPool.Close()
	newWAL := func(name string, opts ...schema.MigrateOption) (schema.Table, func(), error) {
		t := schema.MustParseTable(schemaName + "." + name)
		if err := schema.Migrate(ctx, pool, t, opts...); err != nil {
			return t, nil, err
		}
		if _, err := walrelay.Setup(ctx, pool, t, walrelay.Names{}); err != nil {
			return t, nil, err
		}
		return t, func() { _ = walrelay.Teardown(context.Background(), pool, t, walrelay.Names{}) }, nil
	}
	startWAL := func(t schema.Table, onMsg func(id string)) (*walrelay.Subscriber, error) {
		s, err := walrelay.New(ctx, relayPool, walrelay.Config{Table: t, StatusInterval: 100 * time.Millisecond}, watermill.NopLogger{})
		if err != nil {
			return nil, err
		}
		ch, err := s.Subscribe(ctx, subscriber.AllTopics)
		if err != nil {
			return nil, err
		}
		go func() {
			for m := range ch {
				m.Ack()
				onMsg(m.UUID)
			}
		}()
		return s, nil
	}

	// 1. Writer cost while the relay streams: Enqueue (no NOTIFY: no relay
	// listens) against a bare INSERT of the same row into the same
	// published table; the relay streams and delivers both.
	wt, drop, err := newWAL("wal_writer")
	if err != nil {
		return err
	}
	defer drop()
	var streamed atomic.Int64
	ws, err := startWAL(wt, func(string) { streamed.Add(1) })
	if err != nil {
		return err
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		return err
	}
	tenant := uuid.New()
	bareInsert := `INSERT INTO ` + wt.Sanitize() + ` (tenant_id, topic, payload, event_id) VALUES ($1, $2, $3, $4)`
	// The statement Enqueue sends on a WAL table, without the library: an
	// idempotent insert (a repeated event_id returns the existing row).
	idempotentInsert := bareInsert + ` ON CONFLICT (event_id) DO NOTHING RETURNING sequence`
	cases := []struct {
		name, baseline string
		op             func() (int, error)
	}{
		{"bare INSERT, 1/tx", "", func() (int, error) {
			return 1, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, bareInsert, tenant.String(), "org.organization.updated.v1", string(benchPayload), uuid.NewString())
				return err
			})
		}},
		{"bare INSERT ... ON CONFLICT (event_id) DO NOTHING RETURNING sequence, 1/tx", "bare INSERT, 1/tx", func() (int, error) {
			return 1, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				var seq int64
				return tx.QueryRow(ctx, idempotentInsert, tenant.String(), "org.organization.updated.v1", string(benchPayload), uuid.NewString()).Scan(&seq)
			})
		}},
		{"Enqueue, 1/tx, WAL relay streaming", "bare INSERT, 1/tx", func() (int, error) {
			return 1, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := enq.Enqueue(ctx, tx, wt, publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(), Payload: benchPayload})
				return err
			})
		}},
	}
	best := make([]float64, len(cases))
	paired := make([][]float64, len(cases))
	for range o.rounds {
		var bare float64
		for i, c := range cases {
			rate, err := measure(ctx, o, c.op)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			best[i] = max(best[i], rate)
			if i == 0 {
				bare = rate
			} else if bare > 0 {
				paired[i] = append(paired[i], rate/bare)
			}
		}
	}
	_ = ws.Close()
	names, baselines := make([]string, len(cases)), make([]string, len(cases))
	for i, c := range cases {
		names[i], baselines[i] = c.name, c.baseline
	}
	printTable(fmt.Sprintf("WAL relay: writer cost (%d producers; goal >= 0.97x of bare INSERT)", o.workers), ratioRows(names, baselines, best, "events/s"))
	printPaired("WAL relay: idempotent INSERT statement / bare INSERT", paired[1])
	printPaired("WAL relay: Enqueue / bare INSERT", paired[2])

	// 2. Drain of a backlog: the WAL relay against the ordered mode, the
	// same rows and keys, on this server, once per round (a drain of 40,000
	// rows lasts about 0.3 s, so one drain is noisy). The ordered mode goes
	// first, and each round's slot is created after it, so that the WAL
	// relay reads only its own table's WAL, as it would in production.
	fill := func(t schema.Table, n int) error {
		for i := 0; i < n; {
			k := min(n-i, 1000)
			msgs := make([]publisher.Message, k)
			for j := range msgs {
				msgs[j] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(),
					Payload: benchPayload, OrderingKey: "org-" + strconv.Itoa((i+j)%oo.keys)}
			}
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := enq.EnqueueBatch(ctx, tx, t, msgs)
				return err
			}); err != nil {
				return err
			}
			i += k
		}
		return nil
	}
	n := oo.backlog
	// rates: delivered and durable, for the ordered mode and the WAL relay.
	type rates struct{ ordDelivered, ordDurable, walDelivered, walDurable float64 }
	drainRound := func(round int) (r rates, stmts int64, err error) {
		ot := schema.MustParseTable(fmt.Sprintf("%s.wal_vs_ordered_%d", schemaName, round))
		if err := schema.Migrate(ctx, pool, ot, schema.WithOrderingKeyColumn()); err != nil {
			return r, 0, err
		}
		if err := fill(ot, n); err != nil {
			return r, 0, err
		}
		od, odur, err := drainTimes(ctx, pool, []schema.Table{ot}, n, true, 1)
		if err != nil {
			return r, 0, fmt.Errorf("ordered drain: %w", err)
		}
		dt, drop, err := newWAL(fmt.Sprintf("wal_drain_%d", round), schema.WithOrderingKeyColumn())
		if err != nil {
			return r, 0, err
		}
		defer drop()
		if err := fill(dt, n); err != nil {
			return r, 0, err
		}
		counter.reset()
		var (
			mu       sync.Mutex
			distinct = make(map[string]struct{}, n)
			all      = make(chan struct{})
		)
		start := time.Now()
		ds, err := startWAL(dt, func(id string) {
			mu.Lock()
			defer mu.Unlock()
			before := len(distinct)
			distinct[id] = struct{}{}
			if before < n && len(distinct) == n {
				close(all)
			}
		})
		if err != nil {
			return r, 0, err
		}
		select {
		case <-all:
		case <-time.After(5 * time.Minute):
			_ = ds.Close()
			return r, 0, errors.New("the WAL relay did not drain the backlog in 5 minutes")
		}
		delivered := time.Since(start)
		// Durable, as the ordered drain counts until its floors are
		// written: until the relay's recorded progress settles every row
		// (what the runbook and the cleaner go by).
		for {
			st, err := runbook.New(pool, dt).Stats(ctx)
			if err != nil {
				_ = ds.Close()
				return r, 0, err
			}
			if st.Pending == 0 {
				break
			}
			if time.Since(start) > 5*time.Minute {
				_ = ds.Close()
				return r, 0, fmt.Errorf("the WAL relay's progress did not settle the drained rows in 5 minutes (%d pending)", st.Pending)
			}
			time.Sleep(5 * time.Millisecond)
		}
		durable := time.Since(start)
		_ = ds.Close()
		r = rates{float64(n) / od.Seconds(), float64(n) / odur.Seconds(), float64(n) / delivered.Seconds(), float64(n) / durable.Seconds()}
		return r, counter.claims.Load() + counter.acks.Load() + counter.other.Load(), nil
	}
	var (
		bestDrain      rates
		maxStmts       int64
		deliveredPairs []float64
		durablePairs   []float64
	)
	for round := range o.rounds {
		r, stmts, err := drainRound(round)
		if err != nil {
			return err
		}
		bestDrain = rates{max(bestDrain.ordDelivered, r.ordDelivered), max(bestDrain.ordDurable, r.ordDurable),
			max(bestDrain.walDelivered, r.walDelivered), max(bestDrain.walDurable, r.walDurable)}
		maxStmts = max(maxStmts, stmts)
		deliveredPairs = append(deliveredPairs, r.walDelivered/r.ordDelivered)
		durablePairs = append(durablePairs, r.walDurable/r.ordDurable)
	}
	printTable(fmt.Sprintf("WAL relay: drain of %d rows over %d keys, best of %d (goal >= 1.0x of the ordered mode); delivered: every row handed over and acked; durable: and the progress recorded (ordered: floors past every row; WAL: the runbook counts none pending)", n, oo.keys, o.rounds),
		ratioRows([]string{"ordered mode, delivered", "WAL relay, delivered", "ordered mode, durable", "WAL relay, durable"},
			[]string{"", "ordered mode, delivered", "", "ordered mode, durable"},
			[]float64{bestDrain.ordDelivered, bestDrain.walDelivered, bestDrain.ordDurable, bestDrain.walDurable}, "msgs/s"))
	printPaired("WAL relay / ordered mode, delivered", deliveredPairs)
	printPaired("WAL relay / ordered mode, durable", durablePairs)
	fmt.Printf("WAL relay: at most %d database statements on the relay's pool for %d events: %.4f per event (goal < 0.01)\n\n", maxStmts, n, float64(maxStmts)/float64(n))

	// 3. Commit-to-delivery latency at oo.rate events/s.
	lt, drop3, err := newWAL("wal_latency", schema.WithOrderingKeyColumn())
	if err != nil {
		return err
	}
	defer drop3()
	var (
		committed sync.Map
		lmu       sync.Mutex
		lat       []float64
	)
	ls, err := startWAL(lt, func(id string) {
		now := time.Now()
		if v, ok := committed.Load(id); ok {
			lmu.Lock()
			lat = append(lat, float64(now.Sub(v.(time.Time)).Microseconds())/1000)
			lmu.Unlock()
		}
	})
	if err != nil {
		return err
	}
	defer ls.Close()
	time.Sleep(500 * time.Millisecond)
	per := 10
	tick := time.NewTicker(time.Second * time.Duration(per) / time.Duration(oo.rate))
	defer tick.Stop()
	end := time.Now().Add(oo.duration)
	for i := 0; time.Now().Before(end); i++ {
		<-tick.C
		msgs := make([]publisher.Message, per)
		for j := range msgs {
			msgs[j] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(),
				Payload: benchPayload, OrderingKey: "org-" + strconv.Itoa((i*per+j)%oo.keys)}
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := enq.EnqueueBatch(ctx, tx, lt, msgs)
			return err
		}); err != nil {
			return err
		}
		now := time.Now()
		for _, m := range msgs {
			committed.Store(m.EventID.String(), now)
		}
	}
	time.Sleep(500 * time.Millisecond)
	lmu.Lock()
	defer lmu.Unlock()
	if len(lat) == 0 {
		return errors.New("latency: no event delivered")
	}
	sort.Float64s(lat)
	fmt.Printf("WAL relay: commit-to-delivery at %d events/s for %s: p50 %.2f ms, p99 %.2f ms (goal p50 < 2 ms, p99 < 10 ms), %d events\n\n",
		oo.rate, oo.duration, lat[len(lat)/2], lat[len(lat)*99/100], len(lat))
	return nil
}
