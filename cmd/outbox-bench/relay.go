package main

import (
	"context"
	"errors"
	"fmt"
	"image/color"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// fillBacklog creates table and commits n pending rows in it.
func fillBacklog(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int) error {
	if err := schema.Migrate(ctx, pool, t); err != nil {
		return err
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		return err
	}
	tenant := uuid.New()
	for n > 0 {
		k := min(n, 1000)
		if err := enqueueBenchBatch(ctx, pool, enq, t, tenant, k); err != nil {
			return err
		}
		n -= k
	}
	_, err = pool.Exec(ctx, `VACUUM ANALYZE `+t.Sanitize())
	return err
}

// enqueueBenchBatch commits k benchmark events into t in one transaction.
func enqueueBenchBatch(ctx context.Context, pool *pgxpool.Pool, enq *publisher.Enqueuer, t schema.Table, tenant uuid.UUID, k int) error {
	msgs := make([]publisher.Message, k)
	for i := range msgs {
		msgs[i] = publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: uuid.New(), Payload: benchPayload}
	}
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := enq.EnqueueBatch(ctx, tx, t, msgs)
		return err
	})
}

// drainSubscriber measures how fast a Subscriber drains the backlog of t with
// immediate acks, until every row is published.
// partial is true when t holds more than n pending rows (the scaling
// suite measures the first n): the drain is done when n rows are
// published, not when none is pending.
func drainSubscriber(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int, partial bool, cfg subscriber.Config) (float64, error) {
	cfg.Table = t
	s, err := subscriber.New(ctx, pool, cfg, watermill.NopLogger{})
	if err != nil {
		return 0, err
	}
	defer s.Close()
	start := time.Now()
	ch, err := s.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		return 0, err
	}
	var ids []string // partial: the rows acked, waited for by id
	for got := 0; got < n; got++ {
		select {
		case m := <-ch:
			if partial {
				ids = append(ids, m.UUID)
			}
			m.Ack()
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	// Count the drain as done when the acks are written.
	if partial {
		if err := waitAcked(ctx, pool, t, ids); err != nil {
			return 0, err
		}
	} else if err := waitPublished(ctx, pool, t, n); err != nil {
		return 0, err
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// waitAcked returns when the rows of ids are published: index probes by
// event_id, polled once the consumer has acked them all. (The scaling suite
// measures the first rows of a larger backlog: a wait for no pending row
// never ended, and a count of the published rows scanned the whole table
// every poll, taking PostgreSQL's CPU from the relay it measured.)
func waitAcked(ctx context.Context, pool *pgxpool.Pool, t schema.Table, ids []string) error {
	for {
		var pending bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.Sanitize()+` WHERE event_id = ANY($1::uuid[]) AND published_at IS NULL)`, ids).Scan(&pending); err != nil {
			return err
		}
		if !pending {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// waitPublished returns when every row of t is published, and fails when
// none is pending but fewer than n are published.
func waitPublished(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n int) error {
	// Poll for any unpublished row (the pending index's first live entry),
	// not a count of the published ones: a count scans the table and, polled
	// every 5 ms during a drain, took PostgreSQL CPU from the relay it
	// measures. The count runs once, at the end.
	for {
		var pending bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+t.Sanitize()+` WHERE published_at IS NULL)`).Scan(&pending); err != nil {
			return err
		}
		if !pending {
			break
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
	var published int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.Sanitize()+` WHERE published_at IS NOT NULL`).Scan(&published); err != nil {
		return err
	}
	if published < n {
		return fmt.Errorf("%s: %d of %d rows published and none pending (dead rows?)", t, published, n)
	}
	return nil
}

// drainBareSQL is the ceiling: the subscriber's own claim and ack statements
// in a loop on workers connections, with no delivery at all.
func drainBareSQL(ctx context.Context, pool *pgxpool.Pool, t schema.Table, n, workers, batch int) (float64, error) {
	q := sqlq.NewQueries(t, schema.Columns{})
	var (
		done atomic.Int64
		wg   sync.WaitGroup
		errs = make(chan error, workers)
	)
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for done.Load() < int64(n) && ctx.Err() == nil {
				rows, err := pool.Query(ctx, q.ClaimAll, sqlq.MaxAttemptsDefault, sqlq.LockTTLDefault.Seconds(), batch)
				if err != nil {
					errs <- err
					return
				}
				var ids []string
				var attempts []int32
				var locked []time.Time
				for rows.Next() {
					var r sqlq.ClaimedRow
					if err := r.ScanClaim(rows, schema.Columns{}); err != nil {
						errs <- err
						return
					}
					ids, attempts, locked = append(ids, r.ID), append(attempts, r.Attempts), append(locked, r.LockedAt)
				}
				if err := rows.Err(); err != nil {
					errs <- err
					return
				}
				if len(ids) == 0 {
					continue
				}
				if _, err := pool.Exec(ctx, q.Ack, ids, attempts, locked); err != nil {
					errs <- err
					return
				}
				done.Add(int64(len(ids)))
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, err
	}
	return float64(done.Load()) / time.Since(start).Seconds(), nil
}

// relaySuite compares the subscriber's drain rate with the bare-SQL ceiling
// and the forwarder's with Watermill's own outbox path (watermill-sql +
// components/forwarder), on the same number of rows and the same payload.
func relaySuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	n := o.backlog
	const (
		ceiling = "bare SQL ceiling: claim+ack loop, 2 workers, no delivery"
		peer    = "watermill-sql v3 + components/forwarder -> in-memory sink"
	)
	cases := []struct {
		name, baseline string
		outboxTable    bool // drains a backlog in an outbox table
		run            func(t schema.Table, round int) (float64, error)
	}{
		{ceiling, "", true, func(t schema.Table, _ int) (float64, error) {
			return drainBareSQL(ctx, pool, t, n, 2, 100)
		}},
		{"Subscriber, single-active (default), immediate ack", ceiling, true, func(t schema.Table, _ int) (float64, error) {
			return drainSubscriber(ctx, pool, t, n, false, subscriber.Config{})
		}},
		{"Subscriber, SingleActive off, immediate ack", ceiling, true, func(t schema.Table, _ int) (float64, error) {
			return drainSubscriber(ctx, pool, t, n, false, subscriber.Config{DisableSingleActive: true})
		}},
		{peer, "", false, func(_ schema.Table, round int) (float64, error) {
			return peerDrain(ctx, o, schemaName, n, round)
		}},
		{"outbox Subscriber + Forwarder -> in-memory sink", peer, true, func(t schema.Table, _ int) (float64, error) {
			return drainForwarder(ctx, pool, t, n, &countingSink{}, subscriber.Config{})
		}},
	}
	best := make([]float64, len(cases))
	for round := 0; round < o.rounds; round++ {
		for i, c := range cases {
			t := schema.MustParseTable(fmt.Sprintf("%s.drain_%d_%d", schemaName, round, i))
			if c.outboxTable {
				if err := fillBacklog(ctx, pool, t, n); err != nil {
					return fmt.Errorf("%s: fill: %w", c.name, err)
				}
			}
			rate, err := c.run(t, round)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			best[i] = max(best[i], rate)
			if c.outboxTable {
				if _, err := pool.Exec(ctx, `DROP TABLE `+t.Sanitize()); err != nil {
					return err
				}
			}
		}
	}
	names, baselines := make([]string, len(cases)), make([]string, len(cases))
	for i, c := range cases {
		names[i], baselines[i] = c.name, c.baseline
	}
	printTable(fmt.Sprintf("Relay throughput: drain a backlog of %d rows, best of %d (goals: subscriber >= 0.80x of the bare SQL ceiling; forwarder >= 1.5x of the watermill-sql peer)", n, o.rounds),
		ratioRows(names, baselines, best, "msgs/s"))
	return nil
}

// latencySuite measures commit-to-delivery latency at steady offered rates,
// for the subscriber with wake-up on and off and for the watermill-sql peer
// at its defaults, and draws the p99 chart when -chart is set.
func latencySuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	type result struct {
		name          string
		p50, p95, p99 time.Duration
		n             int
	}
	var results []result
	p50s := []series{
		{name: "outbox, wake-up on (p50)", color: color.RGBA{0, 114, 178, 255}, points: map[int]time.Duration{}},
		{name: "outbox, wake-up on (p99)", color: color.RGBA{86, 180, 233, 255}, points: map[int]time.Duration{}},
		{name: "outbox, wake-up off (p50)", color: color.RGBA{230, 159, 0, 255}, points: map[int]time.Duration{}},
		{name: "watermill-sql peer (p50)", color: color.RGBA{213, 94, 0, 255}, points: map[int]time.Duration{}},
	}
	for _, rate := range o.rates {
		for _, wake := range []bool{true, false} {
			t := schema.MustParseTable(fmt.Sprintf("%s.lat_%d_%v", schemaName, rate, wake))
			if err := schema.Migrate(ctx, pool, t); err != nil {
				return err
			}
			lat, err := measureLatency(ctx, pool, t, rate, o.latencyDuration, subscriber.Config{DisableNotify: !wake})
			if err != nil {
				return err
			}
			name := fmt.Sprintf("outbox Subscriber, %d events/s, wake-up %s", rate, map[bool]string{true: "on", false: "off (poll 1s)"}[wake])
			results = append(results, result{name, percentile(lat, 50), percentile(lat, 95), percentile(lat, 99), len(lat)})
			if wake {
				p50s[0].points[rate], p50s[1].points[rate] = percentile(lat, 50), percentile(lat, 99)
			} else {
				p50s[2].points[rate] = percentile(lat, 50)
			}
		}
		lat, err := measurePeerLatency(ctx, o, schemaName, rate, o.latencyDuration)
		if err != nil {
			return err
		}
		name := fmt.Sprintf("watermill-sql + forwarder (defaults), %d events/s", rate)
		results = append(results, result{name, percentile(lat, 50), percentile(lat, 95), percentile(lat, 99), len(lat)})
		p50s[3].points[rate] = percentile(lat, 50)
	}
	fmt.Printf("Commit-to-delivery latency (%s per case; goal at 1,000 events/s with wake-up on: p50 < 5ms, p99 < 30ms; events = committed in the window)\n", o.latencyDuration)
	for _, r := range results {
		fmt.Printf("  %-58s events=%-6d p50=%-10s p95=%-10s p99=%s\n", r.name, r.n, r.p50.Round(10*time.Microsecond), r.p95.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond))
	}
	fmt.Println()
	if o.chart != "" {
		if err := writeLatencyChart(o.chart, o.rates, p50s); err != nil {
			return err
		}
		fmt.Printf("chart written to %s (legend, left to right:", o.chart)
		for _, s := range p50s {
			fmt.Printf(" %s;", s.name)
		}
		fmt.Println(")")
		fmt.Println()
	}
	return nil
}

// measureLatency offers rate events/s, one per transaction, for d, and
// returns each event's latency from just before COMMIT to its delivery.
func measureLatency(ctx context.Context, pool *pgxpool.Pool, t schema.Table, rate int, d time.Duration, cfg subscriber.Config) ([]time.Duration, error) {
	lat, _, err := measureLatencyPoisoned(ctx, pool, t, rate, d, cfg, false)
	return lat, err
}

// isPoison picks about 1% of events (3 in 256, by the first byte of the
// event_id) to fail permanently.
func isPoison(eventID string) bool {
	b, err := strconv.ParseUint(eventID[:2], 16, 8)
	return err == nil && b < 3
}

// measureLatencyPoisoned is measureLatency where, with poison, the consumer
// nacks about 1% of events with a permanent error; it returns the healthy
// events' latencies and how many poison events it saw.
func measureLatencyPoisoned(ctx context.Context, pool *pgxpool.Pool, t schema.Table, rate int, d time.Duration, cfg subscriber.Config, poison bool) ([]time.Duration, int, error) {
	cfg.Table = t
	s, err := subscriber.New(ctx, pool, cfg, watermill.NopLogger{})
	if err != nil {
		return nil, 0, err
	}
	defer s.Close()
	subCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	ch, err := s.Subscribe(subCtx, subscriber.AllTopics)
	if err != nil {
		return nil, 0, err
	}
	for !s.IsLeader() {
		time.Sleep(10 * time.Millisecond)
	}
	delivered := newArrivals()
	consumerDone := make(chan struct{})
	go func() {
		defer close(consumerDone)
		for m := range ch {
			if poison && isPoison(m.UUID) {
				subscriber.RecordError(m, subscriber.Permanent(errors.New("poison event")))
				m.Nack()
				continue
			}
			delivered.record(m.UUID)
			m.Ack()
		}
	}()
	tenant := uuid.New()
	committed := offerSteady(ctx, rate, d, func() (string, time.Time, error) {
		id := uuid.New()
		tx, err := pool.Begin(ctx)
		if err != nil {
			return "", time.Time{}, err
		}
		if _, err := publisher.Enqueue(ctx, tx, t, publisher.Message{TenantID: tenant, Topic: "org.organization.updated.v1", EventID: id, Payload: benchPayload}); err != nil {
			_ = tx.Rollback(ctx)
			return "", time.Time{}, err
		}
		before := time.Now()
		return id.String(), before, tx.Commit(ctx)
	})
	skip := func(id string) bool { return poison && isPoison(id) }
	lat, err := delivered.latencies(committed, skip, 5*time.Second)
	cancel()
	<-consumerDone
	if err != nil {
		return nil, 0, err
	}
	poisoned := 0
	for id := range committed {
		if skip(id) {
			poisoned++
		}
	}
	return lat, poisoned, nil
}

// offerSteady calls produce, which commits one event and returns its id and
// the time just before its COMMIT, rate times per second in total (from
// rate/250 paced goroutines) for d, and returns those times by id. It stops
// a goroutine at its first error.
func offerSteady(ctx context.Context, rate int, d time.Duration, produce func() (string, time.Time, error)) map[string]time.Time {
	return offerSteadyN(ctx, rate, d, max(1, rate/250), produce)
}

// offerSteadyN is offerSteady from a given number of paced goroutines.
func offerSteadyN(ctx context.Context, rate int, d time.Duration, producers int, produce func() (string, time.Time, error)) map[string]time.Time {
	var (
		mu        sync.Mutex
		committed = map[string]time.Time{}
		wg        sync.WaitGroup
	)
	interval := time.Second / time.Duration(rate)
	stop := time.Now().Add(d)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			next := time.Now().Add(time.Duration(p) * interval)
			for time.Now().Before(stop) && ctx.Err() == nil {
				time.Sleep(time.Until(next))
				next = next.Add(interval * time.Duration(producers))
				id, before, err := produce()
				if err != nil {
					return
				}
				mu.Lock()
				committed[id] = before
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return committed
}

// arrivals records when each event first arrived; it is a message.Publisher
// too, so it can be the sink of a forwarder.
type arrivals struct {
	mu   sync.Mutex
	seen map[string]time.Time
}

func newArrivals() *arrivals { return &arrivals{seen: map[string]time.Time{}} }

func (a *arrivals) record(ids ...string) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, id := range ids {
		if _, dup := a.seen[id]; !dup {
			a.seen[id] = now
		}
	}
}

// Publish records the arrival of msgs.
func (a *arrivals) Publish(_ string, msgs ...*message.Message) error {
	for _, m := range msgs {
		a.record(m.UUID)
	}
	return nil
}

// Close implements message.Publisher.
func (a *arrivals) Close() error { return nil }

// latencies waits up to wait for every committed event not skipped to
// arrive, and returns their commit-to-arrival latencies, sorted.
func (a *arrivals) latencies(committed map[string]time.Time, skip func(string) bool, wait time.Duration) ([]time.Duration, error) {
	want := 0
	for id := range committed {
		if !skip(id) {
			want++
		}
	}
	for deadline := time.Now().Add(wait); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		a.mu.Lock()
		n := len(a.seen)
		a.mu.Unlock()
		if n >= want {
			break
		}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	lat := make([]time.Duration, 0, want)
	for id, c := range committed {
		if skip(id) {
			continue
		}
		at, ok := a.seen[id]
		if !ok {
			return nil, fmt.Errorf("event %s not delivered within %s after the run", id, wait)
		}
		lat = append(lat, at.Sub(c))
	}
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	return lat, nil
}

func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := (len(sorted)*p+99)/100 - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

var _ message.Subscriber = (*subscriber.Subscriber)(nil)

// poisonSuite is "poison under load": 1% of events fail permanently while
// 1,000 events/s flow; the healthy events' latency is compared with a run
// without poison, and every poison event must end dead.
func poisonSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	type res struct {
		name          string
		p50, p99      time.Duration
		healthy, dead int
	}
	var out []res
	for _, poison := range []bool{false, true} {
		t := schema.MustParseTable(fmt.Sprintf("%s.poison_%v", schemaName, poison))
		if err := schema.Migrate(ctx, pool, t); err != nil {
			return err
		}
		lat, poisoned, err := measureLatencyPoisoned(ctx, pool, t, 1000, o.latencyDuration, subscriber.Config{}, poison)
		if err != nil {
			return err
		}
		var dead int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.Sanitize()+` WHERE published_at IS NULL AND dead_at IS NOT NULL`).Scan(&dead); err != nil {
			return err
		}
		if dead != poisoned {
			return fmt.Errorf("poison: %d poison events, %d dead rows", poisoned, dead)
		}
		name := "healthy events, no poison"
		if poison {
			name = "healthy events, 1% poison (permanent failure)"
		}
		out = append(out, res{name, percentile(lat, 50), percentile(lat, 99), len(lat), dead})
	}
	fmt.Printf("Poison under load: 1,000 events/s for %s, wake-up on (goal: healthy p99 with poison <= 1.2x without)\n", o.latencyDuration)
	for _, r := range out {
		fmt.Printf("  %-48s healthy=%-6d dead=%-4d p50=%-10s p99=%s\n", r.name, r.healthy, r.dead, r.p50.Round(10*time.Microsecond), r.p99.Round(10*time.Microsecond))
	}
	fmt.Printf("  healthy p99 with poison / without: %.2fx\n\n", float64(out[1].p99)/float64(max(out[0].p99, 1)))
	return nil
}
