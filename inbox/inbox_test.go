package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/goleak"

	"github.com/outboxkit/watermill-outbox/inbox"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
)

func TestMain(m *testing.M) {
	code := m.Run()
	// Close the shared pool first, so that the leak check sees none of its
	// goroutines; any other goroutine left behind is a leak.
	testdb.ClosePool()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// env is one test's inbox table and effects table in a fresh schema.
type env struct {
	pool    *pgxpool.Pool
	ns      string
	table   schema.Table
	effects string // sanitized name of the handler's effect table (no unique key: doubles show)
	calls   atomic.Int64
}

func setup(t *testing.T) *env {
	t.Helper()
	pool := testdb.Pool(t)
	ns := testdb.Schema(t)
	e := &env{pool: pool, ns: ns, table: schema.MustParseTable(ns + ".app_inbox"), effects: pgx.Identifier{ns, "effects"}.Sanitize()}
	ctx := context.Background()
	if err := inbox.Migrate(ctx, pool, e.table); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+e.effects+` (id BIGSERIAL, consumer TEXT NOT NULL, key TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) newInbox(t *testing.T, cfg inbox.Config) *inbox.Inbox {
	t.Helper()
	if cfg.Table.IsZero() {
		cfg.Table = e.table
	}
	if cfg.Consumer == "" {
		cfg.Consumer = "billing"
	}
	ib, err := inbox.New(e.pool, cfg)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	t.Cleanup(func() { _ = ib.Close() })
	return ib
}

// effect is a handler that writes one effect row through the inbox
// transaction, after an optional pause, and returns fail.
func (e *env) effect(consumer string, pause time.Duration, fail error) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		e.calls.Add(1)
		tx, ok := inbox.Tx(msg.Context())
		if !ok {
			return nil, errors.New("test: no inbox transaction in the message context")
		}
		if _, err := tx.Exec(msg.Context(), `INSERT INTO `+e.effects+` (consumer, key) VALUES ($1, $2)`, consumer, msg.UUID); err != nil {
			return nil, err
		}
		if pause > 0 {
			time.Sleep(pause)
		}
		return nil, fail
	}
}

func (e *env) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", query, err)
	}
	return n
}

func (e *env) effectsOf(t *testing.T, consumer string) int {
	t.Helper()
	return e.count(t, `SELECT count(*) FROM `+e.effects+` WHERE consumer = $1`, consumer)
}

func (e *env) records(t *testing.T, consumer string) int {
	t.Helper()
	return e.count(t, `SELECT count(*) FROM `+e.table.Sanitize()+` WHERE consumer = $1`, consumer)
}

func newMsg() *message.Message {
	id := uuid.NewString()
	m := message.NewMessage(id, []byte(`{}`))
	m.Metadata.Set(schema.MetadataEventID, id)
	return m
}

// copyOf is a second delivery of m: same UUID and metadata, fresh context.
func copyOf(m *message.Message) *message.Message {
	c := message.NewMessage(m.UUID, m.Payload)
	for k, v := range m.Metadata {
		c.Metadata.Set(k, v)
	}
	return c
}

func TestSequentialDuplicates(t *testing.T) {
	t.Parallel()
	e := setup(t)
	m, err := inbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ib := e.newInbox(t, inbox.Config{Metrics: m})
	h := ib.Middleware(e.effect("billing", 0, nil))
	msg := newMsg()
	for i := 0; i < 3; i++ {
		if _, err := h(copyOf(msg)); err != nil {
			t.Fatalf("delivery %d: %v", i+1, err)
		}
	}
	if got := e.calls.Load(); got != 1 {
		t.Errorf("handler ran %d times, want 1", got)
	}
	if got := e.effectsOf(t, "billing"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
	labels := []string{e.table.Qualified(), "billing"}
	if p, d, f := testutil.ToFloat64(m.Processed.WithLabelValues(labels...)), testutil.ToFloat64(m.Duplicates.WithLabelValues(labels...)),
		testutil.ToFloat64(m.Failures.WithLabelValues(labels...)); p != 1 || d != 2 || f != 0 {
		t.Errorf("metrics processed=%v duplicates=%v failures=%v, want 1, 2, 0", p, d, f)
	}
	if _, ok := inbox.Tx(msg.Context()); ok {
		t.Error("the message context still carries the inbox transaction after the middleware returned")
	}
}

func TestConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	for _, mode := range []inbox.Concurrency{inbox.Wait, inbox.FailFast} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			e := setup(t)
			ib := e.newInbox(t, inbox.Config{Concurrency: mode})
			// The pause makes the copies overlap for sure.
			h := ib.Middleware(e.effect("billing", 100*time.Millisecond, nil))
			msg := newMsg()
			const copies = 10
			var (
				wg         sync.WaitGroup
				inProgress atomic.Int64
				failures   = make(chan error, copies)
				start      = make(chan struct{})
			)
			for range copies {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					for {
						_, err := h(copyOf(msg))
						if mode == inbox.FailFast && errors.Is(err, inbox.ErrInProgress) {
							inProgress.Add(1)
							time.Sleep(20 * time.Millisecond) // a redelivery
							continue
						}
						if err != nil {
							failures <- err
						}
						return
					}
				}()
			}
			close(start)
			wg.Wait()
			close(failures)
			for err := range failures {
				t.Errorf("copy failed: %v", err)
			}
			if got := e.effectsOf(t, "billing"); got != 1 {
				t.Errorf("effects = %d, want 1", got)
			}
			if got := e.calls.Load(); got != 1 {
				t.Errorf("handler ran %d times, want 1", got)
			}
			switch mode {
			case inbox.Wait:
				if n := inProgress.Load(); n != 0 {
					t.Errorf("%d ErrInProgress under Wait", n)
				}
			case inbox.FailFast:
				if n := inProgress.Load(); n == 0 {
					t.Error("no copy failed fast with ErrInProgress, though all overlapped")
				}
			}
		})
	}
}

// TestConcurrentCopyAfterRollback: under Wait, a copy blocked on a copy that
// then rolls back does the work itself.
func TestConcurrentCopyAfterRollback(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	msg := newMsg()
	entered, release := make(chan struct{}), make(chan struct{})
	boom := errors.New("boom")
	first := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.Tx(m.Context())
		if _, err := tx.Exec(m.Context(), `INSERT INTO `+e.effects+` (consumer, key) VALUES ('billing', $1)`, m.UUID); err != nil {
			return nil, err
		}
		close(entered)
		<-release
		return nil, boom
	})
	firstErr := make(chan error, 1)
	go func() { _, err := first(copyOf(msg)); firstErr <- err }()
	<-entered
	secondErr := make(chan error, 1)
	go func() { _, err := ib.Middleware(e.effect("billing", 0, nil))(copyOf(msg)); secondErr <- err }()
	select {
	case err := <-secondErr:
		t.Fatalf("the second copy finished (%v) while the first was in flight; it should wait", err)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	if err := <-firstErr; !errors.Is(err, boom) {
		t.Fatalf("first copy: %v, want boom", err)
	}
	if err := <-secondErr; err != nil {
		t.Fatalf("second copy: %v", err)
	}
	if got, calls := e.effectsOf(t, "billing"), e.calls.Load(); got != 1 || calls != 1 {
		t.Errorf("effects = %d, second handler calls = %d; want 1 and 1", got, calls)
	}
}

func TestHandlerErrorRollsBack(t *testing.T) {
	t.Parallel()
	e := setup(t)
	m, _ := inbox.NewMetrics(nil)
	ib := e.newInbox(t, inbox.Config{Metrics: m})
	msg := newMsg()
	boom := errors.New("boom")
	if _, err := ib.Middleware(e.effect("billing", 0, boom))(copyOf(msg)); !errors.Is(err, boom) {
		t.Fatalf("err = %v, want the handler's error (a nack)", err)
	}
	if got, rec := e.effectsOf(t, "billing"), e.records(t, "billing"); got != 0 || rec != 0 {
		t.Fatalf("after a handler error: effects = %d, inbox records = %d; want 0 and 0", got, rec)
	}
	// The redelivery does the work.
	if _, err := ib.Middleware(e.effect("billing", 0, nil))(copyOf(msg)); err != nil {
		t.Fatal(err)
	}
	if got, rec := e.effectsOf(t, "billing"), e.records(t, "billing"); got != 1 || rec != 1 {
		t.Errorf("after the redelivery: effects = %d, records = %d; want 1 and 1", got, rec)
	}
	if f := testutil.ToFloat64(m.Failures.WithLabelValues(e.table.Qualified(), "billing")); f != 1 {
		t.Errorf("failures = %v, want 1", f)
	}
}

func TestHandlerPanicRollsBack(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	msg := newMsg()
	panicking := func(m *message.Message) ([]*message.Message, error) {
		if _, err := e.effect("billing", 0, nil)(m); err != nil {
			return nil, err
		}
		panic("handler bug")
	}
	// With Recoverer outside the inbox (the Watermill convention), the
	// panic becomes an error: a nack.
	_, err := middleware.Recoverer(ib.Middleware(panicking))(copyOf(msg))
	var rp middleware.RecoveredPanicError
	if !errors.As(err, &rp) || rp.V != "handler bug" {
		t.Fatalf("err = %v, want a RecoveredPanicError of the handler's panic", err)
	}
	// Without Recoverer the panic continues past the inbox.
	func() {
		defer func() {
			if r := recover(); r != "handler bug" {
				t.Errorf("recovered %v, want the handler's panic to be re-raised", r)
			}
		}()
		_, _ = ib.Middleware(panicking)(copyOf(msg))
	}()
	if got, rec := e.effectsOf(t, "billing"), e.records(t, "billing"); got != 0 || rec != 0 {
		t.Fatalf("after panics: effects = %d, inbox records = %d; want 0 and 0", got, rec)
	}
	if _, err := ib.Middleware(e.effect("billing", 0, nil))(copyOf(msg)); err != nil {
		t.Fatal(err)
	}
	if got := e.effectsOf(t, "billing"); got != 1 {
		t.Errorf("after the redelivery: effects = %d, want 1", got)
	}
}

func TestIndependentConsumers(t *testing.T) {
	t.Parallel()
	e := setup(t)
	billing := e.newInbox(t, inbox.Config{Consumer: "billing"})
	audit := e.newInbox(t, inbox.Config{Consumer: "audit"})
	msg := newMsg()
	for range 2 {
		if _, err := billing.Middleware(e.effect("billing", 0, nil))(copyOf(msg)); err != nil {
			t.Fatal(err)
		}
		if _, err := audit.Middleware(e.effect("audit", 0, nil))(copyOf(msg)); err != nil {
			t.Fatal(err)
		}
	}
	if b, a := e.effectsOf(t, "billing"), e.effectsOf(t, "audit"); b != 1 || a != 1 {
		t.Errorf("effects billing = %d, audit = %d; want 1 each", b, a)
	}
}

func TestRetention(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	ib := e.newInbox(t, inbox.Config{Retention: time.Hour, CleanupBatch: 2})
	h := ib.Middleware(e.effect("billing", 0, nil))
	var msgs []*message.Message
	for range 6 {
		m := newMsg()
		msgs = append(msgs, m)
		if _, err := h(copyOf(m)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.pool.Exec(ctx, `INSERT INTO `+e.table.Sanitize()+` (consumer, key, processed_at) VALUES ('audit', 'old', now() - interval '2 hours')`); err != nil {
		t.Fatal(err)
	}
	// Five of billing's keys are older than the retention.
	if _, err := e.pool.Exec(ctx, `UPDATE `+e.table.Sanitize()+` SET processed_at = now() - interval '2 hours' WHERE consumer = 'billing' AND key <> $1`, msgs[5].UUID); err != nil {
		t.Fatal(err)
	}
	n, err := ib.Cleanup(ctx)
	if err != nil || n != 5 {
		t.Fatalf("Cleanup = %d, %v; want 5 (in batches of 2)", n, err)
	}
	if rec, audit := e.records(t, "billing"), e.records(t, "audit"); rec != 1 || audit != 1 {
		t.Errorf("records billing = %d, audit = %d; want 1 and 1 (another consumer's keys are its own)", rec, audit)
	}
	// The idempotency window: a duplicate after its key expired runs again,
	// one within it does not.
	if _, err := h(copyOf(msgs[0])); err != nil {
		t.Fatal(err)
	}
	if _, err := h(copyOf(msgs[5])); err != nil {
		t.Fatal(err)
	}
	if got := e.effectsOf(t, "billing"); got != 7 {
		t.Errorf("effects = %d, want 7 (6 + the expired duplicate)", got)
	}
}

func TestRetentionLoop(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ctx := context.Background()
	if _, err := e.pool.Exec(ctx, `INSERT INTO `+e.table.Sanitize()+` (consumer, key, processed_at)
SELECT 'billing', g::text, now() - interval '2 hours' FROM generate_series(1, 25) g`); err != nil {
		t.Fatal(err)
	}
	ib, err := inbox.New(e.pool, inbox.Config{Table: e.table, Consumer: "billing", Retention: time.Hour, CleanupBatch: 10, CleanupInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for e.records(t, "billing") != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the background cleanup left %d expired keys", e.records(t, "billing"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := ib.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ib.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := ib.Cleanup(ctx); !errors.Is(err, inbox.ErrClosed) {
		t.Errorf("Cleanup after Close = %v, want ErrClosed", err)
	}
}

// TestConsumeTransformProduce: the handler enqueues the next event in the
// inbox transaction; it commits once with the dedup record, and a failed
// handler leaves neither.
func TestConsumeTransformProduce(t *testing.T) {
	t.Parallel()
	e := setup(t)
	outbox := schema.MustParseTable(e.ns + ".app_outbox")
	ctx := context.Background()
	if err := schema.Migrate(ctx, e.pool, outbox); err != nil {
		t.Fatal(err)
	}
	ib := e.newInbox(t, inbox.Config{})
	tenant := uuid.New()
	boom := errors.New("boom")
	produce := func(fail error) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			tx, _ := inbox.Tx(msg.Context())
			// The next event's id derives from the consumed one, as a
			// real handler would do (uuid v5), so a retry re-enqueues the same.
			next := uuid.NewSHA1(uuid.NameSpaceOID, []byte("invoice:"+msg.UUID))
			payload, _ := json.Marshal(map[string]string{"order": msg.UUID})
			if _, err := publisher.Enqueue(msg.Context(), tx, outbox, publisher.Message{
				TenantID: tenant, Topic: "billing.invoice.created.v1", EventID: next, Payload: payload,
			}); err != nil {
				return nil, err
			}
			// Watermill handlers may return messages; they pass through.
			return []*message.Message{message.NewMessage(next.String(), payload)}, fail
		}
	}
	msg := newMsg()
	if _, err := ib.Middleware(produce(boom))(copyOf(msg)); !errors.Is(err, boom) {
		t.Fatalf("failing handler: %v", err)
	}
	if n := e.count(t, `SELECT count(*) FROM `+outbox.Sanitize()); n != 0 {
		t.Fatalf("outbox rows after a failed handler = %d, want 0", n)
	}
	for i := 0; i < 3; i++ {
		out, err := ib.Middleware(produce(nil))(copyOf(msg))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 && len(out) != 1 {
			t.Errorf("the handler's returned messages were dropped: got %d, want 1", len(out))
		}
		if i > 0 && len(out) != 0 {
			t.Errorf("a duplicate returned %d messages, want 0", len(out))
		}
	}
	if n := e.count(t, `SELECT count(*) FROM `+outbox.Sanitize()+` WHERE topic = 'billing.invoice.created.v1'`); n != 1 {
		t.Errorf("outbox rows = %d, want 1", n)
	}
	if rec := e.records(t, "billing"); rec != 1 {
		t.Errorf("inbox records = %d, want 1", rec)
	}
}

func TestKeyFunction(t *testing.T) {
	t.Parallel()
	e := setup(t)
	t.Run("default prefers event_id over the UUID", func(t *testing.T) {
		ib := e.newInbox(t, inbox.Config{Consumer: "default"})
		a, b := newMsg(), newMsg()
		b.Metadata.Set(schema.MetadataEventID, a.UUID) // another UUID, same event
		for _, m := range []*message.Message{a, b} {
			if _, err := ib.Middleware(e.effect("default", 0, nil))(m); err != nil {
				t.Fatal(err)
			}
		}
		c := message.NewMessage(uuid.NewString(), nil) // no event_id: the UUID
		if _, err := ib.Middleware(e.effect("default", 0, nil))(c); err != nil {
			t.Fatal(err)
		}
		if got := e.effectsOf(t, "default"); got != 2 {
			t.Errorf("effects = %d, want 2", got)
		}
	})
	t.Run("custom", func(t *testing.T) {
		ib := e.newInbox(t, inbox.Config{Consumer: "custom", Key: func(m *message.Message) (string, error) {
			if v := m.Metadata.Get("order_id"); v != "" {
				return "order:" + v, nil
			}
			return "", errors.New("no order_id metadata")
		}})
		h := ib.Middleware(e.effect("custom", 0, nil))
		for range 2 {
			m := newMsg()
			m.Metadata.Set("order_id", "42")
			if _, err := h(m); err != nil {
				t.Fatal(err)
			}
		}
		if got := e.effectsOf(t, "custom"); got != 1 {
			t.Errorf("effects = %d, want 1", got)
		}
		if _, err := h(newMsg()); !errors.Is(err, inbox.ErrInvalidKey) || !strings.Contains(err.Error(), "no order_id metadata") {
			t.Errorf("missing key: %v, want ErrInvalidKey with the key function's reason", err)
		}
	})
	t.Run("unusable keys", func(t *testing.T) {
		before := e.calls.Load()
		cases := map[string]string{"empty": "", "NUL": "a\x00b", "not UTF-8": "\xff\xfe", "too long": strings.Repeat("k", inbox.MaxKeyBytes+1)}
		for name, key := range cases {
			ib := e.newInbox(t, inbox.Config{Consumer: "bad", Key: func(*message.Message) (string, error) { return key, nil }})
			if _, err := ib.Middleware(e.effect("bad", 0, nil))(newMsg()); !errors.Is(err, inbox.ErrInvalidKey) {
				t.Errorf("%s key: %v, want ErrInvalidKey", name, err)
			}
		}
		ib := e.newInbox(t, inbox.Config{Consumer: "bad"})
		if _, err := ib.Middleware(e.effect("bad", 0, nil))(message.NewMessage("", nil)); !errors.Is(err, inbox.ErrInvalidKey) ||
			!strings.Contains(err.Error(), "neither event_id metadata nor a UUID") {
			t.Errorf("message with neither event_id nor UUID: %v", err)
		}
		if e.calls.Load() != before {
			t.Error("the handler ran for a message without a usable key")
		}
	})
}

func TestBadConfig(t *testing.T) {
	t.Parallel()
	e := setup(t)
	missing := schema.MustParseTable(e.ns + ".no_such_inbox")
	cases := []struct {
		name string
		pool *pgxpool.Pool
		cfg  inbox.Config
		want string
	}{
		{"nil pool", nil, inbox.Config{Table: e.table, Consumer: "c"}, "inbox: invalid config: nil pool"},
		{"empty consumer", e.pool, inbox.Config{Table: e.table}, "inbox: invalid config: Consumer is empty"},
		{"zero table", e.pool, inbox.Config{Consumer: "c"}, "inbox: invalid config: Table is empty"},
		{"negative retention", e.pool, inbox.Config{Table: e.table, Consumer: "c", Retention: -time.Second}, "inbox: invalid config: Retention"},
		{"bad concurrency", e.pool, inbox.Config{Table: e.table, Consumer: "c", Concurrency: 7}, "inbox: invalid config: Concurrency"},
		{"missing table", e.pool, inbox.Config{Table: missing, Consumer: "c"}, "does not exist; create it with inbox.Migrate"},
	}
	for _, c := range cases {
		ib, err := inbox.New(c.pool, c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New = %v, %v; want an error containing %q", c.name, ib, err, c.want)
		}
	}
}

func TestMigrateIdempotent(t *testing.T) {
	t.Parallel()
	e := setup(t) // migrated once already
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- inbox.Migrate(context.Background(), e.pool, e.table) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("Migrate again: %v", err)
		}
	}
	fresh := schema.MustParseTable(e.ns + "_other.inbox")
	t.Cleanup(func() {
		_, _ = e.pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{e.ns + "_other"}.Sanitize()+` CASCADE`)
	})
	// A missing schema is refused unless asked for; then it is created on the way.
	if err := inbox.Migrate(context.Background(), e.pool, fresh); !errors.Is(err, schema.ErrSchemaNotFound) || !strings.HasPrefix(err.Error(), "inbox: ") {
		t.Fatalf("Migrate into a missing schema: %v, want inbox: ... ErrSchemaNotFound", err)
	}
	for range 2 {
		if err := inbox.Migrate(context.Background(), e.pool, fresh, schema.WithCreateSchema()); err != nil {
			t.Fatal(err)
		}
	}
	if err := inbox.Migrate(context.Background(), e.pool, schema.Table{}); err == nil || !strings.HasPrefix(err.Error(), "inbox: ") {
		t.Errorf("Migrate of a zero table: %v", err)
	}
}

// TestClosedPool: a message handled on a closed pool fails (a nack); it is
// never acked and the handler does not run.
func TestClosedPool(t *testing.T) {
	t.Parallel()
	e := setup(t)
	pool := testdb.NewPool(t, nil)
	ib, err := inbox.New(pool, inbox.Config{Table: e.table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	defer ib.Close()
	pool.Close()
	if _, err := ib.Middleware(e.effect("billing", 0, nil))(newMsg()); err == nil || !strings.HasPrefix(err.Error(), "inbox: begin") {
		t.Fatalf("closed pool: %v, want an inbox: begin error", err)
	}
	if e.calls.Load() != 0 {
		t.Error("the handler ran on a closed pool")
	}
}

// TestRouter runs the middleware in a Watermill router on gochannel with
// Recoverer: a failing first attempt is nacked and redelivered, duplicates
// are acked, effects happen once per event.
func TestRouter(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	logger := watermill.NopLogger{}
	pubsub := newGoChannel(logger)
	defer pubsub.Close()
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		t.Fatal(err)
	}
	var attempts atomic.Int64
	r.AddMiddleware(middleware.Recoverer, ib.Middleware)
	r.AddConsumerHandler("billing", "orders", pubsub, func(msg *message.Message) error {
		if attempts.Add(1) == 1 {
			panic("first attempt fails")
		}
		_, err := e.effect("billing", 0, nil)(msg)
		return err
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	<-r.Running()
	const events = 5
	var msgs []*message.Message
	for range events {
		msgs = append(msgs, newMsg())
	}
	for _, m := range msgs {
		for range 2 {
			if err := pubsub.Publish("orders", copyOf(m)); err != nil {
				t.Fatal(err)
			}
		}
	}
	deadline := time.Now().Add(2 * time.Minute)
	for e.records(t, "billing") < events && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := e.effectsOf(t, "billing"); got != events {
		t.Errorf("effects = %d, want %d", got, events)
	}
}

func newGoChannel(logger watermill.LoggerAdapter) *gochannel.GoChannel {
	return gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 16}, logger)
}

// TestHandlerMustNotEndTx: a handler that commits the inbox transaction
// itself gets an error (a nack) that says not to.
func TestHandlerMustNotEndTx(t *testing.T) {
	t.Parallel()
	e := setup(t)
	ib := e.newInbox(t, inbox.Config{})
	_, err := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
		tx, _ := inbox.Tx(m.Context())
		return nil, tx.Commit(m.Context())
	})(newMsg())
	if err == nil || !strings.Contains(err.Error(), "never commit or roll back inbox.Tx") {
		t.Fatalf("err = %v, want the inbox to refuse a handler that ended its transaction", err)
	}
}

// sqlcDBTX is the interface sqlc generates for pgx/v5 (sql_package:
// pgx/v5): the inbox transaction must satisfy it.
type sqlcDBTX interface {
	Exec(context.Context, string, ...interface{}) (pgconn.CommandTag, error)
	Query(context.Context, string, ...interface{}) (pgx.Rows, error)
	QueryRow(context.Context, string, ...interface{}) pgx.Row
}

var _ sqlcDBTX = pgx.Tx(nil)

// TestQueryExecModes: the inbox statements work under every pgx query
// execution mode, the simple protocol (PgBouncer) included.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	e := setup(t)
	modes := map[string]pgx.QueryExecMode{
		"cache_statement": pgx.QueryExecModeCacheStatement, "cache_describe": pgx.QueryExecModeCacheDescribe,
		"describe_exec": pgx.QueryExecModeDescribeExec, "exec": pgx.QueryExecModeExec, "simple_protocol": pgx.QueryExecModeSimpleProtocol,
	}
	for name, mode := range modes {
		pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode; c.MaxConns = 4 })
		for _, cc := range []inbox.Concurrency{inbox.Wait, inbox.FailFast} {
			consumer := name + "/" + cc.String()
			ib, err := inbox.New(pool, inbox.Config{Table: e.table, Consumer: consumer, Concurrency: cc, Retention: time.Millisecond})
			if err != nil {
				t.Fatalf("%s: %v", consumer, err)
			}
			msg := newMsg()
			msg.Metadata.Set(schema.MetadataEventID, "it's a key with 'quotes' and \\backslashes")
			for range 2 {
				if _, err := ib.Middleware(e.effect(consumer, 0, nil))(copyOf(msg)); err != nil {
					t.Fatalf("%s: %v", consumer, err)
				}
			}
			if got := e.effectsOf(t, consumer); got != 1 {
				t.Errorf("%s: effects = %d, want 1", consumer, got)
			}
			time.Sleep(5 * time.Millisecond)
			if n, err := ib.Cleanup(context.Background()); err != nil || n != 1 {
				t.Errorf("%s: Cleanup = %d, %v; want 1", consumer, n, err)
			}
			_ = ib.Close()
		}
	}
}

// TestHandlerMustNotEndTxWithSQL: a handler that ends the inbox transaction
// with a statement sent through it (ROLLBACK or COMMIT), writes its effect
// outside any transaction and returns nil gets an error (a nack), not an
// ack with no inbox record; its connection goes back to the pool idle.
func TestHandlerMustNotEndTxWithSQL(t *testing.T) {
	t.Parallel()
	e := setup(t)
	pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	ib, err := inbox.New(pool, inbox.Config{Table: e.table, Consumer: "billing"})
	if err != nil {
		t.Fatal(err)
	}
	defer ib.Close()
	for _, end := range []string{"ROLLBACK", "COMMIT", "END", "ABORT"} {
		msg := newMsg()
		_, err := ib.Middleware(func(m *message.Message) ([]*message.Message, error) {
			ctx := m.Context()
			tx, _ := inbox.Tx(ctx)
			if _, err := tx.Exec(ctx, end); err != nil {
				return nil, err
			}
			_, err := tx.Exec(ctx, `INSERT INTO `+e.effects+` (consumer, key) VALUES ('billing', $1)`, m.UUID)
			return nil, err
		})(msg)
		if err == nil || !strings.Contains(err.Error(), "never commit or roll back inbox.Tx") {
			t.Errorf("%s through the inbox transaction: err = %v, want the inbox to refuse the handler (a nack)", end, err)
		}
		c, err := pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if s := c.Conn().PgConn().TxStatus(); s != 'I' {
			t.Errorf("%s: the connection came back in transaction status %q", end, s)
		}
		c.Release()
	}
}
