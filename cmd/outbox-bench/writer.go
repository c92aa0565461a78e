package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// The writer suite measures what the outbox costs the business transaction,
// as a new user would see it: 8 producers on a pool of 16 connections, one
// event per transaction, beside a bare INSERT of the same row into a table
// with the same indexes, with and without a relay draining the table on a
// pool of its own; commit-to-delivery latency at 500 and 1,000 events/s from
// 8 writers; producers offered 5,000 events/s; and the relay's statements per
// event relayed.
const (
	writerProducers = 8
	writerPoolSize  = 16
)

// statementCounter counts the relay's statements by kind: it is the
// relay pool's query tracer.
type statementCounter struct {
	claims, acks, other atomic.Int64
	mu                  sync.Mutex
	claimSQL, ackSQL    map[string]bool
}

func newStatementCounter() *statementCounter {
	return &statementCounter{claimSQL: map[string]bool{}, ackSQL: map[string]bool{}}
}

// watch registers the claim and ack statements of t.
func (c *statementCounter) watch(t schema.Table) {
	q := sqlq.NewQueries(t, schema.Columns{})
	c.mu.Lock()
	defer c.mu.Unlock()
	c.claimSQL[q.ClaimAll], c.claimSQL[q.ClaimTopic], c.ackSQL[q.Ack] = true, true, true
}

func (c *statementCounter) reset() { c.claims.Store(0); c.acks.Store(0); c.other.Store(0) }

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	claim, ack := c.claimSQL[data.SQL], c.ackSQL[data.SQL]
	c.mu.Unlock()
	switch {
	case claim:
		c.claims.Add(1)
	case ack:
		c.acks.Add(1)
	default:
		c.other.Add(1)
	}
	return ctx
}

func (c *statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func newPool(ctx context.Context, o options, size int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = size
	cfg.ConnConfig.Tracer = tracer
	return pgxpool.NewWithConfig(ctx, cfg)
}

// relayRun is a relay draining one table on a pool of its own, acking every
// message at once.
type relayRun struct {
	sub      *subscriber.Subscriber
	cancel   context.CancelFunc
	done     chan struct{}
	received atomic.Int64
	arrivals *arrivals // nil unless latencies are measured
}

func startRelay(ctx context.Context, pool *pgxpool.Pool, t schema.Table, cfg subscriber.Config, track bool) (*relayRun, error) {
	cfg.Table = t
	s, err := subscriber.New(ctx, pool, cfg, watermill.NopLogger{})
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(ctx)
	ch, err := s.Subscribe(rctx, subscriber.AllTopics)
	if err != nil {
		cancel()
		_ = s.Close()
		return nil, err
	}
	r := &relayRun{sub: s, cancel: cancel, done: make(chan struct{})}
	if track {
		r.arrivals = newArrivals()
	}
	go func() {
		defer close(r.done)
		for m := range ch {
			if r.arrivals != nil {
				r.arrivals.record(m.UUID)
			}
			r.received.Add(1)
			m.Ack()
		}
	}()
	for !cfg.Ordered && !s.IsLeader() && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // first claims done, the relay is idle
	return r, nil
}

func (r *relayRun) stop() error {
	r.cancel()
	<-r.done
	return r.sub.Close()
}

func writerSuite(ctx context.Context, _ *pgxpool.Pool, schemaName string, o options) error {
	counter := newStatementCounter()
	producers, err := newPool(ctx, o, writerPoolSize, nil)
	if err != nil {
		return err
	}
	defer producers.Close()
	relayPool, err := newPool(ctx, o, 8, counter)
	if err != nil {
		return err
	}
	defer relayPool.Close()

	defaults, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
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
	// Ordered writers: one keyed event per transaction over 1,000 keys.
	keyedMsg := func() publisher.Message {
		m := msg()
		m.OrderingKey = "org-" + strconv.Itoa(rand.IntN(1000))
		return m
	}
	seq := 0
	newTableWith := func(prefix string, opts ...schema.MigrateOption) (schema.Table, error) {
		seq++
		t := schema.MustParseTable(fmt.Sprintf("%s.%s_%d", schemaName, prefix, seq))
		counter.watch(t)
		return t, schema.Migrate(ctx, producers, t, opts...)
	}
	newTable := func(prefix string) (schema.Table, error) { return newTableWith(prefix) }
	bareInsert := func(t schema.Table) func() (int, error) {
		sql := `INSERT INTO ` + t.Sanitize() + ` (tenant_id, topic, payload, event_id) VALUES ($1, $2, $3, $4)`
		return func() (int, error) {
			return 1, pgx.BeginFunc(ctx, producers, func(tx pgx.Tx) error {
				m := msg()
				_, err := tx.Exec(ctx, sql, m.TenantID.String(), m.Topic, string(m.Payload), m.EventID.String())
				return err
			})
		}
	}
	enqueue := func(e *publisher.Enqueuer, t schema.Table, ordered bool) func() (int, error) {
		next := msg
		if ordered {
			next = keyedMsg
		}
		return func() (int, error) {
			return 1, pgx.BeginFunc(ctx, producers, func(tx pgx.Tx) error {
				_, err := e.Enqueue(ctx, tx, t, next())
				return err
			})
		}
	}
	po := o
	po.workers = writerProducers

	// 1. Throughput of the producers, with and without a relay draining.
	type tcase struct {
		name, baseline string
		relay          *subscriber.Config  // nil: no relay
		enq            *publisher.Enqueuer // nil: bare INSERT
		ordered        bool                // keyed events into an ordered table
	}
	relayDefault, relayNoNotify := subscriber.Config{}, subscriber.Config{DisableNotify: true}
	relayOrdered := subscriber.Config{Ordered: true}
	cases := []tcase{
		{name: "bare INSERT, no relay"},
		{name: "Enqueue, default, no relay", baseline: "bare INSERT, no relay", enq: defaults},
		{name: "Enqueue, DisableNotify, no relay", baseline: "bare INSERT, no relay", enq: noNotify},
		{name: "relay draining, NOTIFY off (producers and relay)", relay: &relayNoNotify, enq: noNotify},
		{name: "relay draining, default wake-up", baseline: "relay draining, NOTIFY off (producers and relay)", relay: &relayDefault, enq: defaults},
		{name: "ordered: Enqueue keyed (1,000 keys), no relay", baseline: "Enqueue, default, no relay", enq: defaults, ordered: true},
		{name: "ordered: keyed writers, ordered relay draining", baseline: "relay draining, default wake-up", relay: &relayOrdered, enq: defaults, ordered: true},
	}
	best := make([]float64, len(cases))
	stmts := make([][3]float64, len(cases)) // claims, acks, all relay statements per event (best run)
	for round := 0; round < o.rounds; round++ {
		for i, c := range cases {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			var opts []schema.MigrateOption
			if c.ordered {
				opts = append(opts, schema.WithOrderingKeyColumn())
			}
			t, err := newTableWith("w", opts...)
			if err != nil {
				return err
			}
			op := bareInsert(t)
			if c.enq != nil {
				op = enqueue(c.enq, t, c.ordered)
			}
			var r *relayRun
			if c.relay != nil {
				if r, err = startRelay(ctx, relayPool, t, *c.relay, false); err != nil {
					return err
				}
				counter.reset()
			}
			rate, err := measure(ctx, po, op)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			if r != nil {
				total, err := drainAll(ctx, producers, t, r, 30*time.Second, c.ordered)
				if err != nil {
					return fmt.Errorf("%s: %w", c.name, err)
				}
				if err := r.stop(); err != nil {
					return err
				}
				if rate > best[i] && total > 0 {
					cl, ac, ot := float64(counter.claims.Load()), float64(counter.acks.Load()), float64(counter.other.Load())
					stmts[i] = [3]float64{cl / float64(total), ac / float64(total), (cl + ac + ot) / float64(total)}
				}
			}
			best[i] = max(best[i], rate)
			if _, err := producers.Exec(ctx, `DROP TABLE `+t.Sanitize()); err != nil {
				return err
			}
		}
	}
	names, baselines := make([]string, len(cases)), make([]string, len(cases))
	for i, c := range cases {
		names[i], baselines[i] = c.name, c.baseline
	}
	printTable(fmt.Sprintf("Writer cost: %d producers on a pool of %d, 1 event per transaction, best of %d (goals: Enqueue default >= 0.90x of bare INSERT; with a relay draining, default wake-up >= 0.95x of NOTIFY off; ordered writers >= 0.90x of the default mode's)",
		writerProducers, writerPoolSize, o.rounds), ratioRows(names, baselines, best, "events/s"))
	for i, c := range cases {
		if c.relay != nil {
			fmt.Printf("  %-50s relay statements per event relayed: claims %.3f + acks %.3f = %.3f, all statements %.3f (aim: claims+acks < 0.05)\n",
				c.name, stmts[i][0], stmts[i][1], stmts[i][0]+stmts[i][1], stmts[i][2])
		}
	}
	fmt.Println()

	// 2. Latency at steady rates from 8 writers, defaults.
	fmt.Printf("Commit-to-delivery latency, defaults, %d writers, %s per case (goal: p50 < 5ms, p99 < 30ms; baseline: every commit notifies, as before the handshake)\n", writerProducers, o.latencyDuration)
	for _, lc := range []struct {
		rate        int
		alwaysWoken bool
		ordered     bool
	}{{500, true, false}, {500, false, false}, {1000, true, false}, {1000, false, false}, {500, false, true}, {1000, false, true}} {
		rate := lc.rate
		var opts []schema.MigrateOption
		if lc.ordered {
			opts = append(opts, schema.WithOrderingKeyColumn())
		}
		t, err := newTableWith("wl", opts...)
		if err != nil {
			return err
		}
		var holder *pgx.Conn
		if lc.alwaysWoken {
			// Baseline: the bench holds the idle lock, so every commit
			// notifies, as every enqueue did before the handshake.
			if holder, err = pgx.Connect(ctx, o.dbURL); err != nil {
				return err
			}
			if _, err := holder.Exec(ctx, sqlq.TryIdleLock, sqlq.IdleLockKey(t)); err != nil {
				return err
			}
		}
		r, err := startRelay(ctx, relayPool, t, subscriber.Config{Ordered: lc.ordered}, true)
		if err != nil {
			return err
		}
		counter.reset()
		next := msg
		if lc.ordered {
			next = keyedMsg
		}
		committed := offerSteadyN(ctx, rate, o.latencyDuration, writerProducers, func() (string, time.Time, error) {
			m := next()
			tx, err := producers.Begin(ctx)
			if err != nil {
				return "", time.Time{}, err
			}
			if _, err := defaults.Enqueue(ctx, tx, t, m); err != nil {
				_ = tx.Rollback(ctx)
				return "", time.Time{}, err
			}
			before := time.Now()
			return m.EventID.String(), before, tx.Commit(ctx)
		})
		lat, err := r.arrivals.latencies(committed, func(string) bool { return false }, 10*time.Second)
		ca := float64(counter.claims.Load() + counter.acks.Load())
		if serr := r.stop(); err == nil {
			err = serr
		}
		if holder != nil {
			_ = holder.Close(ctx)
		}
		if err != nil {
			return err
		}
		name := "default handshake"
		switch {
		case lc.alwaysWoken:
			name = "NOTIFY on every commit"
		case lc.ordered:
			name = "ordered, 1,000 keys"
		}
		fmt.Printf("  %-22s %5d events/s offered: events=%-6d p50=%-10s p95=%-10s p99=%-10s max=%-10s claims+acks per event %.2f\n", name, rate, len(lat),
			percentile(lat, 50).Round(10*time.Microsecond), percentile(lat, 95).Round(10*time.Microsecond),
			percentile(lat, 99).Round(10*time.Microsecond), lat[len(lat)-1].Round(10*time.Microsecond), ca/float64(max(1, len(lat))))
	}
	fmt.Println()

	// 3. Producers offered 5,000 events/s.
	const offered = 5000
	type ocase struct {
		name  string
		relay bool
		enq   *publisher.Enqueuer
	}
	ocases := []ocase{
		{"bare INSERT, no relay", false, nil},
		{"Enqueue, default, no relay", false, defaults},
		{"Enqueue, default, relay draining", true, defaults},
	}
	obest := make([]float64, len(ocases))
	for round := 0; round < o.rounds; round++ {
		for i, c := range ocases {
			t, err := newTable("wo")
			if err != nil {
				return err
			}
			var r *relayRun
			if c.relay {
				if r, err = startRelay(ctx, relayPool, t, subscriber.Config{}, false); err != nil {
					return err
				}
			}
			op := bareInsert(t)
			if c.enq != nil {
				op = enqueue(c.enq, t, false)
			}
			committed := offerSteadyN(ctx, offered, o.duration, writerProducers*2, func() (string, time.Time, error) {
				_, err := op()
				return uuid.NewString(), time.Now(), err
			})
			if r != nil {
				if _, err := drainAll(ctx, producers, t, r, 30*time.Second, false); err != nil {
					return err
				}
				if err := r.stop(); err != nil {
					return err
				}
			}
			obest[i] = max(obest[i], float64(len(committed))/o.duration.Seconds())
			if _, err := producers.Exec(ctx, `DROP TABLE `+t.Sanitize()); err != nil {
				return err
			}
		}
	}
	onames, obaselines := make([]string, len(ocases)), make([]string, len(ocases))
	for i, c := range ocases {
		onames[i] = c.name
		if i > 0 {
			obaselines[i] = ocases[0].name
		}
	}
	printTable(fmt.Sprintf("Producers offered %d events/s (%d paced producers, 1 event per transaction), best of %d (goal: Enqueue >= 0.90x of bare INSERT)",
		offered, writerProducers*2, o.rounds), ratioRows(onames, obaselines, obest, "events/s"))
	return nil
}

// drainAll waits until the relay has received every row of t and they are
// all published; it returns how many rows t has.
func drainAll(ctx context.Context, pool *pgxpool.Pool, t schema.Table, r *relayRun, wait time.Duration, ordered bool) (int64, error) {
	var total int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.Sanitize()).Scan(&total); err != nil {
		return 0, err
	}
	deadline := time.Now().Add(wait)
	for r.received.Load() < total {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("relay received %d of %d rows within %s", r.received.Load(), total, wait)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if ordered {
		return total, nil // keyed rows are never updated; the floors are the progress
	}
	dctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	if err := waitPublished(dctx, pool, t, int(total)); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return 0, fmt.Errorf("rows of %s not all published within %s", t, wait)
		}
		return 0, err
	}
	return total, nil
}
