package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/router/amqpbackend"
	"github.com/outboxkit/watermill-outbox/router/kafkabackend"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
	"github.com/outboxkit/watermill-outbox/walrelay"
)

func init() {
	registerCommand("relay", "relay OUTBOX_RELAY_TABLES to OUTBOX_BACKEND and clean them; drains on SIGTERM", runRelay)
}

// relayConfig is the daemon's configuration, read from the environment.
type relayConfig struct {
	databaseURL     string
	relayEnabled    bool
	tables          []schema.Table
	singleActive    bool
	boundedClaim    bool
	ordered         bool
	source          string // "table" or "wal"
	pollInterval    time.Duration
	batchSize       int
	lockTTL         time.Duration
	leaderTimeout   time.Duration
	maxAttempts     int
	dispatchTimeout time.Duration
	lastErrorMax    int
	cleanerEnabled  bool
	cleanerTables   []schema.Table
	cleanerInterval time.Duration
	retention       time.Duration
	deadRetention   time.Duration
	cleanerVacuum   bool
	backend         backendConfig
	metricsEnabled  bool
	metricsPath     string
	metricsAddr     string
	console         consoleConfig // addr "": no console in the daemon

	// Set by runRelay, not read from the environment.
	tracerProvider trace.TracerProvider // nil: the global provider
	health         *health              // nil: OUTBOX_HEALTH_ADDR unset
}

// loadRelayConfig reads the OUTBOX_* variables; the first bad one is the error.
func loadRelayConfig(env Env) (relayConfig, error) {
	var (
		c    relayConfig
		errs []error
	)
	must := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	var err error
	c.databaseURL, err = env.Required("OUTBOX_DATABASE_URL", "postgres://user:password@host:5432/db")
	must(err)
	c.relayEnabled, err = env.Bool("OUTBOX_RELAY_ENABLED", true)
	must(err)
	c.tables, err = env.Tables("OUTBOX_RELAY_TABLES", nil)
	tablesErr := err
	must(err)
	c.singleActive, err = env.Bool("OUTBOX_RELAY_SINGLE_ACTIVE", true)
	must(err)
	c.boundedClaim, err = env.Bool("OUTBOX_RELAY_BOUNDED_CLAIM", true)
	must(err)
	c.ordered, err = env.Bool("OUTBOX_RELAY_ORDERED", false)
	must(err)
	c.source = env.String("OUTBOX_RELAY_SOURCE", sourceTable)
	switch {
	case c.source != sourceTable && c.source != sourceWAL:
		errs = append(errs, fmt.Errorf("OUTBOX_RELAY_SOURCE=%q is not a source; use table (claim rows) or wal (stream them from a logical replication slot, docs/WAL.md)", c.source))
	case c.source == sourceWAL && c.ordered:
		errs = append(errs, errors.New("OUTBOX_RELAY_SOURCE=wal and OUTBOX_RELAY_ORDERED=true: the WAL relay keeps per-key order by itself; unset OUTBOX_RELAY_ORDERED"))
	}
	c.pollInterval, err = env.Duration("OUTBOX_RELAY_POLL_INTERVAL", subscriber.PollIntervalDefault, false)
	must(err)
	c.batchSize, err = env.Int("OUTBOX_RELAY_BATCH_SIZE", subscriber.ClaimBatchSizeDefault)
	must(err)
	c.lockTTL, err = env.Duration("OUTBOX_RELAY_LOCK_TTL", subscriber.LockTTLDefault, false)
	must(err)
	if err == nil && c.lockTTL < subscriber.LockTTLMin {
		errs = append(errs, fmt.Errorf("OUTBOX_RELAY_LOCK_TTL=%s is below %s: leases could not be renewed reliably; use at least %s", c.lockTTL, subscriber.LockTTLMin, subscriber.LockTTLMin))
	}
	c.leaderTimeout, err = env.Duration("OUTBOX_RELAY_LEADER_TIMEOUT", subscriber.LeaderTimeoutDefault, false)
	must(err)
	if err == nil && c.leaderTimeout < subscriber.LeaderTimeoutMin {
		errs = append(errs, fmt.Errorf("OUTBOX_RELAY_LEADER_TIMEOUT=%s is below %s; use at least %s", c.leaderTimeout, subscriber.LeaderTimeoutMin, subscriber.LeaderTimeoutMin))
	}
	c.maxAttempts, err = env.Int("OUTBOX_RELAY_MAX_ATTEMPTS", subscriber.MaxAttemptsDefault)
	must(err)
	c.dispatchTimeout, err = env.Duration("OUTBOX_RELAY_DISPATCH_TIMEOUT", subscriber.DispatchTimeoutDefault, false)
	must(err)
	c.lastErrorMax, err = env.Int("OUTBOX_LAST_ERROR_MAX_BYTES", subscriber.LastErrorMaxBytesDefault)
	must(err)
	c.cleanerEnabled, err = env.Bool("OUTBOX_CLEANER_ENABLED", true)
	must(err)
	c.cleanerTables, err = env.Tables("OUTBOX_CLEANER_TABLES", c.tables)
	must(err)
	c.cleanerInterval, err = env.Duration("OUTBOX_CLEANER_INTERVAL", cleaner.IntervalDefault, false)
	must(err)
	c.retention, err = env.Duration("OUTBOX_CLEANER_RETENTION", cleaner.RetentionDefault, false)
	must(err)
	c.deadRetention, err = env.Duration("OUTBOX_CLEANER_DEAD_RETENTION", 0, true)
	must(err)
	c.cleanerVacuum, err = env.Bool("OUTBOX_CLEANER_VACUUM", false)
	must(err)
	c.metricsEnabled, err = env.Bool("PROMETHEUS_METRICS_ENABLED", false)
	must(err)
	c.metricsPath = env.String("PROMETHEUS_METRICS_PATH", "/debug/prometheus")
	c.metricsAddr = env.String("PROMETHEUS_METRICS_ADDR", ":9464")
	c.console, err = loadConsoleConfig(env, c.tables, false)
	must(err)
	if c.relayEnabled {
		if len(c.tables) == 0 && tablesErr == nil {
			errs = append(errs, errors.New("OUTBOX_RELAY_TABLES is not set; list the tables to relay, for example OUTBOX_RELAY_TABLES=public.org_outbox"))
		}
		c.backend.Kind, err = env.Required("OUTBOX_BACKEND", "kafka (or amqp)")
		must(err)
		switch c.backend.Kind {
		case backendKafka:
			brokers, err := env.Required("OUTBOX_KAFKA_BROKERS", "kafka-1:9092,kafka-2:9092")
			must(err)
			c.backend.KafkaBrokers = parseBrokers(brokers)
		case backendAMQP:
			c.backend.AMQP.URL, err = env.Required("OUTBOX_AMQP_URL", "amqp://user:password@rabbitmq:5672/")
			must(err)
			c.backend.AMQP.Layout = env.String("OUTBOX_AMQP_LAYOUT", amqpbackend.LayoutQueue)
			c.backend.AMQP.Exchange = env.String("OUTBOX_AMQP_EXCHANGE", "")
			if err == nil {
				if uerr := amqpbackend.CheckURL(c.backend.AMQP.URL); uerr != nil {
					errs = append(errs, fmt.Errorf("OUTBOX_AMQP_URL: %w", uerr)) // no password: CheckURL redacts it
				} else if verr := c.backend.AMQP.Validate(); verr != nil {
					errs = append(errs, fmt.Errorf("OUTBOX_AMQP_LAYOUT=%q, OUTBOX_AMQP_EXCHANGE=%q: %w", c.backend.AMQP.Layout, c.backend.AMQP.Exchange, verr))
				}
			}
		case backendGoChannel:
			errs = append(errs, errors.New("OUTBOX_BACKEND=gochannel cannot work in the daemon: an in-process pub/sub has no subscriber in this process, so every event would go dead; use kafka or amqp, or relay in-process inside your service with forwarder.New(sub, router.NewInProcess(), ...)"))
		case "":
		default:
			errs = append(errs, fmt.Errorf("OUTBOX_BACKEND=%q is not a backend; use kafka or amqp", c.backend.Kind))
		}
	}
	if len(c.metricsPath) == 0 || c.metricsPath[0] != '/' {
		errs = append(errs, fmt.Errorf("PROMETHEUS_METRICS_PATH=%q must start with /", c.metricsPath))
	}
	if err := errors.Join(errs...); err != nil {
		return c, fmt.Errorf("%w: %w", errUsage, err)
	}
	return c, nil
}

func runRelay(ctx context.Context, env Env, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("relay", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { relayUsage(stdout) }
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg, err := loadRelayConfig(env)
	if err != nil {
		return err
	}
	logger := watermill.NewSlogLogger(slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: slog.LevelInfo})))
	tp, stopTracing, err := startTracing(ctx, env, logger)
	if err != nil {
		return err
	}
	defer stopTracing()
	cfg.tracerProvider = tp
	if cfg.health, err = startHealth(env, cfg, logger); err != nil {
		return err
	}
	defer cfg.health.Close()

	poolCfg, err := pgxpool.ParseConfig(cfg.databaseURL)
	if err != nil {
		return fmt.Errorf("%w: OUTBOX_DATABASE_URL is not a valid PostgreSQL URL or DSN: %s", errUsage, parseProblem(err))
	}
	poolCfg.MaxConns = max(poolCfg.MaxConns, int32(2*len(cfg.tables)+8)) //nolint:gosec // a handful of tables
	tuneConnConfig(poolCfg, cfg.leaderTimeout)
	nameSessions(poolCfg)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return fmt.Errorf("connect to OUTBOX_DATABASE_URL: %w", err)
	}
	defer pool.Close()
	cfg.health.setPool(pool)
	err = retryStartup(ctx, logger, func() error { return pool.Ping(ctx) })
	if err != nil {
		if ctx.Err() != nil {
			fmt.Fprintln(stdout, "relay stopped before it started")
			return nil // SIGTERM during start-up is a clean stop
		}
		return fmt.Errorf("connect to OUTBOX_DATABASE_URL: %w", err)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: cfg.dispatchTimeout + 5*time.Second}, logger)
	if err != nil {
		return err
	}
	m, err := router.RegisterMetrics(reg, r)
	if err != nil {
		return err
	}

	var wg sync.WaitGroup
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	if cfg.metricsEnabled {
		srv, err := serveMetrics(cfg, reg, logger)
		if err != nil {
			return err
		}
		defer srv.Close()
	}
	if cfg.console.addr != "" {
		srv, err := serveConsole(pool, cfg.console, logger, io.Discard)
		if err != nil {
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
	}
	if cfg.cleanerEnabled {
		// A missing table is reported once, as itself, before any cleaner
		// or relay starts.
		for _, t := range cfg.cleanerTables {
			if err := retryStartup(ctx, logger, func() error { _, err := schema.DetectColumns(ctx, pool, t); return err }); err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
		}
		for _, t := range cfg.cleanerTables {
			c, err := cleaner.New(pool, cleaner.Config{Table: t, Interval: cfg.cleanerInterval, Retention: cfg.retention,
				DeadRetention: cfg.deadRetention, Metrics: m, Vacuum: cfg.cleanerVacuum}, logger)
			if err != nil {
				return err
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				_ = c.Run(runCtx)
			}()
		}
	}
	if !cfg.relayEnabled {
		fmt.Fprintln(stdout, "relay disabled (OUTBOX_RELAY_ENABLED=false); cleaner only")
		<-ctx.Done()
		stop()
		wg.Wait()
		return nil
	}
	err = relayTables(runCtx, pool, cfg, r, m, reg, logger, stdout)
	stop()
	wg.Wait()
	return err
}

// The sources of OUTBOX_RELAY_SOURCE.
const (
	sourceTable = "table"
	sourceWAL   = "wal"
)

// backendConfig selects the broker the relay publishes to.
type backendConfig struct {
	Kind         string
	KafkaBrokers []string
	AMQP         amqpbackend.Config
}

func (b backendConfig) newPublisher(logger watermill.LoggerAdapter) (message.Publisher, error) {
	switch b.Kind {
	case backendKafka:
		return kafkabackend.NewPublisher(b.KafkaBrokers, logger)
	case backendAMQP:
		return amqpbackend.NewPublisher(b.AMQP, logger)
	}
	return nil, fmt.Errorf("OUTBOX_BACKEND=%q is not a backend; use kafka or amqp", b.Kind)
}

// relayTables runs one router with a forwarder per table until ctx is done,
// then drains: the router stops taking messages, waits for those in flight,
// and every subscriber gives its remaining leases back.
func relayTables(ctx context.Context, pool *pgxpool.Pool, cfg relayConfig, r *message.Router, m *metrics.Metrics, reg prometheus.Registerer,
	logger watermill.LoggerAdapter, stdout io.Writer) error {
	backendPub, err := cfg.backend.newPublisher(logger)
	if err != nil {
		return fmt.Errorf("OUTBOX_BACKEND=%s: %w; check %s", cfg.backend.Kind, err, backendAddressVar(cfg.backend.Kind))
	}
	defer backendPub.Close()
	var pub message.Publisher = relayIDPublisher{Publisher: backendPub, id: relayID()}
	if bp, ok := backendPub.(forwarder.BatchPublisher); ok {
		// Keep the forwarder's batching (Kafka).
		pub = relayIDBatchPublisher{relayIDPublisher: pub.(relayIDPublisher), batch: bp}
	}
	var subs []message.Subscriber
	defer func() {
		for _, s := range subs {
			_ = s.Close()
		}
	}()
	for _, t := range cfg.tables {
		var s interface {
			message.Subscriber
			leaderer
		}
		err := retryStartup(ctx, logger, func() error {
			if cfg.source == sourceWAL {
				w, err := walrelay.New(ctx, pool, walrelay.Config{Table: t, MaxAttempts: cfg.maxAttempts, LastErrorMaxBytes: cfg.lastErrorMax,
					CloseTimeout: cfg.dispatchTimeout, Metrics: m}, logger)
				if err != nil {
					return err
				}
				if reg != nil {
					if err := reg.Register(w.Collector()); err != nil {
						return err
					}
				}
				s = w
				return nil
			}
			ts, err := subscriber.New(ctx, pool, subscriber.Config{
				Table: t, BatchSize: cfg.batchSize, PollInterval: cfg.pollInterval, LockTTL: cfg.lockTTL, LeaderTimeout: cfg.leaderTimeout,
				MaxAttempts: cfg.maxAttempts, DisableSingleActive: !cfg.singleActive, DisableBoundedClaim: !cfg.boundedClaim, Ordered: cfg.ordered, LastErrorMaxBytes: cfg.lastErrorMax,
				CloseTimeout: cfg.dispatchTimeout, DispatchTimeout: cfg.dispatchTimeout, Metrics: m,
			}, logger)

			if err != nil {
				return err
			}
			s = ts
			return nil
		})
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, walrelay.ErrWALLevel) {
				return fmt.Errorf("%w: OUTBOX_RELAY_SOURCE=wal: %w", errUsage, err)
			}
			return err
		}
		subs = append(subs, s)
		stack, err := router.Middlewares(router.MiddlewareConfig{DispatchTimeout: cfg.dispatchTimeout, MaxAttempts: cfg.maxAttempts, Logger: logger})
		if err != nil {
			return err
		}
		f, err := forwarder.New(s, pub, forwarder.Config{
			Middleware:     stack,
			TracerProvider: cfg.tracerProvider, MessagingSystem: messagingSystem(cfg.backend.Kind),
		}, logger)
		if err != nil {
			return err
		}
		cfg.health.addRelay(t, s, f.AddTo(r))
	}
	cfg.health.setRouter(r)
	go func() {
		<-r.Running()
		fmt.Fprintf(stdout, "relaying %d table(s) to %s\n", len(cfg.tables), cfg.backend.Kind)
	}()
	if err := r.Run(ctx); err != nil {
		return fmt.Errorf("router: %w", err)
	}
	fmt.Fprintln(stdout, "relay stopped; leases given back")
	return nil
}

// tuneConnConfig bounds what an unreachable database costs the relay's
// connections: a dial gives up after leaderTimeout unless the URL sets
// connect_timeout, and TCP keepalive (idle leaderTimeout/3, interval
// leaderTimeout/6, 3 probes) closes pooled connections to a host that went
// silent instead of after the operating system's two hours. The leader's own
// session gets the server-side settings from the subscriber.
func tuneConnConfig(c *pgxpool.Config, leaderTimeout time.Duration) {
	if c.ConnConfig.ConnectTimeout == 0 {
		c.ConnConfig.ConnectTimeout = leaderTimeout
	}
	d := &net.Dialer{KeepAliveConfig: net.KeepAliveConfig{
		Enable: true, Idle: leaderTimeout / 3, Interval: max(time.Second, leaderTimeout/6), Count: 3,
	}}
	c.ConnConfig.DialFunc = d.DialContext
}

// startupTimeout bounds how long start-up waits out a database that is
// restarting or unreachable before the daemon gives up.
const startupTimeout = 60 * time.Second

// retryStartup runs step until it succeeds, retrying transient failures
// (a restarting database) with backoff for up to startupTimeout; a missing
// table, an error that cannot heal (a wrong password, user or database
// name, a wal_level that is not logical) or a stop signal ends it at once.
func retryStartup(ctx context.Context, logger watermill.LoggerAdapter, step func() error) error {
	deadline := time.Now().Add(startupTimeout)
	delay := 100 * time.Millisecond
	for {
		err := step()
		// wal_level changes only with a server restart: not waited for.
		if err == nil || ctx.Err() != nil || errors.Is(err, schema.ErrTableNotFound) || errors.Is(err, subscriber.ErrOrderedNotMigrated) ||
			errors.Is(err, walrelay.ErrWALLevel) || time.Now().After(deadline) {
			return err
		}
		if hint, ok := unhealable(err); ok {
			return fmt.Errorf("%s (not retried): %w", hint, err)
		}
		logger.Error("Start-up step failed; retrying", err, watermill.LogFields{"retry_in": delay.String()})
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(delay):
		}
		delay = min(2*delay, 5*time.Second)
	}
}

// MetadataRelayID names the relay process that forwarded a message
// (host:pid), for tracing a message back to a relay and for the fault tests'
// single-active overlap detector.
const MetadataRelayID = "outbox_relay_id"

// MetadataRelayedAt is when the relay published the message (Unix
// nanoseconds).
const MetadataRelayedAt = "outbox_relayed_at"

// nameSessions sets the application_name of the daemon's sessions to
// relayApplicationName, unless OUTBOX_DATABASE_URL sets one: then
// pg_stat_activity and the console's relays page tell which process a
// session belongs to.
func nameSessions(c *pgxpool.Config) {
	if _, set := c.ConnConfig.RuntimeParams["application_name"]; !set {
		c.ConnConfig.RuntimeParams["application_name"] = relayApplicationName()
	}
}

// relayApplicationName is "outbox-relay <host> <pid> <version>"
// (sqlq.RelayApplicationPrefix), cut to the 63 bytes PostgreSQL keeps.
func relayApplicationName() string {
	host, _ := os.Hostname()
	version := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		version = bi.Main.Version
	}
	name := sqlq.RelayApplicationPrefix + host + " " + strconv.Itoa(os.Getpid()) + " " + version
	if len(name) > 63 {
		name = name[:63]
	}
	return name
}

func relayID() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s:%d", host, os.Getpid())
}

// relayIDPublisher stamps MetadataRelayID on every message it publishes.
type relayIDPublisher struct {
	message.Publisher
	id string
}

func (p relayIDPublisher) Publish(topic string, msgs ...*message.Message) error {
	p.stamp(msgs)
	return p.Publisher.Publish(topic, msgs...)
}

func (p relayIDPublisher) stamp(msgs []*message.Message) {
	now := strconv.FormatInt(time.Now().UnixNano(), 10)
	for _, m := range msgs {
		m.Metadata.Set(MetadataRelayID, p.id)
		m.Metadata.Set(MetadataRelayedAt, now)
	}
}

// relayIDBatchPublisher is relayIDPublisher over a forwarder.BatchPublisher,
// which it stays, so that the forwarder batches.
type relayIDBatchPublisher struct {
	relayIDPublisher
	batch forwarder.BatchPublisher
}

// PublishBatch stamps msgs and publishes them in one batch.
func (p relayIDBatchPublisher) PublishBatch(topic string, msgs []*message.Message) []error {
	p.stamp(msgs)
	return p.batch.PublishBatch(topic, msgs)
}

func serveMetrics(cfg relayConfig, reg *prometheus.Registry, logger watermill.LoggerAdapter) (*http.Server, error) {
	mux := http.NewServeMux()
	mux.Handle(cfg.metricsPath, promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	ln, err := net.Listen("tcp", cfg.metricsAddr)
	if err != nil {
		return nil, fmt.Errorf("%w: PROMETHEUS_METRICS_ADDR=%q: %w", errUsage, cfg.metricsAddr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			logger.Error("Metrics server stopped", err, nil)
		}
	}()
	logger.Info("Serving metrics", watermill.LogFields{"addr": ln.Addr().String(), "path": cfg.metricsPath})
	return srv, nil
}
