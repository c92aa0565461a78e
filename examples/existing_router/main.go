// Command existing_router adds the outbox relay to a Watermill
// *message.Router that already runs your own handlers, instead of running
// it on a router of its own (forwarder.Run):
//
//   - the router has its own handler (a search indexer consuming
//     org.organization.created.v1 from an in-process pub/sub) and its
//     router-wide middleware, here the outbox stack router.Middlewares
//     (error capture, recoverer, per-message timeout), which suits any
//     handler;
//   - router.RegisterMetrics(registry, r) registers the outbox metrics and
//     Watermill's router metrics; the returned *metrics.Metrics goes to the
//     publisher's Enqueuer and to subscriber.Config;
//   - forwarder.AddTo(r) adds the relay as one more handler. AddTo also adds
//     the forwarder's Config.Middleware to that handler, which defaults to
//     router.Middlewares again: with the stack already router-wide, set it
//     to an empty, non-nil slice so it is not applied twice. (A router
//     without that stack keeps the default instead.)
//
// Producers that already speak Watermill publish *message.Message inside
// their transaction with publisher.NewTxPublisher.
//
// The database is OUTBOX_DATABASE_URL (default
// postgres://postgres@127.0.0.1:5432/test).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TopicOrganizationCreated is the event the search indexer consumes.
const TopicOrganizationCreated = "org.organization.created.v1"

// OrganizationCreated is the event's payload.
type OrganizationCreated struct {
	OrganizationID uuid.UUID `json:"organization_id"`
	Name           string    `json:"name"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Stdout, plumbing.DatabaseURL())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "existing_router:", err)
		os.Exit(1)
	}
}

// tables are the example's tables, all in one fresh schema.
type tables struct {
	outbox        schema.Table
	organizations string // the business table (sanitized name)
	search        string // the indexer's side effect (sanitized name)
	processed     string // the indexer's dedup table (sanitized name)
}

// run is the whole example; it writes what happens to w.
func run(ctx context.Context, w io.Writer, dbURL string) (err error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out := &plumbing.SyncWriter{W: w}
	logger := plumbing.NewLogger()

	pool, err := plumbing.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	ns, dropSchema, err := plumbing.CreateSchema(ctx, pool)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, dropSchema()) }()
	t, err := createTables(ctx, pool, ns)
	if err != nil {
		return err
	}

	// --- The router you already have. ---
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// Router-wide middleware, outermost first: CaptureError, Recoverer,
	// Timeout. It applies to every handler, the relay's included.
	r.AddMiddleware(router.MustMiddlewares(router.MiddlewareConfig{Logger: logger})...)
	// Outbox metrics plus Watermill's handler metrics for r; register before
	// r.Run. Serve the registry with promhttp.HandlerFor in your service.
	registry := prometheus.NewRegistry()
	outboxMetrics, err := router.RegisterMetrics(registry, r)
	if err != nil {
		return err
	}
	bus := router.NewInProcess()
	defer bus.Close()
	indexer := &searchIndexer{pool: pool, tables: t, out: out, handled: make(chan struct{}, 8)}
	r.AddConsumerHandler("search_indexer", TopicOrganizationCreated, bus, indexer.Handle)

	// --- Adding the outbox relay to it. ---
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: t.outbox, Metrics: outboxMetrics}, logger)
	if err != nil {
		return err
	}
	defer sub.Close() // the router closes it too; Close is idempotent
	fwd, err := forwarder.New(sub, bus, forwarder.Config{
		// The router-wide stack already wraps the relay's handler.
		Middleware: []message.HandlerMiddleware{},
	}, logger)
	if err != nil {
		return err
	}
	fwd.AddTo(r)
	names := make([]string, 0, len(r.Handlers()))
	for name := range r.Handlers() {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(out, "router handlers: %s\n", strings.Join(names, ", "))

	stopRouter, err := plumbing.StartRouter(ctx, r)
	if err != nil {
		return fmt.Errorf("router: %w", err)
	}
	defer func() { err = errors.Join(err, stopRouter()) }()

	// --- Producing: Watermill messages, published inside the transaction. ---
	enqueuer, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{Metrics: outboxMetrics})
	if err != nil {
		return err
	}
	tenantID := uuid.New()
	organizations := []string{"Acme", "Globex", "Initech"}
	for _, name := range organizations {
		var eventID string
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			eventID, err = createOrganization(ctx, tx, t, enqueuer, tenantID, uuid.NewString(), name)
			return err
		}); err != nil {
			return fmt.Errorf("create organization %s: %w", name, err)
		}
		fmt.Fprintf(out, "enqueued %s event_id=%s (organization %q)\n", TopicOrganizationCreated, eventID, name)
	}
	// A producer bug: an event the indexer can never read. The indexer
	// rejects it as permanent; the router-wide CaptureError hands that to
	// the relay, which marks the row dead at once (kept and replayable).
	var poisonID string
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		poisonID, err = createOrganization(ctx, tx, t, enqueuer, tenantID, "not-a-uuid", "Broken")
		return err
	}); err != nil {
		return fmt.Errorf("create organization Broken: %w", err)
	}
	fmt.Fprintf(out, "enqueued %s event_id=%s (organization %q, with a malformed organization_id)\n", TopicOrganizationCreated, poisonID, "Broken")

	for range len(organizations) + 1 {
		select {
		case <-indexer.handled:
		case <-ctx.Done():
			return fmt.Errorf("waiting for the search indexer: %w", ctx.Err())
		}
	}
	if err := plumbing.WaitSettled(ctx, pool, t.outbox); err != nil {
		return err
	}
	var published, indexed int
	var dead []string
	rows, err := pool.Query(ctx, `SELECT event_id::text || ' attempts=' || attempts || ' last_error=' || COALESCE(last_error, '')
FROM `+t.outbox.Sanitize()+` WHERE published_at IS NULL AND dead_at IS NOT NULL ORDER BY sequence`)
	if err == nil {
		dead, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil {
		return fmt.Errorf("list dead rows: %w", err)
	}
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t.outbox.Sanitize()+` WHERE published_at IS NOT NULL), (SELECT count(*) FROM `+t.search+`)`).Scan(&published, &indexed); err != nil {
		return err
	}
	fmt.Fprintf(out, "relayed through the existing router: %d rows published, %d organizations indexed, %d dead\n", published, indexed, len(dead))
	for _, d := range dead {
		fmt.Fprintf(out, "dead event_id=%s\n", d)
	}

	// Stop the router (the relay writes its last acks on close), then read
	// the metrics a Prometheus scrape would see.
	if err := stopRouter(); err != nil {
		return fmt.Errorf("stop router: %w", err)
	}
	return printMetrics(out, registry, "outbox_enqueue_total", "outbox_dispatch_total", "outbox_dead_total", "handler_execution_time_seconds")
}

// createOrganization inserts an organization and publishes its event with a
// TxPublisher bound to tx. The message UUID is the event_id; metadata
// tenant_id is the tenant; other metadata is stored in the headers column.
func createOrganization(ctx context.Context, tx pgx.Tx, t tables, enq *publisher.Enqueuer, tenantID uuid.UUID, orgID, name string) (string, error) {
	if _, err := tx.Exec(ctx, `INSERT INTO `+t.organizations+` (id, tenant_id, name) VALUES ($1, $2, $3)`, orgID, tenantID, name); err != nil {
		return "", err
	}
	// The payload is built by hand so that the example can produce a
	// malformed organization_id; marshal a struct in your code.
	payload, err := json.Marshal(map[string]string{"organization_id": orgID, "name": name})
	if err != nil {
		return "", err
	}
	msg := message.NewMessage(watermill.NewUUID(), payload)
	msg.Metadata.Set(schema.MetadataTenantID, tenantID.String())
	msg.Metadata.Set("correlation_id", "create-"+strings.ToLower(name))
	msg.SetContext(ctx)
	pub, err := publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{Table: t.outbox, Enqueuer: enq})
	if err != nil {
		return "", err
	}
	if err := pub.Publish(TopicOrganizationCreated, msg); err != nil {
		return "", err
	}
	return msg.UUID, nil
}

// searchIndexer is the handler the router already had: it indexes each new
// organization once per event_id.
type searchIndexer struct {
	pool    *pgxpool.Pool
	tables  tables
	out     io.Writer
	handled chan struct{}
}

// Handle is the router handler; its error reaches the relay through the
// in-process pub/sub (CaptureError), which retries the outbox row.
func (s *searchIndexer) Handle(msg *message.Message) error {
	ctx := msg.Context()
	var evt OrganizationCreated
	if err := json.Unmarshal(msg.Payload, &evt); err != nil {
		// Retrying cannot fix this payload: say so with Permanent.
		fmt.Fprintf(s.out, "rejected event_id=%s: %v\n", msg.UUID, err)
		s.done(ctx)
		return subscriber.Permanent(fmt.Errorf("decode organization event: %w", err))
	}
	duplicate := false
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `INSERT INTO `+s.tables.processed+` (consumer, event_id) VALUES ('search_indexer', $1) ON CONFLICT DO NOTHING`, msg.UUID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			duplicate = true
			return nil
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+s.tables.search+` (organization_id, document) VALUES ($1, to_tsvector('simple', $2))`, evt.OrganizationID, evt.Name)
		return err
	})
	if err != nil {
		return fmt.Errorf("index organization %s: %w", evt.OrganizationID, err)
	}
	if duplicate {
		fmt.Fprintf(s.out, "duplicate ignored event_id=%s\n", msg.UUID)
		return nil
	}
	fmt.Fprintf(s.out, "indexed organization %q event_id=%s correlation_id=%s\n", evt.Name, msg.UUID, msg.Metadata.Get("correlation_id"))
	s.done(ctx)
	return nil
}

// done tells run that one more message was handled.
func (s *searchIndexer) done(ctx context.Context) {
	select {
	case s.handled <- struct{}{}:
	case <-ctx.Done():
	}
}

// printMetrics prints the samples of the named metric families, as a
// Prometheus scrape would see them (histograms by their sample count).
func printMetrics(w io.Writer, g prometheus.Gatherer, names ...string) error {
	families, err := g.Gather()
	if err != nil {
		return fmt.Errorf("gather metrics: %w", err)
	}
	wanted := map[string]bool{}
	for _, n := range names {
		wanted[n] = true
	}
	var lines []string
	for _, f := range families {
		if !wanted[f.GetName()] {
			continue
		}
		for _, m := range f.GetMetric() {
			labels := make([]string, 0, len(m.GetLabel()))
			for _, l := range m.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			name := f.GetName()
			var value float64
			switch {
			case m.GetCounter() != nil:
				value = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				value = m.GetGauge().GetValue()
			case m.GetHistogram() != nil:
				name += "_count"
				value = float64(m.GetHistogram().GetSampleCount())
			default:
				continue
			}
			lines = append(lines, fmt.Sprintf("metric %s{%s} %g", name, strings.Join(labels, ","), value))
		}
	}
	sort.Strings(lines)
	for _, l := range lines {
		fmt.Fprintln(w, l)
	}
	return nil
}

// createTables creates the outbox (with the headers column TxPublisher needs
// for extra metadata), the business table and the indexer's tables.
func createTables(ctx context.Context, pool *pgxpool.Pool, ns string) (tables, error) {
	outbox, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		return tables{}, err
	}
	if err := schema.Migrate(ctx, pool, outbox, schema.WithHeadersColumn()); err != nil {
		return tables{}, err
	}
	q := func(name string) string { return pgx.Identifier{ns, name}.Sanitize() }
	t := tables{outbox: outbox, organizations: q("organizations"), search: q("search_documents"), processed: q("processed_events")}
	ddl := `
CREATE TABLE ` + t.organizations + ` (id TEXT PRIMARY KEY, tenant_id UUID NOT NULL, name TEXT NOT NULL);
CREATE TABLE ` + t.search + ` (organization_id UUID PRIMARY KEY, document TSVECTOR NOT NULL);
CREATE TABLE ` + t.processed + ` (
  consumer     TEXT        NOT NULL,
  event_id     UUID        NOT NULL,
  processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, event_id)
);`
	if _, err := pool.Exec(ctx, ddl); err != nil {
		return tables{}, fmt.Errorf("create example tables: %w", err)
	}
	return t, nil
}
