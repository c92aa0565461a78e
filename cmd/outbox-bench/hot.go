package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

// hotRate and hotWriters are the load of the hot suite (issue 58): 500
// events/s, one per transaction, from 8 writers.
const (
	hotRate    = 500
	hotWriters = 8
	hotTopic   = "org.organization.updated.v1"
)

// hotSuite measures the hot path (subscriber.HotPath) beside the cold
// paths, in one run: commit-to-publish latency at 500 events/s from 8
// writers of the hot path, the default relay, the WAL relay (when the
// server has wal_level = logical: scripts/bench-wal.sh -suite hot) and a
// bare publish after the commit to the same in-process broker (the
// baseline); then each writer's throughput, closed loop, with and without
// the hot path (the default relay running in both).
func hotSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	var level string
	if err := pool.QueryRow(ctx, `SHOW wal_level`).Scan(&level); err != nil {
		return err
	}
	type result struct {
		name          string
		p50, p95, p99 time.Duration
		n             int
	}
	var results []result
	add := func(name string, lat []time.Duration) {
		results = append(results, result{name, percentile(lat, 50), percentile(lat, 95), percentile(lat, 99), len(lat)})
	}
	tenant := uuid.New()
	msg := func() publisher.Message {
		return publisher.Message{TenantID: tenant, Topic: hotTopic, EventID: uuid.New(), Payload: benchPayload}
	}
	newTable := func(name string) (schema.Table, error) {
		t := schema.MustParseTable(schemaName + "." + name)
		return t, schema.Migrate(ctx, pool, t)
	}
	// consume forwards every message of ch to the broker, then acks it.
	consume := func(ch <-chan *message.Message, broker *arrivals) chan struct{} {
		done := make(chan struct{})
		go func() {
			defer close(done)
			for m := range ch {
				_ = broker.Publish(hotTopic, m)
				m.Ack()
			}
		}()
		return done
	}
	offer := func(produce func() (string, time.Time, error)) map[string]time.Time {
		return offerSteadyN(ctx, hotRate, o.latencyDuration, hotWriters, produce)
	}
	// enqueue commits one event into t the usual way (no hot path) and
	// returns its id and the time just before its COMMIT.
	enqueue := func(t schema.Table) (string, time.Time, error) {
		m := msg()
		var before time.Time
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, t, m)
			before = time.Now()
			return err
		})
		return m.EventID.String(), before, err
	}

	// Bare publish: the writer commits its row, then publishes the event
	// itself (no outbox guarantee: lost if the process dies in between).
	{
		t, err := newTable("hot_bare")
		if err != nil {
			return err
		}
		broker := newArrivals()
		committed := offer(func() (string, time.Time, error) {
			m := msg()
			tx, err := pool.Begin(ctx)
			if err != nil {
				return "", time.Time{}, err
			}
			if _, err := publisher.Enqueue(ctx, tx, t, m); err != nil {
				_ = tx.Rollback(ctx)
				return "", time.Time{}, err
			}
			before := time.Now()
			if err := tx.Commit(ctx); err != nil {
				return "", time.Time{}, err
			}
			return m.EventID.String(), before, broker.Publish(hotTopic, message.NewMessage(m.EventID.String(), message.Payload(m.Payload)))
		})
		lat, err := broker.latencies(committed, func(string) bool { return false }, 5*time.Second)
		if err != nil {
			return err
		}
		add("bare publish after COMMIT (baseline)", lat)
	}

	// The default relay (cold path: NOTIFY wake-up and claim), and the hot
	// path beside it.
	for _, hot := range []bool{false, true} {
		name := map[bool]string{false: "hot_cold", true: "hot_hot"}[hot]
		t, err := newTable(name)
		if err != nil {
			return err
		}
		s, err := subscriber.New(ctx, pool, subscriber.Config{Table: t}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		h, err := subscriber.NewHotPath(s, subscriber.HotConfig{})
		if err != nil {
			_ = s.Close()
			return err
		}
		subCtx, cancel := context.WithCancel(ctx)
		ch, err := s.Subscribe(subCtx, subscriber.AllTopics)
		if err != nil {
			cancel()
			_ = s.Close()
			return err
		}
		for !s.IsLeader() {
			time.Sleep(10 * time.Millisecond)
		}
		broker := newArrivals()
		done := consume(ch, broker)
		committed := offer(func() (string, time.Time, error) {
			if !hot {
				return enqueue(t)
			}
			m := msg()
			var before time.Time
			err := h.BeginFunc(ctx, pool, func(tx *subscriber.HotTx) error {
				_, err := tx.Enqueue(ctx, m)
				before = time.Now()
				return err
			})
			return m.EventID.String(), before, err
		})
		lat, err := broker.latencies(committed, func(string) bool { return false }, 5*time.Second)
		cancel()
		<-done
		_ = s.Close()
		if err != nil {
			return err
		}
		add(map[bool]string{false: "default relay (cold path: wake-up + claim)", true: "hot path (subscriber.HotPath)"}[hot], lat)
	}

	// The WAL relay, on a server with logical decoding.
	walNote := ""
	if level == "logical" {
		t, err := newTable("hot_wal")
		if err != nil {
			return err
		}
		if _, err := walrelay.Setup(ctx, pool, t, walrelay.Names{}); err != nil {
			return err
		}
		s, err := walrelay.New(ctx, pool, walrelay.Config{Table: t, StatusInterval: 100 * time.Millisecond}, watermill.NopLogger{})
		if err != nil {
			return err
		}
		subCtx, cancel := context.WithCancel(ctx)
		ch, err := s.Subscribe(subCtx, subscriber.AllTopics)
		if err != nil {
			cancel()
			_ = s.Close()
			return err
		}
		broker := newArrivals()
		done := consume(ch, broker)
		committed := offer(func() (string, time.Time, error) { return enqueue(t) })
		lat, err := broker.latencies(committed, func(string) bool { return false }, 10*time.Second)
		cancel()
		<-done
		_ = s.Close()
		_ = walrelay.Teardown(context.Background(), pool, t, walrelay.Names{})
		if err != nil {
			return err
		}
		add("WAL relay (push stream)", lat)
	} else {
		walNote = fmt.Sprintf("  (WAL relay not measured: wal_level is %s; scripts/bench-wal.sh -suite hot runs this suite on a private logical server)\n", level)
	}

	fmt.Printf("Hot path: commit-to-publish latency at %d events/s from %d writers, one event per transaction, %s per case, the same in-process broker\n",
		hotRate, hotWriters, o.latencyDuration)
	base := results[0].p99
	for _, r := range results {
		fmt.Printf("  %-44s events=%-6d p50=%-10s p95=%-10s p99=%-10s p99/baseline=%.2fx\n", r.name, r.n, r.p50.Round(10*time.Microsecond),
			r.p95.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond), float64(r.p99)/float64(base))
	}
	fmt.Print(walNote)

	// Writer throughput, closed loop: 8 writers commit one event per
	// transaction as fast as they can, for o.duration, with the default
	// relay consuming; with and without the hot path, interleaved over
	// o.rounds, best kept.
	tw, err := newTable("hot_writer")
	if err != nil {
		return err
	}
	s, err := subscriber.New(ctx, pool, subscriber.Config{Table: tw}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer func() { _ = s.Close() }()
	h, err := subscriber.NewHotPath(s, subscriber.HotConfig{})
	if err != nil {
		return err
	}
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(subCtx, subscriber.AllTopics)
	if err != nil {
		return err
	}
	done := consume(ch, newArrivals())
	defer func() { cancel(); <-done }()
	closedLoop := func(hot bool) (float64, error) {
		var n atomic.Int64
		var firstErr error
		var mu sync.Mutex
		var wg sync.WaitGroup
		stop := time.Now().Add(o.duration)
		for range hotWriters {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) && ctx.Err() == nil {
					m := msg()
					var err error
					if hot {
						err = h.BeginFunc(ctx, pool, func(tx *subscriber.HotTx) error { _, err := tx.Enqueue(ctx, m); return err })
					} else {
						err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { _, err := publisher.Enqueue(ctx, tx, tw, m); return err })
					}
					if err != nil {
						mu.Lock()
						firstErr = err
						mu.Unlock()
						return
					}
					n.Add(1)
				}
			}()
		}
		wg.Wait()
		return float64(n.Load()) / o.duration.Seconds(), firstErr
	}
	var best [2]float64
	for range o.rounds {
		for i, hot := range []bool{false, true} {
			v, err := closedLoop(hot)
			if err != nil {
				return err
			}
			best[i] = max(best[i], v)
		}
	}
	fmt.Printf("Writer throughput with the hot path (%d writers, closed loop, %s, best of %d, the default relay consuming; goal: >= 0.95x)\n",
		hotWriters, o.duration, o.rounds)
	fmt.Printf("  %-44s %8.0f tx/s\n", "publisher.Enqueue in pgx.BeginFunc (baseline)", best[0])
	fmt.Printf("  %-44s %8.0f tx/s  %.2fx\n\n", "HotTx.Enqueue in HotPath.BeginFunc", best[1], best[1]/best[0])
	return nil
}
