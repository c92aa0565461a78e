package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/schema"
)

// inboxWorkers is the number of concurrent handlers of the inbox suite.
const inboxWorkers = 8

// inboxSuite measures the inbox middleware (package inbox):
//
//   - handler throughput with the inbox (Wait and FailFast) beside the same
//     handler writing the same effect row in its own transaction, 8 workers;
//   - the cost of a duplicate (a key already committed: acked without
//     running the handler);
//   - a concurrent duplicate storm: 1,000 events each delivered 10 times at
//     once (10 handlers take deliveries from a queue in which an event's 10
//     copies are adjacent), under Wait and under FailFast (a copy refused
//     with ErrInProgress is redelivered after 5ms); the effects must number
//     exactly 1,000, else the suite fails.
func inboxSuite(ctx context.Context, pool *pgxpool.Pool, schemaName string, o options) error {
	inboxT := schema.MustParseTable(schemaName + ".bench_inbox")
	if err := inbox.Migrate(ctx, pool, inboxT); err != nil {
		return err
	}
	effects := pgx.Identifier{schemaName, "bench_inbox_effects"}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+effects+` (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, amount INT NOT NULL)`); err != nil {
		return err
	}
	insertEffect := `INSERT INTO ` + effects + ` (key, amount) VALUES ($1, 42)`
	newInbox := func(consumer string, mode inbox.Concurrency) (*inbox.Inbox, error) {
		return inbox.New(pool, inbox.Config{Table: inboxT, Consumer: consumer, Concurrency: mode})
	}
	// The handler under the inbox writes its effect through inbox.Tx.
	handler := func(msg *message.Message) ([]*message.Message, error) {
		tx, ok := inbox.Tx(msg.Context())
		if !ok {
			return nil, errors.New("no inbox transaction")
		}
		_, err := tx.Exec(msg.Context(), insertEffect, msg.UUID)
		return nil, err
	}
	wait, err := newInbox("bench-wait", inbox.Wait)
	if err != nil {
		return err
	}
	defer wait.Close()
	failFast, err := newInbox("bench-failfast", inbox.FailFast)
	if err != nil {
		return err
	}
	defer failFast.Close()
	dup, err := newInbox("bench-dup", inbox.Wait)
	if err != nil {
		return err
	}
	defer dup.Close()

	newMsg := func() *message.Message {
		id := uuid.NewString()
		m := message.NewMessage(id, message.Payload(benchPayload))
		m.Metadata.Set(schema.MetadataEventID, id)
		m.SetContext(ctx)
		return m
	}
	through := func(h message.HandlerFunc) func() (int, error) {
		return func() (int, error) { _, err := h(newMsg()); return 1, err }
	}
	// Keys for the duplicate case, committed before each measurement.
	const dupKeys = 1000
	dupMsgs := make([]*message.Message, dupKeys)
	for i := range dupMsgs {
		dupMsgs[i] = newMsg()
	}
	dupH := dup.Middleware(handler)
	// reset empties both tables (so that every case starts at the same
	// size) and commits the duplicate case's keys again.
	reset := func() error {
		if _, err := pool.Exec(ctx, `TRUNCATE `+inboxT.Sanitize()+`, `+effects); err != nil {
			return err
		}
		for _, m := range dupMsgs {
			c := message.NewMessage(m.UUID, m.Payload)
			c.Metadata = m.Metadata
			c.SetContext(ctx)
			if _, err := dupH(c); err != nil {
				return err
			}
		}
		return nil
	}
	var dupNext atomic.Int64
	cases := []struct {
		name, baseline string
		op             func() (int, error)
	}{
		{"handler, own tx (no dedup)", "", func() (int, error) {
			m := newMsg()
			return 1, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, insertEffect, m.UUID)
				return err
			})
		}},
		{"inbox, Wait (default)", "handler, own tx (no dedup)", through(wait.Middleware(handler))},
		{"inbox, FailFast", "handler, own tx (no dedup)", through(failFast.Middleware(handler))},
		{"inbox, duplicate skipped", "handler, own tx (no dedup)", func() (int, error) {
			m := dupMsgs[dupNext.Add(1)%dupKeys]
			c := message.NewMessage(m.UUID, m.Payload)
			c.Metadata = m.Metadata
			c.SetContext(ctx)
			_, err := dupH(c)
			return 1, err
		}},
	}
	wo := o
	wo.workers = inboxWorkers
	best := make([]float64, len(cases))
	// paired are the Wait / own-tx ratios of each round, the two measured
	// one after the other: less exposed to other load than the ratio of
	// the bests.
	var (
		paired []float64
		ownTx  float64
	)
	for round := 0; round < o.rounds; round++ {
		for i, c := range cases {
			if ctx.Err() != nil {
				break
			}
			if err := reset(); err != nil {
				return err
			}
			rate, err := measure(ctx, wo, c.op)
			if err != nil {
				return fmt.Errorf("%s: %w", c.name, err)
			}
			best[i] = max(best[i], rate)
			if i == 0 {
				ownTx = rate
			}
			if i == 1 && ownTx > 0 {
				paired = append(paired, rate/ownTx)
			}
		}
	}
	names, baselines := make([]string, len(cases)), make([]string, len(cases))
	for i, c := range cases {
		names[i], baselines[i] = c.name, c.baseline
	}
	printTable(fmt.Sprintf("Inbox handler throughput (%d handlers; goal: inbox >= 0.85x of the handler in its own transaction)", inboxWorkers),
		ratioRows(names, baselines, best, "msgs/s"))
	printPaired("inbox Wait / own tx", paired)

	// The storm.
	if err := reset(); err != nil {
		return err
	}
	const stormEvents, stormCopies = 1000, 10
	fmt.Printf("Inbox duplicate storm (%d events, each delivered %d times at once to %d handlers; effects must equal %d)\n",
		stormEvents, stormCopies, stormCopies, stormEvents)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "mode\tdeliveries/s\tredeliveries (ErrInProgress)\teffects\tinbox records\t")
	for _, mode := range []inbox.Concurrency{inbox.Wait, inbox.FailFast} {
		if ctx.Err() != nil {
			break
		}
		consumer := "storm-" + mode.String()
		ib, err := newInbox(consumer, mode)
		if err != nil {
			return err
		}
		storm, err := runStorm(ctx, ib.Middleware(handler), newMsg, stormEvents, stormCopies)
		_ = ib.Close()
		if err != nil {
			return fmt.Errorf("storm %s: %w", mode, err)
		}
		var processed, effectRows, distinct int
		if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+inboxT.Sanitize()+` WHERE consumer = $1),
  (SELECT count(*) FROM `+effects+` e WHERE EXISTS (SELECT 1 FROM `+inboxT.Sanitize()+` i WHERE i.consumer = $1 AND i.key = e.key)),
  (SELECT count(DISTINCT e.key) FROM `+effects+` e WHERE EXISTS (SELECT 1 FROM `+inboxT.Sanitize()+` i WHERE i.consumer = $1 AND i.key = e.key))`,
			consumer).Scan(&processed, &effectRows, &distinct); err != nil {
			return err
		}
		if ctx.Err() == nil && (effectRows != stormEvents || distinct != stormEvents || processed != stormEvents) {
			return fmt.Errorf("storm %s: %d effects of %d distinct events, %d inbox records; want %d of each",
				mode, effectRows, distinct, processed, stormEvents)
		}
		fmt.Fprintf(tw, "%s\t%.0f\t%d\t%d\t%d\t\n", mode, storm.rate, storm.redeliveries, effectRows, processed)
	}
	_ = tw.Flush()
	fmt.Println()
	return nil
}

type stormResult struct {
	rate         float64 // deliveries handled (acked) per second
	redeliveries int64
}

// runStorm delivers every one of events messages copies times, the copies of
// one event adjacent in a queue drained by copies handlers, so that they run
// at the same moment. A delivery refused with ErrInProgress is redelivered
// after 5ms; any other error fails the storm.
func runStorm(ctx context.Context, h message.HandlerFunc, newMsg func() *message.Message, events, copies int) (stormResult, error) {
	queue := make(chan *message.Message, events*copies)
	for range events {
		m := newMsg()
		for range copies {
			c := message.NewMessage(m.UUID, m.Payload)
			c.Metadata = m.Metadata
			queue <- c
		}
	}
	close(queue)
	var (
		wg           sync.WaitGroup
		redeliveries atomic.Int64
		errOnce      sync.Once
		failure      error
	)
	start := time.Now()
	for range copies {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for m := range queue {
				for ctx.Err() == nil {
					c := message.NewMessage(m.UUID, m.Payload)
					c.Metadata = m.Metadata
					c.SetContext(ctx)
					_, err := h(c)
					if errors.Is(err, inbox.ErrInProgress) {
						redeliveries.Add(1)
						time.Sleep(5 * time.Millisecond)
						continue
					}
					if err != nil && ctx.Err() == nil {
						errOnce.Do(func() { failure = err })
					}
					break
				}
			}
		}()
	}
	wg.Wait()
	if failure != nil {
		return stormResult{}, failure
	}
	return stormResult{rate: float64(events*copies) / time.Since(start).Seconds(), redeliveries: redeliveries.Load()}, nil
}

// printPaired prints the ratios of a case to its baseline measured back to
// back in each round, and their median: steadier than the ratio of the
// best rates when the machine's speed drifts between rounds.
func printPaired(label string, ratios []float64) {
	if len(ratios) == 0 {
		return
	}
	sorted := slices.Clone(ratios)
	slices.Sort(sorted)
	parts := make([]string, len(ratios))
	for i, r := range ratios {
		parts[i] = fmt.Sprintf("%.2fx", r)
	}
	fmt.Printf("%s, round by round (measured back to back): %s; median %.2fx\n\n", label, strings.Join(parts, ", "), sorted[len(sorted)/2])
}
