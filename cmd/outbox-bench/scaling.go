package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// scalingSuite measures the subscriber's rate on the first rows of backlogs
// of growing size, and with dead rows in the table.
func scalingSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	sample := min(o.scalingSample, 10_000) // every case has at least this many pending rows
	cases := []struct {
		name     string
		pending  int
		dead     int
		baseline string
	}{
		{"10,000 pending", 10_000, 0, ""},
		{"100,000 pending", 100_000, 0, "10,000 pending"},
		{"1,000,000 pending", 1_000_000, 0, "10,000 pending"},
		{"100,000 pending + 100,000 dead", 100_000, 100_000, "100,000 pending"},
	}
	var (
		names, baselines []string
		values           []float64
	)
	for i, c := range cases {
		if c.pending > o.scalingMax {
			continue
		}
		var rate float64
		for round := 0; round < o.rounds; round++ {
			r, err := scaleCase(ctx, pool, schema.MustParseTable(fmt.Sprintf("%s.scale_%d_%d", schemaName, i, round)), c.pending, c.dead, sample)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			rate = max(rate, r)
		}
		names, baselines, values = append(names, c.name), append(baselines, c.baseline), append(values, rate)
	}
	printTable(fmt.Sprintf("Backlog scaling: subscriber rate over the first %d rows, best of %d (goals: 1,000,000 pending >= 0.80x of 10,000; 100,000 dead rows cost < 10%%)", sample, o.rounds),
		ratioRows(names, baselines, values, "msgs/s"))
	return nil
}

// scaleCase fills t with dead then pending rows, measures the first sample
// rows, and drops t.
func scaleCase(ctx context.Context, pool *pgxpool.Pool, t schema.Table, pending, dead, sample int) (float64, error) {
	if err := fillBacklog(ctx, pool, t, dead); err != nil {
		return 0, err
	}
	if dead > 0 {
		// Dead rows as the relay's nack leaves them: attempts at the
		// maximum, an error, parked at available_at = 'infinity'. (Parked
		// at their time of death, as a first design had it, they sat before
		// every due row: EXPLAIN showed 80 ms per claim instead of 0.2 ms.)
		if _, err := pool.Exec(ctx, `UPDATE `+t.Sanitize()+` SET attempts = $1, last_error = 'dead in benchmark',
			available_at = 'infinity', dead_at = now()`, sqlq.MaxAttemptsDefault); err != nil {
			return 0, err
		}
	}
	if err := fillBacklog(ctx, pool, t, pending); err != nil {
		return 0, err
	}
	rate, err := drainSubscriber(ctx, pool, t, sample, true, subscriber.Config{})
	if err != nil {
		return 0, err
	}
	_, err = pool.Exec(ctx, `DROP TABLE `+t.Sanitize())
	return rate, err
}
