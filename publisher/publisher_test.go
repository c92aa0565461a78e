package publisher_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/watermill-outbox/internal/sqlq"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

var tenant = uuid.MustParse("7a1f0c5e-8a57-4d6a-9d43-0d2b8f2f0c11")

func newMsg(topic string) publisher.Message {
	return publisher.Message{TenantID: tenant, Topic: topic, EventID: uuid.New(), Payload: json.RawMessage(`{"id":1,"name":"acme"}`)}
}

func count(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+tbl.Sanitize()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func inTx(t *testing.T, pool *pgxpool.Pool, fn func(tx pgx.Tx)) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fn(tx)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestAtomicity(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE `+tbl.Schema()+`.orgs (id int primary key)`); err != nil {
		t.Fatal(err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+tbl.Schema()+`.orgs VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, tbl); n != 0 {
		t.Fatalf("rollback left %d outbox rows", n)
	}

	m := newMsg("org.organization.created.v1")
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := tx.Exec(ctx, `INSERT INTO `+tbl.Schema()+`.orgs VALUES (1)`); err != nil {
			t.Fatal(err)
		}
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
	})
	var (
		gotTenant, gotTopic string
		payload             map[string]any
		attempts            int
		published           *time.Time
	)
	err = pool.QueryRow(ctx, `SELECT tenant_id::text, topic, payload, attempts, published_at FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID).
		Scan(&gotTenant, &gotTopic, &payload, &attempts, &published)
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, tbl); n != 1 || gotTenant != tenant.String() || gotTopic != m.Topic || payload["name"] != "acme" || attempts != 0 || published != nil {
		t.Fatalf("commit: rows=%d tenant=%s topic=%s payload=%v attempts=%d published=%v", n, gotTenant, gotTopic, payload, attempts, published)
	}
}

func TestIdempotentEnqueue(t *testing.T) {
	t.Parallel()
	quiet, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
	if err != nil {
		t.Fatal(err)
	}
	// The default statement, and the quiet one (no wake-up: DisableNotify
	// or a WAL table), which reads an existing event_id after the fact.
	for name, enqueue := range map[string]func(context.Context, pgx.Tx, schema.Table, publisher.Message) (int64, error){
		"default": func(ctx context.Context, tx pgx.Tx, tbl schema.Table, m publisher.Message) (int64, error) {
			return publisher.Enqueue(ctx, tx, tbl, m)
		},
		"quiet": func(ctx context.Context, tx pgx.Tx, tbl schema.Table, m publisher.Message) (int64, error) {
			return quiet.Enqueue(ctx, tx, tbl, m)
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			testIdempotentEnqueue(t, enqueue)
		})
	}
}

func testIdempotentEnqueue(t *testing.T, enqueue func(context.Context, pgx.Tx, schema.Table, publisher.Message) (int64, error)) {
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	m := newMsg("org.organization.created.v1")
	var first, second int64
	inTx(t, pool, func(tx pgx.Tx) {
		var err error
		if first, err = enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
	})
	inTx(t, pool, func(tx pgx.Tx) {
		var err error
		if second, err = enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
		// A different tenant or topic under the same event_id is a conflict,
		// and the transaction stays usable afterwards.
		other := m
		other.Topic = "org.organization.deleted.v1"
		_, err = enqueue(ctx, tx, tbl, other)
		var ce *publisher.ConflictError
		if !errors.As(err, &ce) || !errors.Is(err, publisher.ErrEventIDConflict) || ce.Sequence != first || ce.ExistingTopic != m.Topic {
			t.Fatalf("conflicting re-enqueue: %v", err)
		}
		other = m
		other.TenantID = uuid.New()
		if _, err = enqueue(ctx, tx, tbl, other); !errors.Is(err, publisher.ErrEventIDConflict) {
			t.Fatalf("conflicting tenant: %v", err)
		}
		if _, err := enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
			t.Fatalf("tx unusable after conflict: %v", err)
		}
	})
	if first != second {
		t.Fatalf("re-enqueue returned sequence %d, first was %d", second, first)
	}
	if n := count(t, pool, tbl); n != 2 {
		t.Fatalf("rows: %d, want 2", n)
	}
}

// sqlRecorder records the statements a pool runs.
type sqlRecorder struct {
	mu  sync.Mutex
	sql []string
}

func (r *sqlRecorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	r.sql = append(r.sql, d.SQL)
	r.mu.Unlock()
	return ctx
}

func (r *sqlRecorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *sqlRecorder) saw(sql string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, s := range r.sql {
		if s == sql {
			return true
		}
	}
	return false
}

// TestEnqueueIntoWALTable: a table the WAL relay streams (it has the WAL
// holds table) takes the quiet statement with the default config, for an
// unkeyed row; a keyed row still takes the statement with the key lock.
func TestEnqueueIntoWALTable(t *testing.T) {
	t.Parallel()
	rec := &sqlRecorder{}
	pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.Tracer = rec })
	tbl := testdb.Table(t, "org_outbox", schema.WithOrderingKeyColumn())
	ctx := context.Background()
	q := sqlq.NewQueries(tbl, schema.Columns{OrderingKey: true})
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := enq.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
			t.Fatal(err)
		}
	})
	if rec.saw(q.EnqueueQuiet) || !rec.saw(q.Enqueue) {
		t.Fatal("a table without the WAL relay took the quiet statement")
	}
	other := schema.MustParseTable(tbl.Schema() + ".wal_outbox")
	if err := schema.Migrate(ctx, pool, other, schema.WithOrderingKeyColumn()); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, sqlq.WALCreateProgressTable(other)); err != nil {
		t.Fatal(err)
	}
	oq := sqlq.NewQueries(other, schema.Columns{OrderingKey: true})
	keyed := newMsg("org.organization.created.v1")
	keyed.OrderingKey = "k"
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := enq.Enqueue(ctx, tx, other, newMsg("org.organization.created.v1")); err != nil {
			t.Fatal(err)
		}
		if _, err := enq.Enqueue(ctx, tx, other, keyed); err != nil {
			t.Fatal(err)
		}
	})
	if !rec.saw(oq.EnqueueQuiet) || !rec.saw(oq.Enqueue) {
		t.Fatal("the WAL table did not take the quiet statement for the unkeyed row and the locking one for the keyed row")
	}
	if n := count(t, pool, other); n != 2 {
		t.Fatalf("rows %d, want 2", n)
	}
}

func TestEnqueueBatch(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	existing := newMsg("org.organization.created.v1")
	var existingSeq int64
	inTx(t, pool, func(tx pgx.Tx) {
		var err error
		existingSeq, err = publisher.Enqueue(ctx, tx, tbl, existing)
		if err != nil {
			t.Fatal(err)
		}
	})
	msgs := []publisher.Message{newMsg("org.a.b.v1"), existing, newMsg("org.a.c.v2")}
	msgs = append(msgs, msgs[0]) // repeated inside the batch
	var seqs []int64
	inTx(t, pool, func(tx pgx.Tx) {
		var err error
		if seqs, err = publisher.EnqueueBatch(ctx, tx, tbl, msgs); err != nil {
			t.Fatal(err)
		}
	})
	if len(seqs) != 4 || seqs[1] != existingSeq || seqs[0] != seqs[3] || seqs[0] == seqs[2] || seqs[0] <= existingSeq {
		t.Fatalf("sequences %v (existing %d)", seqs, existingSeq)
	}
	if n := count(t, pool, tbl); n != 3 {
		t.Fatalf("rows: %d, want 3", n)
	}
	inTx(t, pool, func(tx pgx.Tx) {
		bad := existing
		bad.Topic = "org.other.thing.v1"
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.a.b.v1"), bad})
		if !errors.Is(err, publisher.ErrEventIDConflict) {
			t.Fatalf("batch with conflicting event: %v", err)
		}
	})
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	big := json.RawMessage(`"` + strings.Repeat("a", publisher.DefaultMaxPayloadBytes) + `"`)
	cases := []struct {
		name   string
		mutate func(*publisher.Message)
		field  string
		want   string
	}{
		{"nil tenant", func(m *publisher.Message) { m.TenantID = uuid.Nil }, "TenantID", "nil UUID"},
		{"nil event id", func(m *publisher.Message) { m.EventID = uuid.Nil }, "EventID", "nil UUID"},
		{"empty topic", func(m *publisher.Message) { m.Topic = "" }, "Topic", "empty"},
		{"uppercase topic", func(m *publisher.Message) { m.Topic = "Org.Created.v1" }, "Topic", "does not follow"},
		{"topic with space", func(m *publisher.Message) { m.Topic = "org created.v1" }, "Topic", "does not follow"},
		{"topic without version", func(m *publisher.Message) { m.Topic = "org.organization.created" }, "Topic", "does not follow"},
		{"topic injection", func(m *publisher.Message) { m.Topic = "org.x.v1'; DROP TABLE x; --" }, "Topic", "does not follow"},
		{"topic too long", func(m *publisher.Message) { m.Topic = strings.Repeat("a", 126) + ".v1" }, "Topic", "shorter than 128"},
		{"empty payload", func(m *publisher.Message) { m.Payload = nil }, "Payload", "empty"},
		{"invalid json", func(m *publisher.Message) { m.Payload = json.RawMessage(`{"a":`) }, "Payload", "not valid JSON"},
		{"not json at all", func(m *publisher.Message) { m.Payload = json.RawMessage(`hello`) }, "Payload", "not valid JSON"},
		{"nul escape", func(m *publisher.Message) { m.Payload = json.RawMessage(`{"a":"x\u0000y"}`) }, "Payload", `\u0000`},
		{"oversized payload", func(m *publisher.Message) { m.Payload = big }, "Payload", "exceeds the limit"},
		{"reserved header", func(m *publisher.Message) { m.Headers = map[string]string{"event_id": "x"} }, "Headers", "headers column"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = tx.Rollback(ctx) }()
			m := newMsg("org.organization.created.v1")
			tc.mutate(&m)
			_, err = publisher.Enqueue(ctx, tx, tbl, m)
			var ve *publisher.ValidationError
			if !errors.As(err, &ve) || !errors.Is(err, publisher.ErrInvalidMessage) || ve.Field != tc.field || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want a ValidationError on %s mentioning %q", err, tc.field, tc.want)
			}
			if strings.Contains(err.Error(), "acme") {
				t.Fatalf("error leaks the payload: %v", err)
			}
			// The transaction stays usable.
			if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
				t.Fatalf("tx unusable after validation error: %v", err)
			}
		})
	}
	t.Run("escaped backslash before u0000 is fine", func(t *testing.T) {
		inTx(t, pool, func(tx pgx.Tx) {
			m := newMsg("org.organization.created.v1")
			m.Payload = json.RawMessage(`{"path":"C:\\u0000"}`)
			if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
				t.Fatal(err)
			}
		})
	})
	t.Run("zero table, nil tx, missing table", func(t *testing.T) {
		if _, err := publisher.Enqueue(ctx, nil, tbl, newMsg("a.b.v1")); err == nil {
			t.Fatal("nil tx accepted")
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := publisher.Enqueue(ctx, tx, schema.Table{}, newMsg("a.b.v1")); err == nil {
			t.Fatal("zero table accepted")
		}
		_, err = publisher.Enqueue(ctx, tx, schema.MustParseTable(tbl.Schema()+".missing_outbox"), newMsg("a.b.v1"))
		if !errors.Is(err, schema.ErrTableNotFound) {
			t.Fatalf("missing table: %v", err)
		}
	})
	t.Run("closed pool", func(t *testing.T) {
		p := testdb.NewPool(t, nil)
		p.Close()
		_, err := p.Begin(ctx)
		if err == nil || !strings.Contains(err.Error(), "closed") {
			t.Fatalf("begin on closed pool: %v", err)
		}
	})
	t.Run("custom topic rule and payload limit", func(t *testing.T) {
		e, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{ValidateTopic: publisher.ValidateTopicRelaxed, MaxPayloadBytes: 16})
		if err != nil {
			t.Fatal(err)
		}
		inTx(t, pool, func(tx pgx.Tx) {
			m := newMsg("topic_Relaxed-1")
			m.Payload = json.RawMessage(`{"a":1}`)
			if _, err := e.Enqueue(ctx, tx, tbl, m); err != nil {
				t.Fatal(err)
			}
			m = newMsg("topic_Relaxed-1")
			if _, err := e.Enqueue(ctx, tx, tbl, m); !errors.Is(err, publisher.ErrInvalidMessage) {
				t.Fatalf("payload over custom limit: %v", err)
			}
		})
		if _, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{MaxPayloadBytes: -1}); err == nil {
			t.Fatal("negative limit accepted")
		}
	})
}

func TestConcurrentEnqueue(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	const workers, each = 32, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	seqs := make(chan int64, workers*each)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					s, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1"))
					seqs <- s
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	close(seqs)
	for err := range errs {
		t.Fatal(err)
	}
	seen := map[int64]bool{}
	for s := range seqs {
		if seen[s] {
			t.Fatalf("sequence %d returned twice", s)
		}
		seen[s] = true
	}
	if n := count(t, pool, tbl); n != workers*each || len(seen) != workers*each {
		t.Fatalf("rows %d, distinct sequences %d, want %d", n, len(seen), workers*each)
	}
}

// TestExecModes runs enqueue under every pgx QueryExecMode, including the
// simple protocol that PgBouncer in transaction mode needs, and through
// database/sql on the pgx stdlib driver.
func TestExecModes(t *testing.T) {
	t.Parallel()
	tbl := testdb.Table(t, "org_outbox", schema.WithAllColumns())
	ctx := context.Background()
	modes := []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol}
	for _, mode := range modes {
		t.Run(mode.String(), func(t *testing.T) {
			pool := testdb.NewPool(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode; c.MaxConns = 2 })
			m := newMsg("org.organization.created.v1")
			m.Headers = map[string]string{"correlation_id": "c-1", "quote": `it's "quoted"`}
			m.Payload = json.RawMessage(`{"s":"ünïcödé \"q\" \\ '","n":[1,2.5,null,true]}`)
			inTx(t, pool, func(tx pgx.Tx) {
				s1, err := publisher.Enqueue(ctx, tx, tbl, m)
				if err != nil {
					t.Fatal(err)
				}
				s2, err := publisher.Enqueue(ctx, tx, tbl, m)
				if err != nil || s1 != s2 {
					t.Fatalf("idempotent re-enqueue: %d %d %v", s1, s2, err)
				}
				// The quiet statement (no wake-up), in this mode too.
				quiet, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{DisableNotify: true})
				if err != nil {
					t.Fatal(err)
				}
				qm := newMsg("org.organization.created.v1")
				qm.Headers = m.Headers
				q1, err := quiet.Enqueue(ctx, tx, tbl, qm)
				if err != nil {
					t.Fatal(err)
				}
				if q2, err := quiet.Enqueue(ctx, tx, tbl, qm); err != nil || q1 != q2 {
					t.Fatalf("quiet idempotent re-enqueue: %d %d %v", q1, q2, err)
				}
				b := []publisher.Message{newMsg("org.a.b.v1"), newMsg("org.a.b.v1")}
				b[1].Headers = map[string]string{"k": "v"}
				if _, err := publisher.EnqueueBatch(ctx, tx, tbl, b); err != nil {
					t.Fatal(err)
				}
			})
			var payload, headers string
			if err := pool.QueryRow(ctx, `SELECT payload::text, headers::text FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID.String()).Scan(&payload, &headers); err != nil {
				t.Fatal(err)
			}
			var p, h map[string]any
			_ = json.Unmarshal([]byte(payload), &p)
			_ = json.Unmarshal([]byte(headers), &h)
			if p["s"] != `ünïcödé "q" \ '` || h["quote"] != `it's "quoted"` {
				t.Fatalf("round trip: payload %s headers %s", payload, headers)
			}
		})
	}
	t.Run("database/sql", func(t *testing.T) {
		db, err := sql.Open("pgx", testdb.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer db.Close()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		m := newMsg("org.organization.created.v1")
		s1, err := publisher.Enqueue(ctx, publisher.StdlibTx(tx), tbl, m)
		if err != nil {
			t.Fatal(err)
		}
		seqs, err := publisher.EnqueueBatch(ctx, publisher.StdlibTx(tx), tbl, []publisher.Message{m, newMsg("org.a.b.v1")})
		if err != nil || seqs[0] != s1 {
			t.Fatalf("batch via database/sql: %v %v", seqs, err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID.String()).Scan(&n); err != nil || n != 1 {
			t.Fatalf("database/sql commit: %d rows, %v", n, err)
		}
	})
}

var _ = stdlib.GetDefaultDriver // registers the "pgx" database/sql driver

func TestTraceContextStored(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithTraceColumns())
	plain := testdb.Table(t, "plain_outbox")
	traceID, _ := trace.TraceIDFromHex("4bf92f3577b34da6a3ce929d0e0e4736")
	spanID, _ := trace.SpanIDFromHex("00f067aa0ba902b7")
	ts, _ := trace.ParseTraceState("vendor=abc")
	ctx := trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: traceID, SpanID: spanID, TraceFlags: trace.FlagsSampled, TraceState: ts,
	}))
	m := newMsg("org.organization.created.v1")
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
		// A table without the trace columns works and just does not store it.
		if _, err := publisher.Enqueue(ctx, tx, plain, newMsg("org.organization.created.v1")); err != nil {
			t.Fatal(err)
		}
	})
	var parent, state string
	if err := pool.QueryRow(ctx, `SELECT traceparent, tracestate FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID).Scan(&parent, &state); err != nil {
		t.Fatal(err)
	}
	if parent != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" || state != "vendor=abc" {
		t.Fatalf("stored trace context %q %q", parent, state)
	}
}

func TestNotifyAtCommitOnly(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, sqlq.ListenStatement(sqlq.NotifyChannel(tbl))); err != nil {
		t.Fatal(err)
	}
	// This connection plays an idle relay: it holds the idle lock.
	var got bool
	if err := conn.QueryRow(ctx, sqlq.TryIdleLock, sqlq.IdleLockKey(tbl)).Scan(&got); err != nil || !got {
		t.Fatalf("idle lock: %v %v", got, err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("org.organization.created.v1")); err != nil {
		t.Fatal(err)
	}
	_ = tx.Rollback(ctx)
	short, c2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer c2()
	if n, err := conn.WaitForNotification(short); err == nil {
		t.Fatalf("notification after rollback: %+v", n)
	}
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("a.b.v1"), newMsg("a.b.v1")}); err != nil {
			t.Fatal(err)
		}
	})
	n, err := conn.WaitForNotification(ctx)
	if err != nil || n.Channel != sqlq.NotifyChannel(tbl) {
		t.Fatalf("no notification after commit: %v %v", n, err)
	}
}

// TestNotifyOnlyWhileRelayIdle is the writer's half of the wake-up
// handshake: an enqueue sends NOTIFY only while a relay holds the idle lock,
// and an open enqueueing transaction keeps a relay from taking it.
func TestNotifyOnlyWhileRelayIdle(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	relay, err := pgx.Connect(ctx, testdb.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Close(context.Background())
	if _, err := relay.Exec(ctx, sqlq.ListenStatement(sqlq.NotifyChannel(tbl))); err != nil {
		t.Fatal(err)
	}
	noNotification := func(what string) {
		t.Helper()
		short, c := context.WithTimeout(ctx, 300*time.Millisecond)
		defer c()
		if n, err := relay.WaitForNotification(short); err == nil {
			t.Fatalf("%s: notification %+v", what, n)
		}
	}
	enqueue := func(batch bool) {
		t.Helper()
		inTx(t, pool, func(tx pgx.Tx) {
			var err error
			if batch {
				_, err = publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("a.b.v1")})
			} else {
				_, err = publisher.Enqueue(ctx, tx, tbl, newMsg("a.b.v1"))
			}
			if err != nil {
				t.Fatal(err)
			}
		})
	}
	// No relay idle: no NOTIFY.
	enqueue(false)
	enqueue(true)
	noNotification("no relay idle")

	// A writer with an open transaction keeps the relay from going idle.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := publisher.Enqueue(ctx, tx, tbl, newMsg("a.b.v1")); err != nil {
		t.Fatal(err)
	}
	var got bool
	if err := relay.QueryRow(ctx, sqlq.TryIdleLock, sqlq.IdleLockKey(tbl)).Scan(&got); err != nil || got {
		t.Fatalf("idle lock taken while an enqueueing transaction is open: %v %v", got, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := relay.QueryRow(ctx, sqlq.TryIdleLock, sqlq.IdleLockKey(tbl)).Scan(&got); err != nil || !got {
		t.Fatalf("idle lock after the writer committed: %v %v", got, err)
	}
	// Relay idle: every enqueue notifies.
	for _, batch := range []bool{false, true} {
		enqueue(batch)
		n, err := relay.WaitForNotification(ctx)
		if err != nil || n.Channel != sqlq.NotifyChannel(tbl) {
			t.Fatalf("batch %v: no notification while the relay is idle: %v %v", batch, n, err)
		}
	}
	// A re-enqueue writes nothing and sends nothing.
	m := newMsg("a.b.v1")
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
	})
	if _, err := relay.WaitForNotification(ctx); err != nil {
		t.Fatal(err)
	}
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{m}); err != nil {
			t.Fatal(err)
		}
	})
	noNotification("re-enqueue")
	// Relay busy again.
	if _, err := relay.Exec(ctx, sqlq.IdleUnlock, sqlq.IdleLockKey(tbl)); err != nil {
		t.Fatal(err)
	}
	enqueue(false)
	noNotification("relay busy")
}

func TestTxPublisher(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox", schema.WithHeadersColumn())
	plain := testdb.Table(t, "plain_outbox")
	reg := prometheus.NewRegistry()
	m, err := metrics.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	enq, err := publisher.NewEnqueuer(publisher.EnqueuerConfig{Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	msg := message.NewMessage(uuid.NewString(), []byte(`{"x":1}`))
	msg.Metadata.Set("correlation_id", "abc")
	inTx(t, pool, func(tx pgx.Tx) {
		p, err := publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{Table: tbl, DefaultTenantID: tenant, Enqueuer: enq})
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Publish("org.organization.created.v1", msg, message.NewMessage(uuid.NewString(), []byte(`[]`))); err != nil {
			t.Fatal(err)
		}
		// Idempotent: publishing the same message again adds nothing.
		if err := p.Publish("org.organization.created.v1", msg); err != nil {
			t.Fatal(err)
		}
		if err := p.Publish("org.organization.created.v1", message.NewMessage("not-a-uuid", []byte(`{}`))); !errors.Is(err, publisher.ErrInvalidMessage) {
			t.Fatalf("non-UUID message: %v", err)
		}
		bad := message.NewMessage(uuid.NewString(), []byte(`{}`))
		bad.Metadata.Set(schema.MetadataTenantID, "nope")
		if err := p.Publish("org.organization.created.v1", bad); !errors.Is(err, publisher.ErrInvalidMessage) {
			t.Fatalf("bad tenant: %v", err)
		}
		noHeaders, _ := publisher.NewTxPublisher(tx, publisher.TxPublisherConfig{Table: plain, DefaultTenantID: tenant})
		if err := noHeaders.Publish("org.organization.created.v1", msg); err == nil || !strings.Contains(err.Error(), "WithHeadersColumn") {
			t.Fatalf("metadata into a table without headers: %v", err)
		}
		_ = p.Close()
		_ = p.Close()
		if err := p.Publish("org.organization.created.v1", msg); !errors.Is(err, publisher.ErrPublisherClosed) {
			t.Fatalf("publish after close: %v", err)
		}
	})
	var headers string
	if err := pool.QueryRow(ctx, `SELECT headers::text FROM `+tbl.Sanitize()+` WHERE event_id = $1`, msg.UUID).Scan(&headers); err != nil {
		t.Fatal(err)
	}
	if headers != `{"correlation_id": "abc"}` {
		t.Fatalf("headers %s", headers)
	}
	if n := count(t, pool, tbl); n != 2 {
		t.Fatalf("rows %d, want 2", n)
	}
	if got := testutil.ToFloat64(m.EnqueueTotal.WithLabelValues(tbl.Qualified(), "org.organization.created.v1")); got != 2 {
		t.Fatalf("outbox_enqueue_total = %v, want 2 (re-enqueue not counted)", got)
	}
	if _, err := publisher.NewTxPublisher(nil, publisher.TxPublisherConfig{Table: tbl}); err == nil {
		t.Fatal("nil tx accepted")
	}
}

// TestDBPublisher: a DBPublisher commits each Publish in a transaction of
// its own, with the topic rule of its DBPublisherConfig.
func TestDBPublisher(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "db_outbox", schema.WithHeadersColumn())
	strict, err := publisher.NewDBPublisher(pool, publisher.DBPublisherConfig{Table: tbl, DefaultTenantID: tenant})
	if err != nil {
		t.Fatal(err)
	}
	relaxed, err := publisher.NewDBPublisher(pool, publisher.DBPublisherConfig{Table: tbl, DefaultTenantID: tenant,
		EnqueuerConfig: publisher.EnqueuerConfig{ValidateTopic: publisher.ValidateTopicRelaxed}})
	if err != nil {
		t.Fatal(err)
	}
	const topic = "Orders_Created"
	if err := strict.Publish(topic, message.NewMessage(uuid.NewString(), []byte(`{}`))); !errors.Is(err, publisher.ErrInvalidMessage) {
		t.Fatalf("default topic rule on %q: %v, want ErrInvalidMessage", topic, err)
	}
	if err := relaxed.Publish(topic, message.NewMessage(uuid.NewString(), []byte(`{}`)), message.NewMessage(uuid.NewString(), []byte(`[]`))); err != nil {
		t.Fatalf("relaxed topic rule on %q: %v", topic, err)
	}
	if n := count(t, pool, tbl); n != 2 {
		t.Fatalf("rows %d, want 2 (committed by Publish)", n)
	}
	_ = relaxed.Close()
	if err := relaxed.Publish(topic, message.NewMessage(uuid.NewString(), []byte(`{}`))); !errors.Is(err, publisher.ErrPublisherClosed) {
		t.Fatalf("publish after close: %v", err)
	}
	if _, err := publisher.NewDBPublisher(pool, publisher.DBPublisherConfig{Table: tbl, EnqueuerConfig: publisher.EnqueuerConfig{MaxPayloadBytes: -1}}); err == nil {
		t.Fatal("negative MaxPayloadBytes accepted")
	}
}

// TestReenqueueWithAnotherPayload: the same event_id with a different payload
// is a conflict, for Enqueue and EnqueueBatch, and the error carries no
// payload; the same payload spelled with another key order, whitespace or
// number spelling is the same event.
func TestReenqueueWithAnotherPayload(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx := context.Background()
	m := newMsg("org.organization.created.v1")
	m.Payload = json.RawMessage(`{"id":1,"name":"acme","tags":["a","b"],"n":1.0}`)
	var first int64
	inTx(t, pool, func(tx pgx.Tx) {
		var err error
		if first, err = publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
	})
	same := m
	same.Payload = json.RawMessage("{ \"n\": 1, \"tags\": [\"a\", \"b\"],\n \"name\": \"acme\", \"id\": 1e0 }")
	other := m
	other.Payload = json.RawMessage(`{"id":1,"name":"secret-value-xyz","tags":["a","b"],"n":1}`)
	reordered := m
	reordered.Payload = json.RawMessage(`{"id":1,"name":"acme","tags":["b","a"],"n":1}`)
	inTx(t, pool, func(tx pgx.Tx) {
		if seq, err := publisher.Enqueue(ctx, tx, tbl, same); err != nil || seq != first {
			t.Fatalf("same payload, other spelling: seq %d (first %d), %v", seq, first, err)
		}
		if seqs, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.a.b.v1"), same}); err != nil || seqs[1] != first {
			t.Fatalf("batch, same payload, other spelling: %v, %v", seqs, err)
		}
		for name, bad := range map[string]publisher.Message{"other value": other, "array order": reordered} {
			for _, batch := range []bool{false, true} {
				var err error
				if batch {
					_, err = publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{newMsg("org.a.b.v1"), bad})
				} else {
					_, err = publisher.Enqueue(ctx, tx, tbl, bad)
				}
				var ce *publisher.ConflictError
				if !errors.As(err, &ce) || !errors.Is(err, publisher.ErrEventIDConflict) || !ce.PayloadDiffers || ce.Sequence != first {
					t.Fatalf("%s (batch %v): %v", name, batch, err)
				}
				if strings.Contains(err.Error(), "secret-value-xyz") || strings.Contains(err.Error(), "acme") || !strings.HasPrefix(err.Error(), "publisher: ") {
					t.Fatalf("error text: %q", err)
				}
			}
		}
		// Inside one batch, a repeat with another payload is refused before SQL.
		_, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{same, other})
		var ve *publisher.ValidationError
		if !errors.As(err, &ve) {
			t.Fatalf("repeat with another payload inside a batch: %v", err)
		}
		if _, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{m, same}); err != nil {
			t.Fatalf("repeat with the same payload, other spelling, inside a batch: %v", err)
		}
	})
	var stored string
	if err := pool.QueryRow(ctx, `SELECT payload::text FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	// A batch that met a conflict wrote none of its rows.
	if strings.Contains(stored, "secret") || count(t, pool, tbl) != 2 {
		t.Fatalf("stored %s, rows %d", stored, count(t, pool, tbl))
	}
}

// TestReenqueueDoesNotBlockRelayAck: a producer transaction that re-enqueues
// an event the relay holds leased, and stays open, must not hold the row: the
// relay's ack completes while the producer is open, not when it ends. The
// verdict does not depend on the machine's speed: the test fails as soon as
// any session waits on the producer's locks (pg_blocking_pids), and the ack
// has 2 minutes to complete while the producer stays open.
func TestReenqueueDoesNotBlockRelayAck(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	m := newMsg("org.organization.created.v1")
	inTx(t, pool, func(tx pgx.Tx) {
		if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
			t.Fatal(err)
		}
	})
	sub, err := subscriber.New(context.Background(), pool, subscriber.Config{Table: tbl, DisableNotify: true, PollInterval: 50 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	ch, err := sub.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	var got *message.Message
	select {
	case got = <-ch:
	case <-ctx.Done():
		t.Fatal("no delivery")
	}
	// The producer re-enqueues the leased event and keeps its transaction open.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := publisher.Enqueue(ctx, tx, tbl, m); err != nil {
		t.Fatal(err)
	}
	if _, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{m}); err != nil {
		t.Fatal(err)
	}
	var producer int32
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&producer); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got.Ack()
	for {
		var published bool
		if err := pool.QueryRow(ctx, `SELECT published_at IS NOT NULL FROM `+tbl.Sanitize()+` WHERE event_id = $1`, m.EventID).Scan(&published); err != nil {
			t.Fatal(err)
		}
		if published {
			break
		}
		var blocked []string
		if err := pool.QueryRow(ctx, `SELECT COALESCE(array_agg(left(query, 200)), '{}') FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))`, producer).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
		if len(blocked) > 0 {
			t.Fatalf("the relay's ack waits on the producer's open transaction: %q", blocked)
		}
		if time.Since(start) > 2*time.Minute {
			t.Fatal("the relay's ack did not complete within 2 minutes while the producer's transaction was open")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// The producer was open all along: the ack did not wait for its end.
	if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatalf("the producer's transaction ended before the ack completed: %v", err)
	}
	t.Logf("the ack completed %s after Ack, the producer's transaction open", time.Since(start).Round(time.Millisecond))
}

// TestReenqueueRacingCommit: a re-enqueue that waits on a concurrent,
// uncommitted insert of the same event_id returns that row's sequence once it
// commits (or a conflict when its payload differs), for Enqueue and
// EnqueueBatch. The first transaction commits once the re-enqueue waits on
// it (pg_blocking_pids), not after a guess of 200 ms.
func TestReenqueueRacingCommit(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "org_outbox")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, batch := range []bool{false, true} {
		for _, otherPayload := range []bool{false, true} {
			m := newMsg("org.organization.created.v1")
			first, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			want, err := publisher.Enqueue(ctx, first, tbl, m)
			if err != nil {
				t.Fatal(err)
			}
			var firstPID int32
			if err := first.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&firstPID); err != nil {
				t.Fatal(err)
			}
			again := m
			if otherPayload {
				again.Payload = json.RawMessage(`{"id":2}`)
			}
			type result struct {
				seq int64
				err error
			}
			done := make(chan result, 1)
			go func() {
				var r result
				r.err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					if batch {
						seqs, err := publisher.EnqueueBatch(ctx, tx, tbl, []publisher.Message{again})
						if err == nil {
							r.seq = seqs[0]
						}
						return err
					}
					var err error
					r.seq, err = publisher.Enqueue(ctx, tx, tbl, again)
					return err
				})
				done <- r
			}()
			// The second insert waits on the first.
			for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(10 * time.Millisecond) {
				var waiting bool
				if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid)))`, firstPID).Scan(&waiting); err != nil {
					t.Fatal(err)
				}
				if waiting {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the re-enqueue did not wait on the uncommitted insert within 2 minutes")
				}
			}
			if err := first.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			r := <-done
			switch {
			case otherPayload && !errors.Is(r.err, publisher.ErrEventIDConflict):
				t.Fatalf("batch %v, other payload: %v", batch, r.err)
			case !otherPayload && (r.err != nil || r.seq != want):
				t.Fatalf("batch %v: seq %d (want %d), %v", batch, r.seq, want, r.err)
			}
		}
	}
	if n := count(t, pool, tbl); n != 4 {
		t.Fatalf("rows %d, want 4", n)
	}
}
