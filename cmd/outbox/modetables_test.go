package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/outboxkit/watermill-outbox/cleaner"
	"github.com/outboxkit/watermill-outbox/console"
	"github.com/outboxkit/watermill-outbox/internal/testdb"
	"github.com/outboxkit/watermill-outbox/metrics"
	"github.com/outboxkit/watermill-outbox/publisher"
	"github.com/outboxkit/watermill-outbox/runbook"
	"github.com/outboxkit/watermill-outbox/schema"
	"github.com/outboxkit/watermill-outbox/subscriber"
)

// keyedTables reports which of the keyed modes' companion tables of tbl
// exist: <table>_holds, <table>_partitions, <table>_relays.
func keyedTables(t *testing.T, pool *pgxpool.Pool, tbl schema.Table) (holds, partitions, relays bool) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL, to_regclass($3) IS NOT NULL`,
		tbl.HoldsTable(), tbl.PartitionsTable(), tbl.RelaysTable()).Scan(&holds, &partitions, &relays); err != nil {
		t.Fatal(err)
	}
	return holds, partitions, relays
}

// enqueueKeyed commits one row per key, in order, and returns their event ids.
func enqueueKeyed(t *testing.T, pool *pgxpool.Pool, tbl schema.Table, keys ...string) []uuid.UUID {
	t.Helper()
	ctx := context.Background()
	ids := make([]uuid.UUID, len(keys))
	for i, k := range keys {
		ids[i] = uuid.New()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := publisher.Enqueue(ctx, tx, tbl, publisher.Message{TenantID: rbTenant, Topic: rbTopicA, EventID: ids[i],
				Payload: json.RawMessage(`{}`), OrderingKey: k})
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

// receive acks messages of ch until every id of want has come, and
// returns the event ids in the order they came.
func receive(t *testing.T, ch <-chan *message.Message, want []uuid.UUID) []string {
	t.Helper()
	left := map[string]bool{}
	for _, id := range want {
		left[id.String()] = true
	}
	var got []string
	timeout := time.After(time.Minute)
	for len(left) > 0 {
		select {
		case msg := <-ch:
			got = append(got, msg.UUID)
			delete(left, msg.UUID)
			msg.Ack()
		case <-timeout:
			t.Fatalf("not delivered within a minute: %v (delivered %v)", left, got)
		}
	}
	return got
}

// TestDefaultTableWithoutKeyedTables (issue 57, item 5): a new table
// migrated with every column (README step 1) is a default-mode table with
// the ordering_key column and none of the keyed modes' companion tables
// (<table>_holds, _partitions, _relays). Everything that reads or changes
// it in the default mode works without them: the default relay and its
// gauges, `outbox stats`, `backlog`, `topics`, `dead list`, `dead replay`,
// `dead skip` and `keys held` (no held key), the runbook's held keys and
// relays, the cleaner and the console's pages. An ordered relay started
// directly on it (no migrate step) creates them by its start's switch to
// ordered mode and relays the keyed rows in key order; `outbox keys held`
// then reads them. Before, Migrate created the three tables whatever the
// mode.
func TestDefaultTableWithoutKeyedTables(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t)
	tbl := testdb.Table(t, "outbox", schema.WithAllColumns())
	name := tbl.String()
	if h, p, r := keyedTables(t, pool, tbl); h || p || r {
		t.Fatalf("a new default-mode table has keyed tables: holds %v, partitions %v, relays %v", h, p, r)
	}

	// The default relay, with its gauges, delivers keyed and unkeyed rows.
	m, err := metrics.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	def, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, Metrics: m, StatsInterval: 50 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("default relay on a default-mode table without keyed tables: %v", err)
	}
	sctx, stop := context.WithCancel(ctx)
	ch, err := def.Subscribe(sctx, subscriber.AllTopics)
	if err != nil {
		t.Fatal(err)
	}
	receive(t, ch, append(enqueueKeyed(t, pool, tbl, "k-1", "k-1"), rbEnqueue(t, pool, tbl, rbTopicA)...))
	for deadline := time.Now().Add(time.Minute); testutil.ToFloat64(m.Pending.WithLabelValues(tbl.Qualified())) != 0 ||
		testutil.CollectAndCount(m.Pending) == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the default relay's gauges never read the table")
		}
	}
	stop()
	if err := def.Close(); err != nil {
		t.Fatal(err)
	}

	// The operator surfaces: dead, pending and published rows.
	ids := rbEnqueue(t, pool, tbl, rbTopicA, rbTopicA, rbTopicA)
	rbMarkDead(t, pool, tbl, "boom", ids[0], ids[1])
	rbExec(t, pool, tbl, `UPDATE %s SET published_at = now() - interval '2 hours' WHERE published_at IS NOT NULL`)
	st := rbDecode[runbook.TableStats](t, rbRun(t, rbEnv(), "stats", "--table="+name, "--json").stdout)
	if st.Mode != schema.ModeDefault || st.ModeInferred || st.Dead != 2 || st.Pending != 1 || st.HeldKeys != 0 {
		t.Fatalf("stats --json: %+v; want default mode, 2 dead, 1 pending, no held key", st)
	}
	rbRun(t, rbEnv(), "backlog", "--table="+name).expect(t, 0, []string{ids[2].String()}, nil)
	rbRun(t, rbEnv(), "topics", "--table="+name).expect(t, 0, []string{rbTopicA}, nil)
	rbRun(t, rbEnv(), "keys", "held", "--table="+name).expect(t, 0, []string{"No held key in " + name}, nil)
	rbRun(t, rbEnv(), "keys", "held", "--table="+name, "--json").expect(t, 0, []string{"[]"}, nil)
	rbRun(t, rbEnv(), "dead", "list", "--table="+name).expect(t, 0, []string{ids[0].String(), ids[1].String()}, nil)
	rbRun(t, rbEnv(), "dead", "replay", "--table="+name, "--event-id="+ids[0].String(), "--confirm").expect(t, 0, []string{ids[0].String()}, nil)
	rbRun(t, rbEnv(), "dead", "skip", "--table="+name, "--event-id="+ids[1].String(), "--confirm").expect(t, 0, []string{"Skipped event " + ids[1].String()}, nil)
	rb := runbook.New(pool, tbl)
	if held, err := rb.HeldKeys(ctx, 0); err != nil || len(held) != 0 {
		t.Fatalf("runbook HeldKeys: %v, %v; want none", held, err)
	}
	if n, err := rb.OrderedRelays(ctx); err != nil || n != 0 {
		t.Fatalf("runbook OrderedRelays: %d, %v; want 0", n, err)
	}
	if rl, err := rb.Relays(ctx); err != nil || rl.Mode != schema.ModeDefault || len(rl.Owners) != 0 {
		t.Fatalf("runbook Relays: %+v, %v", rl, err)
	}
	cl, err := cleaner.New(pool, cleaner.Config{Table: tbl, Retention: time.Hour}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if published, dead, err := cl.CleanOnce(ctx); err != nil || published != 3 || dead != 0 {
		t.Fatalf("cleaner: %d published, %d dead deleted, %v; want the 3 rows published 2 hours ago", published, dead, err)
	}
	c, err := console.New(pool, console.Config{Tables: []schema.Table{tbl}})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	defer srv.Close()
	for _, page := range []string{"/", "/t/" + name + "/held", "/t/" + name + "/dead", "/t/" + name + "/relays", "/t/" + name + "/rows", "/api/counts"} {
		res, err := http.Get(srv.URL + page)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if res.StatusCode != http.StatusOK {
			t.Fatalf("console %s: %d\n%s", page, res.StatusCode, body)
		}
	}
	if h, p, r := keyedTables(t, pool, tbl); h || p || r {
		t.Fatalf("the default mode's readers created keyed tables: holds %v, partitions %v, relays %v", h, p, r)
	}

	// An ordered relay started on the table as it is: its start's switch
	// to ordered mode creates what ordered mode needs, then it relays.
	ord, err := subscriber.New(ctx, pool, subscriber.Config{Table: tbl, Ordered: true, ElectionInterval: 100 * time.Millisecond}, watermill.NopLogger{})
	if err != nil {
		t.Fatalf("ordered relay on a default-mode table without ordered mode's tables: %v", err)
	}
	defer ord.Close()
	och, err := ord.Subscribe(ctx, subscriber.AllTopics)
	if err != nil {
		t.Fatalf("subscribe the ordered relay: %v", err)
	}
	if h, p, r := keyedTables(t, pool, tbl); !h || !p || !r {
		t.Fatalf("after the ordered relay's start: holds %v, partitions %v, relays %v; want all three", h, p, r)
	}
	if mode, err := rb.Mode(ctx); err != nil || mode != schema.ModeOrdered {
		t.Fatalf("after the ordered relay's start the table's mode is %q (%v), want ordered", mode, err)
	}
	// The rows left pending (one, and the replayed dead one) come too.
	keyed := enqueueKeyed(t, pool, tbl, "k-2", "k-2", "k-2", "k-3")
	got := receive(t, och, append(keyed, ids[0], ids[2]))
	var k2 []string
	for _, id := range got {
		if id == keyed[0].String() || id == keyed[1].String() || id == keyed[2].String() {
			k2 = append(k2, id)
		}
	}
	if len(k2) != 3 || k2[0] != keyed[0].String() || k2[1] != keyed[1].String() || k2[2] != keyed[2].String() {
		t.Fatalf("key k-2 delivered in the order %v, want %v", k2, keyed[:3])
	}
	rbRun(t, rbEnv(), "keys", "held", "--table="+name).expect(t, 0, []string{"No held key in " + name}, nil)
	rbRun(t, rbEnv(), "stats", "--table="+name, "--json").expect(t, 0, []string{`"mode": "ordered"`}, nil)
}
