// Command outbox-bench measures the outbox against baselines measured in the
// same run, on the local PostgreSQL, and prints a table with ratios.
//
//	go run ./cmd/outbox-bench -suite enqueue
//
// Suites: enqueue (Enqueue and EnqueueBatch beside a bare INSERT into an
// equivalent table, with and without the NOTIFY wake-up); writer (what the
// outbox costs 8 producers on a pool of 16, with and without a relay
// draining, latency from 8 writers, producers offered 5,000 events/s, and
// the relay's statements per event); relay (drain a
// backlog through the subscriber beside the bare-SQL ceiling of the same
// claim and ack statements); latency (commit-to-delivery percentiles at
// steady offered rates, wake-up on and off); brokers (outbox to Kafka via an
// in-process kfake cluster and to RabbitMQ with confirms); inbox (a
// consumer's handler behind the inbox middleware beside the same handler in
// its own transaction, duplicates, and a concurrent duplicate storm); xmin
// (issue 36: each relay mode through a clean phase, a pinned xmin, REPEATABLE
// READ readers, 1.5x load and recovery, with dead tuples and table size;
// not part of all). Stop early with
// SIGINT; the figures so far are printed.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
)

type options struct {
	dbURL             string
	duration          time.Duration
	workers           int
	rounds            int
	backlog           int
	brokerBacklog     int
	brokerBatch       int
	brokerInFlight    int
	brokerPublishes   int
	brokerCases       string
	amqpURL           string
	amqpPool          int
	scalingSample     int
	scalingMax        int
	chart             string
	sustainedRate     int
	sustainedDuration time.Duration
	cleanerVacuum     bool
	rates             []int
	latencyDuration   time.Duration
	ordered           orderedOptions
	xmin              xminOptions
}

func main() {
	var (
		o     options
		suite string
	)
	flag.StringVar(&o.dbURL, "db", envOr("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL")
	flag.DurationVar(&o.duration, "duration", 3*time.Second, "length of one measurement")
	flag.IntVar(&o.workers, "workers", 4, "concurrent producers")
	flag.IntVar(&o.rounds, "rounds", 2, "measurements per case, interleaved; the best is kept")
	flag.IntVar(&o.backlog, "backlog", 100000, "rows to drain in the relay suite")
	flag.IntVar(&o.brokerBacklog, "broker-backlog", 30000, "rows to relay in the brokers suite")
	flag.IntVar(&o.brokerBatch, "broker-batch", 100, "brokers suite: the subscriber's BatchSize (rows per claim)")
	flag.IntVar(&o.brokerInFlight, "broker-inflight", 1000, "brokers suite: the subscriber's MaxInFlight")
	flag.IntVar(&o.brokerPublishes, "broker-publishes", 0, "brokers suite: the batching forwarder's MaxPublishes (0: its default)")
	flag.StringVar(&o.brokerCases, "broker-cases", "", "brokers suite: run only the cases whose name contains this text (for a profile of one case; the bare publishers always run)")
	flag.StringVar(&o.amqpURL, "amqp", envOr("OUTBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"), "RabbitMQ URL for the brokers suite")
	flag.IntVar(&o.amqpPool, "amqp-pool", amqpbackend.ChannelPoolSizeDefault, "AMQP publisher channel pool size")
	flag.IntVar(&o.scalingSample, "scaling-sample", 10000, "rows drained per case in the scaling suite (at most 10,000, the smallest backlog)")
	flag.IntVar(&o.scalingMax, "scaling-max", 1_000_000, "largest backlog of the scaling suite")
	flag.IntVar(&o.sustainedRate, "sustained-rate", 500, "events/s of the sustained suite (multiple of 10)")
	flag.DurationVar(&o.sustainedDuration, "sustained-duration", 10*time.Minute, "length of the sustained suite")
	flag.BoolVar(&o.cleanerVacuum, "cleaner-vacuum", false, "sustained suite: the cleaner runs VACUUM after deleting (for servers with autovacuum off)")
	flag.StringVar(&o.chart, "chart", "", "write the latency chart (PNG) to this file")
	flag.DurationVar(&o.latencyDuration, "latency-duration", 10*time.Second, "length of one latency case")
	rates := flag.String("rates", "100,1000,5000", "comma-separated offered rates (events/s) for the latency suite")
	flag.StringVar(&suite, "suite", "all", "comma-separated suites: enqueue, writer, relay, latency, poison, inbox, brokers, scaling, sustained, ordered, wal, xmin, hot, all (all: every suite but wal, xmin and hot)")
	o.ordered.register()
	o.xmin.register()
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the run to this file")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "outbox-bench:", err)
			os.Exit(2)
		}
		_ = pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	for _, r := range strings.Split(*rates, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(r))
		if err != nil || v <= 0 {
			fmt.Fprintf(os.Stderr, "outbox-bench: -rates: %q is not a positive integer\n", r)
			os.Exit(2)
		}
		o.rates = append(o.rates, v)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o, strings.Split(suite, ",")); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, o options, suites []string) error {
	cfg, err := pgxpool.ParseConfig(o.dbURL)
	if err != nil {
		return fmt.Errorf("parse -db: %w", err)
	}
	cfg.MaxConns = int32(o.workers + 10)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer pool.Close()
	if err := pool.Ping(ctx); err != nil {
		return fmt.Errorf("PostgreSQL at -db is required (run `make up`): %w", err)
	}
	schemaName := fmt.Sprintf("bench_%d", time.Now().UnixNano())
	if _, err := pool.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{schemaName}.Sanitize()); err != nil {
		return fmt.Errorf("create schema: %w", err)
	}
	defer func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA `+pgx.Identifier{schemaName}.Sanitize()+` CASCADE`)
	}()
	fmt.Printf("outbox-bench: PostgreSQL %s, %d workers, %s per measurement, best of %d\n\n", serverVersion(ctx, pool), o.workers, o.duration, o.rounds)
	known := map[string]func(context.Context, *pgxpool.Pool, string, options) error{
		"enqueue": enqueueSuite, "writer": writerSuite, "relay": relaySuite, "latency": latencySuite, "brokers": brokerSuite,
		"scaling": scalingSuite, "sustained": sustainedSuite, "poison": poisonSuite, "inbox": inboxSuite, "ordered": orderedSuite, "wal": walSuite,
		"xmin": xminSuite, "hot": hotSuite,
	}
	order := []string{"enqueue", "writer", "relay", "latency", "poison", "inbox", "brokers", "scaling", "sustained", "ordered"}
	var run []string
	for _, s := range suites {
		s = strings.TrimSpace(s)
		if s == "all" {
			run = append(run, order...)
			continue
		}
		if known[s] == nil {
			return fmt.Errorf("unknown suite %q (known: %s, wal, xmin, hot, all)", s, strings.Join(order, ", "))
		}
		run = append(run, s)
	}
	for _, s := range run {
		if err := known[s](ctx, pool, schemaName, o); err != nil {
			return fmt.Errorf("suite %s: %w", s, err)
		}
	}
	return nil
}

func serverVersion(ctx context.Context, pool *pgxpool.Pool) string {
	var v string
	_ = pool.QueryRow(ctx, `SHOW server_version`).Scan(&v)
	return v
}

// row is one line of a result table.
type row struct {
	name     string
	value    float64
	unit     string
	baseline string  // name of the row this one is compared with
	ratio    float64 // value / baseline value
}

// ratioRows builds table rows, each compared with the row named by its
// baseline.
func ratioRows(names, baselines []string, values []float64, unit string) []row {
	byName := map[string]float64{}
	rows := make([]row, len(names))
	for i := range names {
		byName[names[i]] = values[i]
		rows[i] = row{name: names[i], value: values[i], unit: unit, baseline: baselines[i]}
		if b := byName[baselines[i]]; baselines[i] != "" && b > 0 {
			rows[i].ratio = values[i] / b
		}
	}
	return rows
}

func printTable(title string, rows []row) {
	fmt.Println(title)
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "case\tresult\tunit\tvs baseline\t")
	for _, r := range rows {
		cmp := "baseline"
		if r.baseline != "" {
			cmp = fmt.Sprintf("%.2fx of %s", r.ratio, r.baseline)
		}
		fmt.Fprintf(w, "%s\t%.0f\t%s\t%s\t\n", r.name, r.value, r.unit, cmp)
	}
	_ = w.Flush()
	fmt.Println()
}
