// Command quickstart is the smallest complete use of watermill-outbox, from
// the business write to a consumer that is safe against duplicates:
//
//  1. a business row (an organization) and its event are written in ONE pgx
//     transaction with publisher.Enqueue, so they commit together;
//  2. a transaction that fails after enqueueing rolls back its event too;
//  3. the relay (subscriber.New + forwarder.New) moves committed events to
//     an in-process Watermill pub/sub (router.InProcess);
//  4. a consumer, a Watermill router handler, dedups on event_id: it records
//     the event_id in processed_events in the same transaction as its side
//     effect, so a second delivery of the same event changes nothing.
//
// Delivery is at least once: every consumer of an outbox must dedup. This
// example writes the dedup by hand so that the rule is visible in a few
// lines; package inbox does the same as a Watermill middleware, with
// retention and concurrent copies handled (examples/inbox).
//
// Run it with `go run ./examples/quickstart` against the PostgreSQL of
// OUTBOX_DATABASE_URL (default postgres://postgres@127.0.0.1:5432/test). It
// works in a fresh schema example_<random hex> and drops it at the end.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxkit/watermill-outbox/examples/plumbing"
	"github.com/outboxkit/watermill-outbox/forwarder"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/router"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// TopicOrganizationCreated follows the default topic rule
// <module>.<aggregate>.<event>.vN.
const TopicOrganizationCreated = "org.organization.created.v1"

// OrganizationCreated is the event's payload, stored as JSONB.
type OrganizationCreated struct {
	OrganizationID uuid.UUID `json:"organization_id"`
	Name           string    `json:"name"`
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Stdout, plumbing.DatabaseURL())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "quickstart:", err)
		os.Exit(1)
	}
}

// tables are the example's tables, all in one fresh schema.
type tables struct {
	outbox        schema.Table // the outbox, created by schema.Migrate
	organizations string       // the business table (sanitized name)
	tasks         string       // the consumer's side effect (sanitized name)
	processed     string       // the consumer's dedup table (sanitized name)
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

	// 1. The business write and its event, in one transaction.
	tenantID := uuid.New()
	var created enqueued
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		created, err = createOrganization(ctx, tx, t, tenantID, "Acme")
		return err
	})
	if err != nil {
		return fmt.Errorf("create organization: %w", err)
	}
	fmt.Fprintf(out, "enqueued %s event_id=%s sequence=%d (committed with organization %q)\n",
		TopicOrganizationCreated, created.eventID, created.sequence, "Acme")

	// 2. A transaction that fails after enqueueing: the event is rolled back
	// with the organization, so no one ever hears of it.
	errPlanLimit := errors.New("plan limit reached")
	var doomed enqueued
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if doomed, err = createOrganization(ctx, tx, t, tenantID, "Doomed Ltd"); err != nil {
			return err
		}
		return errPlanLimit // any error rolls the whole transaction back
	})
	if !errors.Is(err, errPlanLimit) {
		return fmt.Errorf("the doomed transaction should fail with %q, got: %w", errPlanLimit.Error(), err)
	}
	var outboxRows, orgRows int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+t.outbox.Sanitize()+` WHERE event_id = $1),
	       (SELECT count(*) FROM `+t.organizations+` WHERE name = $2)`, doomed.eventID, "Doomed Ltd").Scan(&outboxRows, &orgRows); err != nil {
		return err
	}
	fmt.Fprintf(out, "rolled back (%v): event_id=%s outbox rows=%d, organization rows=%d\n", errPlanLimit, doomed.eventID, outboxRows, orgRows)

	// 3. The consumer: a Watermill router handler on the in-process pub/sub.
	// Start it before the relay: InProcess refuses (and the relay retries)
	// a message no one is subscribed to.
	bus := router.NewInProcess()
	defer bus.Close()
	consumer, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	// CaptureError hands the handler's error back to the relay (it becomes
	// the row's last_error); Recoverer turns a panic into an error (a nack).
	consumer.AddMiddleware(subscriber.CaptureError, middleware.Recoverer)
	onboarding := &onboardingHandler{pool: pool, tables: t, out: out}
	consumer.AddConsumerHandler("org_onboarding", TopicOrganizationCreated, bus, onboarding.Handle)
	stopConsumer, err := plumbing.StartRouter(ctx, consumer)
	if err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	defer func() { err = errors.Join(err, stopConsumer()) }()

	// 4. The relay: lease committed rows, publish them, mark them published.
	sub, err := subscriber.New(ctx, pool, subscriber.Config{Table: t.outbox}, logger)
	if err != nil {
		return err
	}
	defer sub.Close() // the forwarder closes it too; Close is idempotent
	fwd, err := forwarder.New(sub, bus, forwarder.Config{}, logger)
	if err != nil {
		return err
	}
	stopRelay, err := plumbing.StartForwarder(ctx, fwd)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	defer func() { err = errors.Join(err, stopRelay()) }()

	if err := waitPublished(ctx, pool, t.outbox, created.eventID); err != nil {
		return err
	}
	fmt.Fprintln(out, "outbox row published: true")

	// 5. At-least-once means the same event may arrive again (for example
	// when the relay crashed after publishing and before recording the ack).
	// Deliver it a second time: the consumer recognises the event_id.
	var payload []byte
	if err := pool.QueryRow(ctx, `SELECT payload FROM `+t.outbox.Sanitize()+` WHERE event_id = $1`, created.eventID).Scan(&payload); err != nil {
		return err
	}
	again := message.NewMessage(created.eventID.String(), payload)
	again.Metadata.Set(schema.MetadataEventID, created.eventID.String())
	again.Metadata.Set(schema.MetadataTenantID, tenantID.String())
	again.Metadata.Set(schema.MetadataTopic, TopicOrganizationCreated)
	if err := bus.Publish(TopicOrganizationCreated, again); err != nil {
		return fmt.Errorf("deliver again: %w", err)
	}

	var tasks int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+t.tasks+` WHERE organization_id = $1`, created.organizationID).Scan(&tasks); err != nil {
		return err
	}
	fmt.Fprintf(out, "onboarding tasks for %q: %d (two deliveries, one effect)\n", "Acme", tasks)
	return nil
}

// enqueued is what createOrganization wrote.
type enqueued struct {
	organizationID uuid.UUID
	eventID        uuid.UUID
	sequence       int64
}

// createOrganization inserts an organization and enqueues its
// OrganizationCreated event inside tx: both commit or neither does.
func createOrganization(ctx context.Context, tx pgx.Tx, t tables, tenantID uuid.UUID, name string) (enqueued, error) {
	e := enqueued{organizationID: uuid.New(), eventID: uuid.New()}
	if _, err := tx.Exec(ctx, `INSERT INTO `+t.organizations+` (id, tenant_id, name) VALUES ($1, $2, $3)`,
		e.organizationID, tenantID, name); err != nil {
		return e, err
	}
	payload, err := json.Marshal(OrganizationCreated{OrganizationID: e.organizationID, Name: name})
	if err != nil {
		return e, err
	}
	e.sequence, err = publisher.Enqueue(ctx, tx, t.outbox, publisher.Message{
		TenantID: tenantID,
		Topic:    TopicOrganizationCreated,
		EventID:  e.eventID, // generate it once; keep it if you retry the transaction
		Payload:  payload,
	})
	return e, err
}

// onboardingHandler consumes OrganizationCreated: it creates the
// organization's onboarding tasks, exactly once per event_id.
type onboardingHandler struct {
	pool   *pgxpool.Pool
	tables tables
	out    io.Writer
}

// consumerName scopes the dedup records, so that several consumers can share
// one processed_events table.
const consumerName = "org_onboarding"

// Handle is the router handler. An error nacks the message: the relay
// retries it with backoff.
func (h *onboardingHandler) Handle(msg *message.Message) error {
	ctx := msg.Context()
	var evt OrganizationCreated
	if err := json.Unmarshal(msg.Payload, &evt); err != nil {
		// Retrying cannot fix a payload we cannot read: send the row dead.
		return subscriber.Permanent(fmt.Errorf("decode %s: %w", msg.UUID, err))
	}
	duplicate := false
	err := pgx.BeginFunc(ctx, h.pool, func(tx pgx.Tx) error {
		// The dedup record and the side effect commit together: if the side
		// effect fails, the record is rolled back and a retry does the work.
		tag, err := tx.Exec(ctx, `INSERT INTO `+h.tables.processed+` (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING`,
			consumerName, msg.UUID)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			duplicate = true // seen before: ack without doing anything
			return nil
		}
		_, err = tx.Exec(ctx, `INSERT INTO `+h.tables.tasks+` (organization_id, task) VALUES ($1, 'send welcome email'), ($1, 'create default workspace')`,
			evt.OrganizationID)
		return err
	})
	if err != nil {
		return fmt.Errorf("onboard organization %s: %w", evt.OrganizationID, err)
	}
	if duplicate {
		fmt.Fprintf(h.out, "duplicate ignored event_id=%s\n", msg.UUID)
		return nil
	}
	fmt.Fprintf(h.out, "consumed %s event_id=%s attempts=%s: onboarding tasks created for %q\n",
		msg.Metadata.Get(schema.MetadataTopic), msg.UUID, msg.Metadata.Get(schema.MetadataAttempts), evt.Name)
	return nil
}

// createTables creates the outbox, the business table and the consumer's
// tables in schema ns. In a real service the consumer's tables live in the
// consumer's own database.
func createTables(ctx context.Context, pool *pgxpool.Pool, ns string) (tables, error) {
	outbox, err := schema.ParseTable(ns + ".org_outbox")
	if err != nil {
		return tables{}, err
	}
	// Migrate is idempotent: run it at deploy or start-up, never inside a
	// business transaction.
	if err := schema.Migrate(ctx, pool, outbox); err != nil {
		return tables{}, err
	}
	q := func(name string) string { return pgx.Identifier{ns, name}.Sanitize() }
	t := tables{outbox: outbox, organizations: q("organizations"), tasks: q("onboarding_tasks"), processed: q("processed_events")}
	ddl := `
CREATE TABLE ` + t.organizations + ` (id UUID PRIMARY KEY, tenant_id UUID NOT NULL, name TEXT NOT NULL);
CREATE TABLE ` + t.tasks + ` (organization_id UUID NOT NULL, task TEXT NOT NULL);
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

// waitPublished waits until the relay has marked the event's row published.
func waitPublished(ctx context.Context, pool *pgxpool.Pool, t schema.Table, eventID uuid.UUID) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		var published bool
		if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+t.Sanitize()+` WHERE event_id = $1`, eventID).Scan(&published); err != nil {
			return fmt.Errorf("look up event %s: %w", eventID, err)
		}
		if published {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("event %s was not published in time: %w", eventID, ctx.Err())
		case <-tick.C:
		}
	}
}
